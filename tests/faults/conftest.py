"""Fault-test services: a private ``redis-server`` with AOF that a test kills and restarts, a
Sentinel deployment (``tests.faults.sentinel``), and the environment that points this process
and real worker processes at them.

Never the shared Redis: each test gets its own server on a free loopback port, in a temp dir.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from tests.integration.workers import WorkerProcess, client_on
from workers.embedded import free_port, ping, redis_executable

if TYPE_CHECKING:  # tests.faults.sentinel imports this module
    from tests.faults.sentinel import SentinelSetup

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


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private Redis with AOF for one test; gone afterwards."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


def _forget_app_connections() -> None:
    """Drop the Celery app's broker pools and result backend: they were built for the URL of
    an earlier test's server, and every test has a server (a port) of its own."""
    from workers.app import app

    app._pool = None
    app.amqp._producer_pool = None
    app._backend_cache = None  # the backend: shared when thread-safe, else per thread
    app._local.__dict__.pop("backend", None)


@pytest.fixture
def fault_store_env() -> dict[str, str]:
    """More environment for :func:`fault_env` (none; a test module overrides this fixture to
    put the store elsewhere, e.g. ``CRITIQUE_STORE_URL``)."""
    return {}


@pytest.fixture
def fault_env(
    redis_server: RedisServer, fault_store_env: dict[str, str]
) -> Iterator[dict[str, str]]:
    """This process's client pointed at the private Redis (db 0), with :data:`FAULT_ENV` and
    :func:`fault_store_env`; the environment for the test's worker processes."""
    with client_on(redis_server.url(0), **FAULT_ENV, **fault_store_env) as env:
        _forget_app_connections()
        try:
            yield env
        finally:
            _forget_app_connections()


@pytest.fixture
def start_worker(fault_env: dict[str, str], tmp_path: Path) -> Iterator[object]:
    """``start_worker(name, pool=..., concurrency=..., env=..., queues=...)`` → a started
    :class:`WorkerProcess` (``env``: more environment); every one is stopped after the test
    (and its log printed when the test failed)."""
    started: list[WorkerProcess] = []

    def start(
        name: str,
        *,
        pool: str = "threads",
        concurrency: int = 4,
        env: dict[str, str] | None = None,
        queues: str = "critique.cpu,critique.llm",
    ) -> WorkerProcess:
        w = WorkerProcess(
            fault_env["REDIS_URL"],
            pool=pool,
            concurrency=concurrency,
            queues=queues,
            name=name,
            env={**fault_env, **(env or {})},
            log=tmp_path / f"worker-{name}.log",
        )
        started.append(w.start(timeout=60))
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSetup]:
    """A master (AOF), one replica and three Sentinels, settled (``tests.faults.sentinel``);
    every one stopped afterwards."""
    from tests.faults.sentinel import SentinelSetup

    setup = SentinelSetup(tmp_path / "redis")
    try:
        yield setup.start()
    finally:
        setup.stop()


@pytest.fixture
def sentinel_env(sentinels: SentinelSetup) -> Iterator[dict[str, str]]:
    """This process's client (store, broker, result backend) on the Sentinel URL; the
    environment for the workers."""
    from pipeline.store.redis_common import celery_url
    from tests.faults.sentinel import MASTER
    from workers.app import app, check_sentinel_settings

    url = sentinels.url()
    saved = (app.conf.broker_transport_options, app.conf.result_backend_transport_options)
    with client_on(url, flush=False, CRITIQUE_REDIS_MASTER=MASTER, **FAULT_ENV) as env:
        # celeryconfig was read before this test set the URL: what it does at start-up for a
        # sentinel:// URL (normalized URL, master_name, sentinel_kwargs), done here.
        # (Celery reads CELERY_BROKER_URL / CELERY_RESULT_BACKEND from the environment first.)
        normalized = celery_url(url, setting="REDIS_URL")
        os.environ["CELERY_BROKER_URL"] = os.environ["CELERY_RESULT_BACKEND"] = normalized
        app.conf.broker_url = app.conf.result_backend = normalized
        app.conf.broker_transport_options = {
            k: v for k, v in saved[0].items() if k not in ("master_name", "sentinel_kwargs")
        }
        app.conf.result_backend_transport_options = {
            k: v for k, v in saved[1].items() if k not in ("master_name", "sentinel_kwargs")
        }
        check_sentinel_settings(app.conf)
        _forget_app_connections()
        try:
            yield env
        finally:
            _forget_app_connections()
            app.conf.broker_transport_options, app.conf.result_backend_transport_options = saved
