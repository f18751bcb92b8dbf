"""``critique worker --processes 2`` with real Celery nodes on the test Redis: both nodes
consume the queue, a killed one is reported and comes back, SIGTERM stops both cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support import pid_alive
from tests.support.workers import ROOT, client_on, worker_db_url


def _until(what: str, probe: Callable[[], Any], proc: subprocess.Popen[bytes], log: Path) -> Any:
    """Poll ``probe`` until it returns something truthy (60 s at most, the supervisor alive)."""
    deadline = time.monotonic() + 60
    while True:
        got = probe()
        if got:
            return got
        text = log.read_text(encoding="utf-8", errors="replace")
        assert proc.poll() is None, f"critique worker exited ({proc.returncode}): {text}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {text}"
        time.sleep(0.2)


def test_processes_2_runs_two_consuming_nodes_restarts_a_killed_one_and_stops_on_sigterm(
    redis_url: str, tmp_path: Path
) -> None:
    """Two nodes (<name>-1, <name>-2) answer and consume critique.cpu; SIGKILL to one is
    reported on stderr (process, node, pid, signal) and the node comes back with a new pid;
    SIGTERM to the command stops both (warm shutdown) and it exits 0."""
    name = f"procs{uuid.uuid4().hex[:6]}"
    host = socket.gethostname()
    nodes = [f"{name}-1@{host}", f"{name}-2@{host}"]
    log = tmp_path / "worker.log"
    with client_on(worker_db_url(redis_url)) as env:
        from workers.app import app

        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "workers.cli", "worker", "--processes", "2",
                 "-Q", "critique.cpu", "-c", "2", "-l", "WARNING", "-n", f"{name}@%h",
                 "--", "--without-gossip", "--without-mingle"],
                env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:

            def stats() -> dict[str, Any]:
                got = app.control.inspect(destination=nodes, timeout=1.0).stats() or {}
                return got if set(got) == set(nodes) else {}

            def queues() -> dict[str, list[str]]:
                got = app.control.inspect(destination=nodes, timeout=1.0).active_queues() or {}
                return {n: sorted(q["name"] for q in qs) for n, qs in got.items()}

            pids = {n: s["pid"] for n, s in _until("both nodes", stats, proc, log).items()}
            assert queues() == {n: ["critique.cpu"] for n in nodes}
            assert len(set(pids.values())) == 2 and all(pid_alive(p) for p in pids.values())

            victim = pids[nodes[1]]
            os.kill(victim, signal.SIGKILL)

            def restarted() -> dict[str, Any]:
                got = stats()
                return got if got and got[nodes[1]]["pid"] != victim else {}

            again = {n: s["pid"] for n, s in _until("node 2 back", restarted, proc, log).items()}
            text = log.read_text(encoding="utf-8", errors="replace")
            assert f"process 2 of 2 ({nodes[1]}, pid {victim}) was killed by SIGKILL" in text
            assert f"restarting process 2 of 2 as {nodes[1]}" in text
            assert again[nodes[0]] == pids[nodes[0]]  # the sibling was left alone
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    assert proc.returncode == 0, log.read_text(encoding="utf-8", errors="replace")
    assert not any(pid_alive(p) for p in again.values())
    text = log.read_text(encoding="utf-8", errors="replace")
    assert text.count("restarting") == 1 and "crash loop" not in text
