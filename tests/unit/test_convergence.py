"""Convergence: target, plateau, budget and their order; the rubric loop's round trace."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pipeline.config import RUBRIC_DIMENSIONS, CritiqueConfig, RubricConfig
from pipeline.critics.base import RevisionResult
from pipeline.critics.rubric import weighted_mean
from pipeline.loop.convergence import (
    RoundDecision,
    RoundFacts,
    decide_round,
    plateau_detected,
    target_met,
)
from pipeline.loop.stages import L0Outcome, run_submission
from pipeline.models import CritiqueEnvelope, RepairAttempt, Submission, Suggestion
from pipeline.wiring import make_context


def test_plateau_needs_the_full_window() -> None:
    """One flat round is noise; plateau_window consecutive flat rounds are a plateau."""
    assert not plateau_detected([5.0, 5.05], 0.1, 2)
    assert plateau_detected([5.0, 5.05, 5.07], 0.1, 2)
    assert not plateau_detected([5.0, 5.05, 5.3], 0.1, 2)
    assert not plateau_detected([4.0, 5.0, 5.05], 0.1, 2)
    assert plateau_detected([5.0, 5.05], 0.1, 1)


def test_plateau_boundary_and_disabled() -> None:
    """An improvement of exactly epsilon is not flat; with epsilon 0 flat rounds never plateau."""
    assert not plateau_detected([5.0, 5.1, 5.2], 0.1, 2)
    assert not plateau_detected([5.0, 5.0, 5.0, 5.0], 0.0, 2)


def test_target_requires_every_dimension() -> None:
    """A high mean with one weak dimension does not meet the target."""
    rubric = RubricConfig(target_score=8.0)
    strong = dict.fromkeys(RUBRIC_DIMENSIONS, 8.0)
    assert target_met(strong, rubric)
    assert not target_met({**strong, "evidence": 7.99, "clarity": 10.0}, rubric)
    assert not target_met({"clarity": 9.0}, rubric)


def test_weighted_mean() -> None:
    """Weights apply; unlisted dimensions weigh 1."""
    rubric = RubricConfig(weights={"clarity": 3.0})
    scores = {**dict.fromkeys(RUBRIC_DIMENSIONS, 4.0), "clarity": 8.0}
    assert weighted_mean(scores, rubric) == pytest.approx((24 + 16) / 7)


def _facts(**kw: Any) -> RoundFacts:
    base: dict[str, Any] = {"round": 3, "score": 0.5, "means": (5.0, 5.05, 5.07)}
    base.update(kw)
    return RoundFacts(**base)


def settle(
    facts: RoundFacts,
    config: CritiqueConfig,
    *,
    fixpoint: bool | None = False,
    unfixable: bool = False,
) -> RoundDecision:
    """decide_round, answering what it asks: the fixpoint (None: it must not be asked), the
    plan, and a granted budget."""
    decision = decide_round(facts, config)
    while decision.ask is not None:
        if decision.ask == "fixpoint":
            assert fixpoint is not None, "fixpoint must not be evaluated here"
            facts = facts.model_copy(update={"fixpoint": fixpoint})
        elif decision.ask == "plan":
            facts = facts.model_copy(update={"unfixable": unfixable})
        else:
            facts = facts.model_copy(update={"budget": "granted"})
        decision = decide_round(facts, config)
    return decision


def _stop(decision: RoundDecision) -> str | None:
    return decision.stop_reason


RUBRIC3 = CritiqueConfig(critic="rubric", max_repair_attempts=2, rubric=RubricConfig(max_rounds=3))
GENERIC2 = CritiqueConfig(critic="heuristic", max_repair_attempts=2)


def test_rubric_order_target_then_plateau_then_budget() -> None:
    """Target beats plateau; plateau beats budget; fixpoint is not consulted once target holds."""
    assert _stop(settle(_facts(target=True), RUBRIC3, fixpoint=None)) == "target"
    assert _stop(settle(_facts(), RUBRIC3, fixpoint=False)) == "plateau"
    assert _stop(settle(_facts(), RUBRIC3, fixpoint=True)) == "repair_fixpoint_detected"
    rising = _facts(means=(3.0, 5.0, 7.0))
    assert _stop(settle(rising, RUBRIC3)) == "budget"
    going = settle(_facts(round=2, means=(3.0, 5.0)), RUBRIC3)
    assert going.action == "repair" and going.stop_reason is None


def test_generic_order() -> None:
    """accepted > fixpoint > no_improvement > attempts_exhausted for generic critics."""
    acc = _facts(acceptable=True, previous_score=0.9, repairs_done=2)
    assert _stop(settle(acc, GENERIC2, fixpoint=None)) == "accepted"
    same = _facts(score=0.5, previous_score=0.5, repairs_done=2)
    assert _stop(settle(same, GENERIC2, fixpoint=True)) == "repair_fixpoint_detected"
    assert _stop(settle(same, GENERIC2)) == "no_improvement"
    up = _facts(score=0.55, previous_score=0.5, repairs_done=2)
    assert _stop(settle(up, GENERIC2)) == "attempts_exhausted"
    assert settle(up.model_copy(update={"repairs_done": 1}), GENERIC2).action == "repair"


def _status(stop_facts: dict[str, Any], config: CritiqueConfig = GENERIC2, **kw: Any) -> str:
    decision = settle(_facts(**stop_facts), config, **kw)
    assert decision.done and decision.status is not None
    return decision.status


def test_final_status() -> None:
    """Round-1 accepts by band; repairs that end acceptable are repaired; fixpoint fails."""
    first = {"round": 1, "repairs_done": 0, "means": ()}
    assert _status({**first, "score": 0.95, "best_score": 0.95}) == "accepted"
    assert _status({**first, "score": 0.7, "best_score": 0.7}) == "accepted_with_warnings"
    target = {"target": True, "best_target": True, "best_score": 0.85}
    assert _status({**first, **target}, RUBRIC3) == "accepted"
    assert _status({**target, "repairs_done": 2}, RUBRIC3) == "repaired"
    fixed_point = {"repairs_done": 2, "previous_score": 0.4, "best_score": 0.9}
    assert _status(fixed_point, fixpoint=True) == "failed"
    assert _status({"repairs_done": 2, "best_score": 0.5}, RUBRIC3) == "escalated"  # plateau
    plateau_ok = {"repairs_done": 2, "best_score": 0.7, "best_acceptable": True}
    assert _status(plateau_ok, RUBRIC3) == "repaired"
    flat = {"repairs_done": 1, "score": 0.5, "previous_score": 0.5, "best_score": 0.5}
    assert _status(flat) == "escalated"  # no_improvement


# --- the rubric loop with a scripted critic --------------------------------------------------


class ScriptedRubricCritic:
    """Returns, per round, all five dimensions at the scripted mean (or explicit score dicts)."""

    name = "scripted-rubric"
    token_free = False
    reads_pitfalls = True

    def __init__(self, rounds: Sequence[float | dict[str, float]]) -> None:
        self.rounds = list(rounds)
        self.calls = 0

    def critique(
        self, submission: Submission, output: Any, *, pitfalls: str, round: int
    ) -> CritiqueEnvelope:
        self.calls += 1
        spec = self.rounds[min(round, len(self.rounds)) - 1]
        scores = spec if isinstance(spec, dict) else dict.fromkeys(RUBRIC_DIMENSIONS, spec)
        mean = sum(scores.values()) / len(scores)
        return CritiqueEnvelope(
            worker_id=submission.worker_id,
            score=mean / 10,
            scores=scores,
            suggestions=(Suggestion(dimension="clarity", edit="say more"),),
            critic="scripted-rubric",
        )


class NoteReviser:
    """Changes the draft each round (a new note) without helping any dimension."""

    name = "note"
    token_free = False
    reads_pitfalls = True

    def __init__(self) -> None:
        self.calls = 0

    def revise(
        self,
        submission: Submission,
        output: Any,
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        self.calls += 1
        return RevisionResult(output={"note": self.calls}, suggestions_applied=1)


def _no_l0(sub: Submission, output: Any, previous_size: int | None) -> L0Outcome:
    return L0Outcome()


def _rubric_run(rounds: Sequence[float | dict[str, float]], **rubric: Any) -> Any:
    config = CritiqueConfig(enabled=True, critic="rubric", rubric=RubricConfig(**rubric))
    ctx = make_context(
        config,
        critic=ScriptedRubricCritic(rounds),
        reviser=NoteReviser(),
        l0=_no_l0,
        fixpoint=lambda a, b: False,
    )
    sub = Submission(run_id="run-1", worker_id="w1", task="Write it.", output={"note": 0})
    return run_submission(sub, ctx)


def test_plateau_after_two_flat_rounds() -> None:
    """Means 5.0, 5.05, 5.07 with target 9 end in plateau at round 3, not earlier."""
    result = _rubric_run([5.0, 5.05, 5.07, 9.5], target_score=9.0)
    assert [t.verdict for t in result.trace] == ["continue", "continue", "plateau"]
    assert [t.mean for t in result.trace] == pytest.approx([5.0, 5.05, 5.07])
    assert result.stop_reason == "plateau"
    assert result.status == "escalated"
    assert result.output == {"note": 2}  # the best (highest) round


def test_target_wins_over_plateau_in_the_same_round() -> None:
    """A round that both meets the target and is flat reports target."""
    result = _rubric_run([8.0, 8.05, 8.1], target_score=8.1)
    assert [t.verdict for t in result.trace] == ["continue", "continue", "target"]
    assert (result.status, result.stop_reason) == ("repaired", "target")


def test_target_on_round_one_is_accepted_without_revision() -> None:
    """A draft already at target stops on round 1 with status accepted."""
    result = _rubric_run([9.0])
    assert (result.status, result.stop_reason) == ("accepted", "target")
    assert result.attempts == ()


def test_one_weak_dimension_blocks_the_target() -> None:
    """A high mean with one dimension below target does not stop with target."""
    weak = {**dict.fromkeys(RUBRIC_DIMENSIONS, 10.0), "evidence": 7.0}
    result = _rubric_run([weak, weak, weak], plateau_epsilon=0.0, max_rounds=3)
    assert result.stop_reason == "budget"
    assert result.status == "repaired"  # acceptable (0.94, no critical) but target not met


def test_budget_when_suggestions_never_help() -> None:
    """With plateau detection off, a critic whose suggestions never help hits max_rounds."""
    result = _rubric_run([4.0], plateau_epsilon=0.0)
    assert len(result.trace) == 5
    assert [t.verdict for t in result.trace] == ["continue"] * 4 + ["budget"]
    assert {t.mean for t in result.trace} == {4.0}
    assert result.stop_reason == "budget"
    assert result.status == "escalated"
    assert result.output == {"note": 0}  # equal rounds never replace the first


def test_flat_scores_under_defaults_are_a_plateau() -> None:
    """Under default settings flat scores stop at round 3 with plateau (no_improvement is off)."""
    result = _rubric_run([4.0])
    assert [t.verdict for t in result.trace] == ["continue", "continue", "plateau"]


def test_rubric_ignores_max_repair_attempts_and_escalate_band() -> None:
    """A rubric score under 0.3 is still revised, beyond max_repair_attempts, up to max_rounds."""
    config = CritiqueConfig(
        enabled=True, critic="rubric", max_repair_attempts=1, rubric=RubricConfig(max_rounds=4)
    )
    reviser = NoteReviser()
    ctx = make_context(
        config,
        critic=ScriptedRubricCritic([1.0, 2.0, 3.0, 4.0]),
        reviser=reviser,
        l0=_no_l0,
        fixpoint=lambda a, b: False,
    )
    sub = Submission(run_id="run-1", worker_id="w1", task="Write it.", output={"note": 0})
    result = run_submission(sub, ctx)
    assert reviser.calls == 3
    assert result.stop_reason == "budget"
    assert [t.mean for t in result.trace] == [1.0, 2.0, 3.0, 4.0]
