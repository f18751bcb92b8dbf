"""Run a configured command on a submission's files, confined (the command critic).

What a run gets, and why:

- **A fresh temp dir** holding the files (:func:`write_workspace`); the command's cwd and
  ``HOME``. Paths are confined twice: a :class:`~pipeline.models.FileRef` is relative and has
  no ``..``, and :func:`write_workspace` refuses again anything that would leave the dir (an
  absolute path, ``..``, a symlink on the way, a name used twice) with
  :class:`~pipeline.errors.PathEscapeError`. Files are created with ``O_EXCL | O_NOFOLLOW``.
- **A scrubbed environment** (:func:`scrubbed_env`): an allowlist, not a denylist, so no
  ``CRITIQUE_*`` setting, no provider key (``*_API_KEY``), no ``REDIS_URL`` with its password
  reaches the command. ``PATH`` is minimal but starts with the directory of this Python (the
  virtual environment's ``bin``), so ``python -m pytest``, ``ruff`` and ``mypy`` are found.
- **Resource limits** (:class:`Limits`), set with ``resource.setrlimit`` in the child before it
  runs the command: CPU seconds, address space, largest file written, number of processes.
- **A wall-clock limit:** the command runs in a new session (``start_new_session``); at the
  limit its whole process group is killed (``os.killpg``), and once it exits anything it left
  running in the group is killed too. The group's leader is not reaped before the kill, so the
  group id cannot be reused by another process in between.
- **No network where the OS allows it:** the command is wrapped in ``unshare -rn`` (a new user
  and network namespace: only a loopback interface, down) when a probe run of it works on this
  machine (:func:`network_isolation`); otherwise it runs with the host's network, and every
  result says which (``RunResult.isolation``).

- **The worker's state directories hidden where the OS allows it** (:func:`state_dirs`: the
  archive directory and the workspace root, never named in the command's environment, never
  its cwd): with a mount namespace (``unshare -rnm``) each is covered by an empty tmpfs that
  the command cannot unmount (:data:`HIDE_SCRIPT`); without one they stay reachable by
  absolute path, and the result says so.

Nothing else isolates the filesystem beyond the cwd: the command can read what the worker's
user can read. Run workers as an unprivileged user, or in a container, for that.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import IO

from pipeline import settings
from pipeline.errors import ConfigError, PathEscapeError
from pipeline.records.archive_file import archive_dir

SYSTEM_PATH: tuple[str, ...] = ("/usr/local/bin", "/usr/bin", "/bin")
"""Directories after the virtual environment's ``bin`` on the command's ``PATH``."""
ENV_PASSTHROUGH: tuple[str, ...] = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
"""The only variables copied from the worker's environment (locale and time zone)."""
OUTPUT_LIMIT = 1 << 20
"""Bytes of the command's output kept for parsing (head and tail when it wrote more)."""
POLL_S = 0.02
"""How often a running command is checked for exit."""


@dataclass(frozen=True)
class Limits:
    """Resource limits for one command (``resource.setrlimit`` in the child, before exec).

    ``cpu_s`` CPU seconds (then SIGXCPU), ``address_space`` bytes of virtual memory,
    ``file_size`` the largest file it may write (then SIGXFSZ; its own output counts),
    ``processes`` processes and threads of the worker's user (the kernel does not apply this
    one to root). Core dumps are off.
    """

    cpu_s: int
    address_space: int = 2 << 30
    file_size: int = 64 << 20
    processes: int = 512

    @classmethod
    def for_timeout(cls, timeout_s: float) -> Limits:
        """The default limits for a command allowed ``timeout_s`` wall seconds: as many CPU
        seconds plus one (the wall limit normally comes first), 2 GiB, 64 MiB, 512 processes."""
        return cls(math.ceil(timeout_s) + 1)

    def triples(self) -> tuple[tuple[int, int, int], ...]:
        """``(resource, soft, hard)``: soft = hard, except CPU, whose hard limit is a second
        later so that SIGXCPU (catchable, reported) comes before SIGKILL."""
        return (
            (resource.RLIMIT_CPU, self.cpu_s, self.cpu_s + 1),
            (resource.RLIMIT_AS, self.address_space, self.address_space),
            (resource.RLIMIT_FSIZE, self.file_size, self.file_size),
            (resource.RLIMIT_NPROC, self.processes, self.processes),
            (resource.RLIMIT_CORE, 0, 0),
        )

    def preexec(self) -> Callable[[], None]:
        """The function the child runs before exec: sets every limit. Built in the parent
        (no import or allocation worth the name happens in the forked child)."""
        triples = tuple(_within_hard(which, soft, hard) for which, soft, hard in self.triples())
        setrlimit = resource.setrlimit

        def apply() -> None:
            for which, soft, hard in triples:
                setrlimit(which, (soft, hard))

        return apply

    def describe(self) -> str:
        """One line for results and the README: ``cpu 61 s, memory 2048 MiB, …``."""
        return (
            f"cpu {self.cpu_s} s, memory {self.address_space >> 20} MiB, "
            f"file size {self.file_size >> 20} MiB, processes {self.processes}"
        )


def _within_hard(which: int, soft: int, hard: int) -> tuple[int, int, int]:
    """``(which, soft, hard)`` lowered to the current hard limit (only root may raise one)."""
    current = resource.getrlimit(which)[1]
    if current != resource.RLIM_INFINITY:
        hard = min(hard, current)
        soft = min(soft, hard)
    return which, soft, hard


@dataclass(frozen=True)
class Isolation:
    """How a command is isolated from the network: the argv prefix that does it, and a line
    saying what it gives (shown in every result)."""

    prefix: tuple[str, ...]
    description: str


@dataclass(frozen=True)
class RunResult:
    """What one confined run did."""

    exit_code: int
    """The exit status; negative: killed by that signal (``-9`` at the time limit)."""
    output: str
    """stdout and stderr interleaved, decoded with replacement characters, at most
    :data:`OUTPUT_LIMIT` bytes (its head and tail, marked, when it wrote more)."""
    timed_out: bool
    elapsed_s: float
    isolation: str
    limits: str

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def tail(self, chars: int = 1500) -> str:
        """The last ``chars`` characters of the output, stripped."""
        text = self.output.strip()
        return text if len(text) <= chars else "…" + text[-chars:]


def minimal_path() -> str:
    """``PATH`` for a command: this Python's directory (a venv's ``bin``), then the system's."""
    dirs = [os.path.dirname(sys.executable), *SYSTEM_PATH]
    return os.pathsep.join(dict.fromkeys(d for d in dirs if d and os.path.isdir(d)))


def scrubbed_env(home: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment a command gets: built from an allowlist, never copied.

    ``HOME`` and ``TMPDIR`` are the run's temp dir, ``PATH`` is :func:`minimal_path`, Python
    writes no bytecode and reads no user site; only :data:`ENV_PASSTHROUGH` (locale, time
    zone) comes from ``environ`` (default ``os.environ``). So no ``CRITIQUE_*`` setting, API
    key, Redis URL or cloud credential can reach it.
    """
    source = os.environ if environ is None else environ
    env = {
        "HOME": home,
        "TMPDIR": home,
        "PATH": minimal_path(),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
        "PYTHONUNBUFFERED": "1",
        "NO_COLOR": "1",
    }
    for name in ENV_PASSTHROUGH:
        value = source.get(name)
        if value:
            env[name] = value
    return env


def _parts(path: str) -> tuple[str, ...]:
    """The components of a relative path, or PathEscapeError when it is not one."""
    if not path or path.startswith(("/", "\\")) or "\x00" in path:
        raise PathEscapeError(f"file path {path!r} is not relative to the workspace")
    parts = tuple(p for p in PurePosixPath(path.replace("\\", "/")).parts if p not in ("", "."))
    if not parts or ".." in parts:
        raise PathEscapeError(f"file path {path!r} leaves the workspace ('..' or empty)")
    return parts


def confined_path(root: str, path: str) -> str:
    """``root/path`` after checking ``path`` stays inside ``root`` (no ``..``, not absolute,
    no symlink on the way): PathEscapeError otherwise."""
    parts = _parts(path)
    real_root = os.path.realpath(root)
    current = real_root
    for part in parts[:-1]:
        current = os.path.join(current, part)
        if os.path.islink(current):
            raise PathEscapeError(f"file path {path!r} goes through a symlink ({part!r})")
    target = os.path.join(real_root, *parts)
    if os.path.commonpath([real_root, os.path.realpath(target)]) != real_root:
        raise PathEscapeError(f"file path {path!r} resolves outside the workspace")
    return target


def write_workspace(root: str, files: Iterable[tuple[str, bytes]]) -> list[str]:
    """Write ``(relative path, bytes)`` pairs under ``root``; returns the normalised paths.

    Every directory on the way is created here (never followed through a symlink), and every
    file is created new (``O_CREAT | O_EXCL | O_NOFOLLOW``), so a path cannot leave ``root``
    and a second file cannot overwrite the first: PathEscapeError names the path.
    """
    written: list[str] = []
    for path, data in files:
        target = confined_path(root, path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            confined_path(root, path)  # nothing raced a symlink into the new directories
            fd = os.open(target, flags, 0o644)
        except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
            if os.path.isfile(target) and not os.path.islink(target):
                raise PathEscapeError(f"file path {path!r} is written twice") from None
            raise PathEscapeError(
                f"file path {path!r} collides with another file's path: {exc.strerror}"
            ) from None
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        written.append("/".join(_parts(path)))
    return written


def _probe(prefix: Sequence[str]) -> str | None:
    """None when ``prefix + ["true"]`` runs and exits 0, else why not."""
    try:
        done = subprocess.run(
            [*prefix, "true"],
            env={"PATH": minimal_path()},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if done.returncode != 0:
        why = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return why[-1] if why else f"exit {done.returncode}"
    return None


HIDE_SCRIPT = (
    'while [ "$1" != -- ]; do mount -t tmpfs -o size=4k,mode=0 none "$1" || exit 125; shift; '
    'done; shift; exec "$0" -rm -- "$@"'
)
"""Run by ``sh -c`` inside ``unshare -rnm`` as ``HIDE_SCRIPT <unshare> <dir>... -- <argv>``:
an empty, mode-0 tmpfs over each state directory, then the command in a nested user and mount
namespace, where those mounts are locked (the command, root only in its namespace, cannot
unmount them to uncover what is below)."""


def state_dirs(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The worker's state directories a command must never reach (absolute, existing, sorted):
    the archive directory (``$CRITIQUE_ARCHIVE_DIR``, else the workspace's ``archive``) and
    the workspace root (``$CRITIQUE_WORKSPACE``, else ``./workspace``). A directory that holds
    the command's own temp dir or the Python its ``PATH`` starts with is left out (hiding it
    would hide the command itself); ``/`` never counts."""
    source = os.environ if environ is None else environ
    workspace = settings.given(settings.WORKSPACE, source) or "workspace"
    needed = [
        os.path.realpath(tempfile.gettempdir()),
        os.path.realpath(minimal_path().split(":")[0]),
    ]
    out: set[str] = set()
    for candidate in (str(archive_dir(source)), workspace):
        path = os.path.realpath(candidate)
        if path == "/" or not os.path.isdir(path):
            continue
        if any(n == path or n.startswith(path.rstrip("/") + "/") for n in needed):
            continue
        out.add(path)
    return tuple(sorted(out))


def network_isolation() -> Isolation:
    """The isolation a command gets by default: :func:`isolation_for` this worker's
    :func:`state_dirs` (looked up at each run, probed once per set of directories)."""
    return isolation_for(state_dirs())


@functools.lru_cache(maxsize=8)
def isolation_for(hidden: tuple[str, ...]) -> Isolation:
    """``unshare -rnm`` hiding ``hidden`` when that works on this machine, else ``unshare -rn``
    (network only), else none; each probed once per process.

    ``-r`` makes a user namespace (so no privilege is needed where unprivileged user
    namespaces are allowed), ``-n`` a network namespace with no usable interface, ``-m`` a
    mount namespace where :data:`HIDE_SCRIPT` covers the worker's state directories.
    """
    unshare = shutil.which("unshare", path=minimal_path())
    if unshare is None:
        return Isolation((), "network: not isolated (no `unshare` on this machine)")
    sh = shutil.which("sh", path=minimal_path())
    if sh is not None:
        prefix = (unshare, "-rnm", "--", sh, "-c", HIDE_SCRIPT, unshare, *hidden, "--")
        if _probe(prefix) is None:
            return Isolation(
                prefix,
                "network: none (user + network namespace, `unshare -rn`); worker state "
                f"directories hidden: {len(hidden)}",
            )
    prefix = (unshare, "-rn", "--")
    why = _probe(prefix)
    if why is not None:
        return Isolation((), f"network: not isolated (`unshare -rn` is not permitted here: {why})")
    return Isolation(
        prefix,
        "network: none (user + network namespace, `unshare -rn`); worker state directories "
        "not hidden (no mount namespace)",
    )


NO_ISOLATION = Isolation((), "network: not isolated (switched off for this run)")


def resolve_program(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str:
    """The program ``argv[0]`` names, found on ``env``'s PATH (or relative to ``cwd`` when it
    has a slash); ConfigError naming ``command`` when there is none."""
    if not argv:
        raise ConfigError("the command critic needs a command (argv), got none", key="command")
    program = argv[0]
    if "/" in program:
        path = program if os.path.isabs(program) else os.path.join(cwd, program)
        found = path if os.access(path, os.X_OK) else None
    else:
        found = shutil.which(program, path=env.get("PATH", ""))
    if found is None:
        raise ConfigError(
            f"command {program!r} is not found on the command's PATH ({env.get('PATH', '')})",
            key="command",
            hint="name a program installed in the worker's virtual environment or system "
            "directories, or give its absolute path",
        )
    return found


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """True once ``proc`` has exited, without reaping it (so its pid, the group id, stays
    taken until the group is killed)."""
    if not hasattr(os, "waitid"):  # pragma: no cover - not Linux
        return proc.poll() is not None
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _read_output(fh: IO[bytes], limit: int) -> str:
    """The command's output, or its head and tail when it wrote more than ``limit`` bytes."""
    size = fh.seek(0, os.SEEK_END)
    fh.seek(0)
    if size <= limit:
        return fh.read().decode("utf-8", "replace")
    half = limit // 2
    head = fh.read(half)
    fh.seek(size - half)
    tail = fh.read(half)
    return (
        head.decode("utf-8", "replace")
        + f"\n… [{size - 2 * half} bytes of output not kept] …\n"
        + tail.decode("utf-8", "replace")
    )


def run_confined(
    argv: Sequence[str],
    cwd: str,
    *,
    timeout_s: float,
    env: Mapping[str, str],
    limits: Limits | None = None,
    isolation: Isolation | None = None,
    output_limit: int = OUTPUT_LIMIT,
    clock: Callable[[], float] = time.monotonic,
) -> RunResult:
    """Run ``argv`` in ``cwd`` with ``env`` (see the module docstring for what confines it).

    ``limits`` default to :meth:`Limits.for_timeout`, ``isolation`` to
    :func:`network_isolation`. At ``timeout_s`` the process group is killed and the result says
    ``timed_out``. Raises ConfigError when the program does not exist.
    """
    limits = limits if limits is not None else Limits.for_timeout(timeout_s)
    iso = isolation if isolation is not None else network_isolation()
    program = resolve_program(argv, env, cwd)
    full = [*iso.prefix, program, *argv[1:]]
    began = clock()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            full,
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            preexec_fn=limits.preexec(),  # setrlimit only; the function is built beforehand
        )
        timed_out = False
        try:
            deadline = began + timeout_s
            while not _exited(proc):
                if clock() >= deadline:
                    timed_out = True
                    break
                time.sleep(POLL_S)
        finally:
            _kill_group(proc.pid)  # at the limit, or what it left running after it exited
            exit_code = proc.wait()
        elapsed = clock() - began
        output = _read_output(out, output_limit)
    return RunResult(
        exit_code=exit_code,
        output=output,
        timed_out=timed_out,
        elapsed_s=round(elapsed, 3),
        isolation=iso.description,
        limits=limits.describe(),
    )


@contextlib.contextmanager
def temp_workspace(prefix: str = "critique-cmd-") -> Iterator[str]:
    """A fresh temp dir, removed afterwards (whatever the command left in it)."""
    root = tempfile.mkdtemp(prefix=prefix)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
