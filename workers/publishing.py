"""What monitors see of a product task's message: a summary, never the payload.

Celery puts ``argsrepr`` and ``kwargsrepr`` (the ``repr`` of the task's arguments, up to 1 KiB)
in every message's headers and in its ``task-sent`` event; a worker copies them into its
``task-received`` event. Flower and ``celery events`` show them as the task's arguments. A
stage's argument is its stage message, which holds the worker's output (and the task), so by
default every monitor would show the first KiB of every output, while the worker logs show none
(:mod:`workers.logs`).

:class:`SummarisingAMQP` (the app's ``amqp`` class, :mod:`workers.app`) builds every message of a
``critique.*`` task, whoever sends it (the client, the entry task, a stage handing on, a retry, a
re-drive), with a summary in their place: run, iteration, worker and pass (as the log lines name
them) and the size of the state, e.g. ``(<run=q3-sales it=1 worker=north pass=7ab5803f7b2e48ee
state=2481 B>,)``. A state carried by reference is read for its ids only as far as its first KiB.
Managers that send ``critique.submit`` themselves set their own (docs/entry.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery.app.amqp import AMQP

from workers.logs import message_ids

PRODUCT_PREFIX = "critique."
"""The product's task names: their messages carry summaries."""
ID_LIMIT = 128
"""Longest id shown (run and worker ids are identifiers: shorter than this)."""


def _summary(arg: Any) -> str:
    """One argument in a few words: a stage or gate message's ids and state size, else its
    type."""
    if not isinstance(arg, Mapping):
        return f"<{type(arg).__name__}>"
    ids = message_ids(arg)
    fields = [f"{k}={str(ids[k])[:ID_LIMIT]}" for k in ("run", "it", "worker", "pass") if k in ids]
    state = arg.get("state")
    if isinstance(state, str):
        fields.append(f"state={len(state.encode('utf-8', 'replace'))} B")
    elif isinstance(arg.get("state_ref"), str):
        fields.append("state=by reference")
    return "<" + " ".join(fields or ["message"]) + ">"


def args_summary(args: Sequence[Any]) -> str:
    """The ``argsrepr`` of a product task's message: a tuple of summaries."""
    parts = [_summary(a) for a in args]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def kwargs_summary(kwargs: Mapping[str, Any]) -> str:
    """The ``kwargsrepr``: the keyword names only."""
    return "{" + ", ".join(f"{str(k)[:ID_LIMIT]!r}: …" for k in kwargs) + "}"


class SummarisingAMQP(AMQP):  # type: ignore[misc]
    """Celery's AMQP helper, with :func:`args_summary` and :func:`kwargs_summary` as the
    ``argsrepr`` and ``kwargsrepr`` of every ``critique.*`` task message (protocol 2, the
    default), in its headers and its ``task-sent`` event alike."""

    def as_task_v2(
        self,
        task_id: str,
        name: str,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *rest: Any,
        **options: Any,
    ) -> Any:
        args, kwargs = args or (), kwargs or {}
        if str(name).startswith(PRODUCT_PREFIX) and isinstance(args, list | tuple):
            options["argsrepr"] = args_summary(args)
            options["kwargsrepr"] = kwargs_summary(kwargs if isinstance(kwargs, Mapping) else {})
        return super().as_task_v2(task_id, name, args, kwargs, *rest, **options)
