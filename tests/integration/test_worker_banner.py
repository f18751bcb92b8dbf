"""What ``critique worker`` prints when it starts (issue 34): with several nodes, one line naming
them and one Celery banner (not one per node), and a ``task events`` line that says what a
running Flower will see instead of Celery's "OFF (enable -E …)". Real nodes on the test Redis."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from pathlib import Path

from tests.support import stop_process, wait_until
from tests.support.workers import ROOT, client_on, worker_db_url
from workers.banner import CELERY_EVENTS_OFF, EVENTS_OFF


def test_two_nodes_print_one_line_one_banner_and_a_truthful_events_line(
    redis_url: str, tmp_path: Path
) -> None:
    """`critique worker --processes 2`: the supervisor's line names both nodes and their
    threads; exactly one banner (the first node's), whose task-events line is ours; both nodes
    consume; SIGTERM stops them (exit 0)."""
    name = f"banner{uuid.uuid4().hex[:6]}"
    host = socket.gethostname()
    nodes = [f"{name}-1@{host}", f"{name}-2@{host}"]
    log = tmp_path / "worker.log"
    with client_on(worker_db_url(redis_url)) as env:
        from workers.app import app

        env.pop("CRITIQUE_TASK_EVENTS", None)  # the command's default: off until asked
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "workers.cli", "worker", "--processes", "2",
                 "-Q", "critique.cpu", "-c", "2", "-n", f"{name}@%h",
                 "--", "--without-gossip", "--without-mingle"],
                env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:

            def both_answer() -> bool:
                assert proc.poll() is None, log.read_text(errors="replace")
                got = app.control.inspect(destination=nodes, timeout=1.0).ping() or {}
                return set(got) == set(nodes)

            wait_until(both_answer, 60, what="both nodes to answer")
        finally:
            stop_process(proc)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text
    assert f"critique worker: 2 processes x 2 threads: {nodes[0]}, {nodes[1]}" in text
    assert text.count("[config]") == 1 and text.count(".> task events:") == 1, text
    assert f"{nodes[0]} v" in text and f"{nodes[1]} v" not in text  # the banner is node 1's
    assert f".> task events: {EVENTS_OFF}" in text and CELERY_EVENTS_OFF not in text
