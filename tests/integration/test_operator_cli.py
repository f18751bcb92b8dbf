"""``critique status``, ``watch`` and ``report`` against a real Redis and a real Celery worker."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_until
from tests.support.submissions import operator_sub
from tests.support.workers import ROOT, WorkerProcess, WorkerSpec, client_on, worker_db_url
from workers.cli import main

pytestmark = pytest.mark.integration

CONFIG = {"enabled": True, "budget": {"total_tokens": 2_000_000}}


def _reset_clients() -> None:
    from workers import runtime

    runtime.client.cache_clear()
    runtime.stores.cache_clear()


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    """This process's client and the worker share the worker-test database (flushed once)."""
    with client_on(worker_db_url(redis_url)) as e:
        yield e


WORKER = WorkerSpec("ops")
"""One real worker process (threads pool) for the module."""


LOOP = (
    "Sales rose four percent in the third quarter, led by the northern region, where two new "
    "stores opened and the online shop doubled its monthly orders compared with last year."
)


@pytest.fixture(scope="module")
def finished_run(worker: WorkerProcess) -> str:
    """A run of five submissions over two iterations, all finished."""
    from workers.client import CritiqueClient

    run_id = f"ops-{uuid.uuid4().hex[:8]}"
    subs = [
        operator_sub(run_id, "w1", "clean"),
        operator_sub(run_id, "w2", "looping"),
        operator_sub(run_id, "w3", "garbage"),
        operator_sub(run_id, "w4", "evil"),
        operator_sub(run_id, "w2", "looping", iteration=2),
    ]
    client = CritiqueClient(CONFIG)
    client.wait_many(client.submit_many(subs), timeout=90)
    return run_id


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_status_json_reports_every_submission(
    finished_run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """status --json lists each submission's outcome; an escalated one is a verdict, not an
    error: exit 0."""
    rc, out, _ = _cli(capsys, "status", finished_run, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] is True
    assert (doc["submitted"], doc["finished"], doc["failed"], doc["pending"]) == (5, 5, [], [])
    assert {r["state"] for r in doc["submissions"]} == {"finished"}
    rows = {(r["iteration"], r["worker_id"]): r for r in doc["submissions"]}
    assert rows[(1, "w1")]["status"] == "accepted"
    assert rows[(1, "w2")]["status"] == "repaired" and rows[(1, "w2")]["repairs"] >= 1
    assert rows[(1, "w2")]["best_score"] > rows[(1, "w2")]["original_score"]
    assert rows[(1, "w3")]["status"] == "escalated"
    assert doc["counts"]["escalated"] == 1

    rc, out, _ = _cli(capsys, "status", finished_run, "--iteration", "2", "--json")
    doc = json.loads(out)
    assert rc == 0 and [r["worker_id"] for r in doc["submissions"]] == ["w2"]

    rc, out, _ = _cli(capsys, "status", finished_run)
    assert rc == 0
    assert "5 submitted, 5 finished, 0 failed, 0 pending" in out
    assert "escalated" in out and "→" in out


def test_pending_submission_is_shown_not_an_error(
    finished_run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A submission without a result is listed as pending: status exits 0, watch times out 1."""
    from workers import runtime

    run_id = f"pend-{uuid.uuid4().hex[:8]}"
    runtime.stores().runs.mark_submitted(run_id, 1, "slow", "no-such-task", "sig")
    rc, out, _ = _cli(capsys, "status", run_id, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["pending"] == ["1:slow"] and doc["finished"] == 0
    assert doc["submissions"][0]["state"] == "pending"

    rc, out, _ = _cli(capsys, "watch", run_id, "--timeout", "0.5", "--json")
    last = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and last == {
        "type": "watch",
        "done": False,
        "submitted": 1,
        "finished": 0,
        "failed": [],
        "pending": ["1:slow"],
        "counts": {},
    }


def _blocked_stream_readers() -> int:
    """Connections to this test's database now blocked in XREAD (a watcher waiting)."""
    from workers import runtime

    client = runtime.client()
    db = int(client.connection_pool.connection_kwargs.get("db", 0))
    return sum(
        1
        for c in client.client_list()
        if c.get("cmd") == "xread" and "b" in c.get("flags", "") and int(c.get("db", -1)) == db
    )


@contextlib.contextmanager
def _watching(env: dict[str, str], *argv: str) -> Iterator[subprocess.Popen[str]]:
    """``critique watch ARGV`` as a process, once it has replayed the stream and blocks reading
    it (imported and connected); killed at the end if it is still running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "watch", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: _blocked_stream_readers() > 0 or proc.poll() is not None,
            30,
            what="critique watch to block reading the run's trace stream",
        )
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


def test_watch_exits_130_on_ctrl_c(env: dict[str, str]) -> None:
    """SIGINT (Ctrl-C) ends a waiting ``critique watch`` with exit 130 and a one-line note."""
    from workers import runtime

    run_id = f"sigint-{uuid.uuid4().hex[:8]}"
    runtime.stores().runs.mark_submitted(run_id, 1, "slow", "no-such-task", "sig")
    with _watching(env, run_id) as proc:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 130
    assert err.strip() == "critique watch: interrupted"


def test_report_writes_tree_html_and_lessons(
    finished_run: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """report --out writes the §5.8 tree per iteration, report.html (an SVG per result, output
    escaped) and lessons.md with the patterns the run taught itself: another run teaching the
    same pattern is neither counted nor named (lessons are per run by default)."""
    from workers.client import CritiqueClient

    other = f"ops-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(CONFIG)
    client.wait(client.submit(operator_sub(other, "w9", "looping")), timeout=60)
    rc, out, _ = _cli(capsys, "report", finished_run, "--out", str(tmp_path), "--json")
    assert rc == 0
    doc = json.loads(out)
    run_dir = tmp_path / "runs" / finished_run
    for it, workers in (("001", ("w1", "w2", "w3", "w4")), ("002", ("w2",))):
        folder = run_dir / "iterations" / it
        assert (folder / "critique.json").is_file() and (folder / "CRITIQUE.md").is_file()
        for w in workers:
            assert (folder / "delegations" / w / "critique.json").is_file()
    assert (run_dir / "iterations" / "001" / "delegations" / "w2" / "repairs.json").is_file()
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert doc["report"] == str(run_dir / "report.html")
    assert page.count("<svg ") == 5
    assert "&lt;script&gt;alert(&#x27;owned&#x27;)&lt;/script&gt;" in page
    assert "<script" not in page
    lessons = (run_dir / "lessons.md").read_text(encoding="utf-8")
    assert lessons.startswith(f"# Lessons\n\nRun {finished_run}.\n")
    assert "policy_violation (taught by this run)" in lessons
    assert other not in lessons and "seen in" not in lessons
    assert set(doc["files"]) >= {str(run_dir / "lessons.md"), str(run_dir / "report.html")}


def test_watch_follows_live_and_ends_when_every_submission_finished(
    worker: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """watch --json prints every stage event live and ends (exit 0) once all results are in."""
    from workers.client import CritiqueClient

    run_id = f"watch-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(CONFIG)
    client.submit_many(
        [operator_sub(run_id, f"w{i}", k) for i, k in enumerate(("looping", "clean"))]
    )
    rc, out, _ = _cli(capsys, "watch", run_id, "--json", "--timeout", "60")
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert rc == 0
    assert lines[-1] == {
        "type": "watch",
        "done": True,
        "submitted": 2,
        "finished": 2,
        "failed": [],
        "pending": [],
        "counts": {"accepted": 1, "repaired": 1},
    }
    events = lines[:-1]
    results = [e for e in events if e["type"] == "result"]
    assert sorted(e["worker_id"] for e in results) == ["w0", "w1"]
    w0 = [e["stage"] for e in events if e["worker_id"] == "w0"]
    assert w0[0] == "l0" and "repair" in w0 and w0[-1] == "gate"

    rc, out, _ = _cli(capsys, "watch", run_id)  # a finished run replays in full, then ends
    assert rc == 0
    assert out.count("RESULT") == 2 and "repair  attempt 1" in out
    assert out.strip().endswith(
        f"watch: run {run_id}: 2 submission(s): 2 finished (accepted 1, repaired 1), "
        "0 failed, 0 pending"
    )


def test_a_mistyped_run_id_is_answered_with_the_closest_run(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown run id one letter off a run of the store: exit 2, and the message ends by
    naming that run (status, watch, report, resume alike)."""
    from workers import runtime

    run_id = f"typo-{uuid.uuid4().hex[:8]}"
    runtime.stores().runs.mark_submitted(run_id, 1, "w1", "no-such-task", "sig")
    for cmd in ("status", "watch", "report", "resume"):
        rc, _, err = _cli(capsys, cmd, run_id[:-1])
        assert rc == 2 and err.rstrip().endswith(f"did you mean {run_id!r}?"), (cmd, err)


def test_unknown_run_and_unreachable_redis(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown run exits 2 with a clear message; an unreachable Redis exits 3 naming
    REDIS_URL (after riding out the outage for CRITIQUE_OUTAGE_S: 1 s here, not the default
    120)."""
    for cmd in ("status", "watch", "report"):
        rc, _, err = _cli(capsys, cmd, "never-submitted")
        assert rc == 2 and "no submission of run 'never-submitted'" in err
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("CRITIQUE_OUTAGE_S", "1")
    _reset_clients()
    try:
        for cmd in ("status", "watch", "report"):
            rc, _, err = _cli(capsys, cmd, "any-run")
            assert rc == 3 and "REDIS_URL" in err and "127.0.0.1:1" in err
    finally:
        monkeypatch.setenv("REDIS_URL", env["REDIS_URL"])
        _reset_clients()


def _failed_chain(run_id: str, worker_id: str) -> None:
    """A registered submission whose chain fails on the worker: its first stage message (sent
    without the client, which would refuse it) asks for a worker-only setting, so the worker
    refuses it and records the failure for the pass (the only failure status believes)."""
    from pipeline.loop.stages import start
    from workers import runtime
    from workers.app import app

    pass_id, task_id = runtime.new_pass_id(), uuid.uuid4().hex
    overrides = {**CONFIG, "llm": {"api_base": "http://127.0.0.1:9/v1"}}
    sub = operator_sub(run_id, worker_id, "clean")
    msg = runtime.encode(start(sub, pass_id), overrides, task="critique.l0", task_id=task_id)
    runtime.stores().runs.begin_pass(run_id, 1, worker_id, pass_id)
    res = app.send_task("critique.l0", args=(msg,), task_id=task_id)
    runtime.stores().runs.mark_submitted(
        run_id, 1, worker_id, res.id, f"sig-{worker_id}", pass_id=pass_id
    )


def test_failed_chains_are_failed_not_pending(
    worker: WorkerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A chain that failed is shown as failed with a one-line reason (no Python repr), never as
    pending: status exits 1, watch ends at once (no --timeout needed) and exits 1, report lists
    it apart and exits 1."""
    from workers.client import CritiqueClient

    run_id = f"fail-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(CONFIG)
    client.wait(client.submit(operator_sub(run_id, "good", "clean")), timeout=60)
    _failed_chain(run_id, "broken")
    reason = "refused by the worker: submission may not set 'llm.api_base'"
    deadline = time.monotonic() + 30
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline and not doc.get("failed"):
        rc, out, _ = _cli(capsys, "status", run_id, "--json")
        doc = json.loads(out)
        time.sleep(0.2)
    assert rc == 1 and doc["ok"] is False
    assert (doc["finished"], doc["failed"], doc["pending"]) == (1, ["1:broken"], [])
    assert doc["errors"]["1:broken"].startswith(reason)
    row = next(r for r in doc["submissions"] if r["worker_id"] == "broken")
    assert row["state"] == "failed" and row["error"].startswith(reason)
    rc, out, _ = _cli(capsys, "status", run_id)
    assert rc == 1 and "1 finished, 1 failed, 0 pending" in out
    assert f"FAILED (chain)         {reason}" in out and "Error(" not in out

    rc, out, _ = _cli(capsys, "watch", run_id)  # no --timeout: it returns by itself or hangs
    assert rc == 1
    assert f"1:broken             FAILED  {reason}" in out
    assert "1 finished (accepted 1), 1 failed, 0 pending" in out
    rc, out, _ = _cli(capsys, "watch", run_id, "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert rc == 1
    (failed,) = [d for d in lines if d["type"] == "failed"]
    assert (failed["iteration"], failed["worker_id"]) == (1, "broken")
    assert failed["error"].startswith(reason)
    assert lines[-1]["failed"] == ["1:broken"] and lines[-1]["pending"] == []
    assert lines[-1]["done"] is True  # it ended because the run had, not at a deadline

    rc, out, _ = _cli(capsys, "report", run_id, "--out", str(tmp_path), "--json")
    assert rc == 1
    report = json.loads(out)
    assert report["failed"]["1:broken"].startswith(reason) and report["pending"] == []
    page = (tmp_path / "runs" / run_id / "report.html").read_text(encoding="utf-8")
    assert "Failed chains" in page and "may not set" in page


def test_watch_shows_a_repeated_note_once(
    worker: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three repairs without budget.total_tokens each note it; watch prints the note once and
    says how many repeats it left out."""
    from workers.client import CritiqueClient

    run_id = f"note-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient({"enabled": True})  # no budget: the decide stage notes it
    client.wait_many(
        client.submit_many([operator_sub(run_id, f"w{i}", "looping") for i in range(3)]), timeout=60
    )
    rc, out, _ = _cli(capsys, "watch", run_id)
    assert rc == 0
    assert out.count("no budget.total_tokens configured") == 1
    assert "2 repeated note(s) not shown" in out


def test_watch_waits_for_a_resubmitted_runs_new_pass(
    worker: WorkerProcess, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """watch follows each submission's latest pass: after a resubmission, the earlier pass's
    result event is replayed (marked superseded) but finishes nothing, so watch does not end
    done until the new pass's result arrives (the worker is paused meanwhile)."""
    from workers.app import app
    from workers.client import CritiqueClient

    run_id = f"again-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(CONFIG)
    first = client.submit(operator_sub(run_id, "w1", "clean"))
    client.wait(first, timeout=60)
    node = [worker.nodename]
    assert app.control.cancel_consumer("critique.cpu", destination=node, reply=True)
    try:
        second = client.submit(operator_sub(run_id, "w1", "clean"))  # queued, nobody consumes
        assert second.pass_id != first.pass_id
        rc, out, _ = _cli(capsys, "watch", run_id, "--json", "--timeout", "2")
        lines = [json.loads(line) for line in out.strip().splitlines()]
        assert [e["pass_id"] for e in lines if e["type"] == "result"] == [first.pass_id]
        assert rc == 1 and lines[-1]["done"] is False and lines[-1]["pending"] == ["1:w1"]
        rc, out, _ = _cli(capsys, "watch", run_id, "--timeout", "1")
        assert rc == 1 and "RESULT  accepted" in out
        assert "(an earlier pass, superseded by a resubmission)" in out
        with _watching(env, run_id, "--json", "--timeout", "60") as proc:
            assert proc.poll() is None, proc.communicate()  # replayed the earlier pass, waits
            app.control.add_consumer("critique.cpu", destination=node, reply=True)
            out, err = proc.communicate(timeout=60)
    finally:
        app.control.add_consumer("critique.cpu", destination=node, reply=True)
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert proc.returncode == 0, err
    results = [e["pass_id"] for e in lines if e["type"] == "result"]
    assert results == [first.pass_id, second.pass_id]
    assert lines[-1]["done"] is True and lines[-1]["finished"] == 1
