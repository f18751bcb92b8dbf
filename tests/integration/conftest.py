"""Integration fixtures: a real Redis (never a mock), one flushed test database per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A bytes client on the test database, flushed (that database only) before the test."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def redis_text_client(redis_client: redis.Redis, redis_url: str) -> Iterator[redis.Redis]:
    """A ``decode_responses=True`` client on the same (already flushed) test database."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()
