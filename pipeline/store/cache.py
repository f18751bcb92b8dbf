"""The critique cache in Redis: envelopes by content key, shared by every worker.

``<prefix>:cache:critique:<sha256>`` holds an envelope's JSON with the configured TTL;
``<prefix>:cache:claim:<sha256>`` (SET NX PX) lets the first of several concurrent identical
critiques run while the others wait for its envelope instead of calling the LLM too.
"""

from __future__ import annotations

import uuid

from pipeline.store import keys
from pipeline.store.redis_common import StoreClient, store_errors, text


class RedisCritiqueCache:
    """:class:`~pipeline.store.base.CritiqueCache` on Redis."""

    def __init__(self, client: StoreClient, *, prefix: str | None = None) -> None:
        self._client = client
        self._prefix = prefix
        self._token = uuid.uuid4().hex

    def _key(self, suffix: str, key: str) -> str:
        return keys.shared_key(f"{suffix}:{key}", self._prefix)

    def get(self, key: str) -> str | None:
        with store_errors(self._client):
            raw = self._client.get(self._key(keys.CACHE, key))
        return None if raw is None else text(raw)

    def put(self, key: str, envelope_json: str, ttl_s: float) -> None:
        with store_errors(self._client):
            self._client.set(
                self._key(keys.CACHE, key), envelope_json, px=max(1, int(ttl_s * 1000))
            )

    def claim(self, key: str, ttl_s: float) -> bool:
        with store_errors(self._client):
            return bool(
                self._client.set(
                    self._key(keys.CACHE_CLAIM, key),
                    self._token,
                    nx=True,
                    px=max(1, int(ttl_s * 1000)),
                )
            )

    def release(self, key: str) -> None:
        with store_errors(self._client):
            self._client.delete(self._key(keys.CACHE_CLAIM, key))
