"""Cluster-wide LLM rate limits: the GCRA script's arithmetic on a real Redis."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from pipeline.config import LLMConfig, RateLimit
from pipeline.errors import LLMTransientError
from pipeline.llm.completion import ChatMessage, LiteLLMCompleter, LLMRequest
from pipeline.store import keys
from pipeline.store.ratelimit import RedisRateLimiter

T0 = 1_700_000_000_000.0  # a fixed "now" in ms (the script otherwise uses Redis TIME)


def test_rpm_allows_the_burst_then_one_slot_per_interval(redis_client: redis.Redis) -> None:
    """rpm 120, depth 1 s: 2 calls at once, the third waits 0.5 s; slots come every 0.5 s."""
    limiter = RedisRateLimiter(redis_client, prefix="t")
    limit = RateLimit(rpm=120, burst_s=1.0)
    assert limiter.try_acquire("m", limit, 0, now_ms=T0) == 0.0
    assert limiter.try_acquire("m", limit, 0, now_ms=T0) == 0.0
    assert limiter.try_acquire("m", limit, 0, now_ms=T0) == pytest.approx(0.5)
    assert limiter.try_acquire("m", limit, 0, now_ms=T0 + 499) == pytest.approx(0.001)
    assert limiter.try_acquire("m", limit, 0, now_ms=T0 + 500) == 0.0
    assert limiter.try_acquire("m", limit, 0, now_ms=T0 + 500) == pytest.approx(0.5)
    # a quiet bucket refills to its depth, no further
    assert limiter.try_acquire("m", limit, 0, now_ms=T0 + 60_000) == 0.0
    assert limiter.try_acquire("m", limit, 0, now_ms=T0 + 60_000) == 0.0
    assert limiter.try_acquire("m", limit, 0, now_ms=T0 + 60_000) == pytest.approx(0.5)
    # the key is the model's, under the prefix, and expires: once the TAT is past, but not
    # before 30 s (the ids of its latest grants answer a call redis-py re-sends)
    key = keys.ratelimit_key("m", "t")
    assert key == "t:ratelimit:m"
    assert 25_000 < redis_client.pttl(key) <= 30_000


def test_tpm_counts_tokens_and_both_limits_must_fit(redis_client: redis.Redis) -> None:
    """tpm 6000 = 100 tokens/s, depth 2 s (200 tokens); a refused call takes nothing."""
    limiter = RedisRateLimiter(redis_client, prefix="t")
    limit = RateLimit(rpm=600, tpm=6000, burst_s=2.0)
    assert limiter.try_acquire("m", limit, 150, now_ms=T0) == 0.0
    # 150 + 100 = 250 tokens ahead > 200: wait 0.5 s; the rpm slot is not taken either
    assert limiter.try_acquire("m", limit, 100, now_ms=T0) == pytest.approx(0.5)
    assert limiter.try_acquire("m", limit, 50, now_ms=T0) == 0.0
    rpm_tat, tpm_tat = (float(v) for v in redis_client.hmget("t:ratelimit:m", "rpm", "tpm"))
    assert rpm_tat == pytest.approx(T0 + 2 * 100)  # two calls at 100 ms each
    assert tpm_tat == pytest.approx(T0 + 200 * 10)  # 200 tokens at 10 ms each
    # a call bigger than the whole depth goes through on a full bucket, then is owed
    later = T0 + 10_000
    assert limiter.try_acquire("m", limit, 1000, now_ms=later) == 0.0
    assert limiter.try_acquire("m", limit, 1, now_ms=later) == pytest.approx(10.0 - 2.0 + 0.01)


def test_models_have_separate_buckets_and_no_limit_passes(redis_client: redis.Redis) -> None:
    limiter = RedisRateLimiter(redis_client, prefix="t")
    limit = RateLimit(rpm=60, burst_s=1.0)
    assert limiter.try_acquire("a", limit, 0, now_ms=T0) == 0.0
    assert limiter.try_acquire("a", limit, 0, now_ms=T0) == pytest.approx(1.0)
    assert limiter.try_acquire("b", limit, 0, now_ms=T0) == 0.0
    unlimited = RateLimit()
    assert all(limiter.try_acquire("a", unlimited, 10**6, now_ms=T0) == 0.0 for _ in range(5))


def test_acquire_waits_for_its_slot_and_gives_up_past_max_wait(redis_client: redis.Redis) -> None:
    """On Redis's clock: the third of rpm 600 (depth 0.2 s) waits about 0.1 s; a deadline of
    0 s fails as a transient LLM error without sleeping."""
    limiter = RedisRateLimiter(redis_client, prefix="t")
    waits: list[float] = []
    limit = RateLimit(rpm=600, burst_s=0.2, max_wait_s=5)
    limiter.acquire("m", limit, 0)
    limiter.acquire("m", limit, 0)
    waited = limiter.acquire("m", limit, 0, on_wait=waits.append)
    assert 0.05 < waited < 1.0 and waits and waits[0] <= 0.1 + 1e-6
    with pytest.raises(LLMTransientError, match="no slot within 0 s"):
        limiter.acquire("m", limit.model_copy(update={"max_wait_s": 0.0}), 0)


def test_threads_sharing_a_bucket_never_pass_the_rate(redis_client: redis.Redis) -> None:
    """8 threads × 5 calls under rpm 1200 (20/s, depth 0.1 s = 2): ≥ (40 − 2) / 20 s."""
    limiter = RedisRateLimiter(redis_client, prefix="t")
    limit = RateLimit(rpm=1200, burst_s=0.1, max_wait_s=30)
    began = time.monotonic()
    threads = [
        threading.Thread(target=lambda: [limiter.acquire("m", limit, 0) for _ in range(5)])
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - began >= (40 - 2) / 20 - 0.05


def test_the_completer_waits_before_every_attempt_reserving_prompt_plus_max_tokens() -> None:
    """LiteLLMCompleter calls wait_for_slot(model, prompt tokens + max_tokens) per attempt."""
    calls: list[tuple[str, int]] = []

    def completion(**kw: object) -> dict[str, object]:
        return {
            "choices": [{"message": {"content": "ok"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            "model": kw["model"],
        }

    completer = LiteLLMCompleter(
        LLMConfig(max_tokens=100),
        completion=completion,
        wait_for_slot=lambda model, tokens: calls.append((model, tokens)) or 0.0,
    )
    request = LLMRequest(
        model="gpt-x", messages=(ChatMessage(role="user", content="x" * 40),), purpose="critic"
    )
    assert completer(request).text == "ok"
    [(model, tokens)] = calls  # the prompt: 10 tokens estimated (or the tokenizer's count)
    assert model == "gpt-x" and 100 < tokens <= 100 + 40
