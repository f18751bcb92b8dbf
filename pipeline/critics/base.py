"""The critic and reviser protocols every implementation follows (SPEC §5.2, §5.3).

A critic scores one output and lists its defects; a reviser applies a critique's prescriptions to
produce the next output. Both are plain objects with one method, so an LLM critic, the rubric
critic, a command critic and the heuristic fallback are interchangeable in the loop.

Capabilities are attributes every critic and reviser declares (part of the protocols):

- ``token_free``: it spends no tokens (it reads the output deterministically, or calls no
  model). A token-free critic may run even when Layer-0 failed (see :func:`merge_l0`); a
  token-free reviser's repairs reserve nothing from the repair budget.
- ``reads_pitfalls``: it reads the Known Pitfalls text. Deterministic ones say False, so the
  runner does not even read pattern memory for them (they are handed ``""``).

A reviser loaded from configuration (``repairer: package.module:function``) that declares
neither is adapted by :func:`pipeline.wiring.load_reviser` as token-spending and
pitfall-reading.

Optional capabilities are protocols of their own, checked with ``isinstance``:

- :class:`PerSubmission` (``resolve(submission)``): a wrapper that picks the critic or reviser
  per submission (``critic: auto``); the runner asks :func:`resolve_for` for the one that
  serves a submission and reads the capabilities there.
- :class:`Planner` (``plan(submission, output, envelope)``): a reviser that knows in advance
  what it can fix (a deterministic one) returns the revision ``revise`` would return, without
  side effects. The runner asks it before spending a repair round: when the plan fixes nothing,
  the loop stops with ``needs_model`` and lists the plan's ``unfixable`` defects (SPEC §5.3).
  A plan of None (an LLM with a model) means it may fix anything.
- :class:`PromptedReviser` and :class:`SizedCritic` (the repair budget, SPEC §5.3): a reviser
  that sends the SPEC §5.3 repair prompt to a model sizes its call from that prompt
  (``repair_bound(..., prompt=...) -> (tokens, output_tokens)``) and takes it ready-made
  (``revise(..., prompt=...)``), so the runner renders it once per round; a critic's
  ``critique_bound(submission, output, *, output_tokens, pitfalls, round) -> tokens`` sizes a
  re-critique. Without them the runner estimates (:mod:`pipeline.repair`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import Field

from pipeline.models import (
    CritiqueEnvelope,
    Defect,
    Frozen,
    RepairAttempt,
    Submission,
    Usage,
)

L0_ERROR_PENALTY = 0.2
"""Score subtracted per Layer-0 error (a critical L0 defect) in the token-free envelope."""
L0_WARNING_PENALTY = 0.1
"""Score subtracted per Layer-0 warning in the token-free envelope."""


class Critic(Protocol):
    """Scores one output and lists its defects."""

    name: str
    token_free: bool
    """True when it spends no tokens (deterministic): it may run even when Layer-0 failed."""
    reads_pitfalls: bool
    """False when it ignores the Known Pitfalls text (pattern memory is then not read for it)."""

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
    token_free: bool
    """True when it calls no model: its repairs reserve nothing from the repair budget."""
    reads_pitfalls: bool
    """False when it ignores the Known Pitfalls text (pattern memory is then not read for it)."""

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


@runtime_checkable
class PerSubmission(Protocol):
    """A critic or reviser that picks, per submission, the one that serves it (``auto``)."""

    def resolve(self, submission: Submission) -> Any:
        """The critic or reviser that serves ``submission``."""
        ...


def resolve_for(obj: Any, submission: Submission) -> Any:
    """The critic or reviser that actually serves ``submission``: a :class:`PerSubmission`
    wrapper picks per submission, everything else is itself."""
    return obj.resolve(submission) if isinstance(obj, PerSubmission) else obj


@runtime_checkable
class Planner(Protocol):
    """A reviser that can say, without side effects, what ``revise`` would return."""

    def plan(
        self, submission: Submission, output: str | dict[str, Any], envelope: CritiqueEnvelope
    ) -> RevisionResult | None:
        """The revision ``revise`` would return; None when it cannot tell (a model may fix
        anything)."""
        ...


@runtime_checkable
class PromptedReviser(Protocol):
    """A reviser that sends the SPEC §5.3 repair prompt to a model: the runner renders the
    prompt once per round (:func:`pipeline.repair.build_repair_prompt`), sizes the call with
    :meth:`repair_bound` and hands the same prompt to ``revise(..., prompt=...)``."""

    def repair_bound(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str = "",
        attempts: Sequence[RepairAttempt] = (),
        prompt: str | None = None,
    ) -> tuple[int, int]:
        """``(tokens, output_tokens)``: the repair call's counted prompt plus its
        ``max_tokens``, and the repaired output's size bound."""
        ...

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str = "",
        attempts: Sequence[RepairAttempt] = (),
        prompt: str | None = None,
    ) -> RevisionResult:
        """Repair with ``prompt`` (rendered by the caller) when given."""
        ...


@runtime_checkable
class SizedCritic(Protocol):
    """A critic that can size one critique call of a repaired output (SPEC §5.3)."""

    def critique_bound(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        output_tokens: int,
        pitfalls: str = "",
        round: int = 1,
    ) -> int:
        """Tokens one critique of ``output`` grown to ``output_tokens`` may spend."""
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
            "summary": summary,
            "usage": Usage(),
            "fallback_reason": "layer-0 contract failed: no critic tokens spent",
        }
    )
