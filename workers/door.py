"""The worker's door: every message a worker consumes is checked
(:mod:`pipeline.security.message_checks`) before kombu or Celery parses it, and one that is not a
well-formed message of a task the worker runs is moved aside instead of reaching code that can raise
out of the consumer.

Two layers. The Redis transport's channels (:mod:`workers.recovery.transport`) check the bytes
they pop (:func:`check_item`); Celery's consumer (:class:`workers.recovery.transport.Consumer`)
checks the message any broker delivered, RabbitMQ included, and moves aside a message whose handling
raised (:func:`guard_consumer`). A refused message is acknowledged (on Redis: never put in
``unacked``), counted in the fleet metrics (``deadletter:<reason>``, :data:`REASONS`), logged in
one line without its payload (at most one line per reason every :data:`LOG_EVERY_S`), and kept
as a small JSON entry (reason, queue, time, task and id when readable, an escaped excerpt) at
the head of the store's ``<prefix>:deadletter`` list, capped at :data:`keys.DEADLETTER_MAX`
entries. A refused ``critique.submit`` message with a readable task id gets a one-line
``FAILURE`` in the result backend when nothing is stored under that id yet, so a manager that
pushed it by hand learns why instead of waiting.

Workers run only the product's tasks: :func:`drop_builtin_tasks` unregisters Celery's own
(``celery.group``, ``celery.chord_unlock``, ``celery.accumulate``…) as a worker starts, so a
message naming one is refused at the door like any unknown task, and nothing is written under
its id (Celery's own unknown-task path stores a ``FAILURE`` there). The result backend expires
records with Redis TTLs (``result_expires``), so ``celery.backend_cleanup`` has nothing to do.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import threading
import time
from typing import Any

from celery.signals import worker_init

from pipeline.errors import SubmissionError
from pipeline.security.message_checks import (
    Admitted,
    Policy,
    Refusal,
    check_message,
    check_raw,
    safe_name,
    valid_task_id,
)
from pipeline.security.message_checks import excerpt as _excerpt
from pipeline.store import keys
from workers import runtime
from workers.app import app
from workers.tasks import RETRY

log = logging.getLogger("workers.door")

LOG_EVERY_S = 10.0
"""At most one log line per refusal reason this often (the rest are counted in the next line)."""
DELAY_MARGIN_S = 300.0
"""Added to the product's longest own delay for the ``eta`` bound: senders' clocks differ."""
EXPIRES_S = 24 * 3600.0
MAX_TIMELIMIT_S = 24 * 3600.0
"""Largest task time limit a message's header may carry: a sender's own limits may differ from
this worker's (an honest client configured with another ``CRITIQUE_TASK_TIME_LIMIT_S``)."""
"""Latest ``expires`` a message may carry, from now (the product sends none)."""

__all__ = [
    "check_delivered",
    "check_item",
    "drop_builtin_tasks",
    "guard_consumer",
    "policy",
    "refuse",
]


def _arity(task: Any) -> tuple[int, int]:
    """The fewest and most positional arguments ``task`` takes (its ``run``, bound)."""
    try:
        params = inspect.signature(task.run).parameters.values()
    except (TypeError, ValueError):
        return 0, 64
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return sum(p.default is p.empty for p in positional), 64
    return sum(p.default is p.empty for p in positional), len(positional)


def max_own_delay_s(conf: Any) -> float:
    """The longest countdown the product gives its own messages: a retry's backoff (at most
    ``retry_backoff_max``, :data:`workers.tasks.RETRY`) or a repair's wait for budget tokens
    (at most half the soft time limit, ``workers.steps._budget_wait_cap``)."""
    backoff: Any = RETRY["retry_backoff_max"]
    limit = conf.task_soft_time_limit or conf.task_time_limit or 120
    return max(float(backoff), float(limit) / 2.0)


@functools.lru_cache(maxsize=1)
def policy() -> Policy:
    """What this worker admits: its registered tasks (built-ins dropped), the product's queues,
    an ``eta`` no later than the longest own delay + :data:`DELAY_MARGIN_S`, an ``expires``
    within :data:`EXPIRES_S`, a time limit no larger than :data:`MAX_TIMELIMIT_S` (or the
    worker's own, if larger)."""
    tasks = {name: _arity(task) for name, task in app.tasks.items() if not _builtin(name)}
    conf = app.conf
    return Policy(
        tasks=tasks,
        queues=frozenset(keys.QUEUES),
        max_delay_s=max_own_delay_s(conf) + DELAY_MARGIN_S,
        max_expires_s=EXPIRES_S,
        # Clients and workers may run with other task time limits (a header carries the
        # sender's): bound it generously, so only an absurd one is refused.
        max_timelimit_s=max(float(conf.task_time_limit or 3600), MAX_TIMELIMIT_S),
    )


def _builtin(name: str) -> bool:
    return name.startswith("celery.")


def drop_builtin_tasks(app: Any) -> list[str]:
    """Unregister Celery's built-in tasks from ``app`` (a worker's, as it starts); returns
    their names. The product never sends one: its canvases are single tasks and replacements."""
    gone = sorted(name for name in app.tasks if _builtin(name))
    for name in gone:
        app.tasks.unregister(name)
    policy.cache_clear()
    return gone


@worker_init.connect
def _run_only_the_products_tasks(sender: Any = None, **_: Any) -> None:
    """A worker runs the product's tasks and nothing else: Celery's built-in tasks
    (``celery.group``, ``celery.chord_unlock``, ``celery.accumulate``…) are unregistered before
    its consumer starts, so a message naming one is refused at this door and nothing is stored
    under its id (``celery.accumulate`` stored any ``SUCCESS``). Connected when the worker
    imports this module, one of the app's ``include`` (before ``worker_init`` is sent)."""
    drop_builtin_tasks(getattr(sender, "app", None) or app)


# --- refusing ------------------------------------------------------------------------------


class _LogGate:
    """One log line per reason every :data:`LOG_EVERY_S`, saying how many were not logged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def say(self, refusal: Refusal, queue: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(refusal.reason, -LOG_EVERY_S) < LOG_EVERY_S:
                self._quiet[refusal.reason] = self._quiet.get(refusal.reason, 0) + 1
                return
            self._last[refusal.reason] = now
            quiet = self._quiet.pop(refusal.reason, 0)
        more = f" ({quiet} more refused for this reason since the last line)" if quiet else ""
        log.warning(
            "refused a message on %s (task %s, id %s): %s: %s; moved to the dead-letter list%s",
            queue, refusal.task, refusal.task_id, refusal.reason, refusal.detail, more,
        )  # fmt: skip


_gate = _LogGate()


def refuse(refusal: Refusal, queue: str, raw: bytes | str | None = None) -> None:
    """Move one refused message aside: the metric, the rate-limited log line, the dead-letter
    entry and, for an entry message, its failure record. Never raises (a store that is down
    costs the entry, not the worker)."""
    _gate.say(refusal, queue)
    try:
        runtime.metrics().add(f"deadletter:{refusal.reason}")
        runtime.metrics().flush()
        entry = {
            "reason": refusal.reason,
            "detail": refusal.detail,
            "queue": _excerpt(queue, 128),
            "at": round(time.time(), 3),
            "task": refusal.task,
            "id": refusal.task_id,
            "excerpt": None if raw is None else _excerpt(raw),
        }
        key = keys.shared_key(keys.DEADLETTER)
        pipe = runtime.client().pipeline(transaction=False)
        pipe.lpush(key, json.dumps(entry, ensure_ascii=True))
        pipe.ltrim(key, 0, keys.DEADLETTER_MAX - 1)
        pipe.expire(key, keys.run_ttl_s())
        pipe.execute()
    except Exception as exc:
        log.warning("could not keep a refused message in the dead-letter list: %s", exc)
    if refusal.task == keys.TASK_SUBMIT and refusal.task_id:
        _fail_entry(refusal)


def _fail_entry(refusal: Refusal) -> None:
    """A one-line ``FAILURE`` under a refused entry message's task id, only where nothing is
    stored yet (``SET NX``: never over a verdict or a failure) and no submission claimed the id
    (a pass in flight under it keeps its id clean)."""
    task_id = refusal.task_id or ""
    if not valid_task_id(task_id):
        return
    try:
        if runtime.stores().runs.entry_claim(task_id) is not None:
            return  # the id belongs to a submission in flight or done: garbage writes nothing
        backend = app.backend
        exc = SubmissionError(
            f"malformed message refused by the worker before it ran: {refusal.reason}: "
            f"{refusal.detail}"
        )
        meta = backend._get_result_meta(
            result=backend.prepare_exception(exc), state="FAILURE", traceback=None, request=None
        )
        meta["task_id"] = task_id
        key = backend.get_key_for_task(task_id)
        value = backend.encode(meta)
        if backend.client.set(key, value, nx=True, ex=int(backend.expires or 0) or None):
            backend.client.publish(key, value)
    except Exception as exc:
        log.warning("could not store the failure of refused entry message %s: %s", task_id, exc)


# --- the two layers ------------------------------------------------------------------------


def check_item(item: bytes | str, queue: str) -> dict[str, Any] | None:
    """The Redis transport's door: the envelope kombu may parse (delivery tag and info
    rewritten), or None when ``item`` was refused and moved aside. Never raises."""
    try:
        got = check_raw(item, queue, policy(), time.time())
    except Exception as exc:  # a bug here must not end the worker either
        got = Refusal("raised", f"the door's check raised {type(exc).__name__}")
    if isinstance(got, Admitted):
        return got.payload
    refuse(got, queue, item)
    return None


def check_delivered(message: Any) -> Refusal | None:
    """The consumer's door: None when ``message`` (a kombu message, any broker) may be
    handled by Celery. Never raises."""
    try:
        return check_message(
            message.headers,
            message.body,
            message.content_type,
            message.content_encoding,
            policy(),
            time.time(),
        )
    except Exception as exc:
        return Refusal("raised", f"the door's check raised {type(exc).__name__}")


def _queue_of(message: Any) -> str:
    try:
        info = message.delivery_info or {}
        return str(info.get("routing_key") or info.get("exchange") or "?")
    except Exception:
        return "?"


def guard_consumer(handle: Any, passthrough: tuple[type[BaseException], ...]) -> Any:
    """Celery's ``on_task_received`` behind the door: a message that does not pass
    :func:`check_delivered`, or whose handling raises anything but a broker connection error
    (``passthrough``: the consumer's reconnect handles those), is acknowledged and moved
    aside. Nothing is stored under its id (Celery's unknown-task path would)."""

    def on_task_received(message: Any) -> Any:
        refusal = check_delivered(message)
        if refusal is None:
            try:
                return handle(message)
            except passthrough:
                raise
            except Exception as exc:
                refusal = Refusal("raised", f"handling it raised {type(exc).__name__}")
                with contextlib.suppress(Exception):
                    refusal = Refusal(
                        "raised",
                        refusal.detail,
                        safe_name(message.headers.get("task")),
                        safe_name(message.headers.get("id")),
                    )
        _drop(message, refusal)
        return None

    return on_task_received


def _drop(message: Any, refusal: Refusal) -> None:
    """Acknowledge ``message`` (once) and move it aside."""
    try:
        if not message.acknowledged:
            message.ack()
    except Exception as exc:
        log.warning("could not acknowledge a refused message: %s", exc)
    raw: Any = None
    with contextlib.suppress(Exception):
        raw = message.body
    refuse(refusal, _queue_of(message), raw if isinstance(raw, bytes | str) else None)
