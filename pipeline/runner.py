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

import importlib
import time
from collections.abc import Callable, Sequence
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
from pipeline.errors import ConfigError, ExtensionLoadError, SubmissionError
from pipeline.files import FileReader, inline_bytes
from pipeline.files import read_file as read_file_bytes
from pipeline.llm import Completer
from pipeline.models import (
    CritiqueEnvelope,
    CritiqueResult,
    Defect,
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
from pipeline.repair import decide, is_acceptable, repair_token_bound
from pipeline.store.base import BudgetLedger, PatternStore, TraceSink
from pipeline.store.memory import MemoryBudgetLedger, MemoryPatternStore, MemoryTraceSink
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
    ``f"{worker_id}:{iteration}"`` so submissions sharing a context never share a lease.
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
    pending_repair_tokens: int = Field(0, ge=0)
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


def start(submission: Submission) -> LoopState:
    """The initial state: the submission's output, about to enter Layer-0."""
    return LoopState(submission=submission, output=submission.output)


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
    """Critique the current output (token-free when L0 failed); record its patterns."""
    sub = state.submission
    round_no = state.round + 1
    began = ctx.clock()
    if _l0_error(state.l0_defects):
        serving: Critic = resolve_for(ctx.critic, sub)
        fallback: Critic = serving if getattr(serving, "token_free", False) else HeuristicCritic()
        pitfalls = _pitfalls(ctx, sub, fallback)
        base = fallback.critique(sub, state.output, pitfalls=pitfalls, round=round_no)
        envelope = merge_l0(base, state.l0_defects)
    else:
        pitfalls = _pitfalls(ctx, sub, ctx.critic)
        envelope = ctx.critic.critique(sub, state.output, pitfalls=pitfalls, round=round_no)
        if state.l0_defects:
            defects = (*state.l0_defects, *envelope.defects)
            envelope = envelope.model_copy(
                update={"defects": defects, "effort_estimate": effort_for(len(defects))}
            )
    repairing = state.attempt > 0
    notes = state.notes
    if envelope.fallback_reason and not _l0_error(state.l0_defects):
        notes = _add_note(notes, f"critic fallback: {envelope.fallback_reason}")
    if state.lease_id is not None:
        actual = state.pending_repair_tokens + envelope.usage.tokens
        charged = ctx.budget.commit(sub.run_id, state.lease_id, actual)
        if charged < actual:
            notes = _add_note(
                notes,
                f"repair {state.lease_id} used {actual} tokens, more than its reservation; "
                f"{charged} charged",
            )
    if ctx.config.pattern_memory:
        ctx.patterns.record(
            sub.run_id,
            f"{sub.worker_id}:{sub.iteration}:{round_no}",
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
            "pending_repair_tokens": 0,
            "notes": notes,
            "next": "decide",
        }
    )
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


def decide_stage(state: LoopState, ctx: StageContext) -> LoopState:
    """Keep the best output, apply the stop rules, reserve the next repair's budget.

    Before a repair is reserved, a reviser with a ``plan`` (the deterministic ones) is asked
    what it would fix; when that is nothing, the loop stops ``needs_model`` (status
    ``escalated``) with the defects it left listed in the notes: no round is spent on a repair
    that cannot help, and nothing is invented (SPEC §5.3). The same holds once
    ``max_repair_attempts`` is reached: ``needs_model`` then says more than
    ``attempts_exhausted``.
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
    if stop is None:
        cap = config.repair_token_cap
        if cap is None:
            if NO_BUDGET_NOTE not in notes:
                notes = _add_note(notes, NO_BUDGET_NOTE)
                _emit(ctx, state, "stage", "decide", note=NO_BUDGET_NOTE)
        else:
            prefix = ctx.lease_prefix or f"{sub.worker_id}:{sub.iteration}"
            lease = f"{prefix}:{state.attempt + 1}"
            bound = repair_token_bound(
                sub, state.output, envelope, _pitfalls(ctx, sub, ctx.reviser), state.attempts
            )
            if ctx.budget.reserve(sub.run_id, lease, bound, cap, ctx.lease_ttl_s):
                lease_id = lease
            else:
                stop = "repair_budget_exhausted"
                reason = (
                    f"repair budget refused {bound} tokens (cap {cap}, "
                    f"spent {ctx.budget.spent(sub.run_id)})"
                )

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
    round_trace = RoundTrace(
        round=state.round,
        score=score,
        scores=dict(envelope.scores),
        mean=mean,
        defects=len(envelope.defects),
        suggestions_applied=state.suggestions_applied,
        verdict=verdict,
    )
    update: dict[str, Any] = {
        **best,
        "original_score": state.original_score if state.original_score is not None else score,
        "previous_defect_ids": actionable_ids,
        "attempts": attempts,
        "trace": (*state.trace, round_trace),
        "notes": notes,
        "lease_id": lease_id,
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
        **round_trace.model_dump(mode="json"),
        stop_reason=stop,
        reason=reason,
    )
    return next_state


def repair_stage(state: LoopState, ctx: StageContext) -> LoopState:
    """Revise the current output for the current envelope; the result goes back through L0."""
    envelope = state.envelope
    if envelope is None:
        raise ValueError("repair_stage needs a critiqued state (envelope is missing)")
    sub = state.submission
    began = ctx.clock()
    try:
        result: RevisionResult = ctx.reviser.revise(
            sub,
            state.output,
            envelope,
            pitfalls=_pitfalls(ctx, sub, ctx.reviser),
            attempts=state.attempts,
        )
    except BaseException:
        if state.lease_id is not None:
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
        notes=state.notes,
    )


def _step_limit(config: CritiqueConfig) -> int:
    rounds = max(config.max_repair_attempts, config.rubric.max_rounds) + 2
    return 4 * rounds + 4


def run_submission(submission: Submission, ctx: StageContext) -> CritiqueResult:
    """Run the whole loop in-process and return the result (also written to the trace).

    The first stage admits the submission (:func:`admit`, through ``ctx.read_file``)."""
    state = start(submission)
    steps = 0
    limit = _step_limit(ctx.config)
    while state.next != "done":
        steps += 1
        if steps > limit:
            raise RuntimeError(f"critique loop did not finish within {limit} stages")
        state = STAGES[state.next](state, ctx)
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


def pick_critic(config: CritiqueConfig, complete: Completer | None = None) -> Critic:
    """The critic ``config.critic`` names; ``auto`` resolves per submission (LLM when a model
    resolves, else the heuristic). ``complete`` defaults to litellm."""
    if config.critic == "heuristic":
        return HeuristicCritic()
    if config.critic == "rubric":
        return RubricCritic(config.rubric)
    if config.critic == "command":
        raise ConfigError(
            "critic 'command' is not available in this build",
            key="critic",
            hint="use 'auto', 'llm', 'heuristic' or 'rubric'",
        )
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
) -> StageContext:
    """A context from configuration; anything given explicitly replaces the default.

    Defaults: critic and reviser from ``config.critic`` / ``config.repairer`` (LLM calls through
    ``complete``, litellm by default), in-memory
    stores, the real L0 and fixpoint functions (loaded on first use), ``time.monotonic``, and
    a file reader that follows no blob reference (:func:`pipeline.files.inline_bytes`).
    """
    return StageContext(
        config=config,
        critic=critic if critic is not None else pick_critic(config, complete),
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
    )
