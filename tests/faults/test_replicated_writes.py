"""Acknowledged writes a failover cannot drop (``CRITIQUE_STORE_REPLICAS``), with real
``redis-server`` processes: a master and one replica linked through a proxy; the proxy stops
passing the master's stream on (the replica lags), a result is written, the master is SIGKILLed
and the replica promoted, as a Sentinel would.
Without the setting the write is acknowledged and then gone; with it, the write is refused
(``StoreUnavailableError``: the task would retry it) until the replica holds it, so an
acknowledged result is always on the promoted replica."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pipeline import settings
from pipeline.errors import StoreUnavailableError
from pipeline.models import CritiqueResult
from pipeline.store.redis_common import replicas_required
from pipeline.store.runs import RedisRunStore
from tests.support import wait_until
from tests.support.replies import ReplyLoser, losing_replies
from tests.support.servers import RedisServer
from tests.support.submissions import accepted_result

pytestmark = pytest.mark.faults


def _result(run_id: str, pass_id: str) -> CritiqueResult:
    return accepted_result(run_id, output={"summary": "Sales rose 4% in Q3."}, pass_id=pass_id)


Pair = tuple[RedisServer, RedisServer, ReplyLoser]


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    """A master, its replica (in sync) linked through a proxy, all stopped afterwards."""
    master = RedisServer(tmp_path / "master", ["--repl-diskless-sync-delay", "0"]).start()
    with losing_replies(master.port) as link:
        replica = RedisServer(tmp_path / "replica", ["--replicaof", "127.0.0.1", str(link.port)])
        replica.start()
        try:
            wait_until(
                lambda: (
                    redis.Redis(port=replica.port).info("replication")["master_link_status"] == "up"
                ),
                20,
                what="the replica's link",
            )
            yield master, replica, link
        finally:
            replica.kill()  # its data is the test's alone: no shutdown to wait for
            master.kill()


def _write_while_the_replica_lags(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, wanted: str
) -> tuple[str, bool, float]:
    """Cut the replica's stream, write one result on the master (``wanted`` replicas), then kill
    the master and promote the replica. Returns the run id, whether the write was acknowledged,
    and how long it took."""
    master, replica, link = pair
    monkeypatch.setenv(settings.STORE_REPLICAS.name, wanted)
    monkeypatch.setenv(settings.STORE_REPLICA_WAIT_MS.name, "500")
    runs = RedisRunStore(redis.Redis(port=master.port))
    run_id = f"repl-{uuid.uuid4().hex[:8]}"
    runs.begin_pass(run_id, 1, "w1", "s1")
    wait_until(lambda: _in_sync(master, replica), 10, what="the replica to catch up")
    link.hold()
    began = time.monotonic()
    try:
        acknowledged = runs.put_result(_result(run_id, "s1"), pass_id="s1")
    except StoreUnavailableError as exc:
        assert settings.STORE_REPLICAS.name in str(exc) and "0 of the 1 replica" in str(exc)
        acknowledged = False
    took = time.monotonic() - began
    master.kill()
    redis.Redis(port=replica.port).execute_command("REPLICAOF", "NO", "ONE")
    return run_id, acknowledged, took


def _in_sync(master: RedisServer, replica: RedisServer) -> bool:
    offset = redis.Redis(port=master.port).info("replication")["master_repl_offset"]
    return bool(redis.Redis(port=replica.port).info("replication")["slave_repl_offset"] >= offset)


def test_without_replicas_required_an_acknowledged_result_is_lost_in_a_failover(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: the write is acknowledged at once, and the promoted replica never had it."""
    run_id, acknowledged, _ = _write_while_the_replica_lags(pair, monkeypatch, "0")
    assert acknowledged
    assert RedisRunStore(redis.Redis(port=pair[1].port)).result(run_id, 1, "w1") is None


def test_with_a_replica_required_an_unreplicated_result_is_never_acknowledged(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``CRITIQUE_STORE_REPLICAS=1`` the write to a master whose replica lags is refused
    after the wait (so the task retries it on the promoted master), never acknowledged and then
    lost; the retried write on the promoted master is acknowledged and read back."""
    run_id, acknowledged, took = _write_while_the_replica_lags(pair, monkeypatch, "1")
    assert not acknowledged and 0.5 <= took < 3
    promoted = RedisRunStore(redis.Redis(port=pair[1].port))
    assert promoted.result(run_id, 1, "w1") is None  # lost, but never acknowledged: retried
    promoted.begin_pass(run_id, 1, "w1", "s1")  # the retried task, on the promoted master
    monkeypatch.setenv(settings.STORE_REPLICAS.name, "0")  # it has no replica of its own any more
    assert promoted.put_result(_result(run_id, "s1"), pass_id="s1")
    assert promoted.result(run_id, 1, "w1") == _result(run_id, "s1")


def test_a_write_in_sync_is_acknowledged_and_on_the_replica(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas in sync: the write returns once the replica has it (readable there at once)."""
    master, replica, _ = pair
    monkeypatch.setenv(settings.STORE_REPLICAS.name, "1")
    runs = RedisRunStore(redis.Redis(port=master.port))
    run_id = f"repl-{uuid.uuid4().hex[:8]}"
    runs.begin_pass(run_id, 1, "w1", "s1")
    assert runs.put_result(_result(run_id, "s1"), pass_id="s1")
    on_replica = RedisRunStore(redis.Redis(port=replica.port)).result(run_id, 1, "w1")
    assert on_replica == _result(run_id, "s1")


def test_the_settings_are_whole_numbers_named_when_wrong() -> None:
    """Defaults 0 replicas and 2000 ms; a bad value is a ConfigError naming the variable."""
    from pipeline.errors import ConfigError

    assert replicas_required({}) == (0, 2000)
    assert replicas_required(
        {settings.STORE_REPLICAS.name: "2", settings.STORE_REPLICA_WAIT_MS.name: "250"}
    ) == (2, 250)
    for env in (
        {settings.STORE_REPLICAS.name: "-1"},
        {settings.STORE_REPLICAS.name: "one"},
        {settings.STORE_REPLICA_WAIT_MS.name: "0"},
    ):
        with pytest.raises(ConfigError, match=next(iter(env))):
            replicas_required(env)
