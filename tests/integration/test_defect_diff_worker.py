"""The defect diff per round (fixed, remaining, new) through a real worker and Redis, not only
the loop."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from pipeline.models import Submission
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    with client_on(worker_db_url(redis_url)) as e:
        yield e


WORKER = WorkerSpec("diff", more_env={"CRITIQUE_REPAIRER": "tests.support.revisers:swap_revise"})
"""A worker whose configured repairer fixes one defect and introduces another."""


def test_a_repair_that_fixes_one_defect_and_adds_another_shows_both_in_the_diff(
    worker: WorkerProcess,
) -> None:
    """Round 2's trace entry and its stream event say: missing_data@findings fixed,
    incomplete@error new, nothing remaining or regressed."""
    from workers.client import CritiqueClient

    run_id = f"diff-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient({"enabled": True})
    sub = Submission(
        run_id=run_id,
        worker_id="w1",
        task="Summarise the Q3 sales report.",
        output={"summary": "Sales rose.", "confidence": 0.9},
        required_fields=("summary", "findings"),
    )
    result = client.wait(client.submit(sub), timeout=60)
    first, second = result.trace[0], result.trace[1]
    assert first.fixed is None and first.new is None
    assert [dict(d) for d in second.fixed or ()] == [
        {"category": "missing_data", "location": "findings"}
    ]
    assert [dict(d) for d in second.new or ()] == [{"category": "incomplete", "location": "error"}]
    assert not second.remaining and not second.regressed
    rounds = [e for e in client.trace(run_id) if e.get("type") == "round" and e.get("round") == 2]
    assert len(rounds) == 1
    assert rounds[0]["fixed"] == [{"category": "missing_data", "location": "findings"}]
    assert rounds[0]["new"] == [{"category": "incomplete", "location": "error"}]
