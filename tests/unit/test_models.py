"""The data model: validation, JSON round trips, bands and stable defect ids."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.models import (
    CritiqueEnvelope,
    Defect,
    FileRef,
    Submission,
    Usage,
    band_for,
    effort_for,
)


def sub(**kw: object) -> Submission:
    base: dict[str, object] = {"run_id": "r1", "worker_id": "w1", "task": "t", "output": "x"}
    base.update(kw)
    return Submission.model_validate(base)


@pytest.mark.parametrize(
    ("score", "band"),
    [
        (1.0, "accept"),
        (0.9, "accept"),
        (0.89, "accept_with_warnings"),
        (0.6, "accept_with_warnings"),
        (0.59, "repair"),
        (0.3, "repair"),
        (0.29, "escalate"),
        (0.0, "escalate"),
    ],
)
def test_band_edges(score: float, band: str) -> None:
    """Score bands switch exactly at 0.9, 0.6 and 0.3."""
    assert band_for(score) == band


def test_effort_estimate_thresholds() -> None:
    """trivial ≤ 1 defect, moderate ≤ 3, major beyond."""
    assert [effort_for(n) for n in (0, 1, 2, 3, 4)] == [
        "trivial",
        "trivial",
        "moderate",
        "moderate",
        "major",
    ]


def test_defect_id_is_stable_and_content_derived() -> None:
    """The same defect gets the same id; a different description a different one."""
    a = Defect(category="missing_data", severity="critical", description="no summary", source="l0")
    b = Defect(category="missing_data", severity="critical", description="no summary", source="l0")
    c = Defect(category="missing_data", severity="critical", description="no title", source="l0")
    assert a.id == b.id != c.id
    assert a.id.startswith("missing_data:-:")


def test_band_and_effort_are_derived_from_score_and_actionable_defects() -> None:
    """band follows the score and effort_estimate counts critical and warning defects only,
    after any change of either; both are in the JSON dump."""

    def d(severity: str, n: int) -> Defect:
        return Defect.model_validate(
            {"category": "x", "severity": severity, "description": f"d{n}", "source": "llm"}
        )

    env = CritiqueEnvelope(
        worker_id="w1", score=0.7, defects=(d("critical", 1), d("info", 2), d("info", 3))
    )
    assert (env.band, env.effort_estimate) == ("accept_with_warnings", "trivial")
    worse = env.model_copy(update={"score": 0.1, "defects": (*env.defects, d("warning", 4))})
    assert (worse.band, worse.effort_estimate) == ("escalate", "moderate")
    dumped = worse.model_dump(mode="json")
    assert (dumped["band"], dumped["effort_estimate"]) == ("escalate", "moderate")


def test_envelope_payloads_with_stored_band_and_effort_still_validate() -> None:
    """A payload written when band and effort_estimate were stored fields validates; the
    stored values are recomputed, so a stale or contradictory one cannot survive."""
    old = {"worker_id": "w1", "score": 0.95, "band": "escalate", "effort_estimate": "major"}
    env = CritiqueEnvelope.model_validate(old)
    assert (env.band, env.effort_estimate) == ("accept", "trivial")
    again = CritiqueEnvelope.model_validate_json(env.model_dump_json())
    assert again == env


def test_defect_check_names_the_layer0_check_and_is_optional() -> None:
    """An L0 defect carries its check; a payload without the field validates (None), and a
    check on a non-L0 defect is refused."""
    from pipeline.contract.models import ContractFailure

    d = ContractFailure(check="no_placeholder", severity="error", reason="TODO").to_defect()
    assert d.check == "no_placeholder"
    assert Defect.model_validate_json(d.model_dump_json()) == d
    old = {"category": "incomplete", "severity": "critical", "description": "L0 x", "source": "l0"}
    assert Defect.model_validate(old).check is None
    with pytest.raises(ValidationError, match="l0 only"):
        Defect.model_validate({**old, "source": "llm", "check": "no_placeholder"})


def test_submission_round_trips_through_json() -> None:
    """A submission survives JSON serialization unchanged (what crosses the broker)."""
    s = sub(output={"summary": "ok", "confidence": 0.8}, files=[{"path": "out/a.csv", "size": 3}])
    assert Submission.model_validate_json(s.model_dump_json()) == s


@pytest.mark.parametrize("bad", ["../x", "a/../../b", "/etc/passwd", "C:\\x", ""])
def test_file_paths_must_stay_relative(bad: str) -> None:
    """FileRef paths that are absolute or climb with '..' are refused."""
    with pytest.raises(ValidationError):
        FileRef(path=bad, size=1)


@pytest.mark.parametrize("bad", ["", "../r", "a/b", "run id", "x" * 200, "-lead"])
def test_run_ids_are_safe_identifiers(bad: str) -> None:
    """run_id ends up in Redis keys and paths, so only a safe alphabet passes."""
    with pytest.raises(ValidationError):
        sub(run_id=bad)


def test_unknown_submission_fields_are_rejected() -> None:
    """A typo in a submission field is an error, not silently dropped data."""
    with pytest.raises(ValidationError):
        sub(outptu="x")


def test_duplicate_files_are_rejected() -> None:
    """The same path twice in one submission is refused."""
    with pytest.raises(ValidationError):
        sub(files=[{"path": "a.txt", "size": 1}, {"path": "a.txt", "size": 2}])


def test_usage_adds_up() -> None:
    """Usage values sum field by field."""
    total = Usage(tokens_in=1, tokens_out=2, cost=0.5, calls=1) + Usage(tokens_in=3, calls=1)
    assert (total.tokens_in, total.tokens_out, total.cost, total.calls, total.tokens) == (
        4,
        2,
        0.5,
        2,
        6,
    )


def test_envelope_actionable_excludes_info() -> None:
    """Only critical and warning defects are handed to a repair."""
    d = [
        Defect(category="stale", severity=s, description=s, source="llm")
        for s in ("critical", "warning", "info")
    ]
    env = CritiqueEnvelope(worker_id="w", score=0.5, defects=tuple(d))
    assert [x.severity for x in env.actionable] == ["critical", "warning"]
    assert [x.severity for x in env.critical] == ["critical"]


def test_score_must_lie_in_unit_interval() -> None:
    """An envelope score outside [0, 1] is invalid."""
    with pytest.raises(ValidationError):
        CritiqueEnvelope(worker_id="w", score=1.2)


def test_result_trace_event_has_one_shape_for_runner_and_gate() -> None:
    """The result event carries the same keys whoever writes it; only ``stage`` differs, and
    ``pass_id`` is there exactly when the pass has one."""
    from pipeline.models import CritiqueResult

    result = CritiqueResult(
        run_id="r1",
        worker_id="w1",
        status="accepted",
        stop_reason="accepted",
        output="ok",
        original_score=0.9,
        best_score=0.95,
        envelope=CritiqueEnvelope(worker_id="w1", score=0.95),
        budget_charged=12,
        pass_id="p1",
    )
    here = result.trace_event(round=2, stage="result")
    there = result.trace_event(round=2, stage="gate")
    assert {**here, "stage": "gate"} == there
    assert here["type"] == "result" and here["budget_charged"] == 12 and here["pass_id"] == "p1"
    assert "pass_id" not in result.model_copy(update={"pass_id": ""}).trace_event(
        round=2, stage="result"
    )
