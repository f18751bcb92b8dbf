"""Flower on a loopback port, with basic auth, sees the pipeline's workers, tasks and progress.

Real processes only: a Celery worker and ``celery -A workers.app flower`` against the worker-test
Redis database; the submissions go through the real chain.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from pipeline.models import Submission
from tests.integration.workers import ROOT, WorkerProcess, client_on, worker_db_url

pytestmark = pytest.mark.e2e

USER, PASSWORD = "user", "secret"
T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, auth: tuple[str, str] | None = (USER, PASSWORD)) -> tuple[int, bytes]:
    """GET ``url`` (with basic auth unless ``auth`` is None): status code and body."""
    req = urllib.request.Request(url)
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _until(what: str, probe: Callable[[], T | None], timeout: float = 20.0) -> T:
    """Poll ``probe`` until it returns something truthy, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = probe()
        except (OSError, ValueError):
            got = None
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    """This process's client, the worker and Flower share the worker-test database."""
    with client_on(worker_db_url(redis_url)) as e:
        yield e


@pytest.fixture(scope="module")
def cluster(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker and Flower (basic auth) running; yields Flower's base URL. Both are killed."""
    logs = tmp_path_factory.mktemp("flower")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    worker = WorkerProcess(env["REDIS_URL"], concurrency=2, name="flowerw", env=env)
    flower: subprocess.Popen[bytes] | None = None
    try:
        worker.start()
        argv = [
            sys.executable, "-m", "celery", "-A", "workers.app", "flower",
            "--address=127.0.0.1", f"--port={port}", f"--basic-auth={USER}:{PASSWORD}",
        ]  # fmt: skip
        with open(logs / "flower.log", "wb") as log:
            flower = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _until("Flower's healthcheck", lambda: _get(f"{base}/healthcheck", None)[0] == 200)

        def worker_alive() -> bool:
            status, body = _get(f"{base}/api/workers?status=1")
            alive: dict[str, bool] = json.loads(body) if status == 200 else {}
            return any(name.startswith("flowerw@") and up for name, up in alive.items())

        # Flower's event receiver has heard the worker's heartbeat: task events will be seen.
        _until("the worker's heartbeat in Flower", worker_alive)
        yield base
    finally:
        if flower is not None and flower.poll() is None:
            flower.terminate()
            try:
                flower.wait(timeout=10)
            except subprocess.TimeoutExpired:
                flower.kill()
                flower.wait(timeout=5)
        worker.stop()


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
    submissions' tasks are listed (one id each), repairs sent task-progress events;
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

    def tasks_seen() -> dict[str, int] | None:
        counts: dict[str, int] = {}
        for name in ("critique.l0", "critique.repair"):
            code, raw = _get(f"{base}/api/tasks?taskname={name}&state=SUCCESS")
            counts[name] = len(json.loads(raw)) if code == 200 else 0
        return counts if counts["critique.l0"] >= 1 and counts["critique.repair"] >= 1 else None

    # One task id per submission: w2's critique.l0 ran its whole loop (Layer-0, critic,
    # decide, gate); w1's was replaced by its repair round under the same id (Task.replace),
    # which Flower lists under the round's name.
    _until("the pipeline's tasks in Flower's task list", tasks_seen)
    code, raw = _get(f"{base}/api/tasks?state=SUCCESS")
    ours = [t for t in json.loads(raw).values() if str(t.get("name")).startswith("critique.")]
    assert code == 200 and len([t for t in ours if t["name"] != "critique.probe"]) == 2

    _, raw = _get(f"{base}/api/tasks?taskname=critique.repair")
    repair = next(iter(json.loads(raw).values()))
    assert repair["state"] == "SUCCESS" and repair["worker"].startswith("flowerw@")

    def progress_counted() -> str | None:
        code, text = _get(f"{base}/metrics", None)
        m = re.search(
            r'flower_events_total\{[^}]*type="task-progress"[^}]*\} ([0-9.]+)', text.decode()
        )
        return m.group(0) if code == 200 and m and "critique.repair" in m.group(0) else None

    assert float(_until("a task-progress event", progress_counted).rsplit(" ", 1)[1]) >= 1

    _, raw = _get(f"{base}/api/task/types")
    types = set(json.loads(raw)["task-types"])
    assert {"critique.l0", "critique.repair"} <= types  # the tasks that ran (one per round)

    for path in ("/api/workers", "/api/tasks", "/api/task/types", "/"):
        assert _get(f"{base}{path}", None)[0] == 401, path
    assert _get(f"{base}/api/workers", (USER, "wrong"))[0] == 401
