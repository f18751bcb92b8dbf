"""The critique cache's protocol: identical outputs are critiqued once (see docs/llm.md,
"Critique cache: `cache`").

A critique's key (:func:`critique_cache_key`) hashes what decides its envelope (the output, the
submission's files, task and contract, the Known Pitfalls and round in the critic's prompt, the
critic configuration and the critic that serves it), never who sent it.
:func:`critique_through_cache` serves a critique from the cache, or critiques once and stores
the envelope; of several concurrent identical critiques the first
claims the key and the others poll for its envelope. Where the envelopes live (memory, Redis)
is the store's side: :class:`~pipeline.store.base.CritiqueCache`,
:mod:`pipeline.store.critique_entries` (which seals each shared entry like a record, since a hit
becomes a verdict the worker signs).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any, Literal

from pipeline.config import CacheConfig, CritiqueConfig
from pipeline.critics.base import Critic, resolve_for
from pipeline.models import CritiqueEnvelope, Submission, Usage
from pipeline.store.base import CritiqueCache

CacheUse = Literal["hit", "miss", ""]
"""What the critique cache did for a critique: served it, stored it, or was not used."""

CACHE_POLL_S = 0.05
"""How often a critique waiting on another's claim looks for the cached envelope."""


def critique_cache_key(
    config: CritiqueConfig,
    critic: Critic,
    submission: Submission,
    output: Any,
    *,
    pitfalls: str,
    round: int,
) -> str:
    """The cache key of a critique: a SHA-256 of everything that goes into the critic's prompt
    or decides its envelope: the output, the files (their digests or content), the task and
    contract, the run's Known Pitfalls as the critic reads them, the critique round (the
    prompt says whether the output is a repair), the configuration (but its ``cache`` and
    ``budget`` blocks) and the name of the critic that serves ``submission``. Who sent it
    (run, worker, iteration, subtask signature) is not part of it: two runs share an envelope
    only when their critics would have read the same prompt."""
    serving: Critic = resolve_for(critic, submission)
    doc = {
        "output": output,
        "submission": submission.model_dump(
            mode="json", exclude={"run_id", "worker_id", "iteration", "subtask_signature", "output"}
        ),
        "config": config.model_dump(mode="json", exclude={"cache", "budget"}),
        "critic": serving.name,
        "pitfalls": pitfalls,
        "round": round,
    }
    raw = json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def critique_through_cache(
    cache: CritiqueCache,
    settings: CacheConfig,
    key: str,
    worker_id: str,
    critique: Callable[[], CritiqueEnvelope],
) -> tuple[CritiqueEnvelope, CacheUse]:
    """Serve the critique under ``key`` from the cache (as ``worker_id``'s, spending nothing),
    or run ``critique`` once and store its envelope. Of several concurrent identical critiques
    the first claims the key and the others wait (up to ``settings.lock_s``, looking every
    :data:`CACHE_POLL_S`) for its envelope, then critique themselves if none came. A fallback
    envelope is never stored."""

    def lookup() -> CritiqueEnvelope | None:
        raw = cache.get(key)
        if raw is None:
            return None
        hit = CritiqueEnvelope.model_validate_json(raw)
        return hit.model_copy(update={"worker_id": worker_id, "usage": Usage()})

    hit = lookup()
    if hit is not None:
        return hit, "hit"
    claimed = cache.claim(key, settings.lock_s)
    deadline = time.monotonic() + settings.lock_s
    while not claimed and time.monotonic() < deadline:
        time.sleep(CACHE_POLL_S)
        hit = lookup()
        if hit is not None:
            return hit, "hit"
        claimed = cache.claim(key, settings.lock_s)
    if claimed:  # the previous holder may have stored it and let go since our first look
        hit = lookup()
        if hit is not None:
            cache.release(key)
            return hit, "hit"
    try:
        envelope = critique()
        if envelope.fallback_reason is None:
            cache.put(key, envelope.model_dump_json(), settings.ttl_s)
    finally:
        if claimed:
            cache.release(key)
    return envelope, "miss"
