"""``critique worker --processes``: how many processes, their command lines, and the supervisor
that runs N > 1 of them (signals forwarded, a dead child reported and restarted, a crash loop
stopped). The supervisor is exercised here with stand-in children (small Python scripts, no
Celery, no Redis); tests/integration/test_worker_processes.py runs it with real Celery nodes."""

from __future__ import annotations

import argparse
import os

import pytest

from pipeline import settings
from workers.cli import build_parser, main
from workers.commands import worker


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
    (critique-<i>@%h) and Celery's --quiet on all but the first (one banner, not three), each
    with the same threads and the options after --."""
    argvs = _dry_run(capsys, "--processes", "3", "-c", "8", "--", "--without-mingle")
    assert len(argvs) == 3
    assert [_option(a, "-n") for a in argvs] == ["critique-1@%h", "critique-2@%h", "critique-3@%h"]
    assert [("--quiet" in a[: a.index("worker")]) for a in argvs] == [False, True, True]
    for argv in argvs:
        assert [a for a in argv if a != "--quiet"][1:6] == [
            "-m", "celery", "-A", "workers.app", "worker"
        ]  # fmt: skip
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
    per usable CPU (on a host of more than two); a critique.cpu-only worker, and a prefork or
    solo one, runs one process."""
    monkeypatch.setattr(worker, "available_cpus", lambda: 4)
    monkeypatch.delenv(settings.PROCESSES.name, raising=False)
    assert worker.PROCESSES_PER_CPU == 2
    assert len(_dry_run(capsys)) == 8
    assert len(_dry_run(capsys, "-Q", "critique.llm")) == 8
    assert len(_dry_run(capsys, "--processes", "auto", "-Q", "critique.llm.critic")) == 8
    assert len(_dry_run(capsys, "-Q", "critique.cpu")) == 1
    assert len(_dry_run(capsys, "-P", "prefork")) == 1
    assert len(_dry_run(capsys, "-P", "solo", "-Q", "critique.llm")) == 1


@pytest.mark.parametrize(("cpus", "nodes"), [(1, 1), (2, 2), (3, 6)])
def test_auto_on_a_small_host_is_one_process_per_cpu(
    cpus: int, nodes: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A laptop's default `critique worker` (2 CPUs) starts 2 nodes (~0.5 GB), not 4; a 1-CPU
    pod one; from 3 CPUs on, two per CPU again. Every node serves every queue."""
    monkeypatch.setattr(worker, "available_cpus", lambda: cpus)
    monkeypatch.delenv(settings.PROCESSES.name, raising=False)
    monkeypatch.delenv("CRITIQUE_QUEUES", raising=False)
    argvs = _dry_run(capsys)
    assert len(argvs) == nodes
    assert {_option(a, "-Q") for a in argvs} == {"critique.cpu,critique.llm,critique.llm.critic"}


@pytest.mark.parametrize(
    "argv",
    [(), ("--processes", "3"), ("-c", "8"), ("--processes", "1", "-c", "4"), ("-P", "prefork")],
)
@pytest.mark.parametrize("cpus", [2, 4])
def test_threads_per_process_is_the_concurrency_the_command_starts(
    argv: tuple[str, ...],
    cpus: int,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``worker.processes`` and ``worker.threads_per_process`` (whose product bench/llm.py
    reports as the calls in flight) are the node count and the ``-c`` of the command lines
    `critique worker` starts: on 2 CPUs by default 2 x 32, not the 2 x 16 a caller that leaves
    out the auto sizing would compute."""
    monkeypatch.setattr(worker, "available_cpus", lambda: cpus)
    for name in (settings.PROCESSES.name, settings.CONCURRENCY.name, "CRITIQUE_QUEUES"):
        monkeypatch.delenv(name, raising=False)
    argvs = _dry_run(capsys, *argv)
    ns = build_parser().parse_args(["worker", *argv])
    queues = list(worker.KNOWN_QUEUES)
    count = worker.processes(ns, queues)
    threads = worker.threads_per_process(ns, queues, count)
    assert count == len(argvs)
    assert {_option(a, "-c") for a in argvs} == {str(threads)}
    if not argv and cpus == 2:
        assert (count, threads) == (2, 32)


def test_processes_from_the_environment_and_the_option_wins(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """$CRITIQUE_PROCESSES sets the count (and is a variable the configuration check
    accepts); --processes overrides it."""
    monkeypatch.setenv(settings.PROCESSES.name, "3")
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
    monkeypatch.setenv(settings.PROCESSES.name, value or "0")
    assert main(["worker", "--dry-run"]) == 2
    assert f"{settings.PROCESSES.name} must be a whole number" in capsys.readouterr().err


def test_available_cpus_is_within_the_affinity_mask() -> None:
    """The automatic count is at least 1 and never more than the CPUs this process may run on."""
    assert 1 <= worker.available_cpus() <= len(os.sched_getaffinity(0))


# --- which CPU each process runs on ------------------------------------------------------------
def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["worker", *argv])


@pytest.mark.parametrize(
    ("mask", "quota", "argv", "count", "expected"),
    [
        ({0, 1}, None, (), 2, [0, 1]),  # the small-host default: one process per CPU
        ({3, 5}, None, (), 2, [3, 5]),  # the mask's CPUs, whatever their numbers
        ({0, 1, 2, 3}, None, (), 4, [0, 1, 2, 3]),  # as many asked for as the mask has
        ({0, 1, 2, 3}, None, (), 2, None),  # fewer: a second command must not stack on them
        ({0, 1}, None, (), 4, None),  # two per CPU: no gain measured, left free
        ({0, 1, 2, 3}, 2, (), 2, None),  # a quota below the mask: which CPUs is not ours
        ({0, 1}, 1, (), 2, None),  # the same with as many processes as the mask has CPUs
        ({0, 1}, 2, (), 2, [0, 1]),  # a quota the size of the mask changes nothing
        ({0, 1}, None, (), 1, None),  # one process: nothing to keep apart
        ({0, 1}, None, ("--no-pin",), 2, None),
        ({0, 1}, None, ("-P", "prefork"), 2, None),  # its forked children would share a CPU
        ({0, 1}, None, ("-P", "solo"), 2, None),
    ],
)
def test_cpu_slots_pins_one_threads_process_per_cpu_of_the_mask_or_none(
    monkeypatch: pytest.MonkeyPatch,
    mask: set[int],
    quota: int | None,
    argv: tuple[str, ...],
    count: int,
    expected: list[int] | None,
) -> None:
    """N threads-pool processes on a mask of exactly N CPUs get one CPU each; none is pinned
    with --no-pin, one process, fewer or more processes than CPUs, a cgroup quota below the
    mask, or a prefork/solo pool."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(mask))
    monkeypatch.setattr(worker, "_cgroup_cpu_limit", lambda: quota)
    assert worker.cpu_slots(_args(*argv), count) == expected


def test_dry_run_says_which_cpu_each_process_runs_on(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--dry-run names each node's CPU on stderr (stdout stays one command line per process),
    and says nothing of it with --no-pin."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(worker, "_cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(worker, "available_cpus", lambda: 2)
    assert main(["worker", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 2
    assert "critique-1@" in out.err and "on CPU 0" in out.err and "on CPU 1" in out.err
    assert main(["worker", "--dry-run", "--no-pin"]) == 0
    assert "CPU" not in capsys.readouterr().err
