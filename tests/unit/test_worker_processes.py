"""``critique worker --processes``: how many processes, their command lines, and the supervisor
that runs N > 1 of them (signals forwarded, a dead child reported and restarted, a crash loop
stopped). The supervisor is exercised here with stand-in children (small Python scripts, no
Celery, no Redis); tests/integration/test_worker_processes.py runs it with real Celery nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import pid_alive
from workers.cli import main
from workers.commands import worker

ROOT = Path(__file__).resolve().parents[2]

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


def _dry_run(capsys: pytest.CaptureFixture[str], *argv: str) -> list[list[str]]:
    assert main(["worker", "--dry-run", *argv]) == 0
    return [line.split() for line in capsys.readouterr().out.splitlines()]


def _option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# --- how many processes, and their command lines ------------------------------------------------
def test_processes_n_builds_n_celery_nodes_with_distinct_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--processes 3: three `celery worker` lines, identical but for the node name
    (critique-<i>@%h), each with the same threads and the options after --."""
    argvs = _dry_run(capsys, "--processes", "3", "-c", "8", "--", "--without-mingle")
    assert len(argvs) == 3
    assert [_option(a, "-n") for a in argvs] == ["critique-1@%h", "critique-2@%h", "critique-3@%h"]
    for argv in argvs:
        assert argv[1:6] == ["-m", "celery", "-A", "workers.app", "worker"]
        assert _option(argv, "-c") == "8" and _option(argv, "-P") == "threads"
        assert argv[-1] == "--without-mingle"


def test_node_names_follow_the_given_name_and_host() -> None:
    """-n name@host gives name-<i>@host; a bare -n value is Celery's host part; none gives
    critique-<i>@%h."""
    assert worker.node_names("llm@box", 2) == ["llm-1@box", "llm-2@box"]
    assert worker.node_names("box", 2) == ["critique-1@box", "critique-2@box"]
    assert worker.node_names(None, 1) == ["critique-1@%h"]
    assert worker.node_names("llm@%h", 1) == ["llm-1@%h"]


def test_processes_1_is_todays_single_worker(capsys: pytest.CaptureFixture[str]) -> None:
    """--processes 1 prints one command line with no node name added (the command execs it,
    no supervisor), and -n passes through unchanged."""
    (argv,) = _dry_run(capsys, "--processes", "1")
    assert "-n" not in argv
    (argv,) = _dry_run(capsys, "--processes", "1", "-n", "llm@%h")
    assert _option(argv, "-n") == "llm@%h"


def test_auto_is_two_processes_per_cpu_for_an_llm_threads_worker_else_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default a threads (or gevent) worker that consumes an LLM queue runs two processes
    per usable CPU; a critique.cpu-only worker, and a prefork or solo one, runs one process."""
    monkeypatch.setattr(worker, "available_cpus", lambda: 4)
    monkeypatch.delenv(worker.PROCESSES_ENV, raising=False)
    assert worker.PROCESSES_PER_CPU == 2
    assert len(_dry_run(capsys)) == 8
    assert len(_dry_run(capsys, "-Q", "critique.llm")) == 8
    assert len(_dry_run(capsys, "--processes", "auto", "-Q", "critique.llm.critic")) == 8
    assert len(_dry_run(capsys, "-Q", "critique.cpu")) == 1
    assert len(_dry_run(capsys, "-P", "prefork")) == 1
    assert len(_dry_run(capsys, "-P", "solo", "-Q", "critique.llm")) == 1


def test_processes_from_the_environment_and_the_option_wins(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """$CRITIQUE_PROCESSES sets the count (and is a variable the configuration check
    accepts); --processes overrides it."""
    monkeypatch.setenv(worker.PROCESSES_ENV, "3")
    assert len(_dry_run(capsys)) == 3
    assert len(_dry_run(capsys, "--processes", "2")) == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", ""])
def test_bad_processes_exit_2_naming_the_value(
    value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--processes 0, a negative or a non-integer is a usage error (exit 2) that says what is
    accepted; the same from $CRITIQUE_PROCESSES names the variable."""
    if value:
        assert main(["worker", "--dry-run", "--processes", value]) == 2
        err = capsys.readouterr().err
        assert "--processes must be a whole number >= 1 or auto" in err and repr(value) in err
    monkeypatch.setenv(worker.PROCESSES_ENV, value or "0")
    assert main(["worker", "--dry-run"]) == 2
    assert f"{worker.PROCESSES_ENV} must be a whole number" in capsys.readouterr().err


def test_available_cpus_is_within_the_affinity_mask() -> None:
    """The automatic count is at least 1 and never more than the CPUs this process may run on."""
    assert 1 <= worker.available_cpus() <= len(os.sched_getaffinity(0))


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

    def __init__(self, folder: Path, count: int, max_restarts: int = worker.MAX_RESTARTS):
        self.folder = folder
        self.script = folder / "child.py"
        self.script.write_text(CHILD, encoding="utf-8")
        argvs = [
            [sys.executable, str(self.script), str(folder), f"c{i}"] for i in range(1, count + 1)
        ]
        code = (
            "import json, sys; from workers.commands.worker import supervise; "
            f"sys.exit(supervise(json.loads(sys.argv[1]), max_restarts={max_restarts}))"
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
