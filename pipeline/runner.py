"""The broker-free critique loop: one stage shape, one loop (DESIGN habit 2).

Each stage is ``stage(state, ctx) -> state``: it reads a frozen, JSON-safe :class:`LoopState`,
does one step, and says which stage comes next (``state.next``). :func:`run_submission` runs
them in a plain ``while`` loop (tests, the A/B harness, the CLI); the Celery chain wires the same
stages across workers, carrying ``LoopState`` in its messages::

    l0 → critic → decide → (repair → l0 → critic → decide)* → done

Policy lives in :mod:`pipeline.repair` (the first decision, the prompt, the token bound) and
:mod:`pipeline.convergence` (stop rules, status); this module only sequences them, keeps the
best output, charges the budget and writes the trace.

Layer-0 rule: when L0 reports an error, the configured critic is not called (no critic tokens):
the envelope is a token-free critic's (the configured one if it is token-free, else the
heuristic) plus the L0 defects, scored ``clamp(score − 0.2 × L0 errors − 0.1 × L0 warnings)``
(:func:`pipeline.critics.base.merge_l0`). L0 warnings alone do not skip the critic; they are
appended to its envelope as defects without changing its score.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from pipeline.config import CritiqueConfig
from pipeline.convergence import (
    STOP_TEXT,
    RoundFacts,
    final_status,
    first_round_stop,
    round_stop,
    target_met,
    verdict_for,
    weighted_mean,
)
from pipeline.critics.base import Critic, Reviser, RevisionResult, merge_l0
from pipeline.critics.heuristic import HeuristicCritic, HeuristicReviser
from pipeline.critics.rubric import DeterministicReviser, RubricCritic
from pipeline.errors import ExtensionLoadError, SubmissionError, TransientError
from pipeline.files import FileReader, inline_bytes
from pipeline.files import read_file as read_file_bytes
from pipeline.llm import Completer, token_allowance
from pipeline.models import (
    CritiqueEnvelope,
    CritiqueResult,
    Defect,
    DefectRef,
    Frozen,
    GateEvent,
    RepairAttempt,
    RoundTrace,
    Status,
    StopReason,
    Submission,
    Usage,
    effort_for,
)
from pipeline.pitfalls import patterns_from_envelope, render_pitfalls
from pipeline.repair import (
    RepairBound,
    decide,
    estimated_critique_tokens,
    estimated_output_tokens,
    estimated_repair_tokens,
    is_acceptable,
)
from pipeline.store.base import (
    BudgetLedger,
    BudgetSnapshot,
    CritiqueCache,
    PatternStore,
    TraceSink,
)
from pipeline.store.memory import (
    MemoryBudgetLedger,
    MemoryCritiqueCache,
    MemoryPatternStore,
    MemoryTraceSink,
)
from pipeline.tokens import estimate_usage, text_of

Next = Literal["l0", "critic", "decide", "repair", "done"]

REPAIR_LEASE_TTL_S = 900.0
"""A repair's budget reservation comes back after this long if its holder dies."""
PITFALLS_LIMIT = 10
"""How many Known Pitfalls go into a critic's or repairer's prompt."""
NO_BUDGET_NOTE = (
    "no budget.total_tokens configured: repair_budget_fraction not applied; "
    "only max_repair_attempts bounds repair"
)
DISABLED_NOTE = "critique disabled (enabled: false): output passed through unchanged"


class L0Outcome(Frozen):
    """What the Layer-0 step found: defects (source ``l0``) and their gate events."""

    defects: tuple[Defect, ...] = ()
    gate_events: tuple[GateEvent, ...] = ()


L0Fn = Callable[[Submission, "str | dict[str, Any]", "int | None"], L0Outcome]
"""``l0(submission, output, previous_size) -> L0Outcome``; ``previous_size`` in UTF-8 bytes."""
FixpointFn = Callable[[str, str], bool]
"""``fixpoint(previous_repair_text, current_text) -> bool`` (similarity ≥ 0.95)."""


def contract_l0(config: CritiqueConfig, read_file: FileReader | None = None) -> L0Fn:
    """The real Layer-0 step over :mod:`pipeline.contract` (imported here, lazily).

    Every file of the submission is read through ``read_file`` (default: inline content only,
    so a file held by reference raises :class:`~pipeline.files.UnreadableFileError`).
    """
    from pipeline.contract import build_suite, check_submission

    suite = build_suite(config.output_contract)

    def run(
        submission: Submission, output: str | dict[str, Any], previous_size: int | None
    ) -> L0Outcome:
        report = check_submission(
            suite, submission, output=output, previous_size=previous_size, read_file=read_file
        )
        return L0Outcome(
            defects=tuple(f.to_defect() for f in report.failures),
            gate_events=tuple(
                f.to_gate_event(submission.iteration, submission.worker_id) for f in report.failures
            ),
        )

    return run


def simhash_fixpoint() -> FixpointFn:
    """The real fixpoint test, :func:`pipeline.simhash.is_fixpoint` (imported lazily)."""
    from pipeline.simhash import is_fixpoint

    def fixpoint(previous_text: str, current_text: str) -> bool:
        return bool(is_fixpoint(previous_text, current_text))

    return fixpoint


@dataclass
class StageContext:
    """Everything a stage needs besides the state: configuration, critic pair, stores, clock.

    ``l0`` and ``fixpoint`` default to the real implementations, resolved on first use; tests
    inject fakes. Leases are ``f"{lease_prefix}:{attempt}"``; an empty prefix becomes
    ``f"{worker_id}:{iteration}:{pass_id}"`` (:func:`lease_for`), so two submissions, or two
    passes of one, never share a lease.
    ``read_file`` reads a submission's files (:mod:`pipeline.files`) for :func:`admit` and the
    real Layer-0 step; the default follows no blob reference (a worker passes its store's).
    """

    config: CritiqueConfig
    critic: Critic
    reviser: Reviser
    patterns: PatternStore
    budget: BudgetLedger
    trace: TraceSink
    lease_prefix: str = ""
    l0: L0Fn | None = None
    fixpoint: FixpointFn | None = None
    clock: Callable[[], float] = field(default=time.monotonic)
    lease_ttl_s: float = REPAIR_LEASE_TTL_S
    """How long a repair's budget reservation outlives a holder that died."""
    read_file: FileReader = inline_bytes
    """Reads a submission file's bytes (inline content, or a blob through a store)."""
    cache: CritiqueCache | None = None
    """The critique cache (used when ``config.cache.enabled``): in memory by default."""

    def l0_fn(self) -> L0Fn:
        """The Layer-0 function, building the real one on first use."""
        if self.l0 is None:
            self.l0 = contract_l0(self.config, self.read_file)
        return self.l0

    def fixpoint_fn(self) -> FixpointFn:
        """The fixpoint test, importing the real one on first use."""
        if self.fixpoint is None:
            self.fixpoint = simhash_fixpoint()
        return self.fixpoint


class LoopState(Frozen):
    """Everything the stages pass along; JSON-safe so a broker can carry it."""

    submission: Submission
    pass_id: str = ""
    """This pass's id (SPEC §4 "Passes": one per submit): it keys the pass's budget leases,
    pattern records, trace events and result, so a resubmission never meets an earlier pass's."""
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
    pending_repair_tokens: int = Field(0, ge=0)
    budget_charged: int = Field(0, ge=0)
    """Tokens this pass's committed repairs charged to the run's budget so far."""
    notes: tuple[str, ...] = ()
    status: Status | None = None
    stop_reason: StopReason | None = None


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


def resolve_for(obj: Any, submission: Submission) -> Any:
    """The critic or reviser that actually serves ``submission``: ``auto`` ones (see
    :class:`AutoCritic`) pick per submission, everything else is itself."""
    resolve = getattr(obj, "resolve", None)
    return resolve(submission) if resolve is not None else obj


def is_token_free(critic: Critic, submission: Submission) -> bool:
    """True when the critic that serves ``submission`` spends no tokens (deterministic)."""
    return bool(getattr(resolve_for(critic, submission), "token_free", False))


def _pitfalls(ctx: StageContext, submission: Submission, reader: object) -> str:
    """The Known Pitfalls text for ``reader`` (a critic or reviser); empty when pattern memory
    is off or the reader declares ``reads_pitfalls = False`` (deterministic ones ignore it,
    so the store is not read for them)."""
    reader = resolve_for(reader, submission)
    if not ctx.config.pattern_memory or not getattr(reader, "reads_pitfalls", True):
        return ""
    return render_pitfalls(ctx.patterns.top(submission.run_id, PITFALLS_LIMIT))


def _rubric_mode(ctx: StageContext) -> bool:
    return ctx.config.critic == "rubric"


def _l0_error(defects: Sequence[Defect]) -> bool:
    return any(d.severity == "critical" for d in defects)


def _add_note(notes: tuple[str, ...], note: str) -> tuple[str, ...]:
    return notes if note in notes else (*notes, note)


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def admit(
    submission: Submission, config: CritiqueConfig, read_file: FileReader | None = None
) -> None:
    """Refuse a submission the pipeline must not take (SPEC §3: ``max_output_bytes`` bounds
    the whole submission): a :class:`SubmissionError` naming the limit and the sizes.

    Counted in UTF-8 bytes: the output's canonical text, the task, every inline file's content,
    and every other file's bytes as ``read_file`` returns them (a blob's real length, never its
    claimed ``size``). Files are read only while the total is within the limit, so an oversized
    submission costs at most one read past it. A file that cannot be read raises
    :class:`~pipeline.files.UnreadableFileError`. The client calls this before it enqueues;
    the worker calls it again at the first Layer-0 stage of every pass (:func:`l0_stage`), so
    a chain sent without the client is bounded too.
    """
    limit = config.max_output_bytes
    output = _utf8_len(text_of(submission.output))
    task = _utf8_len(submission.task)
    inline = sum(_utf8_len(f.content) for f in submission.files if f.content is not None)
    total = output + task + inline
    referenced = 0
    unread = 0
    for i, f in enumerate(submission.files):
        if f.content is not None:
            continue
        if total > limit:
            unread = sum(1 for g in submission.files[i:] if g.content is None)
            break
        size = len(read_file_bytes(f, read_file) or b"")
        referenced += size
        total += size
    if total <= limit:
        return
    lower = "at least " if unread else ""
    not_read = f"; {unread} file(s) by reference not read" if unread else ""
    raise SubmissionError(
        f"submission of worker {submission.worker_id!r} (run {submission.run_id!r}) is "
        f"{lower}{total} bytes, over max_output_bytes ({limit}): output {output} B, "
        f"task {task} B, inline files {inline} B, files by reference {referenced} B{not_read}; "
        "nothing was processed",
        hint="split the work, send less, or raise max_output_bytes on the workers",
    )


def start(submission: Submission, pass_id: str = "") -> LoopState:
    """The initial state of a pass (``pass_id``): the submission's output, about to enter
    Layer-0."""
    return LoopState(submission=submission, output=submission.output, pass_id=pass_id)


def lease_for(ctx: StageContext, state: LoopState) -> str:
    """The budget lease of the state's next repair: one per (pass, attempt), so a re-run
    ``decide`` asks for the same lease again and a resubmission never meets an old one."""
    sub = state.submission
    prefix = ctx.lease_prefix or ":".join(
        p for p in (sub.worker_id, str(sub.iteration), state.pass_id) if p
    )
    return f"{prefix}:{state.attempt + 1}"


def critique_key(state: LoopState, round_no: int) -> str:
    """The pattern-memory key of one critique: (worker, iteration, pass, round), recorded once."""
    sub = state.submission
    return ":".join(
        p for p in (sub.worker_id, str(sub.iteration), state.pass_id, str(round_no)) if p
    )


def _passthrough(state: LoopState) -> LoopState:
    envelope = CritiqueEnvelope(
        worker_id=state.submission.worker_id,
        score=1.0,
        summary="critique disabled: output passed through unchanged",
        critic="disabled",
    )
    return state.model_copy(
        update={
            "next": "done",
            "envelope": envelope,
            "best_output": state.output,
            "best_score": 1.0,
            "best_envelope": envelope,
            "original_score": 1.0,
            "notes": _add_note(state.notes, DISABLED_NOTE),
            "status": "accepted",
            "stop_reason": "accepted",
        }
    )


def l0_stage(state: LoopState, ctx: StageContext) -> LoopState:
    """Layer-0 contract checks (token-free); with critique disabled, the pass-through.

    The first Layer-0 stage of a pass (no repair yet) admits the submission first
    (:func:`admit`), so nothing over ``max_output_bytes`` is processed, whoever sent it.
    """
    if state.attempt == 0:
        admit(state.submission, ctx.config, ctx.read_file)
    if not ctx.config.enabled:
        return _passthrough(state)
    began = ctx.clock()
    outcome = ctx.l0_fn()(state.submission, state.output, state.previous_size)
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
    for gate in outcome.gate_events:
        _emit(ctx, state, "gate", "l0", **gate.model_dump(mode="json"))
    return state.model_copy(update={"l0_defects": outcome.defects, "next": "critic"})


def critic_stage(state: LoopState, ctx: StageContext) -> LoopState:
    """Critique the current output (token-free when L0 failed); record its patterns.

    In a repair round the critique's LLM calls run within what the repair's reservation has
    left (``lease_tokens`` − the repair's spend), and the lease is committed afterwards with
    the round's real spend (:func:`_commit`).
    """
    sub = state.submission
    began = ctx.clock()
    allowance = (
        max(0, state.lease_tokens - state.pending_repair_tokens)
        if state.lease_id is not None
        else None
    )
    try:
        with token_allowance(allowance):
            envelope, cache = _critique(state, ctx)
    except BaseException as exc:
        if state.lease_id is not None and not isinstance(exc, TransientError):
            # The chain ends here: charge what the repair spent and release the hold.
            ctx.budget.commit(sub.run_id, state.lease_id, state.pending_repair_tokens)
        raise
    return _critiqued(state, ctx, envelope, began, cache)


CacheUse = Literal["hit", "miss", ""]
"""What the critique cache did for a critique: served it, stored it, or was not used."""

CACHE_POLL_S = 0.05
"""How often a critique waiting on another's claim looks for the cached envelope."""


def _critique(state: LoopState, ctx: StageContext) -> tuple[CritiqueEnvelope, CacheUse]:
    """The envelope of the current output: the configured critic's (through the critique cache
    when it is on), or a token-free one merged with the Layer-0 defects when Layer-0 failed."""
    sub = state.submission
    round_no = state.round + 1
    cache_use: CacheUse = ""
    if _l0_error(state.l0_defects):
        serving: Critic = resolve_for(ctx.critic, sub)
        fallback: Critic = serving if getattr(serving, "token_free", False) else HeuristicCritic()
        pitfalls = _pitfalls(ctx, sub, fallback)
        base = fallback.critique(sub, state.output, pitfalls=pitfalls, round=round_no)
        envelope = merge_l0(base, state.l0_defects)
    else:
        pitfalls = _pitfalls(ctx, sub, ctx.critic)

        def critique() -> CritiqueEnvelope:
            return ctx.critic.critique(sub, state.output, pitfalls=pitfalls, round=round_no)

        if (
            ctx.cache is not None
            and ctx.config.cache.enabled
            and not is_token_free(ctx.critic, sub)
        ):
            envelope, cache_use = _cached_critique(ctx, ctx.cache, state, critique)
        else:
            envelope = critique()
        if state.l0_defects:
            defects = (*state.l0_defects, *envelope.defects)
            envelope = envelope.model_copy(
                update={"defects": defects, "effort_estimate": effort_for(len(defects))}
            )
    return envelope, cache_use


def critique_cache_key(ctx: StageContext, submission: Submission, output: Any) -> str:
    """The cache key of a critique (SPEC §5.10): a hash of the output, the files (their
    digests or content), the task and contract, the critic configuration and the model. Who
    sent it (run, worker, iteration) is not part of it."""
    serving = resolve_for(ctx.critic, submission)
    doc = {
        "output": output,
        "submission": submission.model_dump(
            mode="json", exclude={"run_id", "worker_id", "iteration", "subtask_signature", "output"}
        ),
        "config": ctx.config.model_dump(mode="json", exclude={"cache", "budget"}),
        "critic": getattr(serving, "name", type(serving).__name__),
    }
    raw = json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def _cached_critique(
    ctx: StageContext,
    cache: CritiqueCache,
    state: LoopState,
    critique: Callable[[], CritiqueEnvelope],
) -> tuple[CritiqueEnvelope, CacheUse]:
    """Serve the critique from the cache, or critique once and store it. Of several
    concurrent identical critiques the first claims the key and the others wait (up to
    ``cache.lock_s``) for its envelope. A fallback envelope is never stored."""
    sub = state.submission
    settings = ctx.config.cache
    key = critique_cache_key(ctx, sub, state.output)

    def cached() -> CritiqueEnvelope | None:
        raw = cache.get(key)
        if raw is None:
            return None
        hit = CritiqueEnvelope.model_validate_json(raw)
        return hit.model_copy(update={"worker_id": sub.worker_id, "usage": Usage()})

    hit = cached()
    if hit is not None:
        return hit, "hit"
    claimed = cache.claim(key, settings.lock_s)
    deadline = time.monotonic() + settings.lock_s
    while not claimed and time.monotonic() < deadline:
        time.sleep(CACHE_POLL_S)
        hit = cached()
        if hit is not None:
            return hit, "hit"
        claimed = cache.claim(key, settings.lock_s)
    if claimed:  # the previous holder may have stored it and let go since our first look
        hit = cached()
        if hit is not None:
            cache.release(key)
            return hit, "hit"
    try:
        envelope = critique()
        if envelope.fallback_reason is None:
            cache.put(key, envelope.model_dump_json(), settings.ttl_s)
    finally:
        if claimed:
            cache.release(key)
    return envelope, "miss"


def _commit(state: LoopState, ctx: StageContext, spent: int) -> tuple[int, tuple[str, ...]]:
    """Commit the open lease with the round's real spend; returns (charge, notes).

    The ledger charges the real figure even past the reservation (never under-counted); when a
    provider reported more than was reserved, the note says so, and the run's budget grants no
    further repairs (SPEC §5.3: the reservation's ``max_tokens`` should have made it impossible).
    """
    lease = state.lease_id
    if lease is None:
        return 0, state.notes
    charged = ctx.budget.commit(state.submission.run_id, lease, spent)
    notes = state.notes
    if charged > state.lease_tokens:
        notes = _add_note(
            notes,
            f"repair {state.attempt}: providers reported {charged} tokens, more than the "
            f"{state.lease_tokens} reserved (lease {lease}); all {charged} charged, and the "
            "run's repair budget grants no further repairs",
        )
    return charged, notes


def _critiqued(
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
    charged, notes = _commit(state, ctx, state.pending_repair_tokens + envelope.usage.tokens)
    if cache == "hit":
        notes = _add_note(
            notes,
            f"round {round_no}: critique cache hit (an identical output was critiqued before; "
            "no tokens spent)",
        )
    if envelope.fallback_reason and not _l0_error(state.l0_defects):
        notes = _add_note(notes, f"critic fallback: {envelope.fallback_reason}")
    if ctx.config.pattern_memory:
        ctx.patterns.record(
            sub.run_id,
            critique_key(state, round_no),
            sub.iteration,
            patterns_from_envelope(envelope),
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
        defects=len(envelope.defects),
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
    ``needs_model``); None when it would fix something, or cannot tell (no ``plan``, or a plan
    of None: a model may fix anything)."""
    plan = getattr(resolve_for(ctx.reviser, submission), "plan", None)
    if plan is None:
        return None
    result: RevisionResult | None = plan(submission, output, envelope)
    return result if result is not None and result.output == output else None


def _needs_model_notes(
    notes: tuple[str, ...],
    ctx: StageContext,
    submission: Submission,
    envelope: CritiqueEnvelope,
    plan: RevisionResult,
) -> tuple[str, ...]:
    """One note saying a model or a person must act, then one per defect left unfixed."""
    reviser = getattr(resolve_for(ctx.reviser, submission), "name", "the reviser")
    lines = [r.line() for r in plan.unfixable] or [
        f"[{d.severity}] {d.category}"
        + (f" at {d.location}" if d.location else "")
        + f": {d.description}"
        for d in envelope.actionable
    ]
    notes = _add_note(
        notes,
        f"needs_model: {reviser} can fix none of the {len(lines)} remaining defect(s) without "
        "inventing content; a model or a person must act on:",
    )
    for line in lines:
        notes = _add_note(notes, f"needs_model: {line}")
    return notes


def repair_bound(ctx: StageContext, state: LoopState, envelope: CritiqueEnvelope) -> RepairBound:
    """What the next repair round reserves (SPEC §5.3): the repair call and its re-critique.

    Each part comes from the reviser or critic that serves the submission: 0 when it is
    token-free (``token_free = True``); its own count when it can size its calls
    (``repair_bound`` / ``critique_bound``: counted prompt + the ``max_tokens`` it will call
    with); else the estimates of :mod:`pipeline.repair`.
    """
    sub = state.submission
    reviser = resolve_for(ctx.reviser, sub)
    critic = resolve_for(ctx.critic, sub)
    known: list[str] = []

    def pitfalls_for(reader: object) -> str:
        if not ctx.config.pattern_memory or not getattr(reader, "reads_pitfalls", True):
            return ""
        if not known:
            known.append(render_pitfalls(ctx.patterns.top(sub.run_id, PITFALLS_LIMIT)))
        return known[0]

    output_tokens = estimated_output_tokens(state.output)
    sized = getattr(reviser, "repair_bound", None)
    if getattr(reviser, "token_free", False):
        repair = 0
    elif sized is not None:
        repair, output_tokens = sized(
            sub, state.output, envelope, pitfalls=pitfalls_for(reviser), attempts=state.attempts
        )
    else:
        repair = estimated_repair_tokens(
            sub, state.output, envelope, pitfalls_for(reviser), state.attempts
        )
    bound = getattr(critic, "critique_bound", None)
    if getattr(critic, "token_free", False):
        critique = 0
    elif bound is not None:
        critique = bound(
            sub,
            state.output,
            output_tokens=output_tokens,
            pitfalls=pitfalls_for(critic),
            round=state.round + 1,
        )
    else:
        critique = estimated_critique_tokens(sub, output_tokens, pitfalls_for(critic))
    return RepairBound(repair=repair, critique=critique, output_tokens=output_tokens)


def refusal_text(tokens: int, cap: int, snap: BudgetSnapshot) -> str:
    """Why the budget refused a repair: what it asked for, the cap, what is spent and held."""
    text = (
        f"repair budget refused {tokens} tokens: cap {cap}, spent {snap.spent}, "
        f"held {snap.held} by {snap.holders} repairs in flight"
    )
    if snap.overrun:
        text += (
            f"; closed since providers reported {snap.overrun} tokens more than was reserved "
            "for their repairs"
        )
    return text


def decide_stage(state: LoopState, ctx: StageContext) -> LoopState:
    """Keep the best output, apply the stop rules, reserve the next repair's budget.

    Before a repair is reserved, a reviser with a ``plan`` (the deterministic ones) is asked
    what it would fix; when that is nothing, the loop stops ``needs_model`` (status
    ``escalated``) with the defects it left listed in the notes: no round is spent on a repair
    that cannot help, and nothing is invented (SPEC §5.3). The same holds once
    ``max_repair_attempts`` is reached: ``needs_model`` then says more than
    ``attempts_exhausted``.

    The reservation is :func:`repair_bound` under the lease :func:`lease_for` (one per pass and
    attempt: a re-run gets the same lease back); a refusal stops the loop
    ``repair_budget_exhausted`` with :func:`refusal_text` as the reason; a round that spends no
    tokens reserves nothing.
    """
    envelope = state.envelope
    if envelope is None:
        raise ValueError("decide_stage needs a critiqued state (envelope is missing)")
    sub = state.submission
    config = ctx.config
    rubric = config.rubric if _rubric_mode(ctx) else None
    score = envelope.score
    l0_failed = _l0_error(state.l0_defects)
    acceptable = is_acceptable(score, envelope, l0_failed)
    target = (
        rubric is not None
        and bool(envelope.scores)
        and target_met(envelope.scores, rubric)
        and not envelope.critical
    )
    mean = weighted_mean(envelope.scores, rubric) if rubric and envelope.scores else score
    previous_score = state.trace[-1].score if state.trace else None

    # Keep-best: an output replaces the best only when strictly better on
    # (target met, acceptable, score); a worse or equal repair never does.
    better = state.best_score is None or (target, acceptable, score) > (
        state.best_target,
        state.best_acceptable,
        state.best_score,
    )
    best_score = score if better or state.best_score is None else state.best_score
    best_acceptable = acceptable if better else state.best_acceptable
    best_target = target if better else state.best_target
    best: dict[str, Any] = {
        "best_output": state.output if better else state.best_output,
        "best_score": best_score,
        "best_envelope": envelope if better else state.best_envelope,
        "best_acceptable": best_acceptable,
        "best_target": best_target,
    }

    def fixpoint() -> bool:
        if state.previous_repair_text is None:
            return False
        return ctx.fixpoint_fn()(state.previous_repair_text, text_of(state.output))

    reason = ""
    stop: StopReason | None
    if rubric is None and state.attempt == 0:
        decision = decide(score, envelope, l0_failed)
        stop = first_round_stop(decision, config.max_repair_attempts)
        reason = decision.reason
    else:
        facts = RoundFacts(
            round=state.round,
            score=score,
            previous_score=previous_score,
            means=(*(t.mean for t in state.trace), mean),
            acceptable=acceptable,
            target=target,
            repairs_done=state.attempt,
        )
        stop = round_stop(
            facts,
            rubric=rubric,
            max_repair_attempts=config.max_repair_attempts,
            fixpoint=fixpoint,
        )

    notes = state.notes
    if stop is None or (stop == "attempts_exhausted" and state.attempt > 0):
        stuck = unfixable_plan(ctx, sub, state.output, envelope)
        if stuck is not None:
            stop = "needs_model"
            reason = STOP_TEXT[stop]
            notes = _needs_model_notes(notes, ctx, sub, envelope, stuck)
    lease_id: str | None = None
    reserved = RepairBound()
    if stop is None:
        cap = config.repair_token_cap
        if cap is None:
            if NO_BUDGET_NOTE not in notes:
                notes = _add_note(notes, NO_BUDGET_NOTE)
                _emit(ctx, state, "stage", "decide", note=NO_BUDGET_NOTE)
        else:
            bound = repair_bound(ctx, state, envelope)
            if bound.total > 0:  # a token-free round (reviser and critic) reserves nothing
                lease = lease_for(ctx, state)
                if ctx.budget.reserve(sub.run_id, lease, bound.total, cap, ctx.lease_ttl_s):
                    lease_id, reserved = lease, bound
                else:
                    stop = "repair_budget_exhausted"
                    reason = refusal_text(bound.total, cap, ctx.budget.snapshot(sub.run_id))

    actionable_ids = tuple(d.id for d in envelope.actionable)
    attempts = state.attempts
    if state.attempt > 0:
        before = set(state.previous_defect_ids)
        attempts = (
            *attempts,
            RepairAttempt(
                worker_id=sub.worker_id,
                attempt=state.attempt,
                original_score=previous_score if previous_score is not None else score,
                repaired_score=score,
                defects_fixed=len(before - set(actionable_ids)),
                defects_remaining=len(actionable_ids),
                stop_reason=stop,
            ),
        )
    if stop is not None and not reason:
        reason = STOP_TEXT[stop]
    verdict = verdict_for(stop)
    current_refs = _defect_refs(envelope.actionable)
    diff: dict[str, tuple[DefectRef, ...]] = {}
    ever_fixed = state.ever_fixed
    if state.trace:
        diff = defect_diff(state.previous_defects, current_refs, state.ever_fixed)
        ever_fixed = _sorted_refs({*state.ever_fixed, *diff["fixed"]})
    round_trace = RoundTrace(
        round=state.round,
        score=score,
        scores=dict(envelope.scores),
        mean=mean,
        defects=len(envelope.defects),
        suggestions_applied=state.suggestions_applied,
        verdict=verdict,
        **diff,
    )
    update: dict[str, Any] = {
        **best,
        "original_score": state.original_score if state.original_score is not None else score,
        "previous_defect_ids": actionable_ids,
        "previous_defects": current_refs,
        "ever_fixed": ever_fixed,
        "attempts": attempts,
        "trace": (*state.trace, round_trace),
        "notes": notes,
        "lease_id": lease_id,
        "lease_tokens": reserved.total,
        "repair_allowance": reserved.repair,
        "next": "repair" if stop is None else "done",
    }
    if stop is not None:
        update["stop_reason"] = stop
        update["status"] = final_status(
            stop,
            repairs_done=state.attempt,
            best_score=best_score,
            best_acceptable=best_acceptable,
            best_target=best_target,
        )
    next_state = state.model_copy(update=update)
    _emit(
        ctx,
        next_state,
        "round",
        "decide",
        **round_trace.model_dump(mode="json", exclude_none=True),
        stop_reason=stop,
        reason=reason,
    )
    return next_state


def _sorted_refs(refs: Iterable[DefectRef]) -> tuple[DefectRef, ...]:
    return tuple(sorted(set(refs), key=lambda r: r.key))


def _defect_refs(defects: Iterable[Defect]) -> tuple[DefectRef, ...]:
    """Defects by (category, location), deduplicated and sorted."""
    return _sorted_refs(DefectRef(category=d.category, location=d.location) for d in defects)


def defect_diff(
    previous: Iterable[DefectRef],
    current: Iterable[DefectRef],
    ever_fixed: Iterable[DefectRef] = (),
) -> dict[str, tuple[DefectRef, ...]]:
    """The round's defect diff (SPEC §5.4), matched by (category, location).

    ``fixed``: in the previous round, gone now; ``remaining``: in both; ``new``: here now, not
    in the previous round and never fixed before; ``regressed``: here now, not in the previous
    round, but fixed in an earlier round. ``new`` and ``regressed`` are disjoint."""
    before = {r.key: r for r in previous}
    now = {r.key: r for r in current}
    fixed_before = {r.key for r in ever_fixed}
    appeared = [r for k, r in now.items() if k not in before]
    return {
        "fixed": _sorted_refs(r for k, r in before.items() if k not in now),
        "remaining": _sorted_refs(r for k, r in now.items() if k in before),
        "new": _sorted_refs(r for r in appeared if r.key not in fixed_before),
        "regressed": _sorted_refs(r for r in appeared if r.key in fixed_before),
    }


def repair_stage(state: LoopState, ctx: StageContext) -> LoopState:
    """Revise the current output for the current envelope; the result goes back through L0.

    With a budget reservation, the reviser's LLM calls run within its repair part
    (``repair_allowance``). A failure that a retry cannot fix releases the reservation; a
    transient one keeps it for the retry (the same lease, so nothing is reserved twice).
    """
    envelope = state.envelope
    if envelope is None:
        raise ValueError("repair_stage needs a critiqued state (envelope is missing)")
    sub = state.submission
    began = ctx.clock()
    try:
        with token_allowance(state.repair_allowance if state.lease_id is not None else None):
            result: RevisionResult = ctx.reviser.revise(
                sub,
                state.output,
                envelope,
                pitfalls=_pitfalls(ctx, sub, ctx.reviser),
                attempts=state.attempts,
            )
    except BaseException as exc:
        if state.lease_id is not None and not isinstance(exc, TransientError):
            ctx.budget.refund(sub.run_id, state.lease_id)
        raise
    current_text = text_of(state.output)
    notes = state.notes
    note = getattr(result, "note", None)
    if note:
        notes = _add_note(notes, f"repair {state.attempt + 1}: {note}")
    next_state = state.model_copy(
        update={
            "notes": notes,
            "output": result.output,
            "attempt": state.attempt + 1,
            "previous_size": len(current_text.encode("utf-8")),
            "previous_repair_text": current_text if state.attempt > 0 else None,
            "usage": state.usage + result.usage,
            "repair_usage": state.repair_usage + result.usage,
            "pending_repair_tokens": result.usage.tokens,
            "suggestions_applied": result.suggestions_applied,
            "next": "l0",
        }
    )
    _emit(
        ctx,
        state,
        "stage",
        "repair",
        attempt=state.attempt + 1,
        reviser=getattr(ctx.reviser, "name", type(ctx.reviser).__name__),
        suggestions_applied=result.suggestions_applied,
        tokens=result.usage.tokens,
        elapsed_ms=round((ctx.clock() - began) * 1000.0, 3),
    )
    return next_state


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
    if envelope is None or state.best_output is None or state.best_score is None:
        raise ValueError("a finished loop must have critiqued at least once")
    sub = state.submission
    return CritiqueResult(
        run_id=sub.run_id,
        iteration=sub.iteration,
        worker_id=sub.worker_id,
        status=state.status,
        stop_reason=state.stop_reason,
        output=state.best_output,
        original_score=state.original_score if state.original_score is not None else 0.0,
        best_score=state.best_score,
        envelope=envelope,
        attempts=state.attempts,
        trace=state.trace,
        usage=state.usage,
        repair_usage=state.repair_usage,
        budget_charged=state.budget_charged,
        pass_id=state.pass_id,
        notes=state.notes,
    )


def _step_limit(config: CritiqueConfig) -> int:
    rounds = max(config.max_repair_attempts, config.rubric.max_rounds) + 2
    return 4 * rounds + 4


def run_submission(submission: Submission, ctx: StageContext, pass_id: str = "") -> CritiqueResult:
    """Run the whole loop in-process and return the result (also written to the trace).

    The first stage admits the submission (:func:`admit`, through ``ctx.read_file``). Nothing
    retries here, so a stage that raises releases the pass's open reservation first."""
    state = start(submission, pass_id)
    steps = 0
    limit = _step_limit(ctx.config)
    while state.next != "done":
        steps += 1
        if steps > limit:
            raise RuntimeError(f"critique loop did not finish within {limit} stages")
        try:
            state = STAGES[state.next](state, ctx)
        except BaseException:
            if state.lease_id is not None:
                ctx.budget.refund(submission.run_id, state.lease_id)
            raise
    result = finish(state)
    if ctx.config.enabled:
        _emit(
            ctx,
            state,
            "result",
            "result",
            status=result.status,
            stop_reason=result.stop_reason,
            best_score=result.best_score,
            original_score=result.original_score,
            attempts=len(result.attempts),
            tokens=result.usage.tokens,
            repair_tokens=result.repair_usage.tokens,
        )
    return result


class CallableReviser:
    """Adapts a configured ``module:function`` repairer to the :class:`Reviser` protocol.

    The function is called like ``Reviser.revise`` and may return a :class:`RevisionResult` or
    just the new output (its usage is then estimated).
    """

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self._fn = fn
        self.name = name

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        """Call the configured function and normalise its answer."""
        got = self._fn(submission, output, envelope, pitfalls=pitfalls, attempts=attempts)
        if isinstance(got, RevisionResult):
            return got
        if isinstance(got, str | dict):
            return RevisionResult(
                output=got,
                usage=estimate_usage(text_of(output), text_of(got)),
                suggestions_applied=len(envelope.actionable),
            )
        raise ExtensionLoadError(
            f"repairer {self.name!r} returned {type(got).__name__}; expected a "
            "RevisionResult, a string or a dict"
        )


def load_reviser(spec: str) -> Reviser:
    """Load a ``package.module:function`` repairer (a Reviser object or a revise-like callable)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
        obj = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise ExtensionLoadError(
            f"cannot load repairer {spec!r}: {exc}", hint="check the 'repairer' setting"
        ) from exc
    if hasattr(obj, "revise"):
        reviser: Reviser = obj
        return reviser
    if callable(obj):
        return CallableReviser(obj, spec)
    raise ExtensionLoadError(f"repairer {spec!r} is neither a Reviser nor callable")


class AutoCritic:
    """``critic: auto`` (SPEC §3): the LLM critic for a submission whose model resolves
    (``model``, else the worker's own in inline mode); the heuristic otherwise."""

    name = "auto"

    def __init__(self, config: CritiqueConfig, llm: Critic, heuristic: Critic) -> None:
        self.config = config
        self.llm = llm
        self.heuristic = heuristic

    def resolve(self, submission: Submission) -> Critic:
        """The critic for this submission."""
        return self.llm if self.config.uses_llm_critic(submission.model) else self.heuristic

    def critique(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        pitfalls: str,
        round: int,
    ) -> CritiqueEnvelope:
        """Critique with the resolved critic."""
        return self.resolve(submission).critique(submission, output, pitfalls=pitfalls, round=round)


class AutoReviser:
    """``repairer: auto``: the LLM reviser (inline: the worker's model) for a submission the
    LLM critic serves, the deterministic reviser that pairs with the critic otherwise."""

    name = "auto"

    def __init__(self, config: CritiqueConfig, llm: Reviser, deterministic: Reviser) -> None:
        self.config = config
        self.llm = llm
        self.deterministic = deterministic

    def resolve(self, submission: Submission) -> Reviser:
        """The reviser for this submission."""
        if self.config.critic in ("auto", "llm") and self.config.uses_llm_critic(submission.model):
            return self.llm
        if self.config.critic == "command" and self.config.critic_model(submission.model):
            return self.llm  # a failing test needs a model to fix it (the prompt quotes it)
        return self.deterministic

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        """Revise with the resolved reviser."""
        return self.resolve(submission).revise(
            submission, output, envelope, pitfalls=pitfalls, attempts=attempts
        )


def default_completer(config: CritiqueConfig) -> Completer:
    """litellm behind the retry policy of ``config.llm`` (litellm loads on the first call)."""
    from pipeline.llm import LiteLLMCompleter

    return LiteLLMCompleter(config.llm)


def _llm_critic(config: CritiqueConfig, complete: Completer) -> Critic:
    from pipeline.critics.llm import LLMCritic, PairedCritic

    critic: Critic = LLMCritic(config, complete)
    if config.paired_critic:
        critic = PairedCritic(critic, config, complete)
    return critic


def pick_critic(
    config: CritiqueConfig,
    complete: Completer | None = None,
    read_file: FileReader | None = None,
) -> Critic:
    """The critic ``config.critic`` names; ``auto`` resolves per submission (LLM when a model
    resolves, else the heuristic). ``complete`` defaults to litellm. ``command`` runs the
    worker's command on the submission's files (read through ``read_file``), merged with the
    heuristic's envelope (:mod:`pipeline.critics.command`)."""
    if config.critic == "heuristic":
        return HeuristicCritic()
    if config.critic == "rubric":
        return RubricCritic(config.rubric)
    if config.critic == "command":
        from pipeline.critics.command import CommandCritic

        return CommandCritic(config, companion=HeuristicCritic(), read_file=read_file)
    llm = _llm_critic(config, complete or default_completer(config))
    if config.critic == "llm":
        return llm
    return AutoCritic(config, llm, HeuristicCritic())


def pick_reviser(config: CritiqueConfig, complete: Completer | None = None) -> Reviser:
    """The reviser ``config.repairer`` names: ``auto`` pairs with the critic (the LLM reviser for
    LLM-critiqued submissions, else the deterministic one), ``llm``, ``deterministic``, or a
    configured ``package.module:function``."""
    deterministic: Reviser = (
        DeterministicReviser() if config.critic == "rubric" else HeuristicReviser()
    )
    if config.repairer == "deterministic":
        return deterministic
    if config.repairer in ("auto", "llm"):
        from pipeline.critics.llm import LLMReviser

        llm = LLMReviser(config, complete or default_completer(config), fallback=deterministic)
        if config.repairer == "llm":
            return llm
        if config.critic in ("heuristic", "rubric"):
            return deterministic
        return AutoReviser(config, llm, deterministic)
    return load_reviser(config.repairer)


def make_context(
    config: CritiqueConfig,
    *,
    critic: Critic | None = None,
    reviser: Reviser | None = None,
    patterns: PatternStore | None = None,
    budget: BudgetLedger | None = None,
    trace: TraceSink | None = None,
    lease_prefix: str = "",
    l0: L0Fn | None = None,
    fixpoint: FixpointFn | None = None,
    clock: Callable[[], float] | None = None,
    lease_ttl_s: float = REPAIR_LEASE_TTL_S,
    complete: Completer | None = None,
    read_file: FileReader | None = None,
    cache: CritiqueCache | None = None,
) -> StageContext:
    """A context from configuration; anything given explicitly replaces the default.

    Defaults: critic and reviser from ``config.critic`` / ``config.repairer`` (LLM calls through
    ``complete``, litellm by default), in-memory
    stores, the real L0 and fixpoint functions (loaded on first use), ``time.monotonic``, and
    a file reader that follows no blob reference (:func:`pipeline.files.inline_bytes`).
    """
    return StageContext(
        config=config,
        critic=critic if critic is not None else pick_critic(config, complete, read_file),
        reviser=reviser if reviser is not None else pick_reviser(config, complete),
        patterns=patterns if patterns is not None else MemoryPatternStore(),
        budget=budget if budget is not None else MemoryBudgetLedger(),
        trace=trace if trace is not None else MemoryTraceSink(),
        lease_prefix=lease_prefix,
        l0=l0,
        fixpoint=fixpoint,
        clock=clock if clock is not None else time.monotonic,
        lease_ttl_s=lease_ttl_s,
        read_file=read_file if read_file is not None else inline_bytes,
        cache=cache if cache is not None else MemoryCritiqueCache(),
    )
