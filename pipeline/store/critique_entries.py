"""The critique cache in Redis: envelopes by content key, shared by every worker.

``<prefix>:cache:critique:<sha256>`` holds an entry with the configured TTL;
``<prefix>:cache:claim:<sha256>`` (SET NX PX) lets the first of several concurrent identical
critiques run while the others wait for its envelope instead of calling the LLM too.

A hit becomes a verdict that the worker signs, so an entry is a record like a result: with
secrets (``CRITIQUE_SECRET``) it is stored signed together with the key it is filed under
(:func:`~pipeline.loop.critique_cache.seal_entry`), and a reader serves only an entry that
verifies and names its own key (:func:`~pipeline.loop.critique_cache.open_entry`). Anything else
(unsigned, altered, copied from another key, not JSON) is a miss, logged and counted
(``cache_refused``), and the critique that follows overwrites it. Without secrets
(development) entries are stored and read unsigned.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence

from pipeline.loop.critique_cache import CacheEntryRefused, open_entry, seal_entry
from pipeline.store import keys
from pipeline.store.redis_common import StoreClient, store_errors, text

log = logging.getLogger(__name__)


class RedisCritiqueCache:
    """:class:`~pipeline.store.base.CritiqueCache` on Redis, entries signed with ``secrets``
    (a callable, read at each use, as the run store's); ``on_refused(reason)`` is called for
    every entry read that is refused (the worker counts them)."""

    def __init__(
        self,
        client: StoreClient,
        *,
        prefix: str | None = None,
        secrets: Callable[[], Sequence[bytes]] | None = None,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._token = uuid.uuid4().hex
        self._secrets = secrets or (lambda: ())
        self._on_refused = on_refused

    def _key(self, suffix: str, key: str) -> str:
        return keys.shared_key(f"{suffix}:{key}", self._prefix)

    def get(self, key: str) -> str | None:
        with store_errors(self._client):
            raw = self._client.get(self._key(keys.CACHE, key))
        if raw is None:
            return None
        try:
            return open_entry(key, text(raw), self._secrets())
        except CacheEntryRefused as exc:
            log.warning("critique cache entry %s refused (a miss): %s", key[:16], exc)
            if self._on_refused is not None:
                self._on_refused(str(exc))
            return None

    def put(self, key: str, envelope_json: str, ttl_s: float) -> None:
        entry = seal_entry(key, envelope_json, self._secrets())
        with store_errors(self._client):
            self._client.set(self._key(keys.CACHE, key), entry, px=max(1, int(ttl_s * 1000)))

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
