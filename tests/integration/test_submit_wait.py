"""``critique submit --wait`` as a process while no worker runs: it says so early and shows
progress before the timeout, and Ctrl-C leaves the submissions queued (said, exit 130)."""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from tests.support.submissions import operator_sub
from tests.support.workers import ROOT, WorkerStarter, client_on, worker_db_url

pytestmark = pytest.mark.integration


@pytest.fixture
def env(redis_url: str) -> Iterator[dict[str, str]]:
    """A flushed worker database that no worker consumes (until a test starts one)."""
    with client_on(worker_db_url(redis_url)) as e:
        yield e


class _Lines:
    """Every line a process writes to stdout and stderr, with when it came (a reader thread
    each, so neither pipe fills)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.began = time.monotonic()
        self.got: queue.Queue[tuple[str, float, str]] = queue.Queue()
        self.seen: list[tuple[str, float, str]] = []
        assert proc.stdout is not None and proc.stderr is not None
        self.readers = [
            threading.Thread(target=self._read, args=(name, pipe), daemon=True)
            for name, pipe in (("out", proc.stdout), ("err", proc.stderr))
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, name: str, pipe: IO[str]) -> None:
        for line in pipe:
            self.got.put((name, time.monotonic() - self.began, line.rstrip("\n")))

    def until(self, name: str, start: str, timeout: float) -> float:
        """Wait for a line of ``name`` starting with ``start``; returns when it came."""
        deadline = time.monotonic() + timeout
        while True:
            for n, at, line in self.seen:
                if n == name and line.startswith(start):
                    return at
            left = deadline - time.monotonic()
            assert left > 0, f"no {name} line starting {start!r} in {timeout} s: {self.seen}"
            with contextlib.suppress(queue.Empty):
                self.seen.append(self.got.get(timeout=left))

    def text(self, name: str) -> str:
        """Every line of ``name`` (call once the process has ended: its pipes are read out)."""
        for reader in self.readers:
            reader.join(timeout=10)
        while not self.got.empty():
            self.seen.append(self.got.get())
        return "\n".join(line for n, _, line in self.seen if n == name)


def _submit_wait(
    env: dict[str, str], tmp_path: Path, run_id: str, *extra: str
) -> subprocess.Popen[str]:
    """``critique submit <one clean submission of run_id> --wait EXTRA`` as a process."""
    path = tmp_path / "sub.json"
    path.write_text(operator_sub(run_id, "w1", "clean").model_dump_json(), encoding="utf-8")
    return subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "submit", str(path), "--wait", *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_no_worker_is_said_early_and_progress_comes_before_the_timeout(
    env: dict[str, str], tmp_path: Path
) -> None:
    """With no worker running: a few seconds after the handles, "no worker has taken these
    yet — is `critique worker` running against <broker>?" on stderr; a progress line ~10 s in,
    before the 13 s timeout; then the timeout's tally, exit 1."""
    run_id = f"nowork-{uuid.uuid4().hex[:8]}"
    proc = _submit_wait(env, tmp_path, run_id, "--timeout", "13")
    try:
        lines = _Lines(proc)
        handed = lines.until("out", f"submitted {run_id}", 30)
        hint = lines.until("err", "critique submit: no worker has taken these yet", 15)
        progress = lines.until("err", "submit --wait: 0/1 finished, 0 failed, 1 pending", 15)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    err = lines.text("err")
    assert proc.returncode == 1, err
    assert hint - handed < 6, lines.seen  # said at ~2 s, not at the timeout
    assert 8 < progress - handed < 12.5, lines.seen
    assert f"is `critique worker` running against {env['CELERY_BROKER_URL']}?" in err
    assert err.count("no worker has taken these yet") == 1
    assert "critique submit: timed out after 13 s" in err


def test_ctrl_c_leaves_the_submissions_queued_and_says_how_to_follow_them(
    env: dict[str, str], tmp_path: Path, start_worker: WorkerStarter
) -> None:
    """SIGINT while waiting: the pending submission is listed, stderr says it stays queued and
    will be critiqued and names `critique watch RUN` / `critique status RUN`; exit 130, and a
    worker started later critiques it."""
    run_id = f"ctrlc-{uuid.uuid4().hex[:8]}"
    proc = _submit_wait(env, tmp_path, run_id)
    try:
        lines = _Lines(proc)
        lines.until("out", f"submitted {run_id}", 30)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    out, err = lines.text("out"), lines.text("err")
    assert proc.returncode == 130, err
    assert f"{run_id}  1  w1  pending" in out and "Traceback" not in err, err
    note = err.strip().splitlines()[-1]
    assert note.startswith("critique submit: interrupted; the 1 pending submission(s) stay queued")
    assert f"`critique watch {run_id}`" in note and f"`critique status {run_id}`" in note
    start_worker("ctrlc", env)
    watched = subprocess.run(
        [sys.executable, "-m", "workers.cli", "watch", run_id, "--json", "--timeout", "60"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert watched.returncode == 0, watched.stderr
    last = json.loads(watched.stdout.strip().splitlines()[-1])
    assert last["finished"] == 1 and last["counts"] == {"accepted": 1}
