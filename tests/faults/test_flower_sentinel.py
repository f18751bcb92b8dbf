"""Flower on a Sentinel broker, with real processes: a master with AOF, one replica and three
Sentinels (``redis-server --sentinel``), a Celery worker and ``celery -A workers.app flower
--basic-auth=…``, all with ``REDIS_URL`` / ``CELERY_BROKER_URL`` = the ``sentinel://`` URL and
``CRITIQUE_REDIS_MASTER``. Flower lists the worker and the submissions' tasks, its broker tab
counts the queues through the Sentinels, and after the master is SIGKILLed and the replica
promoted it follows the new master (it asks the Sentinels again when it reconnects): the
next submissions' tasks are listed too. Task events are pub/sub: those published between the
master's loss and Flower's re-subscription are never seen by it.

Nothing is mocked; the submissions need no LLM (the heuristic critic). Every server runs on a
free loopback port in the test's temp dir and is stopped afterwards."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import StoreUnavailableError
from pipeline.models import Submission
from tests.support.flower import FlowerProcess, until
from tests.support.sentinel import SentinelSetup, SentinelWorker
from tests.support.workers import WorkerStarter

pytestmark = [
    pytest.mark.faults,
    pytest.mark.skipif(
        shutil.which("redis-server") is None,
        reason="redis-server is not on PATH: Flower on a Sentinel broker needs real "
        "redis-server processes (a master, a replica, three Sentinels); install Redis to run it",
    ),
]

LOOP = (
    "Sales rose four percent in the third quarter, led by the northern region, where two "
    "new stores opened and the online shop doubled its monthly orders compared with last year."
)
LOOPING = f"# Q3\n\n## Summary\n\nSales rose.\n\n## Findings\n\n{LOOP}\n\n{LOOP}\n"
"""A verbatim repeated paragraph: one honest repair round (run in its ``critique.l0`` task)."""


def _subs(run_id: str) -> list[Submission]:
    """Two submissions: one repaired, one accepted (each one ``critique.l0`` task: a first repair
    round runs in the task that decided it)."""
    common: dict[str, Any] = {
        "run_id": run_id,
        "task": "Summarise the quarterly sales report with findings.",
        "required_fields": ("summary", "findings"),
    }
    return [
        Submission(worker_id="w1", output=LOOPING, **common),
        Submission(
            worker_id="w2",
            output={"summary": "ok", "findings": "two regions grew", "confidence": 0.9},
            **common,
        ),
    ]


def _submit(run_id: str) -> list[str]:
    """Submit :func:`_subs` and wait for both results; their task ids (one per submission)."""
    from workers.client import CritiqueClient

    client = CritiqueClient({"enabled": True, "budget": {"total_tokens": 1_000_000}})
    handles = client.submit_many(_subs(run_id))
    results = client.wait_many(handles, timeout=60)
    assert [r.status for r in results] == ["repaired", "accepted"]
    return [h.task_id for h in handles]


def _listed(flower: FlowerProcess, ids: list[str], timeout: float = 30.0) -> dict[str, Any]:
    """Until Flower's ``/api/tasks`` lists both task ids as succeeded (each as ``critique.l0``)
    on our worker; the tasks."""

    def both() -> dict[str, Any] | None:
        tasks = flower.json("/api/tasks?state=SUCCESS") or {}
        got = {i: tasks[i] for i in ids if i in tasks}
        return got if len(got) == len(ids) else None

    tasks = until(f"tasks {ids} in Flower's task list", both, timeout)
    assert [tasks[i]["name"] for i in ids] == ["critique.l0", "critique.l0"]
    assert all(str(t["worker"]).startswith("flowersw@") for t in tasks.values())
    return tasks


def _refreshed_worker(flower: FlowerProcess) -> dict[str, Any]:
    """Our worker's entry in ``/api/workers?refresh=1`` (Flower asks every worker over the
    broker's remote control: registered tasks, active queues, stats)."""

    def ours() -> dict[str, Any] | None:
        workers = flower.json("/api/workers?refresh=1") or {}
        found = [info for name, info in workers.items() if name.startswith("flowersw@")]
        return found[0] if found and found[0].get("registered") else None

    return until("the worker in /api/workers?refresh=1", ours)


def _canary_seen(flower: FlowerProcess) -> bool:
    """Submit one accepted output and wait a few seconds for Flower to list its task: whether
    Flower receives the workers' task events (what was published before it subscribed again,
    after a failover, is never seen; the sweeper's probes send no task events)."""
    from workers.client import CritiqueClient

    client = CritiqueClient({"enabled": True, "budget": {"total_tokens": 1_000_000}})
    try:
        [handle] = client.submit_many(_subs(f"flower-canary-{uuid.uuid4().hex[:8]}")[1:])
    except StoreUnavailableError:  # the client has not found the new master yet: next try
        return False
    client.wait(handle, timeout=60)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if handle.task_id in (flower.json("/api/tasks?state=SUCCESS") or {}):
            return True
        time.sleep(0.25)
    return False


@pytest.mark.timeout(240)
def test_flower_follows_a_sentinel_broker_through_a_failover(
    sentinels: SentinelSetup,
    sentinel_env: dict[str, str],
    start_worker: WorkerStarter,
    tmp_path: Path,
) -> None:
    """Pins: Flower started with the ``sentinel://`` URL and ``CRITIQUE_REDIS_MASTER`` (what
    ``celeryconfig`` turns into ``master_name``) needs nothing more: ``/api/workers?refresh=1``
    lists the worker (critique.* tasks registered, both queues), ``/api/tasks`` lists the two
    submissions' task ids (one ``critique.l0`` each, the repaired one's repair round run in
    it), the broker tab's ``/api/queues/length`` answers for both queues. After the
    master is SIGKILLed and a Sentinel promotes the replica, the same Flower process receives
    task events again within 60 s (a canary submission sent after the promotion), then lists the
    next two submissions' tasks and the worker. With the URL's first Sentinel down, the broker
    tab's queue lengths fail (Flower's own client asks only that one) while remote control
    still answers."""
    worker = start_worker(
        "flowersw", sentinel_env, process=SentinelWorker, concurrency=2, started=False
    )
    flower = FlowerProcess(sentinel_env, tmp_path / "flower.log")
    try:
        worker.start(timeout=60)
        flower.start()
        flower.wait_worker_alive("flowersw@")

        before = _listed(flower, _submit(f"flower-sentinel-{uuid.uuid4().hex[:8]}"))
        info = _refreshed_worker(flower)
        assert {"critique.l0", "critique.repair", "critique.gate"} <= set(info["registered"])
        assert {q["name"] for q in info["active_queues"]} == {"critique.cpu", "critique.llm"}
        lengths = flower.json("/api/queues/length") or {}
        assert {q["name"] for q in lengths.get("active_queues", [])} == {
            "critique.cpu",
            "critique.llm",
        }, lengths
        code, page = flower.get("/broker")
        assert code == 200 and b"critique.cpu" in page

        old = sentinels.master.port
        sentinels.master.kill()
        until(
            "the replica's promotion",
            lambda: sentinels.master_port() == sentinels.replica.port,
            timeout=30,
        )
        promoted = time.monotonic()
        # Events are pub/sub: what the worker publishes before Flower has subscribed again (on
        # the new master) is never seen. Flower is following once a task sent after the
        # promotion shows in its list.
        until("a task event through the new master", lambda: _canary_seen(flower), 60)
        following = time.monotonic() - promoted
        after = _listed(flower, _submit(f"flower-sentinel-{uuid.uuid4().hex[:8]}"), timeout=60)
        assert not set(before) & set(after)
        assert _refreshed_worker(flower)["active_queues"]
        assert flower.proc is not None and flower.proc.poll() is None, "Flower exited"

        # Flower's broker tab (Flower's own client, not kombu's) asks only the URL's first
        # Sentinel: with that one down, the queue lengths are not available (the events, the
        # tasks and remote control go through kombu, which tries every Sentinel).
        sentinels.sentinels[0].stop()
        assert flower.get("/api/queues/length")[0] == 500
        code, page = flower.get("/broker")
        assert code == 200 and b"critique.cpu" not in page  # rendered, without the queues
        assert _refreshed_worker(flower)["active_queues"]
        print(
            f"\nFlower on Sentinel: master {old} killed, replica {sentinels.replica.port} "
            f"promoted; after that, Flower received task events again in {following:.1f} s and "
            f"listed the next tasks in {time.monotonic() - promoted:.1f} s"
        )
    finally:
        flower.stop()
        worker.stop()
