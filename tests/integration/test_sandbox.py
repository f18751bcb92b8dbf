"""The command sandbox (:mod:`pipeline.security.sandbox`): the scrubbed environment, path
confinement, resource limits, the time limit killing the whole process group, and the network
namespace.

These run real (tiny) processes: the limits and the kill are the kernel's, not a mock's."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from pipeline.errors import ConfigError, PathEscapeError
from pipeline.security.sandbox import (
    NO_ISOLATION,
    Limits,
    RunResult,
    confined_path,
    minimal_path,
    network_isolation,
    run_confined,
    scrubbed_env,
    write_workspace,
)
from tests.support import wait_until

PY = sys.executable


def run(
    tmp_path: Path, code: str, *, timeout_s: float = 10, limits: Limits | None = None
) -> RunResult:
    return run_confined(
        [PY, "-c", code],
        str(tmp_path),
        timeout_s=timeout_s,
        env=scrubbed_env(str(tmp_path)),
        limits=limits,
        isolation=NO_ISOLATION,
    )


def test_the_environment_is_an_allowlist() -> None:
    """No CRITIQUE_ setting, API key, Redis URL or cloud secret survives; HOME and TMPDIR are
    the run's dir; PATH finds this virtual environment's tools first; the locale passes."""
    worker_env = {
        "CRITIQUE_LLM_API_KEY": "sk-1",
        "CRITIQUE_SECRET": "s",
        "OPENAI_API_KEY": "sk-2",
        "ANTHROPIC_API_KEY": "sk-3",
        "REDIS_URL": "redis://:pw@host/0",
        "AWS_SECRET_ACCESS_KEY": "a",
        "PYTHONPATH": "/work/main",
        "HOME": "/root",
        "LANG": "de_DE.UTF-8",
        "TZ": "Europe/Berlin",
    }
    env = scrubbed_env("/tmp/ws", worker_env)
    assert env["HOME"] == env["TMPDIR"] == "/tmp/ws"
    assert (env["LANG"], env["TZ"]) == ("de_DE.UTF-8", "Europe/Berlin")
    assert env["PATH"] == minimal_path()
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(PY)
    leaked = set(env) & (set(worker_env) - {"HOME", "LANG", "TZ"})
    assert not leaked
    assert not [v for v in env.values() if "sk-" in v or "pw@" in v]


def test_the_command_sees_only_the_scrubbed_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the process itself sees: keys set in the worker's environment are not there."""
    monkeypatch.setenv("CRITIQUE_LLM_API_KEY", "sk-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    result = run(tmp_path, "import os; print(sorted(os.environ))")
    assert result.passed
    assert "API_KEY" not in result.output and "CRITIQUE" not in result.output


@pytest.mark.parametrize(
    "path",
    ["../escape.py", "a/../../escape.py", "/etc/passwd", "\\abs.py", "", ".", "a/..", "x\x00y"],
)
def test_paths_that_leave_the_workspace_are_refused(tmp_path: Path, path: str) -> None:
    """Absolute paths, ``..`` and empty names raise PathEscapeError; nothing is written."""
    root = tmp_path / "ws"
    root.mkdir()
    with pytest.raises(PathEscapeError):
        write_workspace(str(root), [(path, b"x")])
    assert list(root.iterdir()) == []


def test_a_symlink_on_the_way_is_refused(tmp_path: Path) -> None:
    """A directory that is a symlink (to outside) is never followed."""
    root, outside = tmp_path / "ws", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(PathEscapeError, match="symlink"):
        write_workspace(str(root), [("link/evil.py", b"x")])
    (root / "file_link").symlink_to(outside / "target.py")
    with pytest.raises(PathEscapeError):
        write_workspace(str(root), [("file_link", b"x")])
    assert list(outside.iterdir()) == []
    with pytest.raises(PathEscapeError):
        confined_path(str(root), "link/x")


def test_files_are_written_once_in_nested_dirs(tmp_path: Path) -> None:
    """Nested paths get their directories; a path written twice or through a file is refused."""
    written = write_workspace(str(tmp_path), [("pkg/sub/mod.py", b"A = 1\n"), ("./top.py", b"")])
    assert written == ["pkg/sub/mod.py", "top.py"]
    assert (tmp_path / "pkg" / "sub" / "mod.py").read_bytes() == b"A = 1\n"
    with pytest.raises(PathEscapeError, match="twice"):
        write_workspace(str(tmp_path), [("top.py", b"again")])
    with pytest.raises(PathEscapeError):
        write_workspace(str(tmp_path), [("top.py/inner.py", b"x")])


def test_the_limits_are_set_in_the_child(tmp_path: Path) -> None:
    """CPU, address space, file size and process limits are what the child reads back."""
    limits = Limits(3, address_space=1 << 30, file_size=1 << 20, processes=64)
    code = (
        "import resource as r; print([r.getrlimit(x) for x in "
        "(r.RLIMIT_CPU, r.RLIMIT_AS, r.RLIMIT_FSIZE, r.RLIMIT_NPROC, r.RLIMIT_CORE)])"
    )
    result = run(tmp_path, code, limits=limits)
    assert result.output.strip() == str(
        [(3, 4), (1 << 30, 1 << 30), (1 << 20, 1 << 20), (64, 64), (0, 0)]
    )
    assert "cpu 3 s" in result.limits and "processes 64" in result.limits


def test_the_file_size_and_memory_limits_bite(tmp_path: Path) -> None:
    """Writing past the file-size limit fails (EFBIG), allocating past the address space
    fails (MemoryError): the command fails, the worker does not."""
    big = run(
        tmp_path, "open('big', 'wb').write(b'x' * (2 << 20))", limits=Limits(5, file_size=1 << 20)
    )
    assert big.exit_code != 0 and "File too large" in big.output
    mem = run(tmp_path, "b = bytearray(1500 << 20)", limits=Limits(5, address_space=1 << 30))
    assert mem.exit_code != 0 and "MemoryError" in mem.output


def test_the_cpu_limit_stops_a_busy_loop(tmp_path: Path) -> None:
    """A busy loop is stopped by the CPU limit (SIGXCPU, SIGKILL at the hard limit a second
    later) before the wall-clock limit: killed by a signal, not timed out."""
    result = run(tmp_path, "while True: pass", timeout_s=60, limits=Limits(1))
    assert not result.timed_out
    assert result.exit_code in (-signal.SIGXCPU, -signal.SIGKILL), result.exit_code


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(line.split()[1] for line in fh if line.startswith("State:"))
    except FileNotFoundError:
        return None


def test_the_time_limit_kills_the_whole_process_group(tmp_path: Path) -> None:
    """At the limit the command and the child it started are both killed (SIGKILL to the
    group): nothing keeps running, the command never reaches its end; the result says
    timed_out."""
    result = run_confined(
        ["sh", "-c", "sleep 60 & echo $! > child.pid; sleep 60; echo end > reached"],
        str(tmp_path),
        timeout_s=0.5,
        env=scrubbed_env(str(tmp_path)),
        isolation=NO_ISOLATION,
    )
    assert result.timed_out and result.exit_code == -9
    assert not (tmp_path / "reached").exists()
    child = int((tmp_path / "child.pid").read_text())
    wait_until(  # gone, or a zombie waiting for its reaper
        lambda: _state(child) in (None, "Z"), 10, what=f"the child {child} to be killed"
    )


def test_what_a_finished_command_left_running_is_killed(tmp_path: Path) -> None:
    """A background process the command started and left behind is killed when it exits."""
    result = run_confined(
        ["sh", "-c", "(sleep 60 & echo $! > bg.pid); echo done"],
        str(tmp_path),
        timeout_s=5,
        env=scrubbed_env(str(tmp_path)),
        isolation=NO_ISOLATION,
    )
    assert result.passed and result.output.strip() == "done"
    bg = int((tmp_path / "bg.pid").read_text())
    wait_until(lambda: _state(bg) in (None, "Z"), 10, what=f"the left-behind process {bg} to die")


def test_a_missing_program_is_a_configuration_error(tmp_path: Path) -> None:
    """A command whose program is not on its PATH is the operator's error, named."""
    with pytest.raises(ConfigError, match="no-such-tool-xyz") as info:
        run_confined(
            ["no-such-tool-xyz"], str(tmp_path), timeout_s=1, env=scrubbed_env(str(tmp_path))
        )
    assert info.value.key == "command"


def test_no_network_where_unshare_works(tmp_path: Path) -> None:
    """With ``unshare -rn`` available, a connection to a listening loopback port fails inside
    the command; the result says which isolation it had."""
    iso = network_isolation()
    if not iso.prefix:
        pytest.skip(f"this machine gives no network namespace: {iso.description}")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
        result = run_confined(
            [PY, "-c", code],
            str(tmp_path),
            timeout_s=10,
            env=scrubbed_env(str(tmp_path)),
            isolation=iso,
        )
        outside = run(tmp_path, code)
    finally:
        server.close()
    assert result.exit_code != 0 and "unreachable" in result.output.lower()
    assert result.isolation.startswith("network: none")
    assert outside.passed  # the same code reaches it without the namespace


def test_the_archive_dir_is_hidden_from_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a mount namespace, the command can neither list nor delete other runs' archives by
    their absolute path, nor unmount what covers them; the worker's copy is untouched."""
    archive = tmp_path / "archive"
    archive.mkdir()
    victim = archive / "other-run.jsonl"
    victim.write_text("{}\n")
    monkeypatch.setenv("CRITIQUE_ARCHIVE_DIR", str(archive))
    iso = network_isolation()
    if "hidden: " not in iso.description:
        pytest.skip(f"this machine gives no mount namespace: {iso.description}")
    work = tmp_path / "cmd"
    work.mkdir()
    code = (
        "import os, subprocess, sys\n"
        f"d = {str(archive)!r}\n"
        "subprocess.run(['umount', '-l', d], capture_output=True)\n"
        "seen = os.listdir(d) if os.access(d, os.R_OK) else 'denied'\n"
        "try:\n    os.remove(os.path.join(d, 'other-run.jsonl')); gone = 'removed'\n"
        "except OSError as exc:\n    gone = type(exc).__name__\n"
        "print('SEEN', seen, 'GONE', gone)\n"
    )
    result = run_confined(
        [PY, "-c", code], str(work), timeout_s=10, env=scrubbed_env(str(work)), isolation=iso
    )
    assert "SEEN" in result.output and "other-run" not in result.output.split("GONE")[0]
    assert "GONE removed" not in result.output
    assert victim.read_text() == "{}\n"
    assert str(archive) not in scrubbed_env(str(work)).values()
