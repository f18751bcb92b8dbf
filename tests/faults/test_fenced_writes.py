"""A task's acknowledged writes follow a master switch (``fenced_writes``), with two real
``redis-server`` processes standing for the old and the new master: a task body writes a pattern
count on the old one, its connection pool then learns of a switch (as a Sentinel-managed
connection does) and the rest goes to the new one; at the body's end the journaled writes are
applied again there, each idempotent, so the new master holds every count once."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pipeline.models import ReusablePattern
from pipeline.store.redis import RedisPatternStore
from pipeline.store.redis_common import _note_master, fenced_writes, master_switches
from tests.support.servers import RedisServer

pytestmark = pytest.mark.faults

LOOP = ReusablePattern(category="loop", description="a copy", prevention_rule="write it once")
GAP = ReusablePattern(category="gap", description="no findings", prevention_rule="add findings")


class Masters:
    """A client whose pool points at ``old`` until :meth:`switch` points it at ``new`` and
    notes the new address, as :class:`FailoverConnection` does on its reconnect."""

    def __init__(self, old: RedisServer, new: RedisServer) -> None:
        self.old, self.new = old, new
        self.pool = redis.ConnectionPool(host="127.0.0.1", port=old.port)
        _note_master(self.pool, ("127.0.0.1", old.port), 1.0)
        self.store = RedisPatternStore(redis.Redis(connection_pool=self.pool))

    def switch(self) -> None:
        self.pool.disconnect()
        self.pool.connection_kwargs["port"] = self.new.port
        self.pool.reset()  # its connections are made anew, to the new port
        _note_master(self.pool, ("127.0.0.1", self.new.port), 1.0)

    def counts(self, server: RedisServer, run_id: str) -> dict[str, int]:
        store = RedisPatternStore(redis.Redis(port=server.port))
        return {p.category: p.frequency for p in store.top(run_id, 100)}


@pytest.fixture
def masters(tmp_path: Path) -> Iterator[Masters]:
    old = RedisServer(tmp_path / "old").start()
    new = RedisServer(tmp_path / "new").start()
    try:
        yield Masters(old, new)
    finally:
        old.kill()
        new.kill()


def test_a_switch_is_counted_only_when_the_address_changes() -> None:
    """The first address a pool learns, the same one again and "none known" are no switch."""
    pool = redis.ConnectionPool(port=1)
    before = master_switches()
    _note_master(pool, ("10.0.0.1", 6379), 1.0)
    _note_master(pool, ("10.0.0.1", 6379), 1.0)
    _note_master(pool, None, 1.0)
    assert master_switches() == before
    _note_master(pool, ("10.0.0.2", 6379), 1.0)
    assert master_switches() == before + 1
    assert pool._critique_master[2] == before + 1  # type: ignore[attr-defined]


def test_writes_before_a_switch_are_applied_again_on_the_new_master(masters: Masters) -> None:
    """One count on the old master, a switch, one on the new: at the end the new master holds
    both once, and the old one is as the body left it."""
    run_id = f"fence-{uuid.uuid4().hex[:8]}"
    with fenced_writes():
        masters.store.record(run_id, "c1", 1, [LOOP], pass_key="p1")
        masters.switch()
        masters.store.record(run_id, "c2", 1, [LOOP, GAP], pass_key="p2")
    assert masters.counts(masters.new, run_id) == {"loop": 2, "gap": 1}
    assert masters.counts(masters.old, run_id) == {"loop": 1}


def test_without_a_switch_nothing_is_written_twice(masters: Masters) -> None:
    """No switch during the body: its writes are not sent again (the server saw each once)."""
    run_id = f"fence-{uuid.uuid4().hex[:8]}"
    server = redis.Redis(port=masters.old.port)
    with fenced_writes():
        masters.store.record(run_id, "c1", 1, [LOOP], pass_key="p1")
        calls = server.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert server.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0) == calls
    assert masters.counts(masters.old, run_id) == {"loop": 1}


def test_a_body_that_raises_has_nothing_applied_again(masters: Masters) -> None:
    """A task that fails is retried whole: its fence applies nothing on the new master."""
    run_id = f"fence-{uuid.uuid4().hex[:8]}"
    with pytest.raises(RuntimeError), fenced_writes():
        masters.store.record(run_id, "c1", 1, [LOOP], pass_key="p1")
        masters.switch()
        raise RuntimeError("the stage failed")
    assert masters.counts(masters.new, run_id) == {}


def test_a_nested_fence_leaves_the_replay_to_the_outer_one(masters: Masters) -> None:
    """A fence inside a fence (a task calling another in-process) journals into the outer one,
    which applies everything once."""
    run_id = f"fence-{uuid.uuid4().hex[:8]}"
    with fenced_writes():
        with fenced_writes():
            masters.store.record(run_id, "c1", 1, [LOOP], pass_key="p1")
        masters.switch()
    assert masters.counts(masters.new, run_id) == {"loop": 1}
