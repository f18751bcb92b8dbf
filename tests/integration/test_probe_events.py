"""The sweeper's ``critique.probe`` tasks stay out of monitors: a real worker with task events
on (a plain ``celery worker``) sends task events for the stages of a submission, and none at
all (sent, received, started, succeeded) for the probes it keeps sending through its queues."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.models import Submission
from tests.support.workers import WorkerStarter, client_on, worker_db_url

pytestmark = pytest.mark.integration


@pytest.fixture
def env(redis_url: str) -> Iterator[dict[str, str]]:
    """This process's client on the workers' database."""
    with client_on(worker_db_url(redis_url)) as e:
        yield e


def test_probes_send_no_task_events_while_stage_tasks_do(
    env: dict[str, str], start_worker: WorkerStarter
) -> None:
    from workers.app import app
    from workers.client import CritiqueClient

    start_worker("probes", {**env, "CRITIQUE_SWEEP_S": "0.5"})

    seen: list[dict[str, Any]] = []

    def capture() -> None:
        with app.connection_for_read() as conn:
            recv = app.events.Receiver(conn, handlers={"*": seen.append})
            # the capture's timeout ends it (a socket timeout)
            with contextlib.suppress(Exception):
                recv.capture(limit=None, timeout=6, wakeup=True)

    began = time.time()
    listener = threading.Thread(target=capture, daemon=True)
    listener.start()
    time.sleep(0.5)
    client = CritiqueClient()
    sub = Submission(run_id="probe-ev", worker_id="w1", task="t", output={"summary": "x"})
    assert client.wait_many(client.submit_many([sub]), timeout=30)
    listener.join(15)
    tasks = [e for e in seen if str(e.get("type", "")).startswith("task-")]
    names = {e.get("uuid"): e.get("name") for e in tasks if e.get("name")}
    assert set(names.values()) == {"critique.l0"}  # the submission's task is visible
    assert "critique.probe" not in names.values()
    # every started/succeeded event belongs to a task announced by name: none is a probe's
    assert all(e.get("uuid") in names for e in tasks if e["type"] in ("task-started",))
    # ... and the probes still ran: the queue's drain history records some after the start
    from workers.recovery.base import default_stores

    drained = default_stores().pending.drained("critique.cpu")
    assert any(ran >= began for _, ran in drained), drained
