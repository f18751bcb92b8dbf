"""A stage's state as a worker stores it: large parts by reference, each stored once per pass.

A :class:`~pipeline.loop.stages.LoopState` repeats its submission, output and envelope in every
stage's message. :func:`compact_state` swaps each large part for the reference a
content-addressed store (the blob store) gives its JSON, so a pass stores each distinct part
once; :func:`expand_state` reads one back, each part through a getter that checks its bytes
against the reference. Pure: the store is passed in as ``put`` / ``get``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.loop.stages import LoopState

STATE_PART_BYTES = 4096
"""A part of a state (:data:`STATE_PARTS`, or a field of its submission) whose JSON is at least
this long travels by reference inside a compact state (:func:`compact_state`)."""
STATE_PARTS = (
    "output",
    "best_output",
    "previous_repair_text",
    "envelope",
    "best_envelope",
    "repair_order",
)
"""The parts of a state besides its submission's fields that may be large, and that repeat
from stage to stage."""
PARTS_KEY = "$parts"
"""The key of a compact state's references (no :class:`LoopState` has such a field)."""
_SUBMISSION_PART = "submission."


def compact_state(state: LoopState, put: Callable[[bytes], str]) -> bytes:
    """``state`` as JSON in which each large part (a field of its submission, or one of
    :data:`STATE_PARTS`, at least :data:`STATE_PART_BYTES` of JSON) is replaced by the
    reference ``put`` returns for that part's JSON, listed under :data:`PARTS_KEY`. With a
    content-addressed ``put`` (the blob store) the same submission, output or envelope,
    repeated in every stage's state, is stored once per pass instead of once per stage, so what
    a pass stores grows with its input and its distinct outputs, not with its stage count.

    The JSON still begins like a state's (the submission's ids first: the worker log reads
    them from a state's first bytes). :func:`expand_state` reads it back."""
    doc = state.model_dump(mode="json")
    parts: dict[str, str] = {}

    def take(holder: dict[str, Any], name: str, part: str) -> None:
        value = holder.get(name)
        if value is None:
            return
        raw = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        if len(raw) >= STATE_PART_BYTES:
            parts[part] = put(raw.encode("utf-8"))
            del holder[name]

    submission = doc["submission"]
    for name in list(submission):
        take(submission, name, _SUBMISSION_PART + name)
    for name in STATE_PARTS:
        take(doc, name, name)
    ordered = {"submission": submission, PARTS_KEY: parts}
    ordered.update((k, v) for k, v in doc.items() if k != "submission")
    return json.dumps(ordered, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def expand_state(raw: str | bytes, get: Callable[[str], bytes]) -> dict[str, Any] | None:
    """The state document of a compact state (:func:`compact_state`), each part read back
    through ``get`` (which must check that the bytes match the reference), for
    ``LoopState.model_validate``; None when ``raw`` is a plain :class:`LoopState` JSON (read
    it with ``model_validate_json``). Raises ``ValueError`` for a malformed one."""
    data = raw.encode("utf-8") if isinstance(raw, str) else raw
    if f'"{PARTS_KEY}":'.encode() not in data:
        return None
    doc = json.loads(data)
    if not isinstance(doc, dict) or PARTS_KEY not in doc:
        return None  # the key sits inside a value (an output's): a plain state
    parts = doc.pop(PARTS_KEY)
    submission = doc.get("submission")
    if not isinstance(parts, dict) or not isinstance(submission, dict):
        raise ValueError("a compact state needs a submission object and a '$parts' object")
    for part, ref in parts.items():
        holder, name = doc, str(part)
        if name.startswith(_SUBMISSION_PART):
            holder, name = submission, name.removeprefix(_SUBMISSION_PART)
        elif name not in STATE_PARTS:
            raise ValueError(f"compact state part {name[:40]!r} is not a state part")
        if not isinstance(ref, str) or name in holder:
            raise ValueError(f"compact state part {name[:40]!r} is malformed or given twice")
        holder[name] = json.loads(get(ref))
    return dict(doc)
