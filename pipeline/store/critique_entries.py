"""The critique cache in Redis: envelopes by content key, shared by every worker.

``<prefix>:cache:critique:<sha256>`` holds an entry with the configured TTL;
``<prefix>:cache:claim:<sha256>`` (SET NX PX) lets the first of several concurrent identical
critiques run while the others wait for its envelope instead of calling the LLM too.

A hit becomes a verdict that the worker signs, so an entry is a record like a result: with
secrets (``CRITIQUE_SECRET``) it is stored signed together with the key it is filed under
(:func:`seal_entry`: signed under :data:`CACHE_KIND`), and a reader serves only an entry that
verifies and names its own key (:func:`open_entry`). Anything else
(unsigned, altered, copied from another key, not JSON) is a miss, logged and counted
(``cache_refused``), and the critique that follows overwrites it. Without secrets
(development) entries are stored and read unsigned.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence

from pipeline.errors import ForgedMessageError
from pipeline.security import signing
from pipeline.store import keys
from pipeline.store.redis_common import StoreClient, store_errors, text

log = logging.getLogger(__name__)

CACHE_KIND = "critique-cache"
"""The record kind a cache entry is signed as: it never verifies as a result or a message."""


class CacheEntryRefused(Exception):
    """A stored cache entry that cannot be trusted (the reason never quotes it)."""


def seal_entry(key: str, envelope_json: str, secrets: Sequence[bytes]) -> str:
    """The stored form of ``envelope_json`` under ``key``: both in one JSON object, signed as
    :data:`CACHE_KIND` with the first of ``secrets`` (unsigned without)."""
    record = {"key": key, "envelope": envelope_json}
    return json.dumps(signing.sign_record(CACHE_KIND, record, secrets), ensure_ascii=False)


def open_entry(key: str, raw: str, secrets: Sequence[bytes]) -> str:
    """The envelope JSON of a stored entry read under ``key``; ``CacheEntryRefused`` when it is
    not a sealed entry, does not verify under ``secrets`` (when there are any) or was sealed
    under another key (a valid entry copied onto this one)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("envelope"), str):
        raise CacheEntryRefused("not a critique-cache entry")
    if secrets:
        try:
            signing.verify_record(CACHE_KIND, doc, secrets)
        except ForgedMessageError as exc:
            raise CacheEntryRefused(exc.message) from None
    if doc.get("key") != key:
        raise CacheEntryRefused("an entry sealed under another key")
    envelope: str = doc["envelope"]
    return envelope


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
