"""Content-addressed blobs: large outputs and files travel as ``sha256:<hex>`` references.

Messages carry references, not megabytes. A blob's key is its content hash, so the
same bytes stored by two runs share one key (``<prefix>:blob:<hex>``, no run hash tag); every
``put`` (re)sets the blob's expiry to the store's TTL, so a blob lives as long as its last writer
needs it. ``get`` re-hashes what it reads, so a reference always yields the bytes it names.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

from pipeline.errors import ConfigError, PermanentError
from pipeline.store import keys

if TYPE_CHECKING:
    from pipeline.store.redis_common import StoreClient

REF_PREFIX = "sha256:"
_REF = re.compile(r"sha256:([0-9a-f]{64})")  # fullmatch: "$" would accept a trailing newline


class BlobMissingError(PermanentError, KeyError):
    """A blob reference names no stored bytes: malformed, never stored, or expired."""

    def __init__(self, ref: str, message: str | None = None) -> None:
        super().__init__(
            message or f"blob {ref!r} is missing or expired",
            hint="blobs expire with their run (CRITIQUE_RUN_TTL_S); resubmit the content",
        )
        self.ref = ref


class BlobCorruptError(BlobMissingError):
    """The bytes stored under a reference do not hash to it."""


def blob_ref(data: bytes) -> str:
    """The reference of ``data``: ``sha256:<hex digest>``."""
    return REF_PREFIX + hashlib.sha256(data).hexdigest()


def parse_ref(ref: str) -> str:
    """The hex digest inside ``ref``; raises ``BlobMissingError`` for a malformed reference."""
    match = _REF.fullmatch(ref)
    if match is None:
        raise BlobMissingError(ref, f"{ref!r} is not a blob reference (sha256:<64 hex digits>)")
    return match.group(1)


def verified(ref: str, data: bytes) -> bytes:
    """``data`` if it hashes to ``ref``, else raise ``BlobCorruptError``."""
    if blob_ref(data) != ref:
        raise BlobCorruptError(ref, f"blob {ref!r} failed its hash check ({len(data)} bytes)")
    return data


# KEYS[1] a blob. ARGV[1] TTL (ms). 0 when the blob is not there; else 1, its expiry pushed
# out to the TTL unless it already lives longer (or for good).
_EXTEND = """
local left = redis.call('PTTL', KEYS[1])
if left == -2 then return 0 end
if left >= 0 and left < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 1
"""


class RedisBlobStore:
    """Blobs as plain Redis strings under their content hash, with a TTL refreshed on ``put``.

    Needs a client with ``decode_responses=False`` (blobs are bytes).
    """

    def __init__(
        self, client: StoreClient, prefix: str | None = None, ttl_s: float | None = None
    ) -> None:
        # Imported here, not above: the reference functions serve the in-process stores,
        # which must import without redis installed (tests/unit/test_layering.py).
        # lazy: pipeline.store.redis_common loads redis, which importing pipeline.store.blobs does
        # not
        from pipeline.store.redis_common import (
            decodes_responses,
            resolve_prefix,
            resolve_ttl_ms,
            store_errors,
        )

        if decodes_responses(client):
            raise ConfigError(
                "RedisBlobStore needs a Redis client with decode_responses=False",
                hint="blobs are bytes; create a separate client for them",
            )
        self._client = client
        self._prefix = resolve_prefix(prefix)
        self._ttl_ms = resolve_ttl_ms(ttl_s)
        self._errors = store_errors
        self._extend = client.register_script(_EXTEND)

    def put(self, data: bytes, *, live: bool = False) -> str:
        """Store ``data`` (once per content) and return its reference; pushes its expiry out
        to the TTL (never in: the same bytes may be another writer's for longer). ``live``: a
        stage state only a live chain reads, kept ``CRITIQUE_LIVE_TTL_S`` (capped at the TTL)."""
        ref = blob_ref(data)
        key = keys.blob_key(parse_ref(ref), self._prefix)
        ttl_ms = min(self._ttl_ms, self._live_ttl_ms()) if live else self._ttl_ms
        with self._errors(self._client):
            # Refresh first: a blob already there costs one round trip and no upload.
            if not self._extend(keys=[key], args=[ttl_ms]):
                self._client.set(key, data, px=ttl_ms, nx=True)
        return ref

    def _live_ttl_ms(self) -> int:
        return max(1, keys.live_ttl_s() * 1000)

    def get(self, ref: str) -> bytes:
        """The bytes ``ref`` names; BlobMissingError if absent, BlobCorruptError if altered."""
        key = keys.blob_key(parse_ref(ref), self._prefix)
        with self._errors(self._client):
            data = self._client.get(key)
        if data is None:
            raise BlobMissingError(ref)
        if not isinstance(data, bytes):
            raise BlobCorruptError(ref, f"blob {ref!r} came back as text, not bytes")
        return verified(ref, data)
