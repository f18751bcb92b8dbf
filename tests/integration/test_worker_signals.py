"""``critique worker`` on the test Redis, stopped by a signal once it is ready: Ctrl-C
(SIGINT) is a warm shutdown that exits 130, as ``critique --help`` says; SIGTERM (a service
manager's stop) a warm shutdown that exits 0. One process or a supervisor of two alike."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.workers import ROOT, client_on, worker_db_url

pytestmark = pytest.mark.integration


def _log(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@pytest.mark.parametrize(
    ("processes", "signum", "code"),
    [(1, signal.SIGINT, 130), (2, signal.SIGINT, 130), (1, signal.SIGTERM, 0)],
    ids=["one-process-ctrl-c", "supervisor-ctrl-c", "one-process-sigterm"],
)
def test_a_signal_after_ready_is_a_warm_shutdown_with_the_documented_exit_code(
    redis_url: str, tmp_path: Path, processes: int, signum: signal.Signals, code: int
) -> None:
    """SIGINT after every node said ready: warm shutdown, exit 130 (SIGTERM: exit 0), no
    traceback; the code `critique worker --help` documents for each."""
    log = tmp_path / "worker.log"
    name = f"sig{uuid.uuid4().hex[:6]}"
    with client_on(worker_db_url(redis_url)) as env, open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "worker", "--processes", str(processes),
             "-Q", "critique.cpu", "-c", "1", "-l", "INFO", "-n", f"{name}@%h",
             "--", "--without-gossip", "--without-mingle"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while _log(log).count(" ready.") < processes:
                assert proc.poll() is None, f"exited {proc.returncode}: {_log(log)}"
                assert time.monotonic() < deadline, f"never ready: {_log(log)}"
                time.sleep(0.2)
            proc.send_signal(signum)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    text = _log(log)
    assert proc.returncode == code, text
    assert text.count("Warm shutdown") == processes, text
    assert "Traceback" not in text and "Cold shutdown" not in text, text
    helped = subprocess.run(
        [sys.executable, "-m", "workers.cli", "worker", "--help"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "Ctrl-C (SIGINT): warm shutdown" in " ".join(helped.split())
    assert f"exit {code}" in " ".join(helped.split())
