"""The entry message of ``critique.submit``: one submission as plain JSON, for managers in any
language (docs/entry.md).

An entry message is the one argument of a ``critique.submit`` task on ``critique.cpu``::

    {"v": 1,
     "submission": {...},              # a pipeline.models.Submission as JSON
     "config": {...},                  # optional: policy overrides, as CritiqueClient's
     "task_name": "critique.submit",   # the task and task id the message is sent as: required
     "task_id": "<the message's id>",  #   when signed, so it cannot be replayed under another id
     "sig": "hmac-sha256:<hex>"}       # with CRITIQUE_ENTRY_SECRET (else CRITIQUE_SECRET) set

``sig`` is HMAC-SHA256, keyed with the managers' key, over the canonical JSON of every other
field: ``json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` encoded
as UTF-8 (:func:`pipeline.security.signing.canonical`), in lower-case hex after ``hmac-sha256:``.

The worker checks the signature, the address, the submission and its overrides (the trust
boundary, as for the Python client), then starts the pass under the entry task's own id: the
gate's summary lands in Celery's result backend under that id. A refused message fails the task
with a one-line reason (``exc_type``, ``exc_message``), never a traceback, never retried.

Who signed matters too: the key that verified a run's first entry message binds the run to its
identity (:data:`Entry.signer`, ``RedisRunStore.enter_run``), and the entry task id is claimed
fleet-wide (``RedisRunStore.claim_entry``), so neither another manager's run nor another run's
task id can be entered.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import ValidationError

from pipeline.errors import SubmissionError, validation_problems
from pipeline.models import MAX_OUTPUT_DEPTH, Submission
from pipeline.security import signing
from workers import runtime

ENTRY_VERSION = 1
"""The entry message's ``v``."""
FIELDS = frozenset(
    {"v", "submission", "config", signing.TASK_FIELD, signing.TASK_ID_FIELD, signing.SIG_FIELD}
)
"""Every field an entry message may carry."""
MAX_ENTRY_DEPTH = MAX_OUTPUT_DEPTH + 10
"""Deepest nesting (objects and arrays) an entry message may have: its submission's output
(:data:`pipeline.models.MAX_OUTPUT_DEPTH` levels, two below the message) and a little room.
Deeper is refused before anything recurses over it (the signature's canonical JSON, the
configuration's cache key), so the sender gets a one-line failure, not silence."""


class Entry(NamedTuple):
    """A decoded entry message: the submission, its policy overrides, and who signed it."""

    submission: Submission
    config: dict[str, Any]
    signer: str | None
    """The identity of the key that verified it (:func:`workers.runtime.entry_keys`: ``fleet``,
    ``entry`` or ``entry:<name>``); None when the workers hold no key (nothing is checked)."""


def decode_entry(msg: Any, *, task_name: str, task_id: str) -> Entry:
    """The submission, policy overrides and signer an entry message carries, received as
    ``task_name`` running as ``task_id``.

    Nesting deeper than :data:`MAX_ENTRY_DEPTH` is refused first (``SubmissionError``). With a
    managers' key set (:func:`workers.runtime.entry_keys`), the signature is checked next, then
    the address (``ForgedMessageError``: unsigned, altered, signed with another key, or
    addressed to another task or id). Then the shape (``SubmissionError``, one line, never
    quoting the payload; ``v`` must be the integer 1, not ``true``). The overrides are checked
    by the caller against the worker's own configuration (``RefusedOverrideError``)."""
    if not isinstance(msg, dict):
        raise SubmissionError(f"entry message: expected a JSON object, got {type(msg).__name__}")
    _check_depth(msg)
    keys_ = runtime.entry_keys()
    signer = None
    if keys_:
        signer = keys_[signing.verify_signer(msg, [key for _, key in keys_])][0]
        signing.check_addressed(msg, task_name, task_id)
    unknown = sorted(str(k)[:40] for k in set(msg) - FIELDS)
    if unknown:
        raise SubmissionError(
            f"entry message: unknown field(s) {', '.join(unknown[:5])}; expected only "
            f"{', '.join(sorted(FIELDS))}"
        )
    if type(msg.get("v")) is not int or msg["v"] != ENTRY_VERSION:
        raise SubmissionError(f"entry message: 'v' must be the integer {ENTRY_VERSION}")
    config = msg.get("config")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise SubmissionError("entry message: 'config' must be an object")
    doc = msg.get("submission")
    if not isinstance(doc, dict):
        raise SubmissionError(
            "entry message: 'submission' must be an object (a pipeline.models.Submission)"
        )
    try:
        sub = Submission.model_validate(doc)
    except ValidationError as exc:
        problems = validation_problems(exc)
        raise SubmissionError(f"entry message: malformed submission: {problems}") from None
    return Entry(sub, dict(config), signer)


def _check_depth(msg: dict[str, Any]) -> None:
    """Refuse an entry nested deeper than :data:`MAX_ENTRY_DEPTH` (iteratively: a hostile
    depth cannot exhaust the stack here)."""
    stack: list[tuple[Any, int]] = [(msg, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_ENTRY_DEPTH:
            raise SubmissionError(
                f"entry message: nested more than {MAX_ENTRY_DEPTH} levels deep (a submission's "
                f"output may nest {MAX_OUTPUT_DEPTH}); flatten it or send it as a file"
            )
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
