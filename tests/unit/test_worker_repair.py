"""``repairer: worker``: the service decides and checks each repair, the manager's worker makes
it (a pass ends ``worker_repair``, the re-run's output resumes it with ``repair_of``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pipeline.config import CritiqueConfig, check_submission_overrides
from pipeline.critics.worker import WorkerRepairDue, WorkerReviser
from pipeline.errors import SubmissionError
from pipeline.loop.stages import LoopState, StageContext, run_submission
from pipeline.models import CritiqueResult, Submission
from pipeline.store.memory import MemoryBudgetLedger, MemoryPatternStore
from pipeline.wiring import make_context, pick_reviser

TASK = "Summarise the Q3 sales report as JSON."
MISSING = {"summary": "Sales rose 4%.", "confidence": 0.9}
"""A worker output without its required 'findings' (a critical defect)."""
FIXED = {"summary": "Sales rose 4%.", "findings": "Two new stores opened.", "confidence": 0.9}
STILL_MISSING = {"summary": "Sales rose 4 percent.", "confidence": 0.9}


def _sub(output: Any, **kw: Any) -> Submission:
    return Submission(
        run_id="r1",
        worker_id="w1",
        task=TASK,
        output=output,
        required_fields=("summary", "findings"),
        **kw,
    )


class Parking:
    """What a worker's store does for the runner: keeps parked states by pass id."""

    def __init__(self) -> None:
        self.states: dict[str, LoopState] = {}
        self.ttls: list[float] = []

    def park(self, state: LoopState, ttl_s: float) -> None:
        self.states[state.pass_id] = state
        self.ttls.append(ttl_s)

    def parked(self, pass_id: str) -> LoopState | None:
        return self.states.get(pass_id)


def _ctx(
    parking: Parking,
    *,
    budget: MemoryBudgetLedger | None = None,
    total_tokens: int | None = None,
    **config: Any,
) -> StageContext:
    """A heuristic-critic context whose repairs are the worker's, parking in ``parking``."""
    if total_tokens is not None:
        config["budget"] = {"total_tokens": total_tokens}
    cfg = CritiqueConfig(critic="heuristic", repairer="worker", **config)
    ledger = budget if budget is not None else MemoryBudgetLedger()
    ctx = make_context(cfg, patterns=MemoryPatternStore(), budget=ledger)
    return dataclasses.replace(ctx, park=parking.park, parked=parking.parked)


def _repair(
    ctx: StageContext, before: CritiqueResult, output: Any, pass_id: str, tokens: int = 0
) -> CritiqueResult:
    assert before.repair_request is not None
    sub = _sub(output, repair_of=before.repair_request.of_pass, repair_tokens=tokens)
    return run_submission(sub, ctx, pass_id=pass_id)


def test_a_due_repair_ends_the_pass_worker_repair_with_its_request_and_parks_it() -> None:
    """The decide stage's repair goes to the worker: status escalated, stop worker_repair, a
    RepairRequest for attempt 1 naming this pass, and the state kept at the repair stage."""
    parking = Parking()
    result = run_submission(_sub(MISSING), _ctx(parking), pass_id="p1")
    assert (result.status, result.stop_reason) == ("escalated", "worker_repair")
    assert result.repair_request is not None
    assert (result.repair_request.of_pass, result.repair_request.attempt) == ("p1", 1)
    assert result.attempts == ()
    assert parking.states["p1"].next == "repair"
    assert any("findings" in line for line in result.why())
    assert "repair_of" in (result.next_step or "")


def test_the_repaired_output_resumes_the_pass_and_ends_repaired() -> None:
    """A re-run output that fixes the defect, sent with repair_of, is re-critiqued as repair 1:
    status repaired, the original score kept, one RepairAttempt, the new pass's id."""
    parking = Parking()
    ctx = _ctx(parking)
    first = run_submission(_sub(MISSING), ctx, pass_id="p1")
    second = _repair(ctx, first, FIXED, "p2")
    assert (second.status, second.stop_reason) == ("repaired", "accepted")
    assert second.pass_id == "p2"
    assert second.output == FIXED
    assert second.original_score == first.best_score
    assert len(second.attempts) == 1
    assert second.repair_request is None
    assert any("made by the worker" in n for n in second.notes)


def test_keep_best_a_worse_re_run_never_replaces_the_better_output() -> None:
    """A re-run that scores lower ends no_improvement with the earlier, better output kept."""
    parking = Parking()
    ctx = _ctx(parking)
    first = run_submission(_sub(MISSING), ctx, pass_id="p1")
    worse = {"summary": "", "confidence": 0.1}
    second = _repair(ctx, first, worse, "p2")
    assert second.stop_reason == "no_improvement"
    assert second.output == MISSING
    assert second.best_score == first.best_score


def test_two_re_runs_that_change_nothing_stop_at_the_fixpoint() -> None:
    """The second re-run returning the first re-run's output again is a fixpoint: failed."""
    parking = Parking()
    ctx = _ctx(parking, max_repair_attempts=3)
    first = run_submission(_sub({"summary": "", "confidence": 0.9}), ctx, pass_id="p1")
    tweaked = {"summary": "Sales rose 4%.", "confidence": 0.9}  # better, still no findings
    second = _repair(ctx, first, tweaked, "p2")
    assert second.stop_reason == "worker_repair", second
    third = _repair(ctx, second, tweaked, "p3")
    assert (third.status, third.stop_reason) == ("failed", "repair_fixpoint_detected")
    assert len(third.attempts) == 2


def test_the_attempt_cap_is_the_services() -> None:
    """With max_repair_attempts 1, a re-run that still misses the field ends attempts_exhausted,
    with no further request."""
    parking = Parking()
    ctx = _ctx(parking, max_repair_attempts=1)
    first = run_submission(_sub(MISSING), ctx, pass_id="p1")
    second = _repair(ctx, first, STILL_MISSING, "p2")
    assert second.stop_reason in ("attempts_exhausted", "no_improvement")
    assert second.repair_request is None
    assert len(second.attempts) == 1


def test_the_budget_holds_the_re_run_and_charges_what_the_worker_reported() -> None:
    """With a repair budget, the hand-back holds a reservation for the re-run; the repaired
    output commits it with the worker's reported tokens (a heuristic re-critique spends none)."""
    ledger = MemoryBudgetLedger()
    ctx = _ctx(Parking(), budget=ledger, total_tokens=100_000)
    first = run_submission(_sub(MISSING), ctx, pass_id="p1")
    assert first.repair_request is not None and first.repair_request.reserved_tokens > 0
    held = ledger.snapshot("r1")
    assert (held.held, held.holders, held.spent) == (first.repair_request.reserved_tokens, 1, 0)
    second = _repair(ctx, first, FIXED, "p2", tokens=321)
    after = ledger.snapshot("r1")
    assert (after.held, after.spent) == (0, 321)
    assert second.budget_charged == 321
    assert second.repair_usage.tokens == 321


def test_a_re_run_that_reports_more_than_was_held_does_not_close_the_budget() -> None:
    """The worker's reported tokens are charged in full, but a re-run the service could not
    bound is no overrun: the run's next output still gets its worker repair."""
    ledger = MemoryBudgetLedger()
    ctx = _ctx(Parking(), budget=ledger, total_tokens=100_000)
    first = run_submission(_sub(MISSING), ctx, pass_id="p1")
    assert first.repair_request is not None
    big = first.repair_request.reserved_tokens + 5_000
    second = _repair(ctx, first, FIXED, "p2", tokens=big)
    assert second.budget_charged == big
    assert ledger.snapshot("r1").overrun == 0
    other = Submission(
        run_id="r1",
        worker_id="w2",
        task=TASK,
        output=MISSING,
        required_fields=("summary", "findings"),
    )
    assert run_submission(other, ctx, pass_id="p3").stop_reason == "worker_repair"
    assert not any("more than the" in n for n in second.notes)


def test_a_repair_of_with_nothing_waiting_is_refused_in_one_line() -> None:
    """repair_of naming a pass that parked nothing (expired, released, never asked) fails with
    a SubmissionError that says what to do."""
    ctx = _ctx(Parking())
    with pytest.raises(SubmissionError, match=r"repair_of 'nope'.*without repair_of"):
        run_submission(_sub(FIXED, repair_of="nope"), ctx, pass_id="p2")


def test_a_repair_of_another_workers_pass_is_refused() -> None:
    """The parked pass must be the same run, iteration and worker as the repaired output."""
    parking = Parking()
    ctx = _ctx(parking)
    first = run_submission(_sub(MISSING), ctx, pass_id="p1")
    assert first.repair_request is not None
    other = Submission(
        run_id="r1",
        worker_id="w2",
        task=TASK,
        output=FIXED,
        required_fields=("summary", "findings"),
        repair_of="p1",
    )
    with pytest.raises(SubmissionError, match="no repair of worker 'w2'"):
        run_submission(other, ctx, pass_id="p2")


def test_an_accepted_output_asks_for_no_repair() -> None:
    """A clean output ends accepted with no request and parks nothing."""
    parking = Parking()
    result = run_submission(_sub(FIXED), _ctx(parking), pass_id="p1")
    assert result.status == "accepted"
    assert result.repair_request is None
    assert parking.states == {}


def test_repairer_worker_is_the_managers_choice_and_picks_the_worker_reviser() -> None:
    """A submission may set repairer: worker (it reaches no address, secret or code), and the
    wiring serves it with the WorkerReviser, which a runner never calls."""
    check_submission_overrides({"repairer": "worker"}, CritiqueConfig(), env={})
    reviser = pick_reviser(CritiqueConfig(repairer="worker"))
    assert isinstance(reviser, WorkerReviser)
    with pytest.raises(WorkerRepairDue):
        reviser.revise(_sub(MISSING), MISSING, _envelope(), pitfalls="", attempts=())


def _envelope() -> Any:
    from pipeline.models import CritiqueEnvelope

    return CritiqueEnvelope(worker_id="w1", score=0.8)
