"""Flower on a loopback port, with basic auth, sees the pipeline's workers, tasks and progress.

Real processes only: a Celery worker and ``celery -A workers.app flower`` against the worker-test
Redis database; the submissions go through the real chain.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.models import Submission
from tests.support.flower import USER, FlowerProcess, until
from tests.support.flower import get as _get
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    """This process's client, the worker and Flower share the worker-test database."""
    with client_on(worker_db_url(redis_url)) as e:
        yield e


WORKER = WorkerSpec("flowerw", concurrency=2)


@pytest.fixture(scope="module")
def cluster(
    env: dict[str, str], worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The module's worker and Flower (basic auth) running; yields Flower's base URL. Both are
    stopped afterwards."""
    logs = tmp_path_factory.mktemp("flower")
    flower = FlowerProcess(env, logs / "flower.log")
    try:
        flower.start()
        # Flower's event receiver has heard the worker's heartbeat: task events will be seen.
        flower.wait_worker_alive("flowerw@")
        yield flower.base
    finally:
        flower.stop()


def _sub(run_id: str, worker_id: str, output: str | dict[str, Any]) -> Submission:
    return Submission(
        run_id=run_id,
        worker_id=worker_id,
        task="Summarise the quarterly sales report with findings.",
        output=output,
        required_fields=("summary", "findings"),
    )


def test_flower_api_lists_pipeline_tasks_behind_basic_auth(cluster: str) -> None:
    """Through Flower's authenticated API: the worker registers critique.* tasks, the two
    submissions' tasks are listed (one critique.l0 each: a first repair round runs in it), the
    repair sent a task-progress event;
    without (or with wrong) credentials every page answers 401."""
    from workers.client import CritiqueClient

    base = cluster
    run_id = f"flower-{uuid.uuid4().hex[:8]}"
    loop = (
        "Sales rose four percent in the third quarter, led by the northern region, where two "
        "new stores opened and the online shop doubled its monthly orders compared with last year."
    )
    looping = f"# Q3\n\n## Summary\n\nSales rose.\n\n## Findings\n\n{loop}\n\n{loop}\n"
    subs = [
        _sub(run_id, "w1", looping),  # a verbatim repeated paragraph → one honest repair
        _sub(run_id, "w2", {"summary": "ok", "findings": "two regions grew", "confidence": 0.9}),
    ]
    client = CritiqueClient({"enabled": True, "budget": {"total_tokens": 1_000_000}})
    results = client.wait_many(client.submit_many(subs), timeout=30)
    assert [r.status for r in results] == ["repaired", "accepted"]

    status, body = _get(f"{base}/api/workers?refresh=1")
    assert status == 200
    workers = json.loads(body)
    ours = [info for name, info in workers.items() if name.startswith("flowerw@")]
    assert ours, f"worker missing from {sorted(workers)}"
    registered = set(ours[0]["registered"])
    assert {"critique.l0", "critique.critic", "critique.decide", "critique.repair"} <= registered
    assert {"critique.gate", "critique.complete_gate"} <= registered
    queues = {q["name"] for q in ours[0]["active_queues"]}
    assert queues == {"critique.cpu", "critique.llm"}

    def tasks_seen() -> int | None:
        code, raw = _get(f"{base}/api/tasks?taskname=critique.l0&state=SUCCESS")
        seen = len(json.loads(raw)) if code == 200 else 0
        return seen if seen >= 2 else None

    # One task per submission: w2's critique.l0 ran its whole loop (Layer-0, critic, decide,
    # gate), and so did w1's with its repair round (the repair's queue is the task's own).
    until("the pipeline's tasks in Flower's task list", tasks_seen)
    code, raw = _get(f"{base}/api/tasks?state=SUCCESS")
    ours = [t for t in json.loads(raw).values() if str(t.get("name")).startswith("critique.")]
    ours = [t for t in ours if t["name"] != "critique.probe"]
    assert code == 200 and [t["name"] for t in ours] == ["critique.l0"] * 2
    assert all(t["worker"].startswith("flowerw@") for t in ours)

    def progress_counted() -> str | None:
        code, text = _get(f"{base}/metrics", None)
        m = re.search(
            r'flower_events_total\{[^}]*type="task-progress"[^}]*\} ([0-9.]+)', text.decode()
        )
        return m.group(0) if code == 200 and m and "critique.l0" in m.group(0) else None

    assert float(until("a task-progress event", progress_counted).rsplit(" ", 1)[1]) >= 1

    _, raw = _get(f"{base}/api/task/types")
    types = set(json.loads(raw)["task-types"])
    assert "critique.l0" in types and "critique.repair" not in types  # the one task that ran

    for path in ("/api/workers", "/api/tasks", "/api/task/types", "/"):
        assert _get(f"{base}{path}", None)[0] == 401, path
    assert _get(f"{base}/api/workers", (USER, "wrong"))[0] == 401
