"""Scripts that stay exact when redis-py re-sends them: a proxy in front of a real Redis loses
the reply of one call after Redis ran it (tests/support/replies.py), redis-py re-sends the call
on a new connection, and the effect still happens once — the stall claim counts one resume, the
rate limiter takes one slot, a trace append adds its events once. Each test first shows the
reply was really lost and the call really re-sent (the proxy counts it)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
import redis

from pipeline.config import RateLimit
from pipeline.store import keys
from pipeline.store.pending import RedisPendingIndex
from pipeline.store.ratelimit import RedisRateLimiter
from pipeline.store.redis import RedisTraceSink
from tests.support.replies import ReplyLoser, losing_replies

pytestmark = pytest.mark.integration

PREFIX = "resend-test"


@pytest.fixture
def proxied(redis_url: str) -> Iterator[tuple[redis.Redis, ReplyLoser]]:
    """A client through the reply-losing proxy, on the test database, with redis-py's default
    retry (``redis.Redis(...)``: 10 re-sends; a Redis Cluster store's client has the same)."""
    parsed = urlparse(redis_url)
    db = int((parsed.path or "/0").lstrip("/") or 0)
    with losing_replies(parsed.port or 6379) as proxy:
        client = redis.Redis(host="127.0.0.1", port=proxy.port, db=db)
        assert client.connection_pool.make_connection().retry.get_retries() > 0
        try:
            yield client, proxy
        finally:
            client.close()


def test_a_resent_stall_claim_counts_one_resume(
    proxied: tuple[redis.Redis, ReplyLoser], redis_client: redis.Redis
) -> None:
    """The claim's reply is lost and redis-py sends it again: the answer is the count taken
    (1), the resumes hash says 1, and the pass's score is the claim's time."""
    client, proxy = proxied
    index = RedisPendingIndex(client, prefix=PREFIX)
    run_id, member = f"r{uuid.uuid4().hex[:8]}", "1:w1:p1"
    index.add(run_id, member, 100.0)
    proxy.lose_next_reply()
    assert index.claim(run_id, member, 100.0, 200.0, 5) == 1
    assert proxy.lost == 1
    resumes = redis_client.hget(keys.run_key(run_id, keys.RESUMES, PREFIX), member)
    assert resumes == b"1"
    assert index.last_progress(run_id, member) == 200.0
    assert index.claim(run_id, member, 200.0, 300.0, 5) == 2  # a new claim still counts


def test_a_resent_rate_limit_call_takes_one_slot(proxied: tuple[redis.Redis, ReplyLoser]) -> None:
    """With room for exactly two calls in the bucket, a call whose grant reply is lost and
    re-sent leaves room for one more call, not none."""
    client, proxy = proxied
    limiter = RedisRateLimiter(client, prefix=PREFIX)
    model = f"m-{uuid.uuid4().hex[:8]}"
    limit = RateLimit(rpm=2, burst_s=60.0)  # depth 60 s at 1 call / 30 s: two calls fit
    proxy.lose_next_reply()
    assert limiter.try_acquire(model, limit, 0) == 0.0
    assert proxy.lost == 1
    assert limiter.try_acquire(model, limit, 0) == 0.0  # the second call still fits
    assert limiter.try_acquire(model, limit, 0) > 0  # and then the bucket is full


def test_a_resent_trace_append_adds_its_events_once(
    proxied: tuple[redis.Redis, ReplyLoser], redis_client: redis.Redis
) -> None:
    """Two events appended in one call whose reply is lost: the trace holds each once, in
    order, and the ids of recent appends expire on their own."""
    client, proxy = proxied
    sink = RedisTraceSink(client, prefix=PREFIX, ttl_s=60)
    run_id = f"r{uuid.uuid4().hex[:8]}"
    sink.emit(run_id, {"type": "start", "n": 0})
    proxy.lose_next_reply()
    sink.emit_encoded(run_id, ['{"type":"step","n":1}', '{"type":"step","n":2}'])
    assert proxy.lost == 1
    assert [e["n"] for e in sink.read(run_id)] == [0, 1, 2]
    ops = keys.run_key(run_id, keys.TRACE_OPS, PREFIX)
    assert redis_client.zcard(ops) == 2
    assert 0 < redis_client.pttl(ops) <= 60_000


def test_without_the_proxy_losing_anything_each_call_counts(
    proxied: tuple[redis.Redis, ReplyLoser],
) -> None:
    """The control: distinct calls are distinct (two claims count two, two appends append
    two), so the tests above measure the re-send and nothing else."""
    client, proxy = proxied
    index = RedisPendingIndex(client, prefix=PREFIX)
    sink = RedisTraceSink(client, prefix=PREFIX, ttl_s=60)
    run_id, member = f"r{uuid.uuid4().hex[:8]}", "1:w1:p1"
    index.add(run_id, member, time.time() - 100)
    seen = index.last_progress(run_id, member)
    assert seen is not None
    assert index.claim(run_id, member, seen, seen + 1, 5) == 1
    assert index.claim(run_id, member, seen + 1, seen + 2, 5) == 2
    sink.emit(run_id, {"type": "same"})
    sink.emit(run_id, {"type": "same"})
    assert len(sink.read(run_id)) == 2 and proxy.lost == 0
