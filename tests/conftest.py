"""Session-wide test services: a real Redis (never a mock).

``$CRITIQUE_TEST_REDIS_URL`` wins; else database 15 of the Redis on 127.0.0.1:6379 when one
answers; else an embedded redis-server started for the session. Tests flush only their database.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from tests.fakes.openai_server import FakeOpenAIServer
from workers.embedded import EmbeddedRedis, ping

TEST_DB = 15


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the test Redis database."""
    url = os.environ.get("CRITIQUE_TEST_REDIS_URL")
    if url:
        yield url
        return
    if ping("127.0.0.1", 6379):
        yield f"redis://127.0.0.1:6379/{TEST_DB}"
        return
    server = EmbeddedRedis().start()
    try:
        yield f"redis://127.0.0.1:{server.port}/{TEST_DB}"
    finally:
        server.stop()


def redis_host_port(url: str) -> tuple[str, int]:
    """Host and port of a redis:// URL."""
    u = urlparse(url)
    return u.hostname or "127.0.0.1", u.port or 6379


@pytest.fixture
def fake_llm() -> Iterator[FakeOpenAIServer]:
    """A fresh fake OpenAI-compatible server on loopback for one test (``fake_llm.api_base``)."""
    with FakeOpenAIServer() as server:
        yield server
