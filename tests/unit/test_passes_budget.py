"""Passes and the repair budget in the broker-free runner, with the in-memory stores (which keep
the Redis stores' rules): every effect keyed by the pass; reservations sized from counted prompts
plus ``max_tokens``, the calls made with that ``max_tokens``, the unused part refunded; token-free
repairs reserve nothing; an over-report is charged in full and closes the budget."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import pytest

from pipeline.config import CritiqueConfig
from pipeline.critics.base import RevisionResult
from pipeline.errors import LLMPermanentError, LLMTransientError
from pipeline.llm.completion import (
    AllowanceSpent,
    ChatMessage,
    LLMReply,
    LLMRequest,
    complete_within,
    count_prompt_tokens,
    estimate_prompt_tokens,
    token_allowance,
)
from pipeline.llm.tokens import repair_reply_tokens
from pipeline.loop.pitfalls import render_pitfalls
from pipeline.loop.stages import (
    LoopState,
    budget_wait_s,
    critic_stage,
    decide_stage,
    lease_for,
    repair_bound,
    repair_stage,
    run_submission,
    start,
)
from pipeline.models import CritiqueEnvelope, RepairAttempt, Submission, Usage
from pipeline.store.base import BudgetSnapshot
from pipeline.store.memory import MemoryBudgetLedger, MemoryPatternStore, MemoryTraceSink
from pipeline.wiring import make_context
from tests.support import RecordingLedger
from tests.support.providers import (
    MODEL,
    Provider,
    budget_sub,
    llm_context,
    never_similar,
    no_l0,
    seeded_words,
)

# --- complete_within ---------------------------------------------------------------------------


def _request(max_tokens: int | None = 500, chars: int = 400) -> LLMRequest:
    return LLMRequest(
        model=MODEL,
        messages=(ChatMessage(role="user", content="x" * chars),),
        max_tokens=max_tokens,
        purpose="repair",
    )


def test_outside_an_allowance_a_call_is_unchanged() -> None:
    """No allowance (a first critique): the request goes out as it was built."""
    seen: list[LLMRequest] = []

    def complete(request: LLMRequest) -> LLMReply:
        seen.append(request)
        return LLMReply(text="ok", usage=Usage(tokens_in=5, tokens_out=5))

    complete_within(complete, _request())
    assert seen[0].max_tokens == 500


def test_an_allowance_lowers_max_tokens_to_what_is_left_and_counts_the_spend() -> None:
    """max_tokens = min(asked, left − counted prompt); the reported usage is taken off."""
    seen: list[LLMRequest] = []

    def complete(request: LLMRequest) -> LLMReply:
        seen.append(request)
        return LLMReply(text="ok", usage=Usage(tokens_in=100, tokens_out=30))

    prompt = estimate_prompt_tokens(_request())
    assert prompt == 100 + 4 + 3
    with token_allowance(prompt + 200) as allowance:
        complete_within(complete, _request(max_tokens=500))
        assert seen[0].max_tokens == 200
        assert allowance is not None and allowance.left == prompt + 200 - 130
        complete_within(complete, _request(max_tokens=10))
        assert seen[1].max_tokens == 10


def test_a_call_whose_prompt_does_not_fit_is_not_made() -> None:
    """A prompt the allowance cannot hold (plus one reply token) raises AllowanceSpent, a
    transient error the critics and revisers answer token-free; nothing is sent."""
    calls: list[LLMRequest] = []
    with token_allowance(50), pytest.raises(AllowanceSpent) as err:
        complete_within(lambda r: calls.append(r) or LLMReply(text=""), _request())
    assert isinstance(err.value, LLMTransientError)
    assert calls == []
    assert "50 token(s) left" in err.value.message


def test_a_reply_without_usage_counts_as_its_whole_bound() -> None:
    """Never under-counted: a reply reporting no usage spent its prompt + max_tokens."""
    with token_allowance(1000):
        reply = complete_within(lambda r: LLMReply(text="ok"), _request(max_tokens=40))
    assert reply.usage.tokens == estimate_prompt_tokens(_request()) + 40


def test_prompt_count_is_the_larger_of_the_estimate_and_the_tokenizer() -> None:
    """A completer's own count is used when larger; a broken counter leaves the estimate."""

    class Counting:
        def __init__(self, n: int | None) -> None:
            self.n = n

        def __call__(self, request: LLMRequest) -> LLMReply:
            return LLMReply(text="")

        def count_tokens(self, request: LLMRequest) -> int:
            if self.n is None:
                raise RuntimeError("no tokenizer")
            return self.n

    estimate = estimate_prompt_tokens(_request())
    assert count_prompt_tokens(_request(), Counting(10_000)) == 10_000
    assert count_prompt_tokens(_request(), Counting(1)) == estimate
    assert count_prompt_tokens(_request(), Counting(None)) == estimate


# --- the reservation ---------------------------------------------------------------------------


def test_a_repair_round_reserves_counted_prompts_plus_max_tokens_and_charges_real_spend() -> None:
    """The lease holds repair prompt + its max_tokens + re-critique prompt (repaired output at
    its bound) + the re-critique's max_tokens; the calls go out with those max_tokens; the commit
    charges what the provider reported (the rest comes back), and the result says so."""

    provider = Provider()
    ledger = RecordingLedger()
    ctx = llm_context(provider, 10_000_000, budget=ledger)
    sub = budget_sub()
    result = run_submission(sub, ctx, pass_id="p1")

    assert (result.status, result.stop_reason) == ("repaired", "accepted")
    assert [lease for lease, _ in ledger.reserved] == ["w1:1:p1:1", "w1:1:p1:2"]
    repair_calls = [r for r in provider.requests if r.purpose == "repair"]
    assert repair_calls[0].max_tokens == repair_reply_tokens(sub.output, 300)
    spent = provider.spent_on_repairs()
    assert ledger.spent("run-1") == spent == result.budget_charged
    assert result.repair_usage.tokens == spent
    assert ledger.snapshot("run-1") == BudgetSnapshot(spent=spent)
    assert result.pass_id == "p1"
    assert not any("reserved" in n for n in result.notes)
    # Each round's commit is in the trace: what was reserved, what it really cost.
    rounds = [e for e in ctx.trace.read("run-1") if e.get("lease")]
    assert [(e["lease"], e["reserved"]) for e in rounds] == ledger.reserved
    assert all(0 < e["charged"] <= e["reserved"] for e in rounds)
    assert sum(e["charged"] for e in rounds) == spent


def test_repair_bound_parts_are_the_calls_the_stages_make() -> None:
    """The reservation's repair part is the repair call's counted prompt + max_tokens; its
    critique part the critic call's counted prompt with an empty output + the output bound +
    the re-critique's max_tokens."""
    provider = Provider()
    ctx = llm_context(provider, 10_000_000)
    state = LoopState(submission=budget_sub(), output=budget_sub().output, pass_id="p1")
    state = critic_stage(state, ctx)
    assert state.envelope is not None
    bound = repair_bound(ctx, state, state.envelope)
    pitfalls = render_pitfalls(ctx.patterns.top("run-1", 10))
    assert pitfalls  # the first critique's patterns
    reviser = ctx.reviser.resolve(state.submission)
    request = reviser.request(state.submission, state.output, state.envelope, pitfalls, ())
    assert request.max_tokens == repair_reply_tokens(state.output, 300)
    assert bound.output_tokens == request.max_tokens
    assert bound.repair == count_prompt_tokens(request) + request.max_tokens
    assert bound.critique > 300 + bound.output_tokens
    # The repair stage makes exactly the counted call, within the repair part.
    repaired = repair_stage(decide_stage(state, ctx), ctx)
    [call] = [r for r in provider.requests if r.purpose == "repair"]
    assert call == request
    assert repaired.pending_repair_tokens <= bound.repair


def test_a_provider_using_every_allowed_token_never_passes_the_cap() -> None:
    """Replies as long as max_tokens allows, over many submissions sharing a binding budget:
    the provider's real spend stays within the cap; the refusals say spent and held."""
    provider = Provider(fill=True)
    ctx = llm_context(provider, 200_000, repair_budget_fraction=0.1)  # cap 20 000
    results = [run_submission(budget_sub(f"w{i:02d}"), ctx, pass_id=f"p{i}") for i in range(20)]
    spent = ctx.budget.spent("run-1")
    assert spent == provider.spent_on_repairs() == sum(r.budget_charged for r in results)
    assert 0 < spent <= 20_000
    refused = [r for r in results if r.stop_reason == "repair_budget_exhausted"]
    assert refused, "the budget never bound"
    reasons = [
        e["reason"]
        for e in ctx.trace.read("run-1")
        if e["type"] == "round" and e.get("stop_reason") == "repair_budget_exhausted"
    ]
    assert all(
        re.fullmatch(
            r"repair budget refused \d+ tokens: cap 20000, spent \d+, held 0 by 0 repairs "
            r"in flight; spent \+ asked would pass the cap",
            reason,
        )
        for reason in reasons
    ), reasons


def test_a_binding_budget_refuses_only_near_its_end() -> None:
    """With realistic usage, a repair is refused only when spent + its reservation really is
    past the cap, and that reservation is close to what a repair round really spends: so the
    run ends with all but less than one reservation of its cap spent."""
    provider = Provider()
    cap = 10_000
    ctx = llm_context(provider, 100_000, repair_budget_fraction=0.1)
    for i in range(30):
        run_submission(budget_sub(f"w{i:02d}"), ctx, pass_id=f"p{i}")
    events = ctx.trace.read("run-1")
    charged = [e["charged"] for e in events if e.get("lease")]
    refusals = [
        (int(m.group(1)), int(m.group(2)))
        for e in events
        if (m := re.search(r"refused (\d+) tokens: cap \d+, spent (\d+)", str(e.get("reason"))))
    ]
    assert refusals and charged, "the budget never bound"
    mean = sum(charged) / len(charged)
    spent = ctx.budget.spent("run-1")
    for asked, spent_then in refusals:
        assert spent_then + asked > cap  # refused only past the cap
        assert asked <= 1.5 * mean  # sized from what a round really spends
        assert spent >= cap - asked
    assert spent <= cap


def test_an_over_report_is_charged_in_full_noted_and_closes_the_budget() -> None:
    """A provider that reports more than the call's max_tokens allowed: the whole figure is
    charged (never under-counted), the result notes it, and the next repair is refused."""
    provider = Provider(fill=True, over=10.0)
    ctx = llm_context(provider, 10_000_000)
    first = run_submission(budget_sub("w1"), ctx, pass_id="a")
    assert ctx.budget.spent("run-1") == provider.spent_on_repairs() == first.budget_charged
    assert any("more than the" in n and "charged" in n for n in first.notes), first.notes
    snap = ctx.budget.snapshot("run-1")
    assert snap.overrun > 0 and snap.held == 0
    second = run_submission(budget_sub("w2"), ctx, pass_id="b")
    assert second.stop_reason == "repair_budget_exhausted"
    [reason] = [
        e["reason"]
        for e in ctx.trace.read("run-1")
        if e["type"] == "round" and e.get("worker_id") == "w2" and e.get("stop_reason")
    ]
    assert "closed since providers reported" in reason


def test_a_re_ask_runs_only_within_what_the_reservation_left() -> None:
    """A re-critique whose first reply is unusable is re-asked only if the prompt fits in what
    the reservation has left; else the heuristic answers and the reason says why."""

    class Unusable(Provider):
        def __call__(self, request: LLMRequest) -> LLMReply:
            reply = super().__call__(request)
            if request.purpose == "critic" and "Critique round: 2" in request.messages[-1].content:
                return reply.model_copy(update={"text": "not json at all"})
            return reply

    provider = Unusable(fill=True)
    ctx = llm_context(provider, 10_000_000, max_repair_attempts=1)
    result = run_submission(budget_sub(), ctx, pass_id="p")
    reasons = [n for n in result.notes if "critic fallback" in n]
    assert reasons and "re-ask was not made" in reasons[0]
    assert ctx.budget.spent("run-1") == provider.spent_on_repairs()
    assert ctx.budget.snapshot("run-1").overrun == 0


def test_token_free_repairs_reserve_and_charge_nothing() -> None:
    """The deterministic reviser with the heuristic critic: a cap of one token refuses nothing,
    no lease is taken, nothing is charged."""
    looping = "# Q3\n\n## Summary\n\nUp.\n\n## Findings\n\n" + ((seeded_words(3, 30) + "\n\n") * 2)
    config = CritiqueConfig(enabled=True, critic="heuristic", budget={"total_tokens": 10})
    ctx = make_context(config)
    sub = Submission(
        run_id="run-1",
        worker_id="w1",
        task="Report.",
        output=looping,
        claimed_format="markdown",
        required_fields=("summary", "findings"),
    )
    result = run_submission(sub, ctx, pass_id="p")
    assert result.status == "repaired"
    assert result.budget_charged == 0
    assert ctx.budget.snapshot("run-1") == BudgetSnapshot()


# --- rounds sized from what the run's repairs used -----------------------------------------


def _sized_ctx(provider: Provider, *, size_from_usage: bool = True, **extra: Any) -> Any:
    """A binding budget (cap 10 000) for 30 submissions of two repairs each."""
    ctx = llm_context(provider, 100_000, repair_budget_fraction=0.1, **extra)
    budget = ctx.config.budget.model_copy(update={"size_from_usage": size_from_usage})
    return dataclasses.replace(ctx, config=ctx.config.model_copy(update={"budget": budget}))


def _run_many(ctx: Any, n: int = 30) -> list[Any]:
    return [run_submission(budget_sub(f"w{i:02d}"), ctx, pass_id=f"p{i}") for i in range(n)]


def test_a_round_whose_full_bound_would_pass_the_cap_is_sized_from_the_runs_repairs() -> None:
    """Once spent + a round's full bound would pass the cap, a run with committed repairs
    reserves the round sized from what they used, and its repair call goes out with the
    smaller max_tokens: the run funds more of its cap, never passes it, the ledger still
    equals what the provider reported, and the result and the trace say so."""
    provider = Provider()
    ctx = _sized_ctx(provider)
    results = _run_many(ctx)
    spent = ctx.budget.spent("run-1")
    assert spent == provider.spent_on_repairs() == sum(r.budget_charged for r in results)
    assert spent <= 10_000
    usage = ctx.budget.usage("run-1")
    assert usage.rounds > 0 and usage.growth > 1000 and usage.reply > 0
    events = ctx.trace.read("run-1")
    tight = [e for e in events if e["type"] == "round" and e.get("budget_full")]
    assert tight, "no round was sized from the run's repairs"
    notes = [n for r in results for n in r.notes if "sized from what this run's repairs" in n]
    assert len(notes) == len(tight)
    written = [int(m.group(1)) for n in notes if (m := re.search(r"may write (\d+) tokens", n))]
    repair_calls = [r.max_tokens for r in provider.requests if r.purpose == "repair"]
    assert written and all(w in repair_calls for w in written)
    assert min(repair_calls) == min(written) < repair_reply_tokens(budget_sub().output, 300)
    assert ctx.budget.snapshot("run-1").overrun == 0
    assert not any("more than the" in n for r in results for n in r.notes)
    # The same run without it: refused at the full bound, less of the cap funded.
    plain = _sized_ctx(Provider(), size_from_usage=False)
    _run_many(plain)
    assert not any(e.get("budget_full") for e in plain.trace.read("run-1"))
    assert plain.budget.spent("run-1") < spent


def test_a_tight_refusal_names_what_was_asked_and_the_full_bound() -> None:
    """A round refused even at the bound sized from the run's repairs: the reason names that
    ask (spent + it passes the cap: a real refusal) and the full bound it replaced."""
    provider = Provider()
    ctx = _sized_ctx(provider)
    _run_many(ctx)
    reasons = [
        e["reason"]
        for e in ctx.trace.read("run-1")
        if e["type"] == "round" and e.get("stop_reason") == "repair_budget_exhausted"
    ]
    tight = [
        m
        for reason in reasons
        if (
            m := re.fullmatch(
                r"repair budget refused (\d+) tokens: cap 10000, spent (\d+), held 0 by 0 "
                r"repairs in flight; spent \+ asked would pass the cap \(asked: the round sized "
                r"from what this run's repairs used; its full bound (\d+)\)",
                reason,
            )
        )
    ]
    assert tight, reasons
    for m in tight:
        asked, spent, full = (int(g) for g in m.groups())
        assert spent + asked > 10_000 and asked < full


def test_without_history_or_room_to_gain_the_full_bound_is_refused() -> None:
    """The run's first repair has no history: a cap below its full bound refuses it, naming
    the full bound only. A provider that writes every token it may leaves nothing to gain:
    every refusal is at the full bound."""
    ctx = _sized_ctx(Provider())
    budget = ctx.config.budget.model_copy(update={"total_tokens": 1_000})
    ctx = dataclasses.replace(ctx, config=ctx.config.model_copy(update={"budget": budget}))
    result = run_submission(budget_sub(), ctx, pass_id="p")
    assert result.stop_reason == "repair_budget_exhausted"
    [reason] = [e["reason"] for e in _round_events(ctx) if e.get("reason")]
    assert reason.endswith("spent + asked would pass the cap"), reason
    filled = _sized_ctx(Provider(fill=True))
    _run_many(filled)
    events = filled.trace.read("run-1")
    assert not any(e.get("budget_full") for e in events)
    assert not any("its full bound" in str(e.get("reason")) for e in events)


# --- waiting for held tokens ------------------------------------------------------------------


class Clock:
    """A fake clock shared by the ledger and the loop's sleep; ``at`` runs a callback once the
    clock passes a time (another repair settling its lease, say)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []
        self.events: list[tuple[float, Any]] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        for when, action in list(self.events):
            if self.now >= when:
                self.events.remove((when, action))
                action()


def _waiting_ctx(clock: Clock, wait_s: float = 60.0, **extra: Any) -> Any:
    """A binding budget (cap 10 000) of which another repair in flight holds 9 000: one more
    repair round (about 2 600) fits what is left of the cap, not beside that hold."""
    ledger = MemoryBudgetLedger(clock=clock)
    assert ledger.reserve("run-1", "other:1", 9_000, 10_000, 900)
    ctx = llm_context(Provider(), round(10_000 / 0.15) + 1, budget=ledger, **extra)
    budget = ctx.config.budget.model_copy(update={"wait_s": wait_s})
    config = ctx.config.model_copy(update={"budget": budget})
    assert config.repair_token_cap == 10_000
    return dataclasses.replace(ctx, config=config, sleep=clock.sleep)


def _round_events(ctx: Any) -> list[dict[str, Any]]:
    return [e for e in ctx.trace.read("run-1") if e["type"] == "round"]


def test_a_repair_blocked_only_by_held_tokens_waits_for_them_then_runs() -> None:
    """The other repair settles after 3 s: this one waits (short sleeps, nothing held) instead
    of being refused, then repairs; its round event says how long it waited."""
    clock = Clock()
    ctx = _waiting_ctx(clock, max_repair_attempts=1)
    clock.events.append((103.0, lambda: ctx.budget.commit("run-1", "other:1", 6_000)))
    result = run_submission(budget_sub(), ctx, pass_id="p")
    assert result.stop_reason != "repair_budget_exhausted" and len(result.attempts) == 1
    assert 3.0 <= sum(clock.sleeps) <= 4.1 and all(0 < s <= 1.02 for s in clock.sleeps)
    [waited] = [e["budget_wait_s"] for e in _round_events(ctx) if "budget_wait_s" in e]
    assert waited == pytest.approx(sum(clock.sleeps), abs=0.01)
    assert ctx.budget.spent("run-1") == 6_000 + result.budget_charged


def test_a_wait_that_runs_out_is_refused_naming_spent_held_asked_and_the_wait() -> None:
    """The other repair never settles: after ``budget.wait_s`` (5 s) the repair is refused, and
    the reason names what it asked, spent, held and how long it waited."""
    clock = Clock()
    ctx = _waiting_ctx(clock, wait_s=5)
    result = run_submission(budget_sub(), ctx, pass_id="p")
    assert result.stop_reason == "repair_budget_exhausted" and result.attempts == ()
    assert 5.0 <= sum(clock.sleeps) <= 5.1
    [reason] = [e["reason"] for e in _round_events(ctx)]
    assert re.fullmatch(
        r"repair budget refused \d+ tokens: cap 10000, spent 0, held 9000 by 1 repairs in "
        r"flight; waited 5\.\d s \(the most it waits: 5 s\) for them to settle",
        reason,
    ), reason


def test_without_a_wait_held_tokens_refuse_at_once() -> None:
    """``budget.wait_s`` 0: the old rule, refused at once (and the reason says it did not
    wait); a worker's own bound (half its soft time limit) caps a longer wait."""
    clock = Clock()
    ctx = _waiting_ctx(clock, wait_s=0)
    result = run_submission(budget_sub(), ctx, pass_id="p")
    assert result.stop_reason == "repair_budget_exhausted" and clock.sleeps == []
    assert "this run does not wait" in _round_events(ctx)[0]["reason"]
    capped = Clock()
    ctx = dataclasses.replace(_waiting_ctx(capped), max_budget_wait_s=2.0)
    assert budget_wait_s(ctx) == 2.0
    assert run_submission(budget_sub(), ctx, pass_id="p").stop_reason == "repair_budget_exhausted"
    assert 2.0 <= sum(capped.sleeps) <= 2.1


# --- passes ------------------------------------------------------------------------------------


class CountingReviser:
    """A reviser that cannot size its calls (the runner estimates it) and spends 50 tokens."""

    name = "counting"
    token_free = False
    reads_pitfalls = True

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        return RevisionResult(
            output={**dict(output), "n": len(attempts) + 1},  # type: ignore[arg-type]
            usage=Usage(tokens_in=40, tokens_out=10, calls=1),
        )


def _heuristic_ctx(**kw: Any) -> Any:
    config = CritiqueConfig(
        enabled=True, critic="heuristic", max_repair_attempts=1, budget={"total_tokens": 10**6}
    )
    return make_context(config, reviser=CountingReviser(), l0=no_l0, fixpoint=never_similar, **kw)


def test_each_pass_has_its_own_leases_patterns_trace_and_result() -> None:
    """The same submission run twice as two passes: each reserves its own lease, its
    critiques are counted again, its events and its result carry its pass id."""
    ctx = _heuristic_ctx()
    sub = budget_sub(output={"summary": "x", "confidence": 0.9})
    first = run_submission(sub, ctx, pass_id="pass-a")
    freq_once = {p.category: p.frequency for p in ctx.patterns.top("run-1", 50)}
    second = run_submission(sub, ctx, pass_id="pass-b")
    freq_twice = {p.category: p.frequency for p in ctx.patterns.top("run-1", 50)}
    assert freq_twice == {k: 2 * v for k, v in freq_once.items()}
    assert (first.pass_id, second.pass_id) == ("pass-a", "pass-b")
    assert first.budget_charged == second.budget_charged == 50
    assert ctx.budget.spent("run-1") == 100
    events = ctx.trace.read("run-1")
    assert {e.get("pass_id") for e in events} == {"pass-a", "pass-b"}
    assert ctx.budget.snapshot("run-1").holders == 0


def test_without_a_pass_id_the_keys_are_the_old_ones() -> None:
    """The broker-free runner called without a pass id keys leases and critiques as before."""
    ctx = _heuristic_ctx()
    state = start(budget_sub())
    assert lease_for(ctx, state) == "w1:1:1"
    assert lease_for(ctx, state.model_copy(update={"pass_id": "p9"})) == "w1:1:p9:1"


def test_a_re_run_decide_gets_the_same_lease_back() -> None:
    """decide run twice on one state holds one lease once; after the round was committed a
    third run still gets it back, holding nothing."""
    ctx = _heuristic_ctx()
    state = critic_stage(start(budget_sub(), "p"), ctx)
    once = decide_stage(state, ctx)
    twice = decide_stage(state, ctx)
    assert once.lease_id == twice.lease_id == "w1:1:p:1"
    assert ctx.budget.snapshot("run-1").holders == 1
    after = critic_stage(repair_stage(once, ctx), ctx)
    assert after.budget_charged == 50
    again = decide_stage(state, ctx)
    assert again.lease_id == once.lease_id
    assert ctx.budget.snapshot("run-1") == BudgetSnapshot(spent=50)


@pytest.mark.parametrize(
    ("error", "held"),
    [(LLMTransientError("429"), True), (LLMPermanentError("401"), False)],
)
def test_a_failed_repair_keeps_its_lease_only_for_a_retry(error: Exception, held: bool) -> None:
    """A transient failure keeps the lease (the retry uses the same one); a permanent one
    releases it at once."""

    class Failing(CountingReviser):
        def revise(self, *args: Any, **kwargs: Any) -> RevisionResult:
            raise error

    ctx = _heuristic_ctx()
    ctx.reviser = Failing()
    state = decide_stage(critic_stage(start(budget_sub(), "p"), ctx), ctx)
    with pytest.raises(type(error)):
        repair_stage(state, ctx)
    assert (ctx.budget.snapshot("run-1").holders == 1) is held


def test_a_critic_failing_for_good_in_a_repair_round_charges_the_repair() -> None:
    """The re-critique raises a permanent error: the repair's real spend is committed (never
    lost) and the hold released."""

    class Broken:
        name = "broken"
        token_free = False
        reads_pitfalls = True

        def critique(self, *args: Any, **kwargs: Any) -> CritiqueEnvelope:
            raise LLMPermanentError("bad key")

    ctx = _heuristic_ctx()
    state = repair_stage(decide_stage(critic_stage(start(budget_sub(), "p"), ctx), ctx), ctx)
    ctx.critic = Broken()
    with pytest.raises(LLMPermanentError):
        critic_stage(state, ctx)
    assert ctx.budget.snapshot("run-1") == BudgetSnapshot(spent=50)


def test_memory_trace_and_patterns_defaults_are_fresh() -> None:
    """(Sanity) a context built without stores gets its own memory stores."""
    ctx = _heuristic_ctx()
    assert isinstance(ctx.trace, MemoryTraceSink)
    assert isinstance(ctx.patterns, MemoryPatternStore)
