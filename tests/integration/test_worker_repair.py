"""``repairer: worker`` through a real worker process and a real Redis: a due repair comes back
``worker_repair`` holding the run's budget for the re-run, the re-run's output (``repair_of``)
is re-critiqued as that repair, and a released or cancelled request holds nothing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.errors import SubmissionError
from pipeline.models import Submission
from pipeline.store import keys
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url
from workers.cli import main

pytestmark = pytest.mark.integration

CONFIG = {"critic": "heuristic", "repairer": "worker", "budget": {"total_tokens": 100_000}}
MISSING = {"summary": "Sales rose 4%.", "confidence": 0.9}
FIXED = {"summary": "Sales rose 4%.", "findings": "Two new stores opened.", "confidence": 0.9}
WORKER = WorkerSpec("worker-repair", concurrency=2)


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    with client_on(worker_db_url(redis_url)) as e:
        yield e


def _sub(run_id: str, output: Any, worker: str = "w1") -> Submission:
    return Submission(
        run_id=run_id,
        worker_id=worker,
        task="Summarise the Q3 sales report as JSON.",
        output=output,
        required_fields=("summary", "findings"),
    )


def _run() -> str:
    return f"wr-{uuid.uuid4().hex[:8]}"


def _parked_keys(run_id: str) -> list[Any]:
    from workers import runtime

    pattern = keys.run_key(run_id, f"{keys.PARKED}:*")
    return list(runtime.client().scan_iter(match=pattern))


def test_the_worker_repairs_and_the_fleet_checks_the_repair(
    env: dict[str, str], worker: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing field comes back worker_repair with attempt 1 and tokens held; the re-run's
    output, sent with submit_repair and its reported tokens, ends repaired, the tokens charged
    and nothing held; `critique status` shows the repaired verdict."""
    from workers import runtime
    from workers.client import CritiqueClient

    run_id = _run()
    client = CritiqueClient(CONFIG)
    first = client.wait(client.submit(_sub(run_id, MISSING)), timeout=60)
    assert (first.status, first.stop_reason) == ("escalated", "worker_repair")
    assert first.repair_request is not None and first.repair_request.attempt == 1
    budget = runtime.stores().budget
    assert budget.snapshot(run_id).held == first.repair_request.reserved_tokens > 0
    assert len(_parked_keys(run_id)) == 1

    second = client.wait(client.submit_repair(first, _sub(run_id, FIXED), tokens=250), timeout=60)
    assert (second.status, second.stop_reason) == ("repaired", "accepted")
    assert second.output == FIXED and len(second.attempts) == 1
    snap = budget.snapshot(run_id)
    assert (snap.spent, snap.held) == (250, 0)

    assert main(["status", run_id]) == 0
    out = capsys.readouterr().out
    assert "repaired" in out and "worker_repair" not in out


def test_a_released_request_holds_nothing_and_refuses_a_late_repair(
    env: dict[str, str], worker: WorkerProcess
) -> None:
    """release_repair refunds the hold and drops the kept state at once; a repaired output sent
    afterwards fails with one line saying nothing is waiting."""
    from workers import runtime
    from workers.client import CritiqueClient

    run_id = _run()
    client = CritiqueClient(CONFIG)
    first = client.wait(client.submit(_sub(run_id, MISSING)), timeout=60)
    assert client.release_repair(first) is True
    assert runtime.stores().budget.snapshot(run_id).held == 0
    assert _parked_keys(run_id) == []
    with pytest.raises(SubmissionError, match="no repair of worker 'w1'"):
        client.wait(client.submit_repair(first, _sub(run_id, FIXED)), timeout=60)


def test_cancelling_the_run_releases_its_waiting_worker_repairs(
    env: dict[str, str], worker: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """`critique cancel RUN` counts a finished worker_repair pass as finished and releases it:
    its hold refunded, its kept state dropped."""
    from workers import runtime
    from workers.client import CritiqueClient

    run_id = _run()
    client = CritiqueClient(CONFIG)
    client.wait(client.submit(_sub(run_id, MISSING)), timeout=60)
    assert main(["cancel", run_id]) == 0
    assert "1 waiting worker repair(s) released" in capsys.readouterr().out
    assert runtime.stores().budget.snapshot(run_id).held == 0
    assert _parked_keys(run_id) == []
