"""The demo's sample run: every sample ends as designed through the broker-free runner."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pipeline.config import load_config
from pipeline.critics.base import RevisionResult
from pipeline.critics.heuristic import HeuristicReviser
from pipeline.loop.stages import run_submission
from pipeline.models import CritiqueEnvelope, RepairAttempt, Submission
from pipeline.store.memory import MemoryPatternStore
from pipeline.wiring import make_context
from workers.commands._samples import (
    DEMO_TOTAL_TOKENS,
    Sample,
    demo_samples,
    iterations,
    overrides_for,
)

SAMPLES = demo_samples()


@pytest.mark.parametrize("sample", SAMPLES, ids=[f"{s.iteration}-{s.worker_id}" for s in SAMPLES])
def test_sample_ends_as_designed(sample: Sample) -> None:
    """Each sample reaches its designed status and stop reason with its critic and reviser."""
    ctx = make_context(load_config(env={}, overrides=overrides_for(sample.critic)))
    result = run_submission(sample.submission("demo-test"), ctx)
    assert (result.status, result.stop_reason) == (sample.expected_status, sample.expected_stop)
    if sample.expected_status == "repaired":
        assert result.best_score > result.original_score
    if sample.expected_stop == "escalate_band":
        assert not result.attempts
    if sample.expected_stop == "needs_model":
        listed = [n for n in result.notes if n.startswith("needs_model: [")]
        assert listed, result.notes
        critical = {d.description for d in result.envelope.critical}
        assert critical and all(any(c in n for n in listed) for c in critical)


def test_samples_cover_the_product() -> None:
    """About two dozen samples over three iterations hit every status, the rubric critic, the
    honest token-free repairs and needs_model."""
    assert 20 <= len(SAMPLES) <= 30
    assert iterations(SAMPLES) == [1, 2, 3]
    assert {s.expected_status for s in SAMPLES} == {
        "accepted",
        "accepted_with_warnings",
        "repaired",
        "escalated",
        "failed",
    }
    stops = {s.expected_stop for s in SAMPLES}
    assert {"accepted", "target", "needs_model", "escalate_band"} <= stops
    assert "repair_fixpoint_detected" in stops
    repaired = " ".join(s.kind for s in SAMPLES if s.expected_status == "repaired")
    for edit in ("repeating a paragraph", "placeholder-only line", "duplicate heading"):
        assert edit in repaired
    assert "confidence as text" in repaired
    assert any(s.critic == "rubric" for s in SAMPLES)
    keys = [(s.iteration, s.worker_id) for s in SAMPLES]
    assert len(keys) == len(set(keys))


def test_samples_are_deterministic_and_isolated() -> None:
    """Two calls give equal samples, and a submission never shares the sample's output object."""
    assert demo_samples() == demo_samples()
    sample = next(s for s in SAMPLES if isinstance(s.output, dict))
    sub = sample.submission("r1")
    assert isinstance(sub.output, dict)
    sub.output["tampered"] = True
    assert "tampered" not in sample.output


def test_overrides_set_the_budget_and_the_token_free_pair() -> None:
    """The demo configuration enables critique with a total budget and deterministic repairs."""
    for critic in ("heuristic", "rubric"):
        config = load_config(env={}, overrides=overrides_for(critic))
        assert config.enabled and config.critic == critic
        assert config.repairer == "deterministic"
        assert config.repair_token_cap == int(DEMO_TOTAL_TOKENS * config.repair_budget_fraction)


class _Recording:
    """The heuristic reviser, remembering the pitfalls each repair was given."""

    name = "recording"
    token_free = False
    reads_pitfalls = True

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        self.seen[submission.worker_id] = pitfalls
        return HeuristicReviser().revise(
            submission, output, envelope, pitfalls=pitfalls, attempts=attempts
        )


def test_earlier_iterations_pitfalls_reach_later_repairs() -> None:
    """Run in order, iteration 2's repairs are given the pitfalls iteration 1 recorded."""
    patterns = MemoryPatternStore()
    reviser = _Recording()
    ctx = make_context(
        load_config(env={}, overrides=overrides_for("heuristic")),
        patterns=patterns,
        reviser=reviser,
    )
    for s in SAMPLES:
        if s.iteration == 1 and s.critic == "heuristic":
            run_submission(s.submission("demo-order"), ctx)
    target = next(s for s in SAMPLES if s.worker_id == "survey-berlin")
    assert target.iteration == 2
    run_submission(target.submission("demo-order"), ctx)
    given = reviser.seen["survey-berlin"]
    assert "## Known Pitfalls" in given
    assert "Always include the 'findings' field in your output" in given
