"""Server processes the fault tests kill and restart: a private ``redis-server`` with AOF that
keeps its port and data directory, and the environment the fault workers run with."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from workers.embedded import free_port, ping, redis_executable

# Fast sweeps and restores; a stall time and a visibility timeout longer than any test, so
# neither backstop acts within one: what a test sees recovered in seconds, the sweeper's proof
# (a lost chain) or its orphan restore (a message no live worker holds) recovered. The publish
# and backend retry budget stays the default.
FAULT_ENV = {
    "CRITIQUE_STALL_S": "600",
    "CRITIQUE_SWEEP_S": "0.5",
    "CRITIQUE_VISIBILITY_TIMEOUT_S": "900",
    "CRITIQUE_RESTORE_INTERVAL_S": "1",
    "CRITIQUE_RESTORE_MUTEX_S": "3",
    "CRITIQUE_TASK_TIME_LIMIT_S": "60",
    "CRITIQUE_LEASE_TTL_S": "5",
}


class ServerProcess:
    """A server child process (``proc``) that can be killed or stopped."""

    proc: subprocess.Popen[bytes] | None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last fsync (appendfsync always has written every write)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM: the server's own shutdown (SIGKILL after 15 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


class RedisServer(ServerProcess):
    """A ``redis-server`` with ``appendonly yes`` / ``appendfsync always`` that keeps its port and
    data directory across :meth:`kill` / :meth:`stop` and :meth:`start`; ``args`` are more
    options, after (so in place of) those (e.g. a cluster node's)."""

    def __init__(self, workdir: Path, args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, timeout: float = 15.0) -> RedisServer:
        argv = [
            redis_executable(),
            "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
            "--save", "", "--appendonly", "yes", "--appendfsync", "always",
            "--dir", str(self.dir), *self.args,
        ]  # fmt: skip
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - the child keeps it open
        self.proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if ping("127.0.0.1", self.port):
                # Answers PING while it loads the AOF (-LOADING to anything else): wait for it.
                with contextlib.suppress(redis.exceptions.BusyLoadingError):
                    if redis.Redis(port=self.port).dbsize() >= 0:
                        return self
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def shutdown_nosave(self) -> None:
        """``SHUTDOWN NOSAVE``: no RDB snapshot (the AOF, fsynced on every write, is what a
        restart loads)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(redis.exceptions.ConnectionError):
                redis.Redis(port=self.port).shutdown(nosave=True)
            self.proc.wait(timeout=15)


def forget_app_connections() -> None:
    """Drop the Celery app's broker pools and result backend: they were built for the URL of
    an earlier test's server, and every test has a server (a port) of its own."""
    from workers.app import app

    app._pool = None
    app.amqp._producer_pool = None
    app._backend_cache = None  # the backend: shared when thread-safe, else per thread
    app._local.__dict__.pop("backend", None)
