"""Convergence (SPEC §5.3, §5.4, §7): when the critique loop stops, and with what status.

Stop rules after a round, first match wins:

    accepted                  score ≥ 0.6, no critical defect, no L0 error (generic critics)
    target                    every rubric dimension ≥ target (rubric critics; their "accepted")
    repair_fixpoint_detected  consecutive repair outputs ≥ 0.95 similar → status ``failed``
    no_improvement            score not strictly above the previous round's (generic critics)
    plateau                   rubric mean improved < epsilon for ``plateau_window`` rounds running
    attempts_exhausted        ``max_repair_attempts`` repairs done (generic critics)
    budget                    round ≥ ``rubric.max_rounds`` (rubric critics)

``repair_budget_exhausted`` (the semaphore refused) is decided by the runner when it tries to
reserve the next repair, and so is ``needs_model`` (status ``escalated``): the loop would repair
(or has run out of attempts) and the reviser's plan fixes nothing — what is left needs a model or
a person (SPEC §5.3: the deterministic reviser invents nothing), so no round is spent on it.

Rubric critics skip ``no_improvement``: one flat round is noise for a rubric (the seed's reason
for a two-round plateau window), so ``plateau`` is their equivalent; with flat scores the loop
ends in ``plateau``, or in ``budget`` when plateau detection is off (``plateau_epsilon`` 0) or
``max_rounds`` comes first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise

from pydantic import Field

from pipeline.config import RubricConfig
from pipeline.models import Frozen, Status, StopReason, Verdict
from pipeline.repair import ACCEPT_CLEAN_FROM, Decision

STOP_VERDICT: dict[StopReason, Verdict] = {
    "accepted": "accepted",
    "target": "target",
    "repair_fixpoint_detected": "fixpoint",
    "no_improvement": "no_improvement",
    "plateau": "plateau",
    "attempts_exhausted": "budget",
    "budget": "budget",
    "repair_budget_exhausted": "budget",
    "escalate_band": "escalated",
    "needs_model": "escalated",
}
"""The round verdict that each stop reason is reported as."""


STOP_TEXT: dict[StopReason, str] = {
    "accepted": "score ≥ 0.6 with no critical defect and no Layer-0 error",
    "target": "every rubric dimension reached the target score",
    "repair_fixpoint_detected": "two consecutive repair outputs are ≥ 0.95 similar",
    "no_improvement": "the score did not strictly improve over the previous round",
    "plateau": "the rubric mean stopped improving (below epsilon for the plateau window)",
    "attempts_exhausted": "max_repair_attempts repairs were made",
    "budget": "the round cap (rubric.max_rounds) was reached",
    "repair_budget_exhausted": "the run's repair budget refused the next repair",
    "escalate_band": "the score is in the escalate band (< 0.3): no repair",
    "needs_model": "the deterministic reviser can fix none of the remaining defects without "
    "inventing content: a model or a person must act",
}
"""One line per stop reason, for traces and the CLI."""


def verdict_for(stop: StopReason | None) -> Verdict:
    """``continue`` while the loop goes on, else the stop reason's verdict."""
    return "continue" if stop is None else STOP_VERDICT[stop]


def weighted_mean(scores: Mapping[str, float], rubric: RubricConfig) -> float:
    """Weighted mean (0–10) over the configured dimensions that ``scores`` has."""
    dims = [d for d in rubric.dimensions if d in scores]
    total = sum(rubric.weight(d) for d in dims)
    if total <= 0:
        return 0.0
    return round(sum(rubric.weight(d) * scores[d] for d in dims) / total, 6)


def target_met(scores: Mapping[str, float], rubric: RubricConfig) -> bool:
    """Every configured dimension ≥ the target (a high mean with one weak dimension is not)."""
    return all(scores.get(d, float("-inf")) >= rubric.target_score for d in rubric.dimensions)


def plateau_detected(means: Sequence[float], epsilon: float, window: int) -> bool:
    """True when each of the last ``window`` round-over-round improvements is < ``epsilon``."""
    if len(means) < window + 1:
        return False
    tail = list(means[-(window + 1) :])
    return all(b - a < epsilon - 1e-9 for a, b in pairwise(tail))


class RoundFacts(Frozen):
    """What the stop rules need to know about the round just critiqued."""

    round: int = Field(ge=1)
    score: float
    previous_score: float | None = None
    means: tuple[float, ...] = ()
    """The mean of every round so far, this round last."""
    acceptable: bool = False
    target: bool = False
    repairs_done: int = Field(0, ge=0)


def first_round_stop(decision: Decision, max_repair_attempts: int) -> StopReason | None:
    """Generic critics, round 1: the band decision, or no repair allowed at all."""
    if decision.stop_reason is not None:
        return decision.stop_reason
    if max_repair_attempts <= 0:
        return "attempts_exhausted"
    return None


def round_stop(
    facts: RoundFacts,
    *,
    rubric: RubricConfig | None,
    max_repair_attempts: int,
    fixpoint: Callable[[], bool],
) -> StopReason | None:
    """The stop reason for this round, or None to repair again.

    ``rubric`` is the rubric configuration for rubric critics and None for generic ones (which
    use this after a repair; round 1 goes through :func:`first_round_stop`). ``fixpoint`` is
    only called when the earlier rules did not stop the loop.
    """
    if rubric is not None:
        if facts.target:
            return "target"
        if fixpoint():
            return "repair_fixpoint_detected"
        if plateau_detected(facts.means, rubric.plateau_epsilon, rubric.plateau_window):
            return "plateau"
        if facts.round >= rubric.max_rounds:
            return "budget"
        return None
    if facts.acceptable:
        return "accepted"
    if fixpoint():
        return "repair_fixpoint_detected"
    if facts.previous_score is not None and facts.score <= facts.previous_score:
        return "no_improvement"
    if facts.repairs_done >= max_repair_attempts:
        return "attempts_exhausted"
    return None


def final_status(
    stop: StopReason,
    *,
    repairs_done: int,
    best_score: float,
    best_acceptable: bool,
    best_target: bool,
) -> Status:
    """The result status: accepted/with warnings on round 1, repaired, failed or escalated."""
    if stop == "repair_fixpoint_detected":
        return "failed"
    if stop == "needs_model":
        return "escalated"
    if repairs_done == 0:
        if stop == "accepted":
            return "accepted" if best_score >= ACCEPT_CLEAN_FROM else "accepted_with_warnings"
        if stop == "target":
            return "accepted"
        return "escalated"
    if stop in ("accepted", "target") or best_acceptable or best_target:
        return "repaired"
    return "escalated"
