"""Helpers shared by the Redis stores: error mapping, reply decoding, prefix and TTL defaults."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis
from redis.exceptions import ClusterDownError, ReadOnlyError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.errors import StoreUnavailableError
from pipeline.store import keys


def redis_url_of(client: redis.Redis) -> str:
    """A password-free URL naming the server ``client`` talks to (for error hints)."""
    kw = client.connection_pool.connection_kwargs
    db = kw.get("db", 0)
    if kw.get("path"):
        return f"unix://{kw['path']}?db={db}"
    return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{db}"


UNAVAILABLE: tuple[type[Exception], ...] = (
    RedisConnectionError,  # refused, reset, closed; also LOADING (a restart reading its AOF)
    RedisTimeoutError,
    ReadOnlyError,  # writing to a replica: a failover is under way
    TryAgainError,  # a cluster slot migrating
    ClusterDownError,  # a cluster, or a master, is down (MASTERDOWN)
)
"""Redis errors that say "not now" rather than "never": ``StoreUnavailableError`` (transient)."""


@contextmanager
def store_errors(client: redis.Redis) -> Iterator[None]:
    """Map Redis connection failures, timeouts and failover replies (:data:`UNAVAILABLE`) to
    ``StoreUnavailableError`` (transient: retried with backoff) with a hint."""
    try:
        yield
    except UNAVAILABLE as exc:
        url = redis_url_of(client)
        raise StoreUnavailableError(
            f"the Redis store at {url} is unavailable: {exc}",
            hint=f"is Redis running at {url}? set REDIS_URL",
        ) from exc


def text(value: bytes | str) -> str:
    """A reply as ``str`` whether the client decodes responses or not."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def resolve_ttl_ms(ttl_s: float | None) -> int:
    """A run TTL in milliseconds: ``ttl_s`` if given, else ``$CRITIQUE_RUN_TTL_S`` (7 days)."""
    seconds = keys.run_ttl_s() if ttl_s is None else ttl_s
    if seconds <= 0:
        raise ValueError(f"run TTL must be positive, got {seconds!r}")
    return max(1, int(seconds * 1000))


def resolve_prefix(prefix: str | None) -> str:
    """A checked key prefix: ``prefix`` if given, else ``$CRITIQUE_KEY_PREFIX`` or ``critique``."""
    return keys.key_prefix() if prefix is None else keys.check_prefix(prefix)
