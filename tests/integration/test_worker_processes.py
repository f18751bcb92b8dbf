"""``critique worker --processes 2`` with real Celery nodes on the test Redis: both nodes
consume the queue, each on a CPU of its own, a killed one is reported and comes back, SIGTERM
stops both cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import pid_alive
from tests.support.workers import ROOT, client_on, worker_db_url
from workers.commands import worker


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
    """Two nodes (<name>-1, <name>-2) answer and consume critique.cpu, each on a CPU of its own
    (on a host with two); SIGKILL to one is
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
            if len(os.sched_getaffinity(0)) >= 2:  # each node on a CPU of its own
                cpus = [os.sched_getaffinity(pids[n]) for n in nodes]
                assert all(len(c) == 1 for c in cpus) and cpus[0] != cpus[1], cpus

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


# -- the supervisor of `critique worker --processes N`, with stand-in children --------------------
# A stand-in worker process: announces itself (<dir>/<name>.<pid>.ready), records every
# SIGTERM/SIGINT it receives (<dir>/<name>.<pid>.<SIGNAL>) and exits 0 on the first.
CHILD = """
import os, signal, sys, time
from pathlib import Path
folder, name = Path(sys.argv[1]), sys.argv[2]
def stop(signum, frame):
    (folder / f"{name}.{os.getpid()}.{signal.Signals(signum).name}").touch()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
(folder / f"{name}.{os.getpid()}.ready").touch()
while True:
    time.sleep(0.05)
"""


def test_help_says_how_to_size_processes_and_threads() -> None:
    """`critique worker --help` explains processes x threads (threads for waits, processes for
    CPU) and the --processes option."""
    proc = subprocess.run(
        [sys.executable, "-m", "workers.cli", "worker", "--help"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    text = " ".join(proc.stdout.split())
    assert "--processes N" in text
    assert "capacity = processes x threads" in text
    assert "the threads carry the waits" in text and "the processes carry the CPU" in text


# --- the supervisor, with stand-in children -----------------------------------------------------
class Supervisor:
    """``supervise()`` in its own process over ``count`` stand-in children in ``folder``."""

    def __init__(
        self,
        folder: Path,
        count: int,
        max_restarts: int = worker.MAX_RESTARTS,
        cpus: list[int] | None = None,
    ):
        self.folder = folder
        self.script = folder / "child.py"
        self.script.write_text(CHILD, encoding="utf-8")
        argvs = [
            [sys.executable, str(self.script), str(folder), f"c{i}"] for i in range(1, count + 1)
        ]
        code = (
            "import json, sys; from workers.commands.worker import supervise; "
            f"sys.exit(supervise(json.loads(sys.argv[1]), max_restarts={max_restarts}, "
            f"cpus={cpus!r}))"
        )
        self.stderr = folder / "stderr.txt"
        with open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(argvs)], cwd=ROOT, stderr=err
            )

    def files(self, suffix: str) -> list[Path]:
        return sorted(self.folder.glob(f"c*.*.{suffix}"))

    def pids(self, name: str) -> list[int]:
        return [int(p.name.split(".")[1]) for p in self.folder.glob(f"{name}.*.ready")]

    def wait_for(self, what: str, ok: Callable[[], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.text()}"
            time.sleep(0.05)

    def text(self) -> str:
        return self.stderr.read_text(encoding="utf-8", errors="replace")

    def wait(self) -> int:
        return self.proc.wait(timeout=30)


@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    """Supervisors a test starts; any still running at the end are killed (and their children,
    which get SIGTERM from the kernel when the supervisor dies)."""
    started: list[Supervisor] = []
    yield started
    for sup in started:
        if sup.proc.poll() is None:
            sup.proc.kill()
            sup.proc.wait(timeout=10)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_supervisor_forwards_the_signal_once_to_every_child_and_exits_0(
    tmp_path: Path, supervisors: list[Supervisor], signum: signal.Signals
) -> None:
    """SIGTERM or SIGINT to the supervisor reaches each child exactly once (the warm shutdown;
    a second one would be Celery's cold shutdown); it exits 0 once all children exited 0."""
    sup = Supervisor(tmp_path, 2)
    supervisors.append(sup)
    sup.wait_for("two children", lambda: len(sup.files("ready")) == 2)
    sup.proc.send_signal(signum)
    assert sup.wait() == 0
    got = sup.files(signum.name)
    assert sorted(p.name.split(".")[0] for p in got) == ["c1", "c2"]
    assert "2 processes" in sup.text()


def test_supervisor_reports_and_restarts_a_killed_child(
    tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    """A child killed by SIGKILL is named on stderr (which process, pid, how it died) and
    started again; its sibling is left running; SIGTERM then stops both and exits 0."""
    sup = Supervisor(tmp_path, 2)
    supervisors.append(sup)
    sup.wait_for("two children", lambda: len(sup.files("ready")) == 2)
    (victim,) = sup.pids("c2")
    (sibling,) = sup.pids("c1")
    os.kill(victim, signal.SIGKILL)
    sup.wait_for("a new c2", lambda: len(sup.pids("c2")) == 2)
    text = sup.text()
    assert "process 2 of 2 (celery@" in text  # stand-ins have no -n: Celery's default name
    assert f"pid {victim}) was killed by SIGKILL" in text
    assert "restarting process 2 of 2" in text
    assert pid_alive(sibling) and sup.pids("c1") == [sibling]
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait() == 0
    assert not pid_alive(sibling)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="pinning needs two CPUs this process may run on",
)
def test_each_child_and_its_restart_run_on_the_cpu_given_to_it(
    tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    """With ``cpus`` each child (every thread it starts inherits it) runs on its own CPU only,
    a restarted child on the same one, and the supervisor names them."""
    mask = sorted(os.sched_getaffinity(0))
    cpus = [mask[-1], mask[0]]
    sup = Supervisor(tmp_path, 2, cpus=cpus)
    supervisors.append(sup)
    sup.wait_for("two children", lambda: len(sup.files("ready")) == 2)
    (c1,), (c2,) = sup.pids("c1"), sup.pids("c2")
    assert (os.sched_getaffinity(c1), os.sched_getaffinity(c2)) == ({cpus[0]}, {cpus[1]})
    assert f"on CPU {cpus[0]}, " in sup.text() and "(--no-pin: any CPU)" in sup.text()
    os.kill(c2, signal.SIGKILL)
    sup.wait_for("a new c2", lambda: len(sup.pids("c2")) == 2)
    (again,) = set(sup.pids("c2")) - {c2}
    assert os.sched_getaffinity(again) == {cpus[1]}
    assert os.sched_getaffinity(0) == set(mask)  # the supervisor itself stays free
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait() == 0


def test_supervisor_stops_the_rest_and_exits_1_on_a_crash_loop(
    tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    """More unexpected deaths than max_restarts within the window: the other children get
    SIGTERM (warm shutdown) and the supervisor exits 1, saying why."""
    sup = Supervisor(tmp_path, 2, max_restarts=1)
    supervisors.append(sup)
    sup.wait_for("two children", lambda: len(sup.files("ready")) == 2)
    (first,) = sup.pids("c2")
    os.kill(first, signal.SIGKILL)
    sup.wait_for("a new c2", lambda: len(sup.pids("c2")) == 2)
    (second,) = set(sup.pids("c2")) - {first}
    os.kill(second, signal.SIGKILL)
    assert sup.wait() == 1
    assert "2 unexpected exits within 60 s: a crash loop" in sup.text()
    assert [p.name.split(".")[0] for p in sup.files("SIGTERM")] == ["c1"]


def test_a_child_that_exits_0_on_its_own_is_not_restarted(
    tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    """A child shut down on purpose (exit 0, e.g. `celery control shutdown`) is not restarted;
    the supervisor exits 0 when the last child has exited."""
    sup = Supervisor(tmp_path, 2)
    supervisors.append(sup)
    sup.wait_for("two children", lambda: len(sup.files("ready")) == 2)
    for pid in sup.pids("c1") + sup.pids("c2"):
        os.kill(pid, signal.SIGTERM)  # straight to the child: its own warm shutdown
    assert sup.wait() == 0
    assert sup.text().count("on its own") == 2 and "restarting" not in sup.text()
    assert len(sup.files("ready")) == 2


def test_children_get_sigterm_when_the_supervisor_is_killed(
    tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    """SIGKILL to the supervisor leaves no orphan: each child receives SIGTERM (Linux parent
    death signal) and shuts down."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    sup = Supervisor(tmp_path, 2)
    supervisors.append(sup)
    sup.wait_for("two children", lambda: len(sup.files("ready")) == 2)
    pids = sup.pids("c1") + sup.pids("c2")
    sup.proc.kill()
    sup.proc.wait(timeout=10)
    sup.wait_for("both children's SIGTERM", lambda: len(sup.files("SIGTERM")) == 2)
    sup.wait_for("both children gone", lambda: not any(pid_alive(p) for p in pids))
