"""AWP's engine calls served by the fleet, called as AWP's runner calls them, against a real Redis
and a real worker (heuristic critic: no model): verdicts in AWP's order, the worker re-run on
the fleet's rules (keep-best, reported tokens charged), the fleet's pitfalls and summary, and
the fleet repairing by itself when the workflow's critique block says so."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("awp", reason="awp-agents is not installed (pip install -e '.[awp]')")

from awp.models.orchestration import CritiqueConfig as AwpCritiqueConfig

from tests.support.awp_world import write_workflow
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url
from workers.adapters.awp import FleetCritiqueEngine

pytestmark = pytest.mark.integration

WORKER = WorkerSpec("awp-engine", concurrency=2)
CONTRACT = {"output_contract": {"required_fields": ["summary", "findings", "confidence"]}}
CLEAN = {"summary": "Demand is steady.", "findings": ["two stores"], "confidence": 0.8}
MISSING = {"summary": "Demand is steady.", "confidence": 0.8, "_tool_calls": [{"name": "x"}]}
TASK = "Survey the demand."


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    with client_on(worker_db_url(redis_url), CRITIQUE_CRITIC="heuristic") as e:
        yield e


class Budget:
    """AWP's run budget as the runner hands ``attempt_repair`` its ``can_continue``."""

    def __init__(self) -> None:
        self.tokens_consumed = 0

    def can_continue(self) -> tuple[bool, str]:
        return True, ""


def _engine(tmp_path: Path, **critique: Any) -> FleetCritiqueEngine:
    wf = write_workflow(tmp_path, critique=critique)
    return FleetCritiqueEngine(
        config=AwpCritiqueConfig(enabled=True, max_repair_attempts=2),
        workflow_dir=wf,
        run_id=uuid.uuid4().hex[:10],
    )


def _dr(wid: str, result: dict[str, Any]) -> dict[str, Any]:
    return {"worker_id": wid, "result": dict(result), "envelope": dict(CONTRACT)}


def test_verdicts_come_back_in_awps_order_and_a_re_run_is_checked_by_the_fleet(
    env: dict[str, str], worker: WorkerProcess, tmp_path: Path
) -> None:
    """critique_results answers in order (w1 needs its worker, w2 passes); attempt_repair re-runs
    w1 with AWP's repair prompt, the fleet re-critiques it (repaired), the reported tokens are
    the run's repair spend, and AWP's envelope now says the final verdict."""
    engine = _engine(tmp_path)
    results = [_dr("w1", MISSING), _dr("w2", CLEAN)]
    first, second = engine.critique_results(results, TASK, 1)
    assert first.summary.startswith("fleet: escalated (worker_repair)") and first.critical_count
    assert second.summary.startswith("fleet: accepted") and not second.critical_count

    budget = Budget()
    prompts: list[str] = []

    def run_worker(envelope: dict[str, Any], task: str) -> dict[str, Any]:
        prompts.append(envelope["instructions"])
        budget.tokens_consumed += 500
        return {**CLEAN, "_tool_calls": []}

    kept, attempts = engine.attempt_repair(
        "w1", results[0]["result"], first, TASK, CONTRACT, run_worker, budget.can_continue, 1
    )
    assert kept == {**CLEAN, "_tool_calls": []}
    assert len(attempts) == 1 and attempts[0].defects_remaining == 0
    assert "REPAIR MODE" in prompts[0] and "findings" in prompts[0]
    assert first.summary.startswith("fleet: repaired") and first.critical_count == 0
    assert engine._total_repair_tokens == 500
    assert "[seen 1x] missing_data" in engine.build_pattern_pitfalls_section()
    summary = engine.get_summary()
    assert summary["fleet"]["verdicts"] == {
        "1:w1": "repaired (accepted)",
        "1:w2": "accepted (accepted)",
    }
    assert summary["total_repair_tokens"] == 500 and len(summary["repair_history"]) == 1


def test_a_worse_re_run_leaves_the_better_output_with_awp(
    env: dict[str, str], worker: WorkerProcess, tmp_path: Path
) -> None:
    """keep-best is the fleet's: a re-run scoring lower ends the chain, and attempt_repair hands
    AWP back the original output."""
    engine = _engine(tmp_path)
    results = [_dr("w1", MISSING)]
    [first] = engine.critique_results(results, TASK, 1)
    worse = {"summary": "", "confidence": 0.1}
    kept, attempts = engine.attempt_repair(
        "w1",
        results[0]["result"],
        first,
        TASK,
        CONTRACT,
        lambda e, t: worse,
        Budget().can_continue,
        1,
    )
    assert kept == results[0]["result"]
    assert len(attempts) == 1 and attempts[0].repaired_score < attempts[0].original_score
    assert "no_improvement" in first.summary


def test_the_fleet_repairs_itself_when_the_workflow_says_repairer_deterministic(
    env: dict[str, str], worker: WorkerProcess, tmp_path: Path
) -> None:
    """critique.repairer: deterministic (this service's key in AWP's block): the fleet repairs
    the output, AWP's result becomes the repaired one (its _-keys kept) and the envelope has
    nothing left to repair."""
    engine = _engine(tmp_path, repairer="deterministic")
    text_confidence = {
        **CLEAN,
        "confidence": "0.72",
        "sources": "",
        "notes": "",
        "caveats": "",
        "_tool_calls": [1],
    }
    results = [_dr("w1", text_confidence)]
    [env_] = engine.critique_results(results, TASK, 1)
    assert env_.summary.startswith("fleet: repaired"), env_.summary
    assert results[0]["result"]["confidence"] == 0.72
    assert results[0]["result"]["_tool_calls"] == [1]
    assert results[0]["result"]["_critique_repairs"]
    assert not env_.has_critical_defects
