"""Result bounds: what a finished pass's result may hold besides its output.

:func:`bound_result` keeps a result within :data:`RESULT_EXTRA_BYTES` of JSON besides its
output (the envelope, the per-round trace, the repair attempts, the notes), cutting the least
useful parts first and saying so in a note; the output, scores, statuses and counts are never
changed.
"""

from __future__ import annotations

from pipeline.critics.base import clip, fold_defects
from pipeline.models import CritiqueResult, DefectRef

NOTE_CHARS = 600
"""Longest note line a bounded result keeps."""


RESULT_EXTRA_BYTES = 256 * 1024
"""Most a result may hold besides its output (the envelope, the per-round trace, the repair
attempts, the notes), as JSON. The output itself is the answer and is never cut."""
BOUNDED_DIFF_REFS = 10
"""Entries kept per defect-diff list of a round when a result is over its bound."""
BOUNDED_NOTES = 40
"""Notes kept when a result is over its bound."""
BOUNDED_DEFECTS = 20
"""Defects the envelope of a result over its bound keeps listed (the rest folded)."""
_DIFF_LISTS = ("fixed", "remaining", "new", "regressed")


def _extra_bytes(result: CritiqueResult) -> int:
    return len(result.model_copy(update={"output": ""}).model_dump_json())


def bound_result(result: CritiqueResult, limit: int = RESULT_EXTRA_BYTES) -> CritiqueResult:
    """``result`` with at most ``limit`` bytes of JSON besides its output; over it, cut in
    this order until it fits, and say so in a note: each round's defect-diff lists to their
    first :data:`BOUNDED_DIFF_REFS` entries, the notes to :data:`BOUNDED_NOTES` (each clipped),
    the envelope to :data:`BOUNDED_DEFECTS` listed defects (the rest folded, counts kept) and
    as many prescriptions, then the trace to its first and last rounds. Scores, statuses,
    counts and the output are never changed."""
    before = _extra_bytes(result)
    if before <= limit:
        return result
    cuts: list[str] = []

    def cut_diffs(r: CritiqueResult) -> CritiqueResult:
        def short(refs: tuple[DefectRef, ...] | None) -> tuple[DefectRef, ...] | None:
            return refs if refs is None else refs[:BOUNDED_DIFF_REFS]

        trace = tuple(
            t.model_copy(update={k: short(getattr(t, k)) for k in _DIFF_LISTS}) for t in r.trace
        )
        cuts.append(f"each round's defect diff cut to its first {BOUNDED_DIFF_REFS} entries")
        return r.model_copy(update={"trace": trace})

    def cut_notes(r: CritiqueResult) -> CritiqueResult:
        notes = tuple(clip(n, NOTE_CHARS) for n in r.notes[:BOUNDED_NOTES])
        cuts.append(f"notes cut to {len(notes)} of {len(r.notes)}")
        return r.model_copy(update={"notes": notes})

    def cut_envelope(r: CritiqueResult) -> CritiqueResult:
        env = r.envelope
        smaller = env.model_copy(
            update={
                "defects": fold_defects(env.defects, BOUNDED_DEFECTS),
                "prescriptions": env.prescriptions[:BOUNDED_DEFECTS],
                "reusable_patterns": env.reusable_patterns[:BOUNDED_DEFECTS],
                "suggestions": env.suggestions[:BOUNDED_DEFECTS],
            }
        )
        cuts.append(f"the envelope lists {BOUNDED_DEFECTS} defects (the rest folded, counted)")
        return r.model_copy(update={"envelope": smaller})

    def cut_rounds(r: CritiqueResult) -> CritiqueResult:
        if len(r.trace) <= 2:
            return r
        cuts.append(f"the trace keeps rounds 1 and {len(r.trace)} of {len(r.trace)}")
        return r.model_copy(update={"trace": (r.trace[0], r.trace[-1])})

    for step in (cut_diffs, cut_notes, cut_envelope, cut_rounds):
        result = step(result)
        if _extra_bytes(result) <= limit - NOTE_CHARS:
            break
    note = f"result bounded: {before} bytes besides the output, over {limit}; " + "; ".join(cuts)
    note = clip(note, NOTE_CHARS)
    return result.model_copy(update={"notes": (*result.notes, note)})
