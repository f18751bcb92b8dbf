"""The broker-free loop's ledger records no holders, so its stages ask for a lease no more
than the decide stage's reservation. The handover between holders (worker processes) is the
Redis ledger's, pinned in tests/integration/test_lease_handover.py."""

from __future__ import annotations

from pipeline.config import load_config
from pipeline.loop.stages import STAGES, LoopState, StageContext, start
from pipeline.store.memory import MemoryBudgetLedger
from pipeline.wiring import make_context
from tests.support.revisers import estimating_revise
from tests.support.submissions import make_sub

RUN = "r1"
TOTAL = 8_000


def up_to_repair(ctx: StageContext, worker_id: str) -> LoopState:
    state = start(make_sub(RUN, worker_id, 1, "looping"), f"p-{worker_id}")
    while state.next != "repair":
        state = STAGES[state.next](state, ctx)
    assert state.lease_id is not None and state.lease_tokens > 0
    return state


def test_without_holders_the_stages_do_not_ask_again() -> None:
    """The broker-free runner's ledger records no holders: the stages ask nothing more than
    the decide's reservation."""
    config = load_config(env={}, overrides={"enabled": True, "budget": {"total_tokens": TOTAL}})
    ledger = MemoryBudgetLedger()
    asked: list[str] = []
    real_ask = ledger.ask

    def ask(*args: object, **kwargs: object) -> object:
        asked.append(str(args[1]))
        return real_ask(*args, **kwargs)  # type: ignore[arg-type]

    ledger.ask = ask  # type: ignore[method-assign]
    ctx = make_context(config, reviser=estimating_revise, budget=ledger)
    state = up_to_repair(ctx, "w1")
    STAGES["critic"](STAGES["l0"](STAGES["repair"](state, ctx), ctx), ctx)
    assert asked == [state.lease_id]
