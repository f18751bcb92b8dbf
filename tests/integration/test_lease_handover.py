"""The stages that spend under a budget lease hold it (pipeline.store.leases): the repair and
its re-critique ask for the lease as they start, so it is theirs while they run; a lease that
came back because its holder died is reserved afresh, waited for, or, when the budget refuses
it, the loop stops ``repair_budget_exhausted`` without spending. The Redis ledger (holders
have one implementation: the in-memory ledger of the broker-free loop records none, as
tests/unit/test_lease_handover.py pins), two holders on one budget (two worker processes),
one fake clock."""

from __future__ import annotations

import pytest
import redis

from pipeline.config import load_config
from pipeline.loop.stages import STAGES, BudgetWait, LoopState, StageContext, start
from pipeline.store.leases import LeaseHolder
from pipeline.store.redis import RedisBudgetLedger
from pipeline.wiring import make_context
from tests.support.revisers import estimating_revise
from tests.support.stores import PREFIX
from tests.support.submissions import make_sub

pytestmark = pytest.mark.integration

RUN = "r1"
DEAD_S = 20.0
TOTAL = 8_000
CAP = 1_200
"""The repair cap (TOTAL × 0.15): one repair round's reservation fits, two do not."""


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def budget(redis_client: redis.Redis, clock: Clock) -> RedisBudgetLedger:
    return RedisBudgetLedger(redis_client, prefix=PREFIX, clock=clock)


def process(budget: RedisBudgetLedger, name: str) -> StageContext:
    """A worker process: the stages' context on the shared budget, holder ``name``."""
    config = load_config(env={}, overrides={"enabled": True, "budget": {"total_tokens": TOTAL}})
    ledger = budget.with_holder(LeaseHolder(DEAD_S, name=name))
    return make_context(config, reviser=estimating_revise, budget=ledger)


def up_to_repair(ctx: StageContext, worker_id: str) -> LoopState:
    state = start(make_sub(RUN, worker_id, 1, "looping"), f"p-{worker_id}")
    while state.next != "repair":
        state = STAGES[state.next](state, ctx)
    assert state.lease_id is not None and state.lease_tokens > 0
    return state


def test_the_repair_and_its_re_critique_hold_the_lease_in_turn(
    budget: RedisBudgetLedger, clock: Clock
) -> None:
    """Decide on one process, repair on a second, re-critique on a third: the lease is each
    one's in turn, the reserver's death no longer matters once the repair holds it, and it is
    committed once at the end."""
    decide, repair, critic = process(budget, "d"), process(budget, "r"), process(budget, "c")
    state = up_to_repair(decide, "w1")
    lease = state.lease_id
    assert lease is not None
    assert budget.holders(RUN) == {lease: "d"}
    state = STAGES["repair"](state, repair)
    assert budget.holders(RUN) == {lease: "r"}
    clock.now += DEAD_S - 1  # the decide's process is long dead; the repair's beats
    assert repair.budget.beat(RUN, [lease]) == {lease: "kept"}
    clock.now += DEAD_S - 1
    state = STAGES["l0"](state, repair)
    state = STAGES["critic"](state, critic)
    assert state.lease_id is None and state.budget_charged > 0
    assert budget.holds(RUN) == {}
    assert budget.spent(RUN) == state.budget_charged


def test_a_redelivered_repair_whose_lease_came_back_waits_for_it_again(
    budget: RedisBudgetLedger, clock: Clock
) -> None:
    """The repair's holder died; its redelivered task finds the lease gone and another repair
    holding the tokens: it waits (BudgetWait), then holds it afresh once they settle."""
    victim, survivor = process(budget, "victim"), process(budget, "survivor")
    a = up_to_repair(victim, "wa")
    clock.now += DEAD_S + 1  # the victim was killed: nothing beats its lease
    assert budget.holds(RUN) == {}
    b = up_to_repair(survivor, "wb")  # the waiting repair was funded
    assert a.lease_tokens + b.lease_tokens > CAP >= a.lease_tokens
    with pytest.raises(BudgetWait):
        STAGES["repair"](a, survivor)
    b = STAGES["critic"](STAGES["l0"](STAGES["repair"](b, survivor), survivor), survivor)
    assert b.lease_id is None
    a = STAGES["repair"](a, survivor)
    assert a.next == "l0"
    assert budget.holders(RUN) == {a.lease_id: "survivor"}


def test_a_repair_whose_lease_came_back_and_no_longer_fits_stops_the_loop(
    budget: RedisBudgetLedger, clock: Clock
) -> None:
    """When the budget refuses the re-reservation for good (spent + asked passes the cap), the
    loop stops repair_budget_exhausted before any token is spent, with the reason noted."""
    victim, survivor = process(budget, "victim"), process(budget, "survivor")
    a = up_to_repair(victim, "wa")
    clock.now += DEAD_S + 1
    assert survivor.budget.ask(RUN, "other:1", 0, CAP, 900).granted
    survivor.budget.commit(RUN, "other:1", CAP - a.lease_tokens + 1)
    stopped = STAGES["repair"](a, survivor)
    assert (stopped.next, stopped.stop_reason, stopped.status) == (
        "done",
        "repair_budget_exhausted",
        "escalated",
    )
    assert stopped.lease_id is None and stopped.attempt == a.attempt
    assert any("came back when the worker holding it died" in n for n in stopped.notes)
    assert budget.holds(RUN) == {}


def test_a_forked_child_is_a_holder_of_its_own(budget: RedisBudgetLedger) -> None:
    """A prefork pool child gets a new holder id and beats nothing of its parent's (a child
    killed alone loses only its own leases; its parent's are not kept alive by its beats)."""
    import json
    import os

    from pipeline.store.leases import process_holder_id

    h = LeaseHolder(DEAD_S, beat_s=3600)
    ledger = budget.with_holder(h)
    try:
        assert ledger.ask(RUN, "parent:1", 10, CAP, 900).granted
        assert h.held() == {RUN: {"parent:1"}}
        assert h.id.split("/")[1] == str(os.getpid()) and h.id != process_holder_id()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once
            try:
                os.write(write, json.dumps([h.id, sorted(h.held())]).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as fh:
            child_id, child_held = json.loads(fh.read())
        os.waitpid(pid, 0)
    finally:
        h.stop()
    assert child_id != h.id and child_id.split("/")[1] == str(pid)
    assert child_held == []
    assert h.held() == {RUN: {"parent:1"}}
