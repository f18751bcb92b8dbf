"""Per-call overhead of the cluster-wide rate limiter (``pipeline/store/ratelimit.py``).

    python bench/ratelimit.py [--k 5000] [--rounds 3] [--redis URL]

With no --redis it starts a redis-server of its own on a free port (workers.embedded).

Times K calls of ``RedisRateLimiter.acquire`` with limits high enough never to wait (rpm and
tpm both set, so the Lua script does its full work for both buckets), against the same loop
with no limiter (the baseline: what an LLM call costs before it when ``llm.rate_limit`` is
unset) and against K plain Redis PINGs (one round trip, for scale). Each row is the median of
``--rounds``; the database's bench key is deleted afterwards (nothing else is touched).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def per_call_us(fn: Callable[[], object], k: int) -> float:
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    return (time.perf_counter() - t0) / k * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--k", type=int, default=5000, help="calls per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    from bench._redis import add_redis_option, redis_url

    add_redis_option(ap)
    args = ap.parse_args()
    args.redis = redis_url(args.redis)

    import redis

    from pipeline.config import RateLimit
    from pipeline.store.ratelimit import RedisRateLimiter

    client = redis.Redis.from_url(args.redis)
    prefix = f"bench-rl-{uuid.uuid4().hex[:8]}"
    limiter = RedisRateLimiter(client, prefix=prefix)
    model = "openai/bench-model"
    # far above what K calls can reach in the run: never a wait
    limit = RateLimit(rpm=10**9, tpm=10**12, burst_s=60)
    tokens = 1500

    def baseline() -> float:
        return 0.0  # what the completer does when no wait_for_slot is configured

    cases: list[tuple[str, Callable[[], object]]] = [
        ("no limiter", baseline),
        ("redis PING", client.ping),
        ("acquire", lambda: limiter.acquire(model, limit, tokens)),
        ("try_acquire", lambda: limiter.try_acquire(model, limit, tokens)),
    ]
    try:
        for _, fn in cases:  # warm-up: connection, script load (EVALSHA from then on)
            for _ in range(50):
                fn()
        results: dict[str, list[float]] = {name: [] for name, _ in cases}
        for _ in range(args.rounds):
            for name, fn in cases:
                results[name].append(per_call_us(fn, args.k))
        waited = limiter.try_acquire(model, limit, tokens)
    finally:
        client.delete(limiter.key(model))

    med = {name: statistics.median(v) for name, v in results.items()}
    print(
        f"K={args.k} calls per measurement, median of {args.rounds} round(s), "
        f"limit rpm={limit.rpm} tpm={limit.tpm} (never waits: last wait {waited:.3f} s), "
        f"{args.redis}"
    )
    print(f"{'loop':<12} {'us/call':>9} {'min':>9} {'max':>9} {'vs PING':>8} {'vs none':>9}")
    for name, _ in cases:
        v = results[name]
        vs = f"{med[name] / med['redis PING']:.2f}"
        vn = f"{med[name] / med['no limiter']:.0f}x"
        print(f"{name:<12} {med[name]:9.2f} {min(v):9.2f} {max(v):9.2f} {vs:>8} {vn:>9}")
    overhead = med["acquire"] - med["no limiter"]
    print(
        f"limiter overhead per LLM call: {overhead:.1f} us "
        f"(= {overhead / med['redis PING']:.2f} PING round trips); "
        f"against a 200 ms LLM call: {overhead / 200_000:.4%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
