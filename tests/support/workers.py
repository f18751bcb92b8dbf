"""A real Celery worker in a subprocess, against the test Redis (never eager mode).

:class:`WorkerProcess` is one ``celery worker``; :class:`WorkerStarter` makes them and stops
them all (the ``start_worker`` fixture per test, the ``worker`` fixture per module, as a
module's :class:`WorkerSpec` declares); :func:`client_on` points this process's client at the
workers' database and yields their environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_QUEUES = "critique.cpu,critique.llm"
"""The queues a worker consumes unless told otherwise (every stage's default queue)."""


def url_db(url: str) -> int | None:
    """The database number a ``redis://`` URL names (its path), None when it names none."""
    db = urlsplit(url).path.strip("/")
    return int(db) if db.isdigit() else None


def with_db(url: str, db: int) -> str:
    """``url`` naming database ``db`` instead."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{db}"))


def worker_db(test_db: int) -> int:
    """The database worker tests use: the one below the test database (1 → 0 on the session's
    own server; N → N-1 with ``CRITIQUE_TEST_REDIS_URL=.../N``; db 1 when the test database is
    0), so the two never collide, nor sessions that share one Redis with different databases."""
    return test_db - 1 if test_db > 0 else 1


def worker_db_url(test_url: str) -> str:
    """``test_url`` moved to its workers' database (:func:`worker_db`)."""
    return with_db(test_url, worker_db(url_db(test_url) or 0))


@contextlib.contextmanager
def client_on(url: str, *, flush: bool = True, **extra: str) -> Iterator[dict[str, str]]:
    """Point this process's client (``workers.runtime`` and the Celery app) at ``url`` — the
    database the test's workers use — flushing it first; restore everything afterwards.

    Yields the environment to hand to :class:`WorkerProcess` (``worker_env(url, **extra)``).
    """
    from workers import runtime
    from workers.app import app

    if flush:
        redis.Redis.from_url(url).flushdb()
    saved = dict(os.environ)
    saved_conf = (app.conf.broker_url, app.conf.result_backend)
    env = worker_env(url, **extra)
    os.environ.update(env)
    runtime.forget_store()
    _forget_configs(runtime)
    app.conf.broker_url = url
    app.conf.result_backend = url
    try:
        yield env
    finally:
        os.environ.clear()
        os.environ.update(saved)
        app.conf.broker_url, app.conf.result_backend = saved_conf
        runtime.forget_store()
        _forget_configs(runtime)


def _forget_configs(runtime: Any) -> None:
    """Drop the client's cached configurations: its own one (which submissions are checked
    against: allowed_models, the keys it holds) comes from the environment just changed."""
    runtime._configs.clear()
    runtime._contexts.clear()


def worker_env(redis_url: str, **extra: str) -> dict[str, str]:
    """Environment for a worker and for the in-test client: same Redis, fast retries."""
    env = dict(os.environ)
    env.update(
        {
            "REDIS_URL": redis_url,
            "CELERY_BROKER_URL": redis_url,
            "CELERY_RESULT_BACKEND": redis_url,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "PYTHONPATH": str(ROOT),
        }
    )
    env.update(extra)
    return env


class WorkerProcess:
    """``celery -A workers.app worker`` as a child process."""

    def __init__(
        self,
        redis_url: str,
        *,
        pool: str = "threads",
        concurrency: int = 4,
        queues: str = DEFAULT_QUEUES,
        name: str = "w1",
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.name_pattern = f"{name}@%h"
        self.args = [
            sys.executable, "-m", "celery", "-A", "workers.app", "worker",
            "-Q", queues, "-P", pool, "-c", str(concurrency), "-n", self.name_pattern,
            "--without-gossip", "--without-mingle", "-l", "WARNING",
        ]  # fmt: skip
        self.env = worker_env(redis_url, **(env or {}))
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> WorkerProcess:
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
        )
        self._wait_ready(timeout)
        return self

    @property
    def nodename(self) -> str:
        """The worker's node name (``name@host``), as remote control addresses it."""
        from celery.utils.nodenames import host_format

        return host_format(self.name_pattern)

    def _wait_ready(self, timeout: float) -> None:
        if self.answers_within(timeout) is None:
            raise RuntimeError(f"worker {self.nodename} did not answer a ping within {timeout} s")

    def answers_within(self, timeout: float) -> float | None:
        """Seconds until the worker answers a remote-control ping (asked every 0.25 s), None
        if it did not within ``timeout``: then its event loop is running and connected to the
        broker, so it is consuming its queues (a reply is handled by the same loop as the
        tasks). ``RuntimeError`` if the process exits meanwhile. A connection of this process
        that the broker closed (a restart) fails one ping, and the next one reconnects."""
        probe = self._probe_app()
        began = time.monotonic()
        try:
            while time.monotonic() - began < timeout:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited early with code {self.proc.returncode}")
                try:
                    if probe.control.ping(destination=[self.nodename], timeout=0.25, limit=1):
                        return time.monotonic() - began
                except redis.exceptions.ConnectionError:
                    continue
        finally:
            probe.close()
        return None

    def _probe_app(self) -> Any:
        """The Celery app that pings this worker (a client of its broker)."""
        from celery import Celery

        return Celery("probe", broker=self.redis_url, set_as_current=False)

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool children)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> WorkerProcess:
        """``with WorkerProcess(...) as w``: started (ready), and stopped at the end."""
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def child_pids(pid: int) -> list[int]:
    """The pids of a process's children (a prefork worker's pool), from /proc; none when the
    process is gone or /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


class WorkerStarter:
    """Starts :class:`WorkerProcess` handles on the Redis their environment names, logging to
    ``logs``, and stops every one it made at :meth:`stop_all`: the ``start_worker`` and
    ``worker`` fixtures of tests/conftest.py are built on it, so no test leaves a worker behind."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.made: list[WorkerProcess] = []

    def __call__(
        self,
        name: str,
        env: Mapping[str, str],
        *,
        pool: str = "threads",
        concurrency: int = 4,
        queues: str = DEFAULT_QUEUES,
        started: bool = True,
        timeout: float = 60.0,
        process: type[WorkerProcess] = WorkerProcess,
    ) -> WorkerProcess:
        """A worker named ``name`` with the environment ``env`` (its ``REDIS_URL`` is the
        worker's broker, backend and store), logging to ``<logs>/worker-<name>.log``; started (it
        answers a ping; ``timeout`` only bounds a hang, generous for a loaded machine) unless
        ``started=False``, for a test that starts it itself later. ``process`` is the class
        of handle (a subclass whose readiness probe differs, e.g. a Sentinel worker's)."""
        w = process(
            env["REDIS_URL"],
            pool=pool,
            concurrency=concurrency,
            queues=queues,
            name=name,
            env=dict(env),
            log=self.logs / f"worker-{name}.log",
        )
        self.made.append(w)
        if started:
            w.start(timeout=timeout)
        return w

    def stop_all(self) -> None:
        """Stop every worker made here (a stopped or killed one is left as it is), then SIGKILL
        any pool child of theirs still running (one a killed main process left behind)."""
        children: set[int] = set()
        for w in self.made:
            if w.proc is not None:
                children.update(child_pids(w.proc.pid))
            w.stop()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a module's shared worker is (``WORKER = WorkerSpec(...)`` at module level, read by the
    ``worker`` fixture): its name, the module fixture whose value is its environment (the one
    :func:`client_on` yields), more environment on top, and its pool, size and queues."""

    name: str
    env_fixture: str = "env"
    more_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    pool: str = "threads"
    concurrency: int = 4
    queues: str = DEFAULT_QUEUES


ACCEPTING_CRITIQUE = (
    '{"score": 0.95, "defects": [], "prescriptions": [], "reusable_patterns": [], '
    '"summary": "fine"}'
)
"""A critic reply that accepts the output (the default answer of a fake LLM server)."""


@contextlib.contextmanager
def llm_env(redis_url: str, api_base: str, **extra: str) -> Iterator[dict[str, str]]:
    """This process's client on the workers' database of ``redis_url`` (as :func:`client_on`),
    yielding the environment of workers whose LLM calls go to ``api_base`` (worker-only
    configuration, so through the environment), with a key and ``extra``."""
    with client_on(
        worker_db_url(redis_url),
        CRITIQUE_LLM_API_KEY="sk-test",
        CRITIQUE_LLM__API_BASE=api_base,
        CRITIQUE_LLM__TIMEOUT_S="5",
        **extra,
    ) as env:
        yield env
