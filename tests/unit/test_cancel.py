"""Cancel, its pure parts: a cancelled pass stops before its next critic or repair call
(``StageContext.cancelled`` → ``PassCancelled``) with its budget hold settled; token-free
calls ask nothing; the lease prefix a cancel refunds is the one every lease of the pass is
named from; who cancelled is one bounded line; the CLI knows the command."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.config import CritiqueConfig
from pipeline.critics.base import RevisionResult
from pipeline.loop.stages import (
    PassCancelled,
    critic_stage,
    decide_stage,
    lease_for,
    pass_lease_prefix,
    repair_stage,
    run_submission,
    start,
)
from pipeline.store.base import BudgetSnapshot
from pipeline.wiring import make_context
from tests.support.providers import budget_sub, never_similar, no_l0
from tests.unit.test_passes_budget import CountingReviser
from tests.unit.test_runner import SpendingCritic
from workers.cancelling import BY_CHARS, CancelReport, who
from workers.cli import COMMANDS, build_parser


class Asked:
    """A ``cancelled`` callable that says yes from the ``after``-th question on, counting
    the questions."""

    def __init__(self, after: int = 1) -> None:
        self.after = after
        self.asked = 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked >= self.after


def _ctx(**kw: Any) -> Any:
    config = CritiqueConfig(
        enabled=True, critic="heuristic", max_repair_attempts=1, budget={"total_tokens": 10**6}
    )
    return make_context(config, reviser=CountingReviser(), l0=no_l0, fixpoint=never_similar, **kw)


def test_a_cancelled_pass_never_calls_a_token_spending_critic() -> None:
    """critic_stage asks before the LLM critic's call and raises PassCancelled: no call made."""
    critic = SpendingCritic()
    ctx = _ctx(critic=critic)
    ctx.cancelled = Asked()
    with pytest.raises(PassCancelled):
        critic_stage(start(budget_sub(), "p1"), ctx)
    assert critic.rounds == [] and ctx.cancelled.asked == 1


def test_a_token_free_critic_and_reviser_ask_nothing() -> None:
    """Heuristic critique and a token-free repair spend nothing: no lookup is made for them
    (a worker's lookup is a Redis round trip), and the loop runs to its verdict."""
    ctx = make_context(CritiqueConfig(enabled=True, critic="heuristic"), l0=no_l0)
    ctx.cancelled = Asked()
    result = run_submission(budget_sub(), ctx, pass_id="p1")
    assert result.status != "cancelled" and ctx.cancelled.asked == 0


def test_a_cancelled_repair_stops_before_the_reviser_and_refunds_its_lease() -> None:
    """repair_stage asks before the reviser's call: PassCancelled, the reviser never ran, and
    the lease the decide stage reserved holds nothing any more (refunded, not charged)."""
    calls: list[int] = []

    class Recording(CountingReviser):
        def revise(self, *args: Any, **kwargs: Any) -> RevisionResult:
            calls.append(1)
            return super().revise(*args, **kwargs)

    ctx = _ctx()
    ctx.reviser = Recording()
    state = decide_stage(critic_stage(start(budget_sub(), "p1"), ctx), ctx)
    assert state.lease_id == "w1:1:p1:1" and ctx.budget.snapshot("run-1").holders == 1
    ctx.cancelled = Asked()
    with pytest.raises(PassCancelled):
        repair_stage(state, ctx)
    assert calls == []
    assert ctx.budget.snapshot("run-1") == BudgetSnapshot()


def test_a_re_critique_cancelled_after_its_repair_charges_what_the_repair_spent() -> None:
    """Cancelled between the repair and its re-critique: the critic is not called, the
    repair's real spend is committed (tokens spent are never lost) and nothing stays held."""
    ctx = _ctx()
    state = repair_stage(decide_stage(critic_stage(start(budget_sub(), "p1"), ctx), ctx), ctx)
    critic = SpendingCritic()
    ctx.critic = critic
    ctx.cancelled = Asked()
    with pytest.raises(PassCancelled):
        critic_stage(state, ctx)
    assert critic.rounds == []
    assert ctx.budget.snapshot("run-1") == BudgetSnapshot(spent=50)


def test_the_default_context_never_cancels() -> None:
    """In-process runs (no worker) have nothing to cancel them: cancelled() is False."""
    assert make_context(CritiqueConfig()).cancelled() is False


def test_every_lease_of_a_pass_starts_with_its_prefix() -> None:
    """The prefix a cancel refunds names every attempt's lease of that pass, and no lease of
    a pass whose id merely starts the same (``p1`` vs ``p10``)."""
    ctx = _ctx()
    prefix = pass_lease_prefix("w1", 1, "p1") + ":"
    for attempt in range(3):
        state = start(budget_sub(), "p1").model_copy(update={"attempt": attempt})
        assert lease_for(ctx, state).startswith(prefix)
    assert not lease_for(ctx, start(budget_sub(), "p10")).startswith(prefix)


def test_who_cancelled_is_one_bounded_printable_line() -> None:
    """`by` is kept on one line, without control characters, at most BY_CHARS long; empty
    falls back to the default."""
    assert who("  alice \n smith ", "cli") == "alice smith"
    assert who("", "client") == who(None, "client") == "client"
    assert who("\x1b[31mx", "cli") == "[31mx"
    assert len(who("x" * 500, "cli")) == BY_CHARS


def test_the_report_counts_and_lists_each_pass() -> None:
    """A cancel report prints its counts in one line and lists passes by iteration, worker and
    pass id in JSON."""
    report = CancelReport("r1", "alice", ("1:w1:p1", "2:w2:p2"), ("1:w3:p3",))
    assert str(report) == "cancelled 2 in run r1 (by alice), already finished 1"
    doc = report.as_json()
    assert doc["cancelled"][1] == {"iteration": 2, "worker_id": "w2", "pass_id": "p2"}
    assert doc["already_finished"] == [{"iteration": 1, "worker_id": "w3", "pass_id": "p3"}]


def test_the_cli_has_a_cancel_command() -> None:
    """`critique cancel RUN --worker W --worker V --iteration N --by WHO --json` parses."""
    assert COMMANDS["cancel"] == "cancel"
    args = build_parser().parse_args(
        ["cancel", "r1", "--worker", "w1", "--worker", "w2", "--iteration", "2", "--json"]
    )
    assert (args.run_id, args.worker, args.iteration, args.json) == ("r1", ["w1", "w2"], 2, True)
