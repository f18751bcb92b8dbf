"""``critique submit`` and ``critique worker`` as processes, on a real Redis and real workers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support.workers import ROOT, WorkerProcess, WorkerSpec, worker_db_url, worker_env

pytestmark = pytest.mark.integration

TASK = "Summarise the quarterly sales report as JSON with summary, findings and confidence."
REQUIRED = ["summary", "findings"]


@pytest.fixture(scope="module")
def db_url(redis_url: str) -> str:
    """The worker database (flushed once, before the module's worker starts)."""
    url = worker_db_url(redis_url)
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture(scope="module")
def env(db_url: str) -> dict[str, str]:
    """The worker's environment: this process's, on the worker database."""
    return worker_env(db_url)


WORKER = WorkerSpec("submitcli")
"""One real worker process (threads pool) for the module."""


def critique(
    url: str, *args: str, stdin: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``critique ARGS`` as a process against ``url``."""
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=worker_env(url),
        cwd=ROOT,
        timeout=timeout,
    )


def sub(run_id: str, worker_id: str, output: Any, **extra: Any) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "worker_id": worker_id,
        "task": TASK,
        "output": output,
        "required_fields": REQUIRED,
        **extra,
    }


GOOD = {"summary": "Sales rose 4%.", "findings": "The north grew.", "confidence": 0.9}
LOOP = (
    "Sales rose four percent in the third quarter, led by the northern region, where two new "
    "stores opened and the online shop doubled its monthly orders compared with last year."
)
LOOPING = f"# Q3 sales\n\n## Summary\n\nSales rose 4%.\n\n## Findings\n\n{LOOP}\n\n{LOOP}\n"
"""A report the token-free reviser repairs exactly: the verbatim copy of LOOP is deleted."""
HOPELESS = {"error": "the sales API refused the credentials"}


def _run_id() -> str:
    return f"cli-{uuid.uuid4().hex[:8]}"


def _lines(stdout: str) -> list[dict[str, Any]]:
    """`submit --json` output: JSON Lines, one object per line."""
    return [json.loads(line) for line in stdout.splitlines()]


def test_submit_file_and_wait(worker: WorkerProcess, db_url: str, tmp_path: Path) -> None:
    """A JSON list is enqueued, --wait --json prints JSON Lines: every handle, every result,
    a summary; all have a verdict → exit 0."""
    run_id = _run_id()
    path = tmp_path / "subs.json"
    path.write_text(
        json.dumps([sub(run_id, "clean", GOOD), sub(run_id, "looping", LOOPING)]), "utf-8"
    )
    proc = critique(db_url, "submit", str(path), "--wait", "--timeout", "30", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = _lines(proc.stdout)
    handles = [d for d in lines if d["type"] == "submitted"]
    assert [h["worker_id"] for h in handles] == ["clean", "looping"]
    assert all(h["task_id"] and h["run_id"] == run_id for h in handles)
    by_worker = {r["worker_id"]: r for r in lines if r["type"] == "result"}
    assert by_worker["clean"]["status"] == "accepted"
    assert by_worker["looping"]["status"] == "repaired"
    assert by_worker["looping"]["output"].count(LOOP) == 1
    assert {r["task_id"] for r in by_worker.values()} == {h["task_id"] for h in handles}
    assert lines[-1] == {
        "type": "summary",
        "submitted": 2,
        "finished": 2,
        "failed": 0,
        "pending": 0,
        "counts": {"accepted": 1, "repaired": 1},
        "elapsed_s": lines[-1]["elapsed_s"],
    }


def test_stdin_json_lines_escalation_exits_0(worker: WorkerProcess, db_url: str) -> None:
    """JSON Lines on stdin; an escalated result is a verdict, not a failure: --wait prints
    every result and a tally, and exits 0."""
    run_id = _run_id()
    lines = "\n".join(
        json.dumps(s) for s in (sub(run_id, "ok", GOOD), sub(run_id, "hopeless", HOPELESS))
    )
    proc = critique(db_url, "submit", "-", "--wait", "--timeout", "30", stdin=lines)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("submitted ") == 2
    assert "hopeless" in out and "escalated (escalate_band" in out
    assert "accepted (accepted" in out
    # The escalated line says why: its deciding defects, then what the manager should do.
    rows = out.split("\n")
    at = next(i for i, row in enumerate(rows) if "escalated (escalate_band" in row)
    why = rows[at + 1 : next(i for i in range(at + 1, len(rows)) if "next: " in rows[i]) + 1]
    assert len(why) >= 2 and all(row.startswith("      ") for row in why), out
    assert " at " in why[0] or ": " in why[0]
    assert why[-1].startswith("      next: re-dispatch the subtask")
    assert (
        "submit: 2 submission(s): 2 finished (accepted 1, escalated 1), 0 failed, 0 pending" in out
    )


def test_wait_json_prints_every_handle_and_every_answer(worker: WorkerProcess, db_url: str) -> None:
    """One chain fails (its model's provider key is missing on the worker, which refuses it:
    no silent heuristic verdict): --wait --json still prints every handle, the other results,
    the failure with a one-line reason, and the summary; exit 1 (before: 0 bytes)."""
    if os.environ.get("OPENAI_API_KEY") or os.environ.get("CRITIQUE_LLM_API_KEY"):
        pytest.skip("this environment holds an OpenAI key: the worker would use it")
    run_id = _run_id()
    subs = [
        sub(run_id, "ok", GOOD),
        sub(run_id, "keyless", GOOD, model="openai/gpt-4o-mini"),
        sub(run_id, "hopeless", HOPELESS),
    ]
    stdin = "\n".join(json.dumps(s) for s in subs)
    args = ("submit", "-", "--wait", "--timeout", "60", "--json", "--no-key-check")
    proc = critique(db_url, *args, stdin=stdin, timeout=90)
    assert proc.returncode == 1, proc.stderr
    lines = _lines(proc.stdout)
    assert [d["worker_id"] for d in lines if d["type"] == "submitted"] == [
        "ok",
        "keyless",
        "hopeless",
    ]
    results = {d["worker_id"]: d["status"] for d in lines if d["type"] == "result"}
    assert results == {"ok": "accepted", "hopeless": "escalated"}
    (failed,) = [d for d in lines if d["type"] == "failed"]
    assert failed["worker_id"] == "keyless" and failed["task_id"]
    assert failed["error"].startswith("refused by the worker: model 'openai/gpt-4o-mini' needs")
    assert "OPENAI_API_KEY" in failed["error"] and "Error(" not in failed["error"]
    assert lines[-1]["type"] == "summary" and lines[-1]["failed"] == 1
    keyless = json.dumps(sub(_run_id(), "keyless", GOOD, model="openai/gpt-4o-mini"))
    text = critique(db_url, *args[:-2], "--no-key-check", stdin=keyless, timeout=90)
    assert text.returncode == 1
    assert "keyless  FAILED  refused by the worker: model 'openai/gpt-4o-mini'" in text.stdout
    assert "0 finished, 1 failed, 0 pending" in text.stdout


def test_submit_without_wait_returns_handles(worker: WorkerProcess, db_url: str) -> None:
    """Without --wait the command prints the handles at once and the chain still completes."""
    from workers.client import CritiqueClient, Handle

    run_id = _run_id()
    proc = critique(db_url, "submit", "-", "--json", stdin=json.dumps(sub(run_id, "w1", LOOPING)))
    assert proc.returncode == 0, proc.stderr
    (handle,) = _lines(proc.stdout)
    assert handle.pop("type") == "submitted"
    saved = dict(os.environ)
    os.environ.update(worker_env(db_url))
    from workers import runtime

    runtime.client.cache_clear()
    runtime.stores.cache_clear()
    try:
        client = CritiqueClient({"enabled": True})
        result = client.wait(Handle(**handle), timeout=30)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        runtime.client.cache_clear()
        runtime.stores.cache_clear()
    assert result.status == "repaired"


def test_malformed_input_enqueues_nothing(
    worker: WorkerProcess, db_url: str, tmp_path: Path
) -> None:
    """One bad submission among good ones → exit 2 naming file and field; nothing is enqueued."""
    run_id = _run_id()
    good = tmp_path / "good.json"
    good.write_text(json.dumps(sub(run_id, "fine", GOOD)), "utf-8")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(sub(run_id, "fine2", GOOD))
        + "\n"
        + json.dumps({"run_id": run_id, "worker_id": "nofield", "output": "x"})
        + "\n",
        "utf-8",
    )
    proc = critique(db_url, "submit", str(good), str(bad), "--wait", "--timeout", "5")
    assert proc.returncode == 2
    assert f"{bad}:2: field 'task': Field required" in proc.stderr
    assert proc.stdout == ""
    # The CLI has exited: anything it sent is already marked submitted (the mark follows the
    # send in the same call), so an empty record means nothing was sent.
    from pipeline.store.runs import RedisRunStore

    store = RedisRunStore(redis.Redis.from_url(db_url))
    assert store.submitted(run_id) == {}
    assert store.results(run_id) == []


def test_oversized_output_enqueues_nothing(db_url: str) -> None:
    """An output over max_output_bytes → exit 2 naming the limit; the other one is not sent."""
    run_id = _run_id()
    lines = [sub(run_id, "small", GOOD), sub(run_id, "huge", {**GOOD, "summary": "x" * 400})]
    stdin = "\n".join(json.dumps(x) for x in lines)
    proc = critique(db_url, "submit", "-", "--set", "max_output_bytes=300", stdin=stdin)
    assert proc.returncode == 2
    assert "over max_output_bytes (300)" in proc.stderr
    from pipeline.store.runs import RedisRunStore

    assert RedisRunStore(redis.Redis.from_url(db_url)).submitted(run_id) == {}


def test_broker_down_names_the_broker_url(db_url: str) -> None:
    """With the store up and CELERY_BROKER_URL pointing nowhere, submit exits 3 naming the
    broker's URL (not the store's), without waiting out the publish retries."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    broker = f"redis://127.0.0.1:{port}/0"
    env = worker_env(db_url, CELERY_BROKER_URL=broker, CRITIQUE_OUTAGE_S="2")
    proc = subprocess.run(
        [sys.executable, "-m", "workers.cli", "submit", "-"],
        input=json.dumps(sub(_run_id(), "w1", GOOD)),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 3
    assert f"cannot reach the broker at {broker}" in proc.stderr
    assert "CELERY_BROKER_URL" in proc.stderr


def test_redis_down_exits_3(tmp_path: Path) -> None:
    """With nothing listening at REDIS_URL, submit exits 3 and names the URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    proc = critique(url, "submit", "-", stdin=json.dumps(sub("r1", "w1", GOOD)), timeout=30)
    assert proc.returncode == 3
    assert f"cannot reach Redis at {url}" in proc.stderr


def test_critique_worker_consumes_every_queue(worker: WorkerProcess, db_url: str) -> None:
    """`critique worker` becomes a real Celery worker on every queue and stops on SIGTERM."""
    node = f"cliw-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "worker", "--processes", "1", "-c", "2",
         "-l", "WARNING", "-n", node, "--", "--without-gossip", "--without-mingle"],
        env=worker_env(db_url),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    saved = dict(os.environ)
    os.environ.update(worker_env(db_url))
    try:
        from workers.app import app

        app.conf.broker_url = db_url
        app.conf.result_backend = db_url
        queues: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not queues:
            assert proc.poll() is None, "critique worker exited early"
            active = app.control.inspect(destination=[node], timeout=1.0).active_queues() or {}
            queues = sorted(q["name"] for q in active.get(node, []))
        assert queues == ["critique.cpu", "critique.llm", "critique.llm.critic"]
        run_id = _run_id()
        done = critique(db_url, "submit", "-", "--wait", "--timeout", "30",
                        stdin=json.dumps(sub(run_id, "w1", LOOPING)))  # fmt: skip
        assert done.returncode == 0, done.stderr
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    assert proc.returncode == 0


def test_cpu_only_worker_repairs_and_logs_one_line_per_stage(tmp_path: Path) -> None:
    """A `critique worker -Q critique.cpu` alone finishes a token-free repair (the repair is
    routed to critique.cpu, not to an LLM queue nobody consumes, and runs in the submission's
    task), and its INFO log has one line per task with ids, timing and outcome but never the
    payload (Celery's "succeeded in …: {state}")."""
    from workers.embedded import EmbeddedRedis

    server = EmbeddedRedis().start()  # its own Redis: no other worker takes these tasks
    log = tmp_path / "worker.log"
    marker = "Zanzibar" + uuid.uuid4().hex[:6]
    output = LOOPING.replace("## Summary\n\nSales rose 4%.", f"## Summary\n\n{marker} sales.")
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "workers.cli", "worker", "-Q", "critique.cpu", "-c", "2",
                 "-l", "INFO", "--", "--without-gossip", "--without-mingle"],
                env=worker_env(server.url), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            run_id = _run_id()
            done = critique(server.url, "submit", "-", "--wait", "--timeout", "45",
                            stdin=json.dumps(sub(run_id, "w1", output)), timeout=90)  # fmt: skip
            assert done.returncode == 0, done.stderr
            assert "repaired" in done.stdout
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
    finally:
        server.stop()
    text = log.read_text(encoding="utf-8", errors="replace")
    stages = [line for line in text.splitlines() if f"run={run_id} it=1 worker=w1" in line]
    names = [line.split("critique.", 1)[1].split("[", 1)[0] for line in stages]
    assert names == ["l0"], text  # the submission's one task: its repair round ran in it
    assert " SUCCESS " in stages[0] and "repaired/accepted" in stages[0]
    assert marker not in text and "succeeded in" not in text
