"""The critic and reviser protocols every implementation follows (SPEC §5.2, §5.3).

A critic scores one output and lists its defects; a reviser applies a critique's prescriptions to
produce the next output. Both are plain objects with one method, so an LLM critic, the rubric
critic, a command critic and the heuristic fallback are interchangeable in the loop.

Optional attribute: a critic that spends no tokens (it reads the output deterministically) sets
``token_free = True``; the runner may then run it even when Layer-0 failed (see
:func:`merge_l0`). Critics without the attribute are treated as token-spending. A reviser that
calls no model sets it too: its repairs reserve nothing from the repair budget.

Optional sizing methods (the repair budget, SPEC §5.3): a reviser's ``repair_bound(submission,
output, envelope, *, pitfalls, attempts) -> (tokens, output_tokens)`` and a critic's
``critique_bound(submission, output, *, output_tokens, pitfalls, round) -> tokens`` say what one
repair call and one re-critique may spend (counted prompt + the ``max_tokens`` they call with);
the runner reserves their sum. Without them the runner estimates (:mod:`pipeline.repair`).

Optional method: a reviser that knows in advance what it can fix (a deterministic one) offers
``plan(submission, output, envelope) -> RevisionResult``, the revision ``revise`` would return,
without side effects. The runner asks it before spending a repair round: when the plan fixes
nothing, the loop stops with ``needs_model`` and lists the plan's ``unfixable`` defects
(SPEC §5.3). Revisers without ``plan``, or whose plan is None (an LLM with a model), are
assumed able to try every defect.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import Field

from pipeline.models import (
    CritiqueEnvelope,
    Defect,
    Frozen,
    RepairAttempt,
    Submission,
    Usage,
    band_for,
    effort_for,
)

L0_ERROR_PENALTY = 0.2
"""Score subtracted per Layer-0 error (a critical L0 defect) in the token-free envelope."""
L0_WARNING_PENALTY = 0.1
"""Score subtracted per Layer-0 warning in the token-free envelope."""


class Critic(Protocol):
    """Scores one output and lists its defects."""

    name: str

    def critique(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        pitfalls: str,
        round: int,
    ) -> CritiqueEnvelope:
        """Critique ``output`` (the current version of ``submission.output``) in ``round``."""
        ...


class Refusal(Frozen):
    """A defect a reviser left alone, and why (e.g. fixing it would invent content)."""

    defect: Defect
    reason: str

    def line(self) -> str:
        """One line for notes and the CLI: severity, category, where, what, why not."""
        d = self.defect
        where = f" at {d.location}" if d.location else ""
        return f"[{d.severity}] {d.category}{where}: {d.description} (not fixed: {self.reason})"


class RevisionResult(Frozen):
    """What a reviser returns: the new output, what it cost, how many suggestions it applied."""

    output: str | dict[str, Any]
    usage: Usage = Field(default_factory=Usage)
    suggestions_applied: int = Field(0, ge=0)
    note: str | None = None
    """Something the user should know about this revision (e.g. a fallback reviser answered)."""
    unfixable: tuple[Refusal, ...] = ()
    """The defects this reviser could not fix honestly, each with the reason (deterministic
    revisers list every critical and warning defect they left alone)."""


class Reviser(Protocol):
    """Repairs an output: fixes only the defects the envelope names, keeps everything else."""

    name: str

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        """Return the repaired output for ``envelope``'s critical and warning defects."""
        ...


def clamp_score(score: float) -> float:
    """Clamp to [0, 1] and round away float noise (0.30000000000000004 → 0.3)."""
    return round(min(1.0, max(0.0, score)), 6)


def l0_prescription(defect: Defect) -> str:
    """The repair instruction for one Layer-0 defect."""
    where = f" at {defect.location}" if defect.location else ""
    return f"Fix the output-contract failure{where}: {defect.description}"


def merge_l0(envelope: CritiqueEnvelope, l0_defects: Sequence[Defect]) -> CritiqueEnvelope:
    """The token-free envelope used when Layer-0 failed (SPEC §5.1: no critic tokens spent).

    Rule: take a token-free critic's envelope (the heuristic, or a deterministic critic), put the
    L0 defects first, and subtract 0.2 per L0 error (critical) and 0.1 per L0 warning, clamped
    to [0, 1]. Usage is zero; ``fallback_reason`` says why the configured critic did not run.
    """
    errors = sum(1 for d in l0_defects if d.severity == "critical")
    warnings = sum(1 for d in l0_defects if d.severity == "warning")
    score = clamp_score(envelope.score - L0_ERROR_PENALTY * errors - L0_WARNING_PENALTY * warnings)
    defects = (*l0_defects, *envelope.defects)
    prescriptions = (
        *(l0_prescription(d) for d in l0_defects if d.severity != "info"),
        *envelope.prescriptions,
    )
    summary = (
        f"layer-0 contract failed ({errors} error(s), {warnings} warning(s)); "
        f"critic skipped, token-free score {score:.2f}. {envelope.summary}"
    ).strip()
    return envelope.model_copy(
        update={
            "score": score,
            "defects": defects,
            "prescriptions": prescriptions,
            "band": band_for(score),
            "effort_estimate": effort_for(len(defects)),
            "summary": summary,
            "usage": Usage(),
            "fallback_reason": "layer-0 contract failed: no critic tokens spent",
        }
    )
