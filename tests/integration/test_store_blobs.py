"""Content-addressed blobs in Redis: shared keys, TTLs and hash verification."""

from __future__ import annotations

import pytest
import redis

from pipeline import settings
from pipeline.errors import ConfigError
from pipeline.store import keys
from pipeline.store.blobs import (
    BlobCorruptError,
    BlobMissingError,
    RedisBlobStore,
)
from tests.support import wait_until

pytestmark = pytest.mark.integration

PREFIX = "critique-test"
TTL_S = 3600


@pytest.fixture
def store(redis_client: redis.Redis) -> RedisBlobStore:
    return RedisBlobStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)


def key_of(ref: str) -> str:
    return keys.blob_key(ref.removeprefix("sha256:"), PREFIX)


def test_blob_key_is_shared_across_runs(store: RedisBlobStore, redis_client: redis.Redis) -> None:
    """A blob lives at <prefix>:blob:<sha256>, outside any run's hash tag, with the store TTL."""
    ref = store.put(b"payload")
    assert redis_client.get(key_of(ref)) == b"payload"
    assert 0 < redis_client.pttl(key_of(ref)) <= TTL_S * 1000


def test_put_refreshes_an_existing_blobs_ttl(
    store: RedisBlobStore, redis_client: redis.Redis
) -> None:
    """Storing bytes that are already there pushes their expiry back to the full TTL."""
    ref = store.put(b"payload")
    redis_client.pexpire(key_of(ref), 2_000)
    assert store.put(b"payload") == ref
    assert redis_client.pttl(key_of(ref)) > 2_000


def test_tampered_blob_fails_its_hash_check(
    store: RedisBlobStore, redis_client: redis.Redis
) -> None:
    """Bytes under a ref that do not hash to it raise BlobCorruptError, never come back."""
    ref = store.put(b"the real content")
    redis_client.set(key_of(ref), b"something else")
    with pytest.raises(BlobCorruptError) as err:
        store.get(ref)
    assert isinstance(err.value, BlobMissingError)
    assert err.value.ref == ref


def test_expired_blob_is_missing(store: RedisBlobStore, redis_client: redis.Redis) -> None:
    """Once a blob's TTL has passed, get raises BlobMissingError with a hint about the TTL."""
    ref = store.put(b"short-lived")
    redis_client.pexpire(key_of(ref), 1)
    wait_until(lambda: not redis_client.exists(key_of(ref)), 10, what="the blob to expire")
    with pytest.raises(BlobMissingError) as err:
        store.get(ref)
    assert err.value.hint is not None and settings.RUN_TTL_S.name in err.value.hint


def test_blob_store_requires_a_bytes_client(redis_text_client: redis.Redis) -> None:
    """A decode_responses=True client would mangle binary blobs, so it is refused up front."""
    with pytest.raises(ConfigError):
        RedisBlobStore(redis_text_client, prefix=PREFIX, ttl_s=TTL_S)
