"""decide_round, the one pure round decision: every outcome, the order it asks for facts in,
and the decide stage's one repair order per round (the prompt sized is the prompt sent)."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.config import CritiqueConfig, RubricConfig
from pipeline.critics.llm_prompts import pitfalls_block
from pipeline.loop.convergence import STOP_TEXT, Ask, RoundDecision, RoundFacts, decide_round
from pipeline.loop.pitfalls import render_pitfalls
from pipeline.loop.stages import critic_stage, decide_stage, repair_stage, start
from pipeline.models import ReusablePattern
from pipeline.store.memory import MemoryPatternStore
from tests.support.providers import Provider, budget_sub, llm_context

GENERIC = CritiqueConfig(critic="heuristic", max_repair_attempts=2)
RUBRIC = CritiqueConfig(critic="rubric", rubric=RubricConfig(max_rounds=4))


def facts(**kw: Any) -> RoundFacts:
    """A generic critic's round 2 (one repair done), every lookup answered: not a fixpoint,
    the plan fixes something, the budget grants. Override what a test is about."""
    base: dict[str, Any] = {
        "round": 2,
        "repairs_done": 1,
        "score": 0.5,
        "previous_score": 0.4,
        "means": (0.4, 0.5),
        "critical": 1,
        "best_score": 0.5,
        "fixpoint": False,
        "unfixable": False,
        "budget": "granted",
    }
    base.update(kw)
    return RoundFacts(**base)


def asks(start_facts: RoundFacts, config: CritiqueConfig, **answers: Any) -> list[Ask]:
    """The facts decide_round asks for, in order, answering each from ``answers`` (or the
    defaults of :func:`facts`)."""
    defaults: dict[str, Any] = {"fixpoint": False, "unfixable": False, "budget": "granted"}
    defaults.update(answers)
    key = {"fixpoint": "fixpoint", "plan": "unfixable", "budget": "budget"}
    asked: list[Ask] = []
    current = start_facts
    decision = decide_round(current, config)
    while decision.ask is not None:
        asked.append(decision.ask)
        current = current.model_copy(update={key[decision.ask]: defaults[key[decision.ask]]})
        decision = decide_round(current, config)
    return asked


def test_round_one_band_outcomes() -> None:
    """Round 1 of a generic critic: escalate_band below 0.3 (escalated, no repair), repair on a
    critical defect, accepted (≥ 0.9 accepted, else with warnings) otherwise."""
    first: dict[str, Any] = {"round": 1, "repairs_done": 0, "previous_score": None}
    low = decide_round(facts(**first, score=0.2, best_score=0.2), GENERIC)
    assert (low.action, low.stop_reason, low.status) == ("stop", "escalate_band", "escalated")
    assert "escalate band" in low.reason
    fix = decide_round(facts(**first, score=0.7), GENERIC)
    assert (fix.action, fix.stop_reason, fix.status) == ("repair", None, None)
    assert fix.reason == "repair: 1 critical defect(s)"
    clean = decide_round(
        facts(**first, score=0.95, critical=0, acceptable=True, best_score=0.95), GENERIC
    )
    assert (clean.action, clean.stop_reason, clean.status) == ("accept", "accepted", "accepted")
    warm = decide_round(facts(**first, score=0.7, critical=0, best_score=0.7), GENERIC)
    assert warm.status == "accepted_with_warnings" and warm.done


def test_round_one_with_no_repair_allowed_is_attempts_exhausted() -> None:
    """max_repair_attempts 0: a round-1 repair decision stops attempts_exhausted (escalated),
    keeps the band's reason, and never asks for the plan or the budget."""
    config = CritiqueConfig(critic="heuristic", max_repair_attempts=0)
    first = facts(round=1, repairs_done=0, previous_score=None, unfixable=None, budget=None)
    decision = decide_round(first, config)
    assert (decision.stop_reason, decision.status) == ("attempts_exhausted", "escalated")
    assert decision.reason.startswith("repair: ")


@pytest.mark.parametrize(
    ("overrides", "stop", "status"),
    [
        (
            {"acceptable": True, "critical": 0, "score": 0.8, "best_acceptable": True},
            "accepted",
            "repaired",
        ),
        ({"fixpoint": True}, "repair_fixpoint_detected", "failed"),
        ({"score": 0.4, "previous_score": 0.4}, "no_improvement", "escalated"),
        ({"repairs_done": 2}, "attempts_exhausted", "escalated"),
        ({"unfixable": True}, "needs_model", "escalated"),
        ({"repairs_done": 2, "unfixable": True}, "needs_model", "escalated"),
        (
            {"budget": "refused", "refusal": "repair budget refused 9 tokens"},
            "repair_budget_exhausted",
            "escalated",
        ),
    ],
)
def test_generic_stops_after_a_repair(overrides: dict[str, Any], stop: str, status: str) -> None:
    """Each generic stop after a repair, with its status; needs_model also outranks
    attempts_exhausted once a repair was made."""
    decision = decide_round(facts(**overrides), GENERIC)
    assert decision.stop_reason == stop and decision.status == status
    assert decision.action == ("accept" if stop == "accepted" else "stop")
    expected = overrides.get("refusal") or STOP_TEXT[decision.stop_reason]  # type: ignore[index]
    assert decision.reason == expected


def test_generic_repair_again() -> None:
    """Improving, under the attempts cap, fixable and within budget: repair again."""
    decision = decide_round(facts(), GENERIC)
    assert decision == RoundDecision(action="repair")


@pytest.mark.parametrize(
    ("overrides", "stop", "status"),
    [
        ({"target": True, "best_target": True, "repairs_done": 0}, "target", "accepted"),
        ({"target": True, "best_target": True}, "target", "repaired"),
        ({"fixpoint": True}, "repair_fixpoint_detected", "failed"),
        ({"round": 3, "means": (5.0, 5.05, 5.07)}, "plateau", "escalated"),
        ({"round": 4, "means": (3.0, 5.0, 7.0, 9.0)}, "budget", "escalated"),
        (
            {"round": 4, "means": (3.0, 5.0, 7.0, 9.0), "best_acceptable": True},
            "budget",
            "repaired",
        ),
    ],
)
def test_rubric_stops(overrides: dict[str, Any], stop: str, status: str) -> None:
    """Rubric critics: target, fixpoint, plateau, the round cap; status by the best round."""
    decision = decide_round(facts(**{"means": (3.0, 5.0), **overrides}), RUBRIC)
    assert (decision.stop_reason, decision.status) == (stop, status)


def test_rubric_ignores_the_band_and_the_attempts_cap() -> None:
    """A rubric score under 0.3 on round 1, or past max_repair_attempts, still repairs."""
    config = RUBRIC.model_copy(update={"max_repair_attempts": 1})
    low = facts(round=1, repairs_done=0, score=0.1, means=(1.0,), previous_score=None)
    assert decide_round(low, config).action == "repair"
    assert decide_round(facts(repairs_done=3, means=(1.0, 3.0)), config).action == "repair"


def test_asks_each_fact_only_when_its_rule_is_reached() -> None:
    """The order is fixpoint, plan, budget; an earlier stop asks for nothing later (an
    accepted round never runs the fixpoint test, the plan or the reservation)."""
    blank: dict[str, Any] = {"fixpoint": None, "unfixable": None, "budget": None}
    assert asks(facts(**blank), GENERIC) == ["fixpoint", "plan", "budget"]
    assert asks(facts(**blank, acceptable=True), GENERIC) == []
    assert asks(facts(**blank), GENERIC, fixpoint=True) == ["fixpoint"]
    assert asks(facts(**blank), GENERIC, unfixable=True) == ["fixpoint", "plan"]
    first = facts(**blank, round=1, repairs_done=0, previous_score=None)
    assert asks(first, GENERIC) == ["plan", "budget"]  # no fixpoint before a repair
    assert asks(facts(**blank, target=True), RUBRIC) == []


def test_decide_round_is_pure() -> None:
    """The same facts give the same decision, and the facts are not changed."""
    f = facts(unfixable=None, budget=None)
    before = f.model_dump()
    assert (
        decide_round(f, GENERIC)
        == decide_round(f, GENERIC)
        == RoundDecision(action="ask", ask="plan")
    )
    assert f.model_dump() == before


# --- the decide stage's repair order ---------------------------------------------------------


def test_the_repair_sends_the_prompt_the_decide_stage_sized() -> None:
    """The repair prompt is built once, in the decide stage, and carried: the repair call sends
    exactly that prompt (with the pitfalls read then), even when pattern memory changed
    between decide and repair; the order is dropped once the repair ran."""
    provider = Provider()
    patterns = MemoryPatternStore()
    ctx = llm_context(provider, 10_000_000, patterns=patterns)
    state = decide_stage(critic_stage(start(budget_sub(), "p1"), ctx), ctx)
    order = state.repair_order
    assert order is not None and order.prompt is not None and state.next == "repair"
    assert order.pitfalls == render_pitfalls(patterns.top("run-1", 10))
    assert pitfalls_block(order.pitfalls) in order.prompt
    assert state.lease_tokens == order.bound.total > 0
    # another worker records a new pattern between this pass's decide and repair
    lesson = ReusablePattern(
        category="format",
        description="a late lesson",
        prevention_rule="Always quote the region names",
    )
    assert patterns.record("run-1", "w9:1:p9:1", 1, [lesson])
    assert render_pitfalls(patterns.top("run-1", 10)) != order.pitfalls
    repaired = repair_stage(state, ctx)
    [call] = [r for r in provider.requests if r.purpose == "repair"]
    assert [m.content for m in call.messages if m.role == "user"] == [order.prompt]
    assert repaired.repair_order is None


def test_without_a_budget_cap_nothing_is_rendered_before_the_repair() -> None:
    """No budget cap: the round is not sized, so the decide stage renders no prompt (the
    reviser renders it once, in the repair) and still carries the pitfalls it read."""
    provider = Provider()
    ctx = llm_context(provider, None)
    state = decide_stage(critic_stage(start(budget_sub(), "p1"), ctx), ctx)
    assert state.repair_order is not None
    assert state.repair_order.prompt is None and state.repair_order.bound.total == 0
    assert state.lease_id is None
    repair_stage(state, ctx)
    [call] = [r for r in provider.requests if r.purpose == "repair"]
    assert pitfalls_block(state.repair_order.pitfalls) in call.messages[-1].content


def test_a_state_without_an_order_still_repairs() -> None:
    """A repair state from before repair orders existed (no ``repair_order``) repairs as before:
    the reviser reads the pitfalls and renders the prompt itself."""
    provider = Provider()
    ctx = llm_context(provider, 10_000_000)
    state = decide_stage(critic_stage(start(budget_sub(), "p1"), ctx), ctx)
    legacy = state.model_copy(update={"repair_order": None})
    repaired = repair_stage(legacy, ctx)
    assert repaired.attempt == 1
    assert [r.purpose for r in provider.requests].count("repair") == 1
