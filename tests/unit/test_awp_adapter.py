"""The AWP door's translation (workers/adapters/awp.py, workers/adapters/verdicts.py): the fleet's
verdict as AWP's envelope, AWP's critique block as the submissions' policy, ids the fleet takes,
and which output of a repair chain the fleet kept. No Redis: the mapping is pure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("awp", reason="awp-agents is not installed (pip install -e '.[awp]')")

from awp.models.orchestration import CritiqueConfig as AwpCritiqueConfig

from pipeline.models import CritiqueEnvelope, CritiqueResult, Defect
from workers.adapters import verdicts
from workers.adapters.awp import (
    awp_envelope,
    clean_output,
    refused_envelope,
    service_config,
    workflow_total_tokens,
)


def _result(status: str = "escalated", stop: str = "worker_repair", **kw: Any) -> CritiqueResult:
    envelope = CritiqueEnvelope(
        worker_id="w1",
        score=0.45,
        defects=(
            Defect(
                category="missing_data",
                location="findings",
                description="no findings",
                severity="critical",
                source="llm",
            ),
            Defect(
                category="hallucinated",
                location="summary",
                description="names a file",
                severity="critical",
                source="llm",
                false_positive=True,
            ),
        ),
        prescriptions=("add the findings",),
        summary="1 defect",
    )
    fields: dict[str, Any] = {
        "run_id": "awp-r1",
        "worker_id": "w1",
        "status": status,
        "stop_reason": stop,
        "output": {"summary": "x"},
        "original_score": 0.45,
        "best_score": 0.45,
        "envelope": envelope,
    }
    fields.update(kw)
    return CritiqueResult(**fields)


def test_a_verdict_becomes_awps_envelope_with_its_defects_and_why() -> None:
    """Score, defects (a grounding false positive as info), prescriptions, and a summary that
    starts with the fleet's status and stop reason."""
    env = awp_envelope(_result(), "w1")
    assert env.score == 0.45
    assert [(d.category, d.severity) for d in env.defects] == [
        ("missing_data", "critical"),
        ("hallucinated", "info"),
    ]
    assert env.has_critical_defects and env.critical_count == 1
    assert env.prescriptions == ["add the findings"]
    assert env.summary.startswith("fleet: escalated (worker_repair) 0.45 → 0.45")


def test_an_unchecked_verdict_is_never_a_perfect_score() -> None:
    """An output the fleet did not check scores 0.0 for AWP's gates and says why, never 1.0."""
    env = awp_envelope(_result("unchecked", "disabled", original_score=None, best_score=None), "w1")
    assert env.score == 0.0
    assert any("not critiqued by the fleet" in d.description for d in env.defects)


def test_a_refused_output_is_a_critical_defect_not_a_pass() -> None:
    """The fleet refusing or not answering gives AWP a 0.0 envelope with one critical defect."""
    env = refused_envelope("w2", "timed out")
    assert (env.score, env.critical_count) == (0.0, 1)
    assert "timed out" in env.summary


def test_awps_critique_block_becomes_the_managers_policy() -> None:
    """repairer: worker, AWP's attempt cap, fraction, gate and categories, and the loop's token
    budget; AWP's own critic settings (model, mode) are not sent."""
    cfg = AwpCritiqueConfig(enabled=True, max_repair_attempts=1, model="gpt-4o", mode="dedicated")
    doc = service_config(cfg, 2_000_000)
    assert doc["repairer"] == "worker"
    assert doc["max_repair_attempts"] == 1
    assert doc["budget"] == {"total_tokens": 2_000_000}
    assert "model" not in doc and "mode" not in doc
    assert "budget" not in service_config(cfg, None)


def test_awps_internal_keys_are_not_submitted() -> None:
    """Tool-call logs and critique annotations (``_``-keys) stay with AWP."""
    assert clean_output({"summary": "s", "_tool_calls": [1], "_critique_score": 0.4}) == {
        "summary": "s"
    }


def test_the_kept_output_is_found_among_the_chains_candidates() -> None:
    """keep-best: the candidate equal to the verdict's output (keys in any order), else the
    newest."""
    result = _result("repaired", "accepted", output={"b": 2, "a": 1})
    assert verdicts.kept_index(result, [{"a": 0}, {"a": 1, "b": 2}, {"a": 3}]) == 1
    assert verdicts.kept_index(result, [{"a": 0}, {"a": 3}]) == 1


def test_feedback_is_the_why_and_the_prescriptions_and_empty_for_a_pass() -> None:
    """What a worker sent back is told: the deciding defects and the fixes, not the manager's
    next step (resubmitting is the manager's business, not the worker model's)."""
    text = verdicts.feedback(_result("escalated", "needs_model"))
    assert "missing_data at findings: no findings" in text
    assert "fix: add the findings" in text
    assert "next:" not in text and "submit_repair" not in text
    assert verdicts.feedback(_result("accepted", "accepted")) == ""


def test_the_workflows_budget_is_read_with_awps_parser(tmp_path: Path) -> None:
    """max_total_tokens of the delegation loop in workflow.awp.yaml; None when unreadable."""
    from tests.support.awp_world import write_workflow

    wf = write_workflow(tmp_path)
    cfg = AwpCritiqueConfig(enabled=True)
    assert workflow_total_tokens(wf, cfg) == 2_000_000
    assert workflow_total_tokens(tmp_path / "missing", cfg) is None
