"""pipeline.loop.critique_cache on its own: serve from the cache, critique once, wait on a claim,
never store a fallback."""

from __future__ import annotations

import time

from pipeline.config import CacheConfig
from pipeline.loop.critique_cache import critique_through_cache
from pipeline.models import CritiqueEnvelope, Usage
from pipeline.store.memory import MemoryCritiqueCache

SETTINGS = CacheConfig(enabled=True, ttl_s=60, lock_s=0.3)


class _Critic:
    """Counts its critiques; its envelope spends tokens (optionally a fallback's)."""

    def __init__(self, fallback: str | None = None) -> None:
        self.calls = 0
        self.fallback = fallback

    def __call__(self) -> CritiqueEnvelope:
        self.calls += 1
        return CritiqueEnvelope(
            worker_id="w1",
            score=0.8,
            usage=Usage(tokens_in=100, tokens_out=20, calls=1),
            fallback_reason=self.fallback,
        )


def test_a_miss_critiques_once_and_a_hit_is_the_askers_and_spends_nothing() -> None:
    """The first ask critiques and stores ("miss"); the next, from another worker, is served
    from the cache ("hit") with that worker's id and zero usage, and no second critique."""
    cache, critic = MemoryCritiqueCache(), _Critic()
    first, use = critique_through_cache(cache, SETTINGS, "k1", "w1", critic)
    assert use == "miss" and first.usage.tokens == 120
    again, use = critique_through_cache(cache, SETTINGS, "k1", "w2", critic)
    assert use == "hit" and critic.calls == 1
    assert again.worker_id == "w2" and again.usage == Usage() and again.score == 0.8


def test_a_fallback_envelope_is_never_stored() -> None:
    """A critique that fell back (fallback_reason set) is returned but not cached: the next
    identical critique runs the critic again."""
    cache, critic = MemoryCritiqueCache(), _Critic(fallback="provider down")
    critique_through_cache(cache, SETTINGS, "k2", "w1", critic)
    _, use = critique_through_cache(cache, SETTINGS, "k2", "w1", critic)
    assert use == "miss" and critic.calls == 2
    assert cache.get("k2") is None


def test_a_held_claim_is_waited_for_then_the_waiter_critiques_itself() -> None:
    """While another holds the key's claim and stores nothing, a critique waits about
    lock_s, then critiques itself; the claim is released afterwards."""
    cache, critic = MemoryCritiqueCache(), _Critic()
    assert cache.claim("k3", 30.0)
    began = time.monotonic()
    _, use = critique_through_cache(cache, SETTINGS, "k3", "w1", critic)
    assert use == "miss" and critic.calls == 1
    assert time.monotonic() - began >= SETTINGS.lock_s * 0.9
    assert cache.get("k3") is not None
