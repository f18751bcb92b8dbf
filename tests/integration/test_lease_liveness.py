"""A budget lease belongs to a live holder (pipeline.store.leases): the rules of holders, beats
and liveness deadlines, on the Lua script on a real Redis (their one implementation: the
in-memory ledger of the broker-free loop records no holders) with a fake clock; and the beating
thread itself, on the real clocks."""

from __future__ import annotations

import time

import pytest

from pipeline.store.base import BudgetLedger
from pipeline.store.leases import LeaseHolder
from pipeline.store.redis import RedisBudgetLedger
from tests.support.stores import PREFIX, FakeClock

pytestmark = pytest.mark.integration

DEAD_S = 20.0
TTL_S = 900.0
CAP = 100
RUN = "run-live"


def holder(name: str) -> LeaseHolder:
    """A holder with a fixed id that nothing beats unless the test does (no thread)."""
    return LeaseHolder(DEAD_S, name=name)


@pytest.fixture
def base(redis_client: object, clock: FakeClock) -> RedisBudgetLedger:
    """A ledger without a holder; ``.with_holder(h)`` is process ``h`` on the same budget."""
    return RedisBudgetLedger(redis_client, prefix=PREFIX, clock=clock)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def on(base: BudgetLedger, name: str) -> BudgetLedger:
    return base.with_holder(holder(name))  # type: ignore[attr-defined]


def test_a_dead_holders_lease_is_released_after_its_window(
    base: BudgetLedger, clock: FakeClock
) -> None:
    """A holder that stops beating (killed) holds nothing DEAD_S after its grant, long before
    its TTL: a repair waiting for those tokens is granted; the dead holder's late commit still
    charges what it really spent."""
    a, b = on(base, "host/1/dead"), on(base, "host/2/live")
    assert a.ask(RUN, "a:1", 60, CAP, TTL_S).granted
    assert b.ask(RUN, "b:1", 60, CAP, TTL_S, wait_s=60).verdict == "wait"
    clock.advance(DEAD_S - 1)
    assert b.ask(RUN, "b:1", 60, CAP, TTL_S, wait_s=60).verdict == "wait"
    assert b.holds(RUN) == {"a:1": 60}  # type: ignore[attr-defined]
    clock.advance(2)
    assert b.snapshot(RUN).held == 0  # every reader sees it released at once
    assert b.ask(RUN, "b:1", 60, CAP, TTL_S, wait_s=60).granted
    assert b.holders(RUN) == {"b:1": "host/2/live"}  # type: ignore[attr-defined]
    assert a.beat(RUN, ["a:1"]) == {"a:1": "lapsed"}
    assert a.commit(RUN, "a:1", 55) == 55  # the tokens were spent: recorded all the same
    assert b.commit(RUN, "b:1", 40) == 40
    assert b.spent(RUN) == 95


def test_a_beating_slow_holder_keeps_its_lease(base: BudgetLedger, clock: FakeClock) -> None:
    """A holder whose task runs long but whose process beats keeps its lease well past the
    liveness window, until it settles."""
    a, b = on(base, "host/1/slow"), on(base, "host/2/waiter")
    assert a.ask(RUN, "a:1", 60, CAP, TTL_S).granted
    for _ in range(6):  # 90 s of beats every 15 s
        clock.advance(15)
        assert a.beat(RUN, ["a:1"]) == {"a:1": "kept"}
        assert b.ask(RUN, "b:1", 60, CAP, TTL_S, wait_s=300).verdict == "wait"
    assert b.snapshot(RUN).held == 60
    assert a.commit(RUN, "a:1", 50) == 50
    assert b.ask(RUN, "b:1", 50, CAP, TTL_S, wait_s=300).granted


def test_a_lapsed_lease_is_never_revived(base: BudgetLedger, clock: FakeClock) -> None:
    """A beat after the deadline gets nothing back (its tokens may be another's by then): the
    budget never holds past the cap."""
    a, b = on(base, "host/1/stalled"), on(base, "host/2/other")
    assert a.ask(RUN, "a:1", 60, CAP, TTL_S).granted
    clock.advance(DEAD_S + 1)
    assert a.beat(RUN, ["a:1"]) == {"a:1": "lapsed"}
    assert b.ask(RUN, "b:1", 60, CAP, TTL_S).granted
    assert a.beat(RUN, ["a:1"]) == {"a:1": "lapsed"}
    assert b.holds(RUN) == {"b:1": 60}  # type: ignore[attr-defined]
    assert b.snapshot(RUN).held == 60


def test_a_restarted_nodes_old_leases_come_back(base: BudgetLedger, clock: FakeClock) -> None:
    """A worker restarted under the same node name (even the same pid) is a new incarnation:
    its beats never keep its predecessor's leases, which come back after the window."""
    old, new = on(base, "node1/100/0a0a0a0a"), on(base, "node1/100/0b0b0b0b")
    waiter = on(base, "node2/7/0c0c0c0c")
    assert old.ask(RUN, "a:1", 60, CAP, TTL_S).granted
    clock.advance(10)
    assert new.ask(RUN, "n:1", 30, CAP, TTL_S).granted
    assert new.beat(RUN, ["a:1", "n:1"]) == {"a:1": "gone", "n:1": "kept"}
    clock.advance(DEAD_S - 5)  # 25 s after the old incarnation's grant, 15 s after the new's
    assert waiter.holds(RUN) == {"n:1": 30}  # type: ignore[attr-defined]
    assert waiter.ask(RUN, "w:1", 60, CAP, TTL_S).granted


def test_a_live_lease_asked_again_is_handed_over(base: BudgetLedger, clock: FakeClock) -> None:
    """The stage that spends under a lease asks for it as it starts: it holds it from then (its
    beats keep it, the reserver's no longer do), and nothing more is held; when it dies, the
    lease comes back though the reserver still lives."""
    decide, repair = on(base, "host/1/decide"), on(base, "host/2/repair")
    assert decide.ask(RUN, "p:1", 60, CAP, TTL_S).granted
    clock.advance(5)
    assert repair.ask(RUN, "p:1", 60, CAP, TTL_S).granted
    assert repair.holders(RUN) == {"p:1": "host/2/repair"}  # type: ignore[attr-defined]
    assert repair.snapshot(RUN).held == 60
    assert decide.beat(RUN, ["p:1"]) == {"p:1": "gone"}
    clock.advance(15)
    assert repair.beat(RUN, ["p:1"]) == {"p:1": "kept"}
    clock.advance(15)
    assert repair.snapshot(RUN).held == 60
    clock.advance(DEAD_S)  # the repair's process died; the reserver beats on, to no effect
    assert decide.beat(RUN, ["p:1"]) == {"p:1": "gone"}
    assert repair.snapshot(RUN).held == 0


def test_repeats_are_answered_from_the_record(base: BudgetLedger, clock: FakeClock) -> None:
    """Idempotence holds with holders: a repeated reserve of a live lease holds nothing new; a
    released lease asked again (its work redelivered) is reserved afresh against the cap; a
    repeated commit charges nothing more; a refund or beat of a settled lease does nothing."""
    a, b = on(base, "host/1/a"), on(base, "host/2/b")
    assert a.ask(RUN, "a:1", 60, CAP, TTL_S).granted
    assert a.ask(RUN, "a:1", 60, CAP, TTL_S).granted
    assert a.snapshot(RUN).held == 60
    clock.advance(DEAD_S + 1)
    assert b.ask(RUN, "b:1", 50, CAP, TTL_S).granted
    # The dead holder's task, redelivered to b: its lease is reserved afresh, so it must fit.
    assert b.ask(RUN, "a:1", 60, CAP, TTL_S).verdict == "refused"
    assert b.ask(RUN, "a:1", 50, CAP, TTL_S).granted
    assert b.holds(RUN) == {"a:1": 50, "b:1": 50}  # type: ignore[attr-defined]
    assert b.commit(RUN, "a:1", 45) == 45
    assert b.commit(RUN, "a:1", 99) == 45
    b.refund(RUN, "a:1")
    assert b.beat(RUN, ["a:1"]) == {"a:1": "gone"}
    assert b.ask(RUN, "a:1", 60, CAP, TTL_S).granted  # committed: granted, nothing held
    assert b.snapshot(RUN).held == 50
    assert b.spent(RUN) == 45


def test_a_parked_lease_is_no_process_and_lives_to_its_ttl(
    base: BudgetLedger, clock: FakeClock
) -> None:
    """A repair handed to the manager's worker is parked: no process beats it, and only its
    TTL ends it; a process that asks for it then holds it again."""
    a = on(base, "host/1/a")
    assert a.ask(RUN, "a:1", 60, CAP, 300).granted
    assert a.park(RUN, "a:1") is True
    assert a.holders(RUN) == {"a:1": ""}  # type: ignore[attr-defined]
    assert a.beat(RUN, ["a:1"]) == {"a:1": "gone"}
    clock.advance(200)
    assert a.snapshot(RUN).held == 60
    resume = on(base, "host/3/resume")
    assert resume.ask(RUN, "a:1", 60, CAP, 300).granted
    assert resume.holders(RUN) == {"a:1": "host/3/resume"}  # type: ignore[attr-defined]
    clock.advance(DEAD_S + 1)
    assert a.snapshot(RUN).held == 0
    assert a.park(RUN, "a:1") is False


def test_without_a_holder_only_the_ttl_ends_a_lease(base: BudgetLedger, clock: FakeClock) -> None:
    """A ledger with no holder (the broker-free runner) records none: TTL semantics as before,
    and asking for a holder's live lease does not take it away from that holder."""
    assert base.ask(RUN, "x:1", 40, CAP, 100).granted
    clock.advance(99)
    assert base.snapshot(RUN).held == 40
    clock.advance(2)
    assert base.snapshot(RUN).held == 0
    a = on(base, "host/1/a")
    assert a.ask(RUN, "a:1", 40, CAP, TTL_S).granted
    assert base.ask(RUN, "a:1", 40, CAP, TTL_S).granted
    assert a.holders(RUN) == {"a:1": "host/1/a"}  # type: ignore[attr-defined]


def test_records_without_a_holder_still_parse(redis_client: object, clock: FakeClock) -> None:
    """A record written before holders existed ("tokens:expires:state:charge") is still read:
    its lease lives to its TTL, is granted again as live, and its commit charges once; a new
    record keeps the state third, the holder last."""
    import redis as redis_lib

    from pipeline.store import keys

    assert isinstance(redis_client, redis_lib.Redis)
    ledger = RedisBudgetLedger(redis_client, prefix=PREFIX, clock=clock)
    now_us = int(clock() * 1_000_000)
    expires = now_us + 100_000_000
    leases = keys.run_key(RUN, keys.BUDGET_LEASES, PREFIX)
    redis_client.hset(leases, "old:1", f"30:{expires}:0:0")
    redis_client.zadd(keys.run_key(RUN, keys.BUDGET_LIVE, PREFIX), {"old:1": expires})
    a = ledger.with_holder(holder("host/1/a"))
    assert a.snapshot(RUN).held == 30
    assert a.ask(RUN, "old:1", 30, CAP, TTL_S).granted  # live: handed over to a
    assert a.ask(RUN, "new:1", 20, CAP, TTL_S).granted
    assert a.commit(RUN, "old:1", 25) == 25 == a.commit(RUN, "old:1", 1)
    record = redis_client.hget(leases, "new:1")
    assert record is not None
    assert record.decode().split(":")[2] == "0"
    assert record.decode().endswith(":host/1/a")


def test_the_holders_thread_beats_until_it_stops(request: pytest.FixtureRequest) -> None:
    """On the real clock (Redis TIME): a holder's own thread keeps
    its lease alive for many windows while the task thread does nothing; once it stops (the
    process died) the lease is released within one window; a settled lease is no longer
    beaten."""
    h = LeaseHolder(0.6, beat_s=0.1, name="host/1/redis")
    plain = RedisBudgetLedger(request.getfixturevalue("redis_client"), prefix=PREFIX)
    ledger = plain.with_holder(h)
    try:
        assert ledger.ask(RUN, "slow:1", 60, CAP, TTL_S).granted
        assert ledger.ask(RUN, "done:1", 10, CAP, TTL_S).granted
        ledger.commit(RUN, "done:1", 10)
        time.sleep(1.5)  # 2.5 windows
        assert ledger.holds(RUN) == {"slow:1": 60}
        assert h.held() == {RUN: {"slow:1"}}
    finally:
        h.stop()
    began = time.monotonic()
    while ledger.holds(RUN) and time.monotonic() - began < 5:
        time.sleep(0.05)
    took = time.monotonic() - began
    assert ledger.holds(RUN) == {}
    assert took <= 0.6 + 0.3, f"released {took:.2f} s after its holder stopped"
