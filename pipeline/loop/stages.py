"""The critique loop's stages and the broker-free loop: one stage shape, one loop.

Each stage is ``stage(state, ctx) -> state``: it reads a frozen, JSON-safe :class:`LoopState`,
does one step, and says which stage comes next (``state.next``). :func:`run_submission` runs
them in a plain ``while`` loop (tests, the A/B harness, the CLI); the Celery chain wires the same
stages across workers, carrying ``LoopState`` in its messages::

    l0 → critic → decide → (repair → l0 → critic → decide)* → done

This module only sequences the stages. Each mechanism a stage uses lives in its own module:
the round decision in :mod:`pipeline.loop.convergence`
(:func:`~pipeline.loop.convergence.decide_round`, pure), the repair prompt and estimates in
:mod:`pipeline.loop.repair`, the sizing of a repair round in :mod:`pipeline.loop.repair_sizing`, the
critique cache's claim and poll in :mod:`pipeline.loop.critique_cache`, the round's defect diff in
:mod:`pipeline.loop.defect_diff`. The decide stage is a row of named steps: keep the best output,
gather the round's facts, decide, record the repair attempt, diff the defects, trace the round. What
the stages run with (critic, reviser, stores, the real Layer-0 step) is built from configuration by
:mod:`pipeline.wiring`, the composition root. A submission is admitted (its size limit) by
:mod:`pipeline.loop.admission`; a finished pass's result is bounded by
:mod:`pipeline.records.result_bounds`.

Layer-0 rule: when L0 reports an error, the configured critic is not called (no critic tokens):
the envelope is a token-free critic's (the configured one if it is token-free, else the
heuristic) plus the L0 defects, scored ``clamp(score − 0.2 × L0 errors − 0.1 × L0 warnings)``
(:func:`pipeline.critics.base.merge_l0`). L0 warnings alone do not skip the critic; they are
appended to its envelope as defects without changing its score.

Bounds (what a pass keeps grows with its input, never faster): every critique goes through
:func:`checked_envelope` (the injection scan's cap, for every critic, then the per-critique
bounds of :func:`pipeline.critics.base.bound_envelope`); a Layer-0 outcome is folded the same
way and traces at most :data:`MAX_L0_GATE_EVENTS` gate events; :func:`finish` bounds what a
result holds besides its output (:func:`bound_result`); a worker stores a large state with its
parts by reference (:func:`pipeline.records.state_refs.compact_state`), so an output carried by
every stage is stored once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from pipeline.config import CritiqueConfig
from pipeline.critics.base import (
    Critic,
    Planner,
    PromptedReviser,
    Reviser,
    RevisionResult,
    bound_envelope,
    clip,
    fold_defects,
    merge_l0,
    resolve_for,
)
from pipeline.critics.heuristic import HeuristicCritic
from pipeline.critics.rubric import weighted_mean
from pipeline.critics.worker import WorkerReviser
from pipeline.errors import SubmissionError, TransientError
from pipeline.llm.completion import token_allowance
from pipeline.llm.tokens import text_of
from pipeline.loop.admission import admit
from pipeline.loop.convergence import (
    Ask,
    RoundDecision,
    RoundFacts,
    decide_round,
    target_met,
    verdict_for,
)
from pipeline.loop.critique_cache import CacheUse, critique_cache_key, critique_through_cache
from pipeline.loop.defect_diff import defect_diff, defect_refs, sorted_refs
from pipeline.loop.pitfalls import patterns_from_envelope, render_pitfalls
from pipeline.loop.repair import RepairBound, RepairOrder, is_acceptable, repair_growth
from pipeline.loop.repair_sizing import order_repair
from pipeline.models import (
    UNSCORED,
    CritiqueEnvelope,
    CritiqueResult,
    Defect,
    DefectRef,
    Frozen,
    GateEvent,
    RepairAttempt,
    RepairRequest,
    RoundTrace,
    Status,
    StopReason,
    Submission,
    Usage,
)
from pipeline.records.files import FileReader, inline_bytes
from pipeline.records.result_bounds import NOTE_CHARS, bound_result
from pipeline.security.injection import apply_injections, submission_injections
from pipeline.store.base import (
    BudgetAnswer,
    BudgetLedger,
    BudgetSnapshot,
    CritiqueCache,
    PatternStore,
    RepairUsage,
    TraceSink,
)

Next = Literal["l0", "critic", "decide", "repair", "done"]

REPAIR_LEASE_TTL_S = 900.0
"""A repair's budget reservation comes back after this long if its holder dies."""
BUDGET_POLL_S = 1.0
"""How often a repair waiting for held budget tokens to settle asks again (jittered down to
half of it, and never past the end of its wait)."""
PITFALLS_LIMIT = 10
"""How many Known Pitfalls go into a critic's or repairer's prompt."""
NO_BUDGET_NOTE = (
    "no budget.total_tokens configured: repair_budget_fraction not applied; "
    "only max_repair_attempts bounds repair"
)
DISABLED_NOTE = (
    "critique disabled (enabled: false): nothing was checked; the output passed through unchecked"
)


class L0Outcome(Frozen):
    """What the Layer-0 step found: defects (source ``l0``) and their gate events."""

    defects: tuple[Defect, ...] = ()
    gate_events: tuple[GateEvent, ...] = ()


L0Fn = Callable[[Submission, "str | dict[str, Any]", "int | None"], L0Outcome]
"""``l0(submission, output, previous_size) -> L0Outcome``; ``previous_size`` in UTF-8 bytes."""
FixpointFn = Callable[[str, str], bool]
"""``fixpoint(previous_repair_text, current_text) -> bool`` (similarity ≥ 0.95)."""


@dataclass
class StageContext:
    """Everything a stage needs besides the state: configuration, critic pair, stores, the
    Layer-0 step, the fixpoint test, clock. Built from configuration by
    :func:`pipeline.wiring.make_context` (tests inject fakes through it).

    Leases are ``f"{lease_prefix}:{attempt}"``; an empty prefix becomes
    ``f"{worker_id}:{iteration}:{pass_id}"`` (:func:`lease_for`), so two submissions, or two
    passes of one, never share a lease.
    ``read_file`` reads a submission's files (:mod:`pipeline.records.files`) for :func:`admit` and
    the real Layer-0 step; the default follows no blob reference (a worker passes its store's).
    """

    config: CritiqueConfig
    critic: Critic
    reviser: Reviser
    patterns: PatternStore
    budget: BudgetLedger
    trace: TraceSink
    l0: L0Fn
    """The Layer-0 step (:func:`pipeline.wiring.contract_l0`)."""
    fixpoint: FixpointFn
    """The fixpoint test (:func:`pipeline.wiring.simhash_fixpoint`)."""
    lease_prefix: str = ""
    clock: Callable[[], float] = field(default=time.monotonic)
    lease_ttl_s: float = REPAIR_LEASE_TTL_S
    """How long a repair's budget reservation outlives a holder that died."""
    read_file: FileReader = inline_bytes
    """Reads a submission file's bytes (inline content, or a blob through a store)."""
    cache: CritiqueCache | None = None
    """The critique cache (used when ``config.cache.enabled``): in memory by default."""
    max_budget_wait_s: float | None = None
    """The most a repair may wait for held budget tokens here, whatever ``budget.wait_s`` says
    (a worker: half its soft time limit); None: ``budget.wait_s`` alone."""
    sleep: Callable[[float], None] = field(default=time.sleep)
    """How :func:`run_submission` waits between budget asks (tests pass a fake clock's)."""
    park: Callable[[LoopState, float], None] = field(default=lambda state, ttl_s: None)
    """Keeps a pass's state, for ``ttl_s`` seconds, for the repaired output its worker will
    send (``repairer: worker``, :func:`repair_stage`); a worker stores it in Redis, signed. The
    default (in-process runs, where no manager answers) keeps nothing."""
    parked: Callable[[str], LoopState | None] = field(default=lambda pass_id: None)
    """The state :attr:`park` kept for a pass (by pass id) of this context's run, or None."""
    cancelled: Callable[[], bool] = field(default=lambda: False)  # never, in-process
    """True once the pass this context runs was cancelled (``critique cancel``): consulted
    before each critic or repair call that spends tokens, which then raises
    :class:`PassCancelled` instead. A worker wires it to a lookup of the pass's result; the
    default (in-process runs) never cancels."""


class LoopState(Frozen):
    """Everything the stages pass along; JSON-safe so a broker can carry it."""

    submission: Submission
    pass_id: str = ""
    """This pass's id (one per submit; see docs/client.md, "Passes: submitting the same
    submission again"): it keys the pass's budget leases, pattern records, trace events and
    result, so a resubmission never meets an earlier pass's."""
    output: str | dict[str, Any]
    """The current output (the original, then each repair's result)."""
    next: Next = "l0"
    round: int = Field(0, ge=0)
    """Critiques done so far; the first critique is round 1."""
    attempt: int = Field(0, ge=0)
    """Repairs done so far."""
    previous_size: int | None = None
    """UTF-8 size of the output the last repair started from (for L0 ``file_size_delta``)."""
    previous_repair_text: str | None = None
    """The previous repair's output text, when the current output is a second or later repair."""
    l0_defects: tuple[Defect, ...] = ()
    envelope: CritiqueEnvelope | None = None
    previous_defect_ids: tuple[str, ...] = ()
    """Ids of the previous round's critical and warning defects (defects fixed / remaining)."""
    previous_defects: tuple[DefectRef, ...] = ()
    """The previous round's critical and warning defects by (category, location)."""
    ever_fixed: tuple[DefectRef, ...] = ()
    """Every (category, location) some round fixed: a later return of one is a regression."""
    best_output: str | dict[str, Any] | None = None
    best_score: float | None = None
    best_envelope: CritiqueEnvelope | None = None
    best_acceptable: bool = False
    best_target: bool = False
    original_score: float | None = None
    attempts: tuple[RepairAttempt, ...] = ()
    trace: tuple[RoundTrace, ...] = ()
    usage: Usage = Field(default_factory=Usage)
    repair_usage: Usage = Field(default_factory=Usage)
    suggestions_applied: int = Field(0, ge=0)
    """Suggestions the last repair applied (reported in the next round's trace)."""
    lease_id: str | None = None
    """The open budget reservation of the repair in flight, committed after its re-critique."""
    lease_tokens: int = Field(0, ge=0)
    """Tokens that reservation holds: the repair call's part plus the re-critique's."""
    repair_allowance: int = Field(0, ge=0)
    """The repair call's part of it: the most the repair stage's LLM calls may spend."""
    repair_order: RepairOrder | None = None
    """The next repair as the decide stage ordered it (pitfalls, the prompt rendered once, the
    bound it was sized at); None outside a repair round, or in a state sent by an older
    worker (the repair stage then reads the pitfalls itself)."""
    pending_repair_tokens: int = Field(0, ge=0)
    repair_growth: int = Field(0, ge=0)
    """The growth the repair in flight showed, in thousandths
    (:func:`~pipeline.loop.repair.repair_growth`; 0: no model wrote it), brought to the run's
    :class:`~pipeline.store.base.RepairUsage` by its commit."""
    budget_charged: int = Field(0, ge=0)
    """Tokens this pass's committed repairs charged to the run's budget so far."""
    notes: tuple[str, ...] = ()
    status: Status | None = None
    stop_reason: StopReason | None = None
    chain: str = ""
    """The first pass of a worker-repair chain this pass continues (``repair_of``), else "":
    pattern records are keyed by it, so a repair's re-critique does not count a pattern twice."""
    repair_request: RepairRequest | None = None
    """Set when the pass ends ``worker_repair``: what the worker's re-run answers."""


Stage = Callable[[LoopState, StageContext], LoopState]


def _emit(ctx: StageContext, state: LoopState, kind: str, stage: str, **fields: Any) -> None:
    sub = state.submission
    event: dict[str, Any] = {
        "type": kind,
        "stage": stage,
        "worker_id": sub.worker_id,
        "iteration": sub.iteration,
        "round": state.round,
    }
    if state.pass_id:
        event["pass_id"] = state.pass_id
    event.update(fields)
    ctx.trace.emit(sub.run_id, event)


def is_token_free(critic: Critic, submission: Submission) -> bool:
    """True when the critic that serves ``submission`` spends no tokens (deterministic)."""
    serving: Critic = resolve_for(critic, submission)
    return serving.token_free


def _pitfalls(ctx: StageContext, submission: Submission, reader: Critic | Reviser) -> str:
    """The Known Pitfalls text for ``reader`` (a critic or reviser); empty when pattern memory
    is off or the reader declares ``reads_pitfalls = False`` (deterministic ones ignore it,
    so the store is not read for them)."""
    serving: Critic | Reviser = resolve_for(reader, submission)
    if not ctx.config.pattern_memory or not serving.reads_pitfalls:
        return ""
    return render_pitfalls(ctx.patterns.top(submission.run_id, PITFALLS_LIMIT))


def _rubric_mode(ctx: StageContext) -> bool:
    return ctx.config.critic == "rubric"


def _l0_error(defects: Sequence[Defect]) -> bool:
    return any(d.severity == "critical" for d in defects)


def _add_note(notes: tuple[str, ...], note: str) -> tuple[str, ...]:
    return notes if note in notes else (*notes, note)


def start(submission: Submission, pass_id: str = "") -> LoopState:
    """The initial state of a pass (``pass_id``): the submission's output, about to enter
    Layer-0."""
    return LoopState(submission=submission, output=submission.output, pass_id=pass_id)


def lease_for(ctx: StageContext, state: LoopState) -> str:
    """The budget lease of the state's next repair: one per (pass, attempt), so a re-run
    ``decide`` asks for the same lease again and a resubmission never meets an old one."""
    sub = state.submission
    prefix = ctx.lease_prefix or pass_lease_prefix(sub.worker_id, sub.iteration, state.pass_id)
    return f"{prefix}:{state.attempt + 1}"


def pass_lease_prefix(worker_id: str, iteration: int, pass_id: str) -> str:
    """What every budget lease of one pass is named from (:func:`lease_for` adds
    ``:<attempt>``): ``"<worker>:<iteration>:<pass>"``; a cancel refunds the leases under it."""
    return ":".join(p for p in (worker_id, str(iteration), pass_id) if p)


def pattern_record_key(state: LoopState, round_no: int) -> str:
    """The pattern-memory key of one critique: (worker, iteration, pass, round), recorded once."""
    return f"{pass_key(state)}:{round_no}"


def pass_key(state: LoopState) -> str:
    """The pattern-memory key of the state's pass: (worker, iteration, pass). A pattern counts
    once per pass, so a repair round finding it again does not count it again, while a
    resubmission (a new pass) does."""
    sub = state.submission
    pass_id = state.chain or state.pass_id
    return ":".join(p for p in (sub.worker_id, str(sub.iteration), pass_id) if p)


def _passthrough(state: LoopState) -> LoopState:
    """Critique explicitly off: the output passes through ``unchecked``, with no score (never
    ``accepted``, never 1.00) and nothing checked, not even Layer-0."""
    envelope = CritiqueEnvelope(
        worker_id=state.submission.worker_id,
        score=0.0,
        summary="critique disabled (enabled: false): nothing was checked",
        critic="disabled",
    )
    return state.model_copy(
        update={
            "next": "done",
            "envelope": envelope,
            "best_output": state.output,
            "best_envelope": envelope,
            "notes": _add_note(state.notes, DISABLED_NOTE),
            "status": "unchecked",
            "stop_reason": "disabled",
        }
    )


def l0_stage(state: LoopState, ctx: StageContext) -> LoopState:
    """Layer-0 contract checks (token-free); with critique disabled, the pass-through.

    The first Layer-0 stage of a pass (no repair yet) admits the submission first
    (:func:`admit`), so nothing over ``max_output_bytes`` is processed, whoever sent it. A
    submission with ``repair_of`` then resumes the pass it answers (:func:`resume_worker_repair`):
    its output is checked as that pass's next repair.
    """
    if state.attempt == 0:
        admit(state.submission, ctx.config, ctx.read_file)
        if state.submission.repair_of and state.round == 0:
            state = resume_worker_repair(state, ctx)
    if not ctx.config.enabled:
        return _passthrough(state)
    began = ctx.clock()
    outcome = ctx.l0(state.submission, state.output, state.previous_size)
    errors = sum(1 for d in outcome.defects if d.severity == "critical")
    _emit(
        ctx,
        state,
        "stage",
        "l0",
        defects=len(outcome.defects),
        errors=errors,
        warnings=sum(1 for d in outcome.defects if d.severity == "warning"),
        elapsed_ms=round((ctx.clock() - began) * 1000.0, 3),
    )
    gates = outcome.gate_events
    for gate in gates[:MAX_L0_GATE_EVENTS]:
        _emit(ctx, state, "gate", "l0", **_clipped_gate(gate))
    if len(gates) > MAX_L0_GATE_EVENTS:
        more = len(gates) - MAX_L0_GATE_EVENTS
        _emit(
            ctx,
            state,
            "gate",
            "l0",
            gate="l0",
            verdict="reject",
            reason=f"and {more} more Layer-0 failures, not traced one by one",
            iteration=state.submission.iteration,
            worker_id=state.submission.worker_id,
            folded=more,
        )
    defects = fold_defects(outcome.defects)
    return state.model_copy(update={"l0_defects": defects, "next": "critic"})


MAX_L0_GATE_EVENTS = 50
"""Layer-0 gate events traced per stage; the rest are one event that says how many."""
_GATE_TEXT_CHARS = 300


def _clipped_gate(gate: GateEvent) -> dict[str, Any]:
    """A gate event as traced: every text clipped (a file path or reason may be megabytes)."""
    return {
        k: clip(v, _GATE_TEXT_CHARS) if isinstance(v, str) else v
        for k, v in gate.model_dump(mode="json").items()
    }


def critic_stage(state: LoopState, ctx: StageContext) -> LoopState:
    """Critique the current output (token-free when L0 failed); record its patterns.

    In a repair round the critique's LLM calls run within what the repair's reservation has
    left (``lease_tokens`` − the repair's spend), and the lease is committed afterwards with
    the round's real spend (:func:`_commit`). A cancelled pass stops before the critic's
    call (:class:`PassCancelled`), the repair's spend charged and its hold released.
    """
    sub = state.submission
    began = ctx.clock()
    held = hold_lease(ctx, state, wait=False)
    if held is not None and not held.granted:
        # Its lease came back (its holder died after the repair) and does not fit again: the
        # repair's tokens are spent all the same, so the re-critique runs and the commit
        # charges the real figure (the ledger never under-counts).
        state = state.model_copy(
            update={"notes": _add_note(state.notes, _lost_lease_note(state.attempt, "re-critique"))}
        )
    allowance = (
        max(0, state.lease_tokens - state.pending_repair_tokens)
        if state.lease_id is not None
        else None
    )
    try:
        with token_allowance(allowance):
            envelope, cache = _envelope_for(state, ctx)
    except BaseException as exc:
        if state.lease_id is not None and not isinstance(exc, TransientError):
            # The chain ends here: charge what the repair spent and release the hold.
            ctx.budget.commit(sub.run_id, state.lease_id, state.pending_repair_tokens)
        raise
    return _record_critique(state, ctx, envelope, began, cache)


def _envelope_for(state: LoopState, ctx: StageContext) -> tuple[CritiqueEnvelope, CacheUse]:
    """The envelope of the current output: the configured critic's (through the critique cache
    when it is on), or a token-free one merged with the Layer-0 defects when Layer-0 failed."""
    sub = state.submission
    round_no = state.round + 1
    cache_use: CacheUse = ""
    if _l0_error(state.l0_defects):
        serving: Critic = resolve_for(ctx.critic, sub)
        fallback: Critic = serving if serving.token_free else HeuristicCritic()
        pitfalls = _pitfalls(ctx, sub, fallback)
        base = fallback.critique(sub, state.output, pitfalls=pitfalls, round=round_no)
        envelope = merge_l0(bound_envelope(base), state.l0_defects)
    else:
        pitfalls = _pitfalls(ctx, sub, ctx.critic)

        def critique() -> CritiqueEnvelope:
            if not is_token_free(ctx.critic, sub):
                check_cancelled(ctx, state)  # the last moment before tokens are spent
            # Bounded before anything keeps it (the critique cache included).
            return bound_envelope(
                ctx.critic.critique(sub, state.output, pitfalls=pitfalls, round=round_no)
            )

        if (
            ctx.cache is not None
            and ctx.config.cache.enabled
            and not is_token_free(ctx.critic, sub)
        ):
            key = critique_cache_key(
                ctx.config, ctx.critic, sub, state.output, pitfalls=pitfalls, round=round_no
            )
            envelope, cache_use = critique_through_cache(
                ctx.cache, ctx.config.cache, key, sub.worker_id, critique
            )
        else:
            envelope = critique()
        if state.l0_defects:
            defects = (*state.l0_defects, *envelope.defects)
            envelope = envelope.model_copy(update={"defects": defects})
    return checked_envelope(sub, state.output, envelope), cache_use


def checked_envelope(
    submission: Submission, output: str | dict[str, Any], envelope: CritiqueEnvelope
) -> CritiqueEnvelope:
    """What the loop keeps of any critic's envelope (the post-critique hook, every critic and
    the Layer-0 path alike): the injection scan's hits added and the score capped at 0.59
    (:func:`~pipeline.security.injection.apply_injections`: idempotent, so the LLM critic's own scan
    is not counted twice), then the per-critique bounds
    (:func:`~pipeline.critics.base.bound_envelope`)."""
    hits = submission_injections(text_of(output), submission)
    return bound_envelope(apply_injections(envelope, hits))


def _commit(
    state: LoopState, ctx: StageContext, spent: int, reply: int = 0
) -> tuple[int, tuple[str, ...]]:
    """Commit the open lease with the round's real spend; returns (charge, notes).

    The ledger charges the real figure even past the reservation (never under-counted); when a
    provider reported more than was reserved, the note says so, and the run's budget grants no
    further repairs (the reservation's ``max_tokens`` should have made an overrun impossible).
    The commit brings the round's figures to the run's :class:`RepairUsage` (what a later round
    may be sized from): the repair's growth and the re-critique's ``reply`` (the tokens its
    critic reported writing).
    """
    lease = state.lease_id
    if lease is None:
        return 0, state.notes
    # A worker's re-run (repairer: worker) spent what it reported where no reservation bounds
    # it: charged in full, never an overrun that would stop the run's other repairs.
    by_worker = isinstance(resolve_for(ctx.reviser, state.submission), WorkerReviser)
    outside = min(state.pending_repair_tokens, spent) if by_worker else 0
    usage = RepairUsage(growth=state.repair_growth, reply=max(0, reply))
    charged = ctx.budget.commit(state.submission.run_id, lease, spent, outside=outside, usage=usage)
    notes = state.notes
    if charged - outside > state.lease_tokens:
        notes = _add_note(
            notes,
            f"repair {state.attempt}: providers reported {charged} tokens, more than the "
            f"{state.lease_tokens} reserved (lease {lease}); all {charged} charged, and the "
            "run's repair budget grants no further repairs",
        )
    return charged, notes


def _record_critique(
    state: LoopState,
    ctx: StageContext,
    envelope: CritiqueEnvelope,
    began: float,
    cache: CacheUse = "",
) -> LoopState:
    """Record a critique: commit the repair round's lease, count its patterns, trace it."""
    sub = state.submission
    round_no = state.round + 1
    repairing = state.attempt > 0
    charged, notes = _commit(
        state, ctx, state.pending_repair_tokens + envelope.usage.tokens, envelope.usage.tokens_out
    )
    if cache == "hit":
        notes = _add_note(
            notes,
            f"round {round_no}: critique cache hit (an identical output was critiqued before; "
            "no tokens spent)",
        )
    if envelope.fallback_reason and not _l0_error(state.l0_defects):
        notes = _add_note(notes, f"critic fallback: {envelope.fallback_reason}")
    found = patterns_from_envelope(envelope, output=state.output)
    if ctx.config.pattern_memory and found:  # nothing to count: no store round trip
        ctx.patterns.record(
            sub.run_id,
            pattern_record_key(state, round_no),
            sub.iteration,
            found,
            pass_key=pass_key(state),
        )
    next_state = state.model_copy(
        update={
            "round": round_no,
            "envelope": envelope,
            "usage": state.usage + envelope.usage,
            "repair_usage": state.repair_usage + envelope.usage
            if repairing
            else state.repair_usage,
            "lease_id": None,
            "lease_tokens": 0,
            "repair_allowance": 0,
            "pending_repair_tokens": 0,
            "repair_growth": 0,
            "budget_charged": state.budget_charged + charged,
            "notes": notes,
            "next": "decide",
        }
    )
    budget: dict[str, Any] = {}
    if state.lease_id is not None:
        budget = {"lease": state.lease_id, "reserved": state.lease_tokens, "charged": charged}
    _emit(
        ctx,
        next_state,
        "stage",
        "critic",
        critic=envelope.critic,
        score=envelope.score,
        defects=envelope.defect_count,
        tokens=envelope.usage.tokens,
        l0_skipped_critic=_l0_error(state.l0_defects),
        elapsed_ms=round((ctx.clock() - began) * 1000.0, 3),
        **budget,
        **({"cache": cache} if cache else {}),
    )
    return next_state


def unfixable_plan(
    ctx: StageContext,
    submission: Submission,
    output: str | dict[str, Any],
    envelope: CritiqueEnvelope,
) -> RevisionResult | None:
    """The serving reviser's plan when it would change nothing (the loop then stops
    ``needs_model``); None when it would fix something, or cannot tell (no
    :class:`~pipeline.critics.base.Planner`, or a plan of None: a model may fix anything)."""
    reviser = resolve_for(ctx.reviser, submission)
    if not isinstance(reviser, Planner):
        return None
    result = reviser.plan(submission, output, envelope)
    return result if result is not None and result.output == output else None


def _needs_model_notes(
    notes: tuple[str, ...],
    ctx: StageContext,
    submission: Submission,
    envelope: CritiqueEnvelope,
    plan: RevisionResult,
) -> tuple[str, ...]:
    """One note saying a model or a person must act, then one per defect left unfixed."""
    reviser: Reviser = resolve_for(ctx.reviser, submission)
    lines = [r.line() for r in plan.unfixable] or [
        f"[{d.severity}] {d.category}"
        + (f" at {d.location}" if d.location else "")
        + f": {d.description}"
        for d in envelope.actionable
    ]
    count = (
        sum(r.defect.folded or 1 for r in plan.unfixable)
        if plan.unfixable
        else envelope.actionable_count
    )
    notes = _add_note(
        notes,
        f"needs_model: {reviser.name} can fix none of the {count} remaining defect(s) "
        "without inventing content; a model or a person must act on:",
    )
    for line in lines[:MAX_NEEDS_MODEL_LINES]:
        notes = _add_note(notes, f"needs_model: {clip(line, NOTE_CHARS)}")
    if len(lines) > MAX_NEEDS_MODEL_LINES:
        more = len(lines) - MAX_NEEDS_MODEL_LINES
        notes = _add_note(notes, f"needs_model: … and {more} more listed in the envelope")
    return notes


MAX_NEEDS_MODEL_LINES = 20
"""Defects a ``needs_model`` stop lists in the notes (the envelope lists the rest)."""


def next_repair_order(
    ctx: StageContext,
    state: LoopState,
    envelope: CritiqueEnvelope,
    *,
    sized: bool = True,
    usage: RepairUsage | None = None,
) -> RepairOrder:
    """The state's next repair round, ordered and (with ``sized``) sized once by the reviser
    and critic that serve its submission (:func:`pipeline.loop.repair_sizing.order_repair`); with
    ``usage``, sized from what the run's committed repairs used when that is smaller."""
    sub = state.submission
    return order_repair(
        sub,
        state.output,
        envelope,
        state.attempts,
        round_no=state.round + 1,
        reviser=ctx.reviser,
        critic=ctx.critic,
        pitfalls=lambda reader: _pitfalls(ctx, sub, reader),
        sized=sized,
        usage=usage,
    )


def repair_bound(ctx: StageContext, state: LoopState, envelope: CritiqueEnvelope) -> RepairBound:
    """What the next repair round reserves: :func:`next_repair_order`'s bound."""
    return next_repair_order(ctx, state, envelope).bound


def refusal_text(
    tokens: int,
    cap: int,
    snap: BudgetSnapshot,
    waited_s: float = 0.0,
    wait_s: float = 0.0,
    full: int | None = None,
) -> str:
    """Why the budget refused a repair: what it asked for, the cap, what is spent, held and
    queued, and why that is final (past the cap, closed by an overrun, or the wait ran out).
    ``full``: the round's full bound, when what was asked (``tokens``) is the tighter one sized
    from what the run's repairs used."""
    return _refusal_why(tokens, cap, snap, waited_s, wait_s) + (
        f" (asked: the round sized from what this run's repairs used; its full bound {full})"
        if full is not None
        else ""
    )


def _refusal_why(
    tokens: int, cap: int, snap: BudgetSnapshot, waited_s: float, wait_s: float
) -> str:
    text = (
        f"repair budget refused {tokens} tokens: cap {cap}, spent {snap.spent}, "
        f"held {snap.held} by {snap.holders} repairs in flight"
    )
    if snap.queued:
        text += f", {snap.queued} asked by {snap.waiters} repairs waiting longer"
    if snap.overrun:
        return text + (
            f"; closed since providers reported {snap.overrun} tokens more than was reserved "
            "for their repairs"
        )
    if snap.spent + tokens > cap:
        return text + "; spent + asked would pass the cap"
    if wait_s <= 0:
        return text + "; held tokens would have to settle, and this run does not wait for them"
    return text + f"; waited {waited_s:.1f} s (the most it waits: {wait_s:g} s) for them to settle"


class PassCancelled(Exception):
    """The pass was cancelled (``critique cancel``) while a stage of it ran: raised before the
    stage's next critic or repair call (:attr:`StageContext.cancelled`), so nothing more is
    spent. The cancel wrote the pass's result already: a worker ends the chain and writes
    nothing."""


def check_cancelled(ctx: StageContext, state: LoopState) -> None:
    """Raise :class:`PassCancelled` when the pass was cancelled (one cheap lookup)."""
    if ctx.cancelled():
        raise PassCancelled(f"pass {state.pass_id or '-'} was cancelled")


class BudgetWait(Exception):
    """The decide stage could not reserve its repair yet, only because tokens are held (or
    asked by repairs that waited longer) that may come back: ask again in ``retry_s``.

    Nothing was recorded: :func:`run_submission` sleeps and re-runs the stage; a worker hands
    its task back to the broker with that countdown (no thread held while it waits)."""

    def __init__(self, retry_s: float, reason: str) -> None:
        super().__init__(reason)
        self.retry_s = retry_s
        self.reason = reason

    @classmethod
    def of(cls, answer: BudgetAnswer, cap: int, wait_s: float, what: str) -> BudgetWait:
        """The wait a ``wait`` answer asks for (jittered, within what is left of ``wait_s``),
        its reason ``what`` then the budget's figures."""
        b = answer.budget
        left = max(0.0, wait_s - answer.waited_s)
        return cls(
            min(left, BUDGET_POLL_S * random.uniform(0.5, 1.0)) + 0.01,
            f"repair budget: {what} (cap {cap}, spent {b.spent}, held {b.held} by {b.holders}, "
            f"queued {b.queued}); waited {answer.waited_s:.1f} of {wait_s:g} s",
        )


def budget_wait_s(ctx: StageContext) -> float:
    """How long a repair waits for held budget tokens: ``budget.wait_s``, at most
    ``ctx.max_budget_wait_s`` (a worker's half soft time limit)."""
    wait = ctx.config.budget.wait_s
    if ctx.max_budget_wait_s is not None:
        wait = min(wait, ctx.max_budget_wait_s)
    return max(0.0, wait)


def hold_lease(ctx: StageContext, state: LoopState, *, wait: bool) -> BudgetAnswer | None:
    """The stage about to spend under the state's lease (the repair, its re-critique) asks for
    it again as it starts: a live lease becomes this process's from here on (it beats it:
    :mod:`pipeline.store.leases`); one that came back meanwhile, because its holder died (this
    is a redelivery of a killed worker's task, or the stage before died after handing on), is
    reserved afresh against the cap. With ``wait``, a reservation blocked only by held tokens
    raises :class:`BudgetWait` as the decide stage's does. None: no lease to hold, or a ledger
    that records no holders (the broker-free runner: one process, leases end at their TTL)."""
    cap = ctx.config.repair_token_cap
    if state.lease_id is None or cap is None or ctx.budget.holder is None:
        return None
    sub = state.submission
    wait_s = budget_wait_s(ctx) if wait else 0.0
    tokens = state.lease_tokens
    answer = ctx.budget.ask(sub.run_id, state.lease_id, tokens, cap, ctx.lease_ttl_s, wait_s)
    if answer.verdict == "wait":
        raise BudgetWait.of(
            answer,
            cap,
            wait_s,
            f"the lease of repair {state.attempt + 1} came back when its holder died; its "
            f"{tokens} tokens wait for held ones to settle",
        )
    return answer


def _lost_lease_note(attempt: int, what: str) -> str:
    return (
        f"repair {attempt}: its budget lease came back when the worker holding it died, and "
        f"the budget could not hold it again for the {what}"
    )


@dataclass
class _Gathered:
    """What :func:`decide_stage` looked up for :func:`~pipeline.loop.convergence.decide_round`, and
    what the lookups left behind (notes, the reservation, the repair order)."""

    notes: tuple[str, ...]
    lease_id: str | None = None
    order: RepairOrder | None = None
    waited_s: float = 0.0
    """How long the granted reservation waited for held tokens to settle."""
    full: int | None = None
    """The round's full bound when the granted reservation is the tighter one sized from what
    the run's repairs used."""


def _answer(
    ask: Ask,
    facts: RoundFacts,
    gathered: _Gathered,
    ctx: StageContext,
    state: LoopState,
    envelope: CritiqueEnvelope,
) -> RoundFacts:
    """Look up the fact a decision asked for (the decide stage's I/O). A reservation that only
    held tokens block raises :class:`BudgetWait` (tokens that may come back are waited for,
    not refused; see docs/pipeline.md, "The repair budget")."""
    sub = state.submission
    if ask == "fixpoint":
        previous = state.previous_repair_text
        hit = previous is not None and ctx.fixpoint(previous, text_of(state.output))
        return facts.model_copy(update={"fixpoint": hit})
    if ask == "plan":
        stuck = unfixable_plan(ctx, sub, state.output, envelope)
        if stuck is not None:
            gathered.notes = _needs_model_notes(gathered.notes, ctx, sub, envelope, stuck)
        return facts.model_copy(update={"unfixable": stuck is not None})
    cap = ctx.config.repair_token_cap
    if cap is None:
        if NO_BUDGET_NOTE not in gathered.notes:
            gathered.notes = _add_note(gathered.notes, NO_BUDGET_NOTE)
            _emit(ctx, state, "stage", "decide", note=NO_BUDGET_NOTE)
        gathered.order = next_repair_order(ctx, state, envelope, sized=False)
        return facts.model_copy(update={"budget": "granted"})
    order = next_repair_order(ctx, state, envelope)
    if order.bound.total > 0:  # a token-free round (reviser and critic) reserves nothing
        lease = lease_for(ctx, state)
        wait = budget_wait_s(ctx)
        order, answer = _reserve_round(ctx, state, envelope, order, lease, cap, wait)
        total = order.bound.total
        if answer.verdict == "wait":
            raise BudgetWait.of(answer, cap, wait, f"{total} tokens wait for held ones to settle")
        if not answer.granted:
            full = order.full_bound.total if order.full_bound is not None else None
            refusal = refusal_text(total, cap, answer.budget, answer.waited_s, wait, full)
            return facts.model_copy(update={"budget": "refused", "refusal": refusal})
        gathered.lease_id = lease
        gathered.waited_s = answer.waited_s
        if order.full_bound is not None:
            gathered.full = order.full_bound.total
            gathered.notes = _add_note(
                gathered.notes,
                f"repair {state.attempt + 1}: reserved {total} tokens, sized from what this "
                f"run's repairs used (its full bound, {gathered.full}, would pass the cap): the "
                f"repair call may write {order.reply_tokens} tokens",
            )
    gathered.order = order
    return facts.model_copy(update={"budget": "granted"})


def _reserve_round(
    ctx: StageContext,
    state: LoopState,
    envelope: CritiqueEnvelope,
    order: RepairOrder,
    lease: str,
    cap: int,
    wait: float,
) -> tuple[RepairOrder, BudgetAnswer]:
    """Ask the budget for the round ``order`` sized; returns the order asked for and the answer.

    The full bound is asked for unless it can no longer be granted: when spent + it passes the
    cap (spent only grows; tokens merely held make it wait, as ever) and the run has committed
    repairs, the round is sized from what they used (``budget.size_from_usage``:
    :func:`next_repair_order` with the run's :class:`RepairUsage`) and that smaller bound is
    asked for instead, its calls then made within it. One read of the run's usage comes first;
    a full ask refused because spent grew meanwhile is followed by the tight one."""
    sub = state.submission
    full = order.bound.total

    def ask(tokens: int) -> BudgetAnswer:
        return ctx.budget.ask(sub.run_id, lease, tokens, cap, ctx.lease_ttl_s, wait)

    if not ctx.config.budget.size_from_usage:
        return order, ask(full)
    usage = ctx.budget.usage(sub.run_id)
    tried = False
    if usage.rounds > 0 and usage.spent + full > cap:
        tried = True
        tight = next_repair_order(ctx, state, envelope, usage=usage)
        if tight.full_bound is not None:
            return tight, ask(tight.bound.total)
    answer = ask(full)
    past_cap = answer.budget.overrun == 0 and answer.budget.spent + full > cap
    if answer.verdict == "refused" and past_cap and usage.rounds > 0 and not tried:
        tight = next_repair_order(ctx, state, envelope, usage=usage)
        if tight.full_bound is not None:
            return tight, ask(tight.bound.total)
    return order, answer


@dataclass(frozen=True)
class _RoundScore:
    """The critiqued round's own figures, as every decide step reads them."""

    score: float
    mean: float
    """The rubric's weighted mean (the score itself outside rubric mode)."""
    previous_score: float | None
    l0_failed: bool
    acceptable: bool
    target: bool
    """The rubric's per-dimension targets are all met, with no critical defect."""


def _score_round(state: LoopState, ctx: StageContext, envelope: CritiqueEnvelope) -> _RoundScore:
    """The round's score, mean, acceptability and target, from its envelope."""
    rubric = ctx.config.rubric if _rubric_mode(ctx) else None
    score = envelope.score
    l0_failed = _l0_error(state.l0_defects)
    target = (
        rubric is not None
        and bool(envelope.scores)
        and target_met(envelope.scores, rubric)
        and not envelope.critical
    )
    return _RoundScore(
        score=score,
        mean=weighted_mean(envelope.scores, rubric) if rubric and envelope.scores else score,
        previous_score=state.trace[-1].score if state.trace else None,
        l0_failed=l0_failed,
        acceptable=is_acceptable(score, envelope, l0_failed),
        target=target,
    )


def _keep_best(state: LoopState, envelope: CritiqueEnvelope, r: _RoundScore) -> dict[str, Any]:
    """The state's best-output fields after this round. An output replaces the best only when
    strictly better on (target met, acceptable, score); a worse or equal repair never does."""
    better = state.best_score is None or (r.target, r.acceptable, r.score) > (
        state.best_target,
        state.best_acceptable,
        state.best_score,
    )
    return {
        "best_output": state.output if better else state.best_output,
        "best_score": r.score if better or state.best_score is None else state.best_score,
        "best_envelope": envelope if better else state.best_envelope,
        "best_acceptable": r.acceptable if better else state.best_acceptable,
        "best_target": r.target if better else state.best_target,
    }


def _round_facts(
    state: LoopState, envelope: CritiqueEnvelope, r: _RoundScore, best: dict[str, Any]
) -> RoundFacts:
    """What :func:`~pipeline.loop.convergence.decide_round` is given up front (the rest it asks)."""
    return RoundFacts(
        round=state.round,
        repairs_done=state.attempt,
        score=r.score,
        previous_score=r.previous_score,
        means=(*(t.mean for t in state.trace), r.mean),
        critical=len(envelope.critical),
        l0_failed=r.l0_failed,
        acceptable=r.acceptable,
        target=r.target,
        best_score=best["best_score"],
        best_acceptable=best["best_acceptable"],
        best_target=best["best_target"],
    )


def _decide(
    facts: RoundFacts, ctx: StageContext, state: LoopState, envelope: CritiqueEnvelope
) -> tuple[RoundDecision, _Gathered]:
    """Ask :func:`~pipeline.loop.convergence.decide_round` until it needs no further fact, looking
    up each fact it asks for (:func:`_answer`); returns the decision and what the lookups left."""
    gathered = _Gathered(notes=state.notes)
    decision: RoundDecision = decide_round(facts, ctx.config)
    while decision.ask is not None:
        facts = _answer(decision.ask, facts, gathered, ctx, state, envelope)
        decision = decide_round(facts, ctx.config)
    return decision, gathered


def _record_attempt(
    state: LoopState, envelope: CritiqueEnvelope, r: _RoundScore, stop: StopReason | None
) -> tuple[RepairAttempt, ...]:
    """The state's repair attempts, with the one this round re-critiqued (none in round 1)."""
    if state.attempt == 0:
        return state.attempts
    before = set(state.previous_defect_ids)
    now = {d.id for d in envelope.actionable}
    attempt = RepairAttempt(
        worker_id=state.submission.worker_id,
        attempt=state.attempt,
        original_score=r.previous_score if r.previous_score is not None else r.score,
        repaired_score=r.score,
        defects_fixed=len(before - now),
        defects_remaining=envelope.actionable_count,
        stop_reason=stop,
    )
    return (*state.attempts, attempt)


def _diff_defects(
    state: LoopState, current: tuple[DefectRef, ...]
) -> tuple[dict[str, tuple[DefectRef, ...]], tuple[DefectRef, ...]]:
    """The round's defect diff against the previous round (empty in round 1), and every
    (category, location) fixed so far."""
    if not state.trace:
        return {}, state.ever_fixed
    diff = defect_diff(state.previous_defects, current, state.ever_fixed)
    return diff, sorted_refs({*state.ever_fixed, *diff["fixed"]})


def _trace_round(
    ctx: StageContext,
    next_state: LoopState,
    round_trace: RoundTrace,
    decision: RoundDecision,
    gathered: _Gathered,
) -> None:
    """The decide stage's ``round`` trace event: the round's trace, the stop and its reason."""
    waited = gathered.waited_s
    _emit(
        ctx,
        next_state,
        "round",
        "decide",
        **round_trace.model_dump(mode="json", exclude_none=True),
        stop_reason=decision.stop_reason,
        reason=decision.reason,
        **({"budget_wait_s": round(waited, 3)} if waited > 0 else {}),
        **({"budget_full": gathered.full} if gathered.full is not None else {}),
    )


def decide_stage(state: LoopState, ctx: StageContext) -> LoopState:
    """Keep the best output, decide the round, reserve the next repair's budget.

    The decision is :func:`~pipeline.loop.convergence.decide_round` (pure); this stage gathers the
    facts it asks for, in its order: the fixpoint test, the serving reviser's plan (a reviser
    with a ``plan`` that fixes nothing stops the loop ``needs_model``, status ``escalated``,
    with the defects it left listed in the notes: no round is spent on a repair that cannot
    help, and nothing is invented), and the budget's answer.

    The reservation is :func:`next_repair_order`'s bound under the lease :func:`lease_for` (one per
    pass and attempt: a re-run gets the same lease back); a refusal stops the loop
    ``repair_budget_exhausted`` with :func:`refusal_text` as the reason; a round that spends no
    tokens reserves nothing. A reservation that would fit once held tokens settle raises
    :class:`BudgetWait` (for at most :func:`budget_wait_s`, counted per lease by the ledger):
    the stage is run again later, and is refused only when spent + asked passes the cap, the
    run overran, or the wait ran out. The order travels in the state to :func:`repair_stage`.

    The steps, in order: :func:`_score_round`, :func:`_keep_best`, :func:`_round_facts`,
    :func:`_decide`, :func:`_record_attempt`, :func:`_diff_defects`, :func:`_trace_round`.
    """
    envelope = state.envelope
    if envelope is None:
        raise ValueError("decide_stage needs a critiqued state (envelope is missing)")
    r = _score_round(state, ctx, envelope)
    best = _keep_best(state, envelope, r)
    decision, gathered = _decide(_round_facts(state, envelope, r, best), ctx, state, envelope)
    stop = decision.stop_reason
    repairing = decision.action == "repair"
    order = gathered.order if repairing else None
    reserved = order.bound if order is not None and gathered.lease_id is not None else None
    attempts = _record_attempt(state, envelope, r, stop)
    current_refs = defect_refs(envelope.actionable)
    diff, ever_fixed = _diff_defects(state, current_refs)
    round_trace = RoundTrace(
        round=state.round,
        score=r.score,
        scores=dict(envelope.scores),
        mean=r.mean,
        defects=envelope.defect_count,
        suggestions_applied=state.suggestions_applied,
        verdict=verdict_for(stop),
        **diff,
    )
    update: dict[str, Any] = {
        **best,
        "original_score": state.original_score if state.original_score is not None else r.score,
        "previous_defect_ids": tuple(d.id for d in envelope.actionable),
        "previous_defects": current_refs,
        "ever_fixed": ever_fixed,
        "attempts": attempts,
        "trace": (*state.trace, round_trace),
        "notes": gathered.notes,
        "lease_id": gathered.lease_id if repairing else None,
        "lease_tokens": reserved.total if reserved is not None else 0,
        "repair_allowance": reserved.repair if reserved is not None else 0,
        "repair_order": order,
        "next": "repair" if repairing else "done",
    }
    if decision.done:
        update["stop_reason"] = stop
        update["status"] = decision.status
    next_state = state.model_copy(update=update)
    _trace_round(ctx, next_state, round_trace, decision, gathered)
    return next_state


def repair_stage(state: LoopState, ctx: StageContext) -> LoopState:
    """Revise the current output for the current envelope; the result goes back through L0.

    The reviser gets what the decide stage ordered (``state.repair_order``): the pitfalls read
    then and, for a :class:`~pipeline.critics.base.PromptedReviser`, the prompt rendered then
    (so the call made is the call sized). With a budget reservation, the reviser's LLM calls
    run within its repair part (``repair_allowance``). A failure that a retry cannot fix
    releases the reservation; a transient one keeps it for the retry (the same lease, so
    nothing is reserved twice). A cancelled pass stops before the reviser's call
    (:class:`PassCancelled`), its reservation released.
    """
    envelope = state.envelope
    if envelope is None:
        raise ValueError("repair_stage needs a critiqued state (envelope is missing)")
    sub = state.submission
    began = ctx.clock()
    held = hold_lease(ctx, state, wait=True)
    if held is not None and not held.granted:
        return _lease_refused(state, ctx, held)
    if isinstance(resolve_for(ctx.reviser, sub), WorkerReviser):
        return _hand_to_worker(state, ctx)
    order = state.repair_order
    pitfalls = order.pitfalls if order is not None else _pitfalls(ctx, sub, ctx.reviser)
    try:
        with token_allowance(state.repair_allowance if state.lease_id is not None else None):
            result: RevisionResult
            serving = resolve_for(ctx.reviser, sub)
            if not serving.token_free:
                check_cancelled(ctx, state)
            if (
                order is not None
                and order.prompt is not None
                and isinstance(serving, PromptedReviser)
            ):
                result = serving.revise(
                    sub,
                    state.output,
                    envelope,
                    pitfalls=pitfalls,
                    attempts=state.attempts,
                    prompt=order.prompt,
                    max_tokens=order.reply_tokens,
                )
            else:
                result = ctx.reviser.revise(
                    sub, state.output, envelope, pitfalls=pitfalls, attempts=state.attempts
                )
    except BaseException as exc:
        if state.lease_id is not None and not isinstance(exc, TransientError):
            ctx.budget.refund(sub.run_id, state.lease_id)
        raise
    next_state = _repaired(state, result)
    _emit(
        ctx,
        state,
        "stage",
        "repair",
        attempt=state.attempt + 1,
        reviser=ctx.reviser.name,
        suggestions_applied=result.suggestions_applied,
        tokens=result.usage.tokens,
        elapsed_ms=round((ctx.clock() - began) * 1000.0, 3),
    )
    return next_state


def _lease_refused(state: LoopState, ctx: StageContext, answer: BudgetAnswer) -> LoopState:
    """The repair's lease came back (its holder died) and the budget refused it again: the loop
    stops ``repair_budget_exhausted`` here, as the decide stage would have, keeping the best
    output so far; nothing was spent on the repair."""
    cap = ctx.config.repair_token_cap or 0
    order = state.repair_order
    full = order.full_bound.total if order is not None and order.full_bound is not None else None
    refusal = refusal_text(
        state.lease_tokens, cap, answer.budget, answer.waited_s, budget_wait_s(ctx), full
    )
    repaired = state.attempt > 0 and (state.best_acceptable or state.best_target)
    _emit(
        ctx,
        state,
        "stage",
        "repair",
        attempt=state.attempt + 1,
        reviser=ctx.reviser.name,
        refused=refusal,
    )
    return state.model_copy(
        update={
            "notes": _add_note(
                state.notes, f"{_lost_lease_note(state.attempt + 1, 'repair')}: {refusal}"
            ),
            "lease_id": None,
            "lease_tokens": 0,
            "repair_allowance": 0,
            "repair_order": None,
            "next": "done",
            "status": "repaired" if repaired else "escalated",
            "stop_reason": "repair_budget_exhausted",
        }
    )


def _repaired(state: LoopState, result: RevisionResult) -> LoopState:
    """The state after a repair (by a reviser, or by the worker: :func:`resume_worker_repair`):
    ``result.output`` is the current output, about to go back through Layer-0."""
    current_text = text_of(state.output)
    notes = state.notes
    if result.note:
        notes = _add_note(notes, f"repair {state.attempt + 1}: {result.note}")
    return state.model_copy(
        update={
            "notes": notes,
            "output": result.output,
            "attempt": state.attempt + 1,
            "previous_size": len(current_text.encode("utf-8")),
            "previous_repair_text": current_text if state.attempt > 0 else None,
            "usage": state.usage + result.usage,
            "repair_usage": state.repair_usage + result.usage,
            "pending_repair_tokens": result.usage.tokens,
            "repair_growth": repair_growth(state.output, result.output, result.usage.tokens_out),
            "suggestions_applied": result.suggestions_applied,
            "repair_order": None,
            "next": "l0",
        }
    )


def _hand_to_worker(state: LoopState, ctx: StageContext) -> LoopState:
    """``repairer: worker``: park the state for the worker's repaired output and end the pass
    ``worker_repair`` (status ``escalated``, with the :class:`RepairRequest`). The budget
    reservation the decide stage made stays held for the re-run and its re-critique (it is
    committed when the repaired output is critiqued, refunded on release or cancel, and comes
    back after ``lease_ttl_s`` if no answer comes, as the parked state expires)."""
    try:
        check_cancelled(ctx, state)
        ctx.park(state, ctx.lease_ttl_s)
        if state.lease_id is not None:
            # No worker process holds it while the manager's worker repairs: its TTL only.
            ctx.budget.park(state.submission.run_id, state.lease_id)
    except BaseException as exc:
        if state.lease_id is not None and not isinstance(exc, TransientError):
            ctx.budget.refund(state.submission.run_id, state.lease_id)
        raise
    request = RepairRequest(
        of_pass=state.pass_id,
        attempt=state.attempt + 1,
        reserved_tokens=state.lease_tokens if state.lease_id is not None else 0,
        expires_s=ctx.lease_ttl_s,
    )
    _emit(
        ctx,
        state,
        "stage",
        "repair",
        attempt=request.attempt,
        reviser="worker",
        handed_to_worker=True,
        reserved=request.reserved_tokens,
    )
    return state.model_copy(
        update={
            "next": "done",
            "status": "escalated",
            "stop_reason": "worker_repair",
            "repair_request": request,
            "repair_order": None,
        }
    )


def resume_worker_repair(state: LoopState, ctx: StageContext) -> LoopState:
    """A submission with ``repair_of``: the parked state of the pass it answers, carried on as
    if the service's reviser had returned the submission's output (:func:`_repaired`), under
    this pass's id; the worker's reported ``repair_tokens`` are the repair's usage, charged with
    the re-critique under the reservation the parked pass holds. The parked pass must be of the
    same run, iteration and worker and be waiting for a repair, else :class:`SubmissionError`."""
    sub = state.submission
    of = sub.repair_of or ""
    parked = ctx.parked(of)
    theirs = parked.submission if parked is not None else None
    if (
        parked is None
        or theirs is None
        or parked.next != "repair"
        or (theirs.run_id, theirs.iteration, theirs.worker_id)
        != (sub.run_id, sub.iteration, sub.worker_id)
    ):
        raise SubmissionError(
            f"repair_of {of!r}: no repair of worker {sub.worker_id!r} (iteration "
            f"{sub.iteration}) is waiting under that pass in run {sub.run_id!r}: it expired, "
            "was released or cancelled, was answered with another worker's output, or that "
            "pass never asked for one; submit the output without repair_of to critique it afresh"
        )
    reported = sub.repair_tokens
    note = (
        f"made by the worker; it reported {reported} tokens"
        if reported
        else "made by the worker; it reported no tokens (only the re-critique is charged)"
    )
    revision = RevisionResult(
        output=sub.output,
        usage=Usage(tokens_in=reported, calls=1 if reported else 0),
        note=note,
    )
    carried = parked.model_copy(
        update={"submission": sub, "pass_id": state.pass_id, "chain": parked.chain or of}
    )
    return _repaired(carried, revision)


def _done(state: LoopState, ctx: StageContext) -> LoopState:
    return state


STAGES: dict[str, Stage] = {
    "l0": l0_stage,
    "critic": critic_stage,
    "decide": decide_stage,
    "repair": repair_stage,
    "done": _done,
}
"""Stage functions keyed by ``LoopState.next``."""


def finish(state: LoopState) -> CritiqueResult:
    """The final answer of a finished loop (``state.next == "done"``)."""
    if state.next != "done" or state.status is None or state.stop_reason is None:
        raise ValueError(f"the loop is not finished (next stage: {state.next!r})")
    envelope = state.best_envelope or state.envelope
    scored = state.status not in UNSCORED
    if envelope is None or state.best_output is None or (scored and state.best_score is None):
        raise ValueError("a finished loop must have critiqued at least once")
    sub = state.submission
    return bound_result(
        CritiqueResult(
            run_id=sub.run_id,
            iteration=sub.iteration,
            worker_id=sub.worker_id,
            status=state.status,
            stop_reason=state.stop_reason,
            output=state.best_output,
            original_score=(
                None
                if not scored
                else state.original_score
                if state.original_score is not None
                else 0.0
            ),
            best_score=state.best_score if scored else None,
            envelope=envelope,
            attempts=state.attempts,
            trace=state.trace,
            usage=state.usage,
            repair_usage=state.repair_usage,
            budget_charged=state.budget_charged,
            pass_id=state.pass_id,
            notes=state.notes,
            repair_request=state.repair_request,
        )
    )


def _step_limit(config: CritiqueConfig) -> int:
    rounds = max(config.max_repair_attempts, config.rubric.max_rounds) + 2
    return 4 * rounds + 4


def run_submission(submission: Submission, ctx: StageContext, pass_id: str = "") -> CritiqueResult:
    """Run the whole loop in-process and return the result (also written to the trace).

    The first stage admits the submission (:func:`admit`, through ``ctx.read_file``). A decide
    stage waiting for held budget tokens (:class:`BudgetWait`) sleeps (``ctx.sleep``) and runs
    again. Nothing retries here, so a stage that raises releases the pass's open reservation
    first."""
    state = start(submission, pass_id)
    steps = 0
    limit = _step_limit(ctx.config)
    while state.next != "done":
        steps += 1
        if steps > limit:
            raise RuntimeError(f"critique loop did not finish within {limit} stages")
        try:
            state = STAGES[state.next](state, ctx)
        except BudgetWait as wait:
            ctx.sleep(wait.retry_s)
            steps -= 1  # the ledger bounds the wait: it is not a stage
        except BaseException:
            if state.lease_id is not None:
                ctx.budget.refund(submission.run_id, state.lease_id)
            raise
    result = finish(state)
    ctx.trace.emit(submission.run_id, result.trace_event(round=state.round, stage="result"))
    return result
