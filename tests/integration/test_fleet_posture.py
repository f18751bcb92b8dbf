"""The fleet's posture in a real Redis (pipeline.store.fleet): one field per worker, stale ones
dropped, the hash kept as long as its freshest record, malformed records ignored."""

from __future__ import annotations

import time

import pytest
import redis

from pipeline.security.posture import WorkerPosture, posture_of
from pipeline.store import keys
from pipeline.store.fleet import RedisFleetPosture

pytestmark = pytest.mark.integration

PREFIX = "critique-test"
KEY = keys.shared_key(keys.FLEET_POSTURE, PREFIX)
SECRET = b"s" * 32


def _posture(worker: str, seen: float, fresh_s: float = 60.0) -> WorkerPosture:
    return posture_of(worker, (SECRET,), (), now=seen, fresh_s=fresh_s)


def test_each_worker_publishes_its_own_field_and_readers_get_the_current_ones(
    redis_client: redis.Redis,
) -> None:
    """Two workers' records read back as written, ordered by worker; the key is under the
    prefix, as ``<prefix>:fleet:posture``."""
    fleet = RedisFleetPosture(redis_client, prefix=PREFIX)
    now = time.time()
    fleet.publish(_posture("w2@host", now))
    fleet.publish(_posture("w1@host", now))
    assert redis_client.exists(f"{PREFIX}:fleet:posture")
    assert [p.worker for p in fleet.read(now)] == ["w1@host", "w2@host"]
    assert fleet.read(now)[0] == _posture("w1@host", now)


def test_a_publish_drops_workers_gone_quiet_and_keeps_the_hash_as_long_as_the_freshest(
    redis_client: redis.Redis,
) -> None:
    """A record past its freshness is deleted at the next publish (so autoscaled workers'
    names do not pile up); the hash's TTL covers the longest-lived current record."""
    fleet = RedisFleetPosture(redis_client, prefix=PREFIX)
    now = time.time()
    fleet.publish(_posture("gone@host", now - 120))
    fleet.publish(_posture("slow@host", now, fresh_s=600))
    fleet.publish(_posture("w1@host", now))
    assert sorted(redis_client.hkeys(KEY)) == [b"slow@host", b"w1@host"]
    assert 590_000 < redis_client.pttl(KEY) <= 600_000
    assert [p.worker for p in fleet.read(now + 300)] == ["slow@host"]


def test_a_malformed_record_is_ignored_by_readers_and_dropped_by_the_next_publish(
    redis_client: redis.Redis,
) -> None:
    """Garbage in the hash (another writer) never breaks a reader and goes at the next
    publish."""
    fleet = RedisFleetPosture(redis_client, prefix=PREFIX)
    redis_client.hset(KEY, mapping={"junk": "not json", "list": "[1]"})
    now = time.time()
    assert fleet.read(now) == []
    fleet.publish(_posture("w1@host", now))
    assert redis_client.hkeys(KEY) == [b"w1@host"]


def test_a_stopping_worker_withdraws_its_record(redis_client: redis.Redis) -> None:
    """A worker that stops removes its own field, leaving the others'."""
    fleet = RedisFleetPosture(redis_client, prefix=PREFIX)
    now = time.time()
    fleet.publish(_posture("w1@host", now))
    fleet.publish(_posture("w2@host", now))
    fleet.withdraw("w1@host")
    assert [p.worker for p in fleet.read(now)] == ["w2@host"]


def test_a_clients_clean_check_stands_a_second_for_the_same_secrets(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CritiqueClient.check_fleet reads the posture once per POSTURE_CHECK_S while it finds
    nothing to refuse and its secrets stay the same: a worker that starts requiring a secret
    is seen at the next read; a change of this process's secrets reads again at once."""
    from pipeline.errors import ConfigError
    from tests.support.workers import client_on, worker_db_url
    from workers import client as client_module
    from workers.client import CritiqueClient

    with client_on(worker_db_url(redis_url)) as env:
        monkeypatch.delenv("CRITIQUE_SECRET", raising=False)
        client = CritiqueClient()
        client.check_fleet()  # no posture yet: nothing to refuse
        fleet = RedisFleetPosture(redis.Redis.from_url(env["REDIS_URL"]))
        fleet.publish(posture_of("w@host", (SECRET,), (), now=time.time(), fresh_s=60.0))
        client.check_fleet()  # within the second: the clean check stands
        monkeypatch.setenv("CRITIQUE_SECRET", "x" * 64)  # other secrets: read again
        with pytest.raises(ConfigError):
            client.check_fleet()
        monkeypatch.delenv("CRITIQUE_SECRET")
        monkeypatch.setattr(client_module, "POSTURE_CHECK_S", 0.0)
        with pytest.raises(ConfigError, match="CRITIQUE_SECRET"):
            client.check_fleet()
