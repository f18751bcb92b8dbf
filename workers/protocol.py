"""The protocol every stage run follows, in one template (:meth:`StageProtocol.process`), and
the task bases that say what its steps mean: :class:`StageTask` for the loop's stages,
:class:`CompletionGateTask` for the manager's completion gate. The tasks themselves are
declarations in :mod:`workers.tasks`.

The steps: *decode* the message (it must be addressed to this task and verify), check it at the
*trust boundary* (its configuration overrides and model against this worker's own), *replay* the
step's recorded output if it has one, else *run* the stage, *record* its output (the first
record of a step wins: a duplicate returns that one), and *refund* a budget reservation the
recorded output does not hold. Step records, pattern records, budget leases, trace events and
the result are keyed by the submission's pass (a fresh pass id per submit: the state's
``pass_id``, the message's ``sid``; see docs/client.md, "Passes: submitting the same submission
again"), step records and leases also by round and attempt, so a redelivered task writes nothing
again. Once the pass's result has landed its step records are gone (Redis holds live state, not
history): a step of it delivered late records nothing and ends its chain there
(:class:`pipeline.store.runs.PassFinished`). Transient errors (Redis, LLM) are retried with
exponential backoff and jitter; permanent ones fail the task at once.

A message that cannot be trusted or read (unsigned, forged or altered while ``CRITIQUE_SECRET``
is set, addressed to another task or task id, or malformed) is refused
(:func:`record_refusal`): a warning in the log (never the payload), a ``refused`` event in the
trace of the run it claims (marked ``run_id_verified: false``; at most
:data:`UNVERIFIED_REFUSALS_TRACED` per run, the rest counted), and the task fails with the
reason, never retried and never turned into a result. A task that fails for good records the
failure in the store for the pass (:meth:`pipeline.store.runs.RedisRunStore.put_failure`) only
when it can attribute it: the message verified and was addressed to it. Clients read that
record, never Celery's ``FAILURE`` state, which anyone who can write to the broker can set for
any task id. See docs/security.md, "Signed messages".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from celery import Task
from celery.backends.base import BaseKeyValueStoreBackend
from celery.utils.log import get_task_logger

from pipeline.config import CritiqueConfig, check_submission_model
from pipeline.errors import ConfigError, CritiqueError, PermanentError, SubmissionError
from pipeline.gates import evaluate_completion
from pipeline.models import CritiqueResult, check_identifier
from pipeline.redaction import scrub
from pipeline.runner import (
    STAGES,
    BudgetWait,
    LoopState,
    PassCancelled,
    StageContext,
    finish,
    is_token_free,
)
from pipeline.store import keys
from pipeline.store.base import encode_event
from pipeline.store.memory import BufferedTraceSink
from pipeline.store.metrics import refusal_reason
from pipeline.store.redis_common import fenced_writes
from pipeline.store.runs import PassFinished, StepRecord, completion_member, pass_member
from workers import routing, runtime, telemetry
from workers.app import app, task_events_off

log = get_task_logger(__name__)

REPLACED: dict[str, Any] = {"replaced": True}
"""What a stage task that handed its chain to a repair round returns (nothing receives it)."""

FINISHED: dict[str, Any] = {"pass_finished": True}
"""What a stage task of a pass that already has its result returns (nothing receives it)."""

OVER = "over"
"""The pseudo-stage after a step of a pass that already has its result: nothing runs next."""

BUDGET_WAIT_HEADER = "critique_budget_wait"
"""A message header marking a task sent again to ask the repair budget once more."""

_CLAIM = "critique_claim"
"""The request attribute naming what a task's failure is recorded against: ``(run id, pass or
completion member, stage)``, set only once its message verified and was addressed to it."""

_CLAIM_LIMIT = 1 << 20
"""Largest inline state a refused message may carry for its claimed run id to be looked up."""

T = TypeVar("T")


# --- failures and refusals -------------------------------------------------------------------


class CritiqueTask(Task):  # type: ignore[misc]
    """A pipeline task: a failure for good (not a retry) is recorded in the store against the
    pass (or completion-gate request) the task's message was attributed to, if any
    (:func:`_record_failure`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The task's body, its acknowledged store writes applied again on the current master
        if a Sentinel failover happened while it ran (:func:`fenced_writes`)."""
        with fenced_writes():
            return super().__call__(*args, **kwargs)

    def on_failure(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        _record_failure(self, exc)


def _attribute(task: Task, run_id: str, field: str, stage: str) -> None:
    """From now on a failure of ``task`` belongs to ``field`` (a pass or completion member) of
    ``run_id``: call only once its message verified and was addressed to the task."""
    if task.request.id:
        setattr(task.request, _CLAIM, (run_id, field, stage))


def one_line(exc: BaseException) -> str:
    """An error's message on one line (at most 500 characters), else its type's name, with
    anything key-like hidden (:func:`pipeline.redaction.scrub`): managers read it (a failure
    reason, an entry task's ``FAILURE``), and an error from a library may quote a provider."""
    message = exc.message if isinstance(exc, CritiqueError) else str(exc)
    return scrub(" ".join(str(message).split()))[:500] or type(exc).__name__


def _record_failure(task: Task, exc: BaseException) -> None:
    """Record a failed task's error against the pass it was attributed to (:func:`_attribute`),
    signed, so the client reports it; a message that never got that far (forged, garbage,
    addressed to another task) records nothing and affects no pass."""
    claim = getattr(task.request, _CLAIM, None)
    if claim is None:
        return
    run_id, field, stage = claim
    try:
        runtime.stores().runs.put_failure(
            run_id,
            field,
            stage=stage,
            error=type(exc).__name__,
            reason=one_line(exc),
            refused=isinstance(exc, (SubmissionError, ConfigError)),
            task_id=str(task.request.id or ""),
        )
    except Exception as store_exc:  # never mask the task's own failure
        log.warning("could not record the failure of %s of run %s: %s", field, run_id, store_exc)


UNVERIFIED_REFUSALS_TRACED = 20
"""Refusals of unverified messages traced per claimed run; later ones are counted there only
(:meth:`pipeline.store.redis.RedisTraceSink.emit_capped`), so unsigned messages naming a run
cannot flood its trace."""


def record_refusal(
    task: Task,
    stage: str,
    exc: Exception,
    run_id: str | None,
    reason: str,
    *,
    verified: bool,
    **where: Any,
) -> None:
    """Record one refused message: a fleet metric, a warning log line (never the payload), and a
    ``refused`` event (with ``where``: the submission's worker and iteration) in the trace of
    ``run_id``. ``verified``: the message passed its signature check, so ``run_id`` is the
    run's; else it is only the run the message claims (the event says so, and files the refusal
    where the run's owner looks)."""
    runtime.metrics().add(f"refused:{refusal_reason(exc)}")
    log.warning(
        "refused a %s message (task %s, %s %s): %s: %s",
        stage,
        task.request.id,
        "run" if verified else "claimed run",
        run_id or "-",
        type(exc).__name__,
        reason,
    )
    if run_id is None:
        return
    event = {
        "type": "refused",
        "stage": stage,
        **where,
        "reason": reason,
        "error": type(exc).__name__,
        "task_id": task.request.id,
    }
    try:
        if verified:
            runtime.stores().trace.emit(run_id, event)
        else:  # anyone may claim any run: at most UNVERIFIED_REFUSALS_TRACED of them per run
            event["run_id_verified"] = False
            runtime.stores().trace.emit_capped(
                run_id, event, "refused_unverified", UNVERIFIED_REFUSALS_TRACED
            )
    except CritiqueError as store_exc:
        log.warning("could not record the refusal in run %s's trace: %s", run_id, store_exc)


def refuse(task: Task, msg: Any, stage: str, exc: Exception) -> None:
    """A message refused before it verified (:func:`record_refusal`): nothing in it is trusted,
    the run id it claims only files the refusal."""
    record_refusal(task, stage, exc, _claimed_run_id(msg), str(exc)[:500], verified=False)


def _claimed_run_id(msg: Any) -> str | None:
    """The run id a message says it belongs to (a gate request's ``run_id``, an inline state's
    ``submission.run_id``), if it is a valid identifier; else None. Never fetches a blob."""
    if not isinstance(msg, dict):
        return None
    run_id = msg.get("run_id")
    if run_id is None and isinstance(msg.get("submission"), dict):
        run_id = msg["submission"].get("run_id")  # an entry message (critique.submit)
    state = msg.get("state")
    if run_id is None and isinstance(state, str) and len(state) <= _CLAIM_LIMIT:
        try:
            run_id = json.loads(state).get("submission", {}).get("run_id")
        except (ValueError, AttributeError, RecursionError):
            return None
    if not isinstance(run_id, str):
        return None
    try:
        return check_identifier(run_id, "run_id")
    except ValueError:
        return None


def from_broker(task: Task, msg: Any, stage: str, decode: Callable[..., T]) -> T:
    """``decode`` (a ``runtime`` decoder) of a message off the broker, which must be addressed
    to this task and its id (with ``CRITIQUE_SECRET`` set); a refused message is recorded
    first."""
    try:
        return decode(msg, task=task.name, task_id=str(task.request.id or ""))
    except PermanentError as exc:
        refuse(task, msg, stage, exc)
        raise


def boundary_config(
    task: Task,
    overrides: dict[str, Any],
    stage: str,
    run_id: str,
    iteration: int,
    worker_id: str | None = None,
    model: str | None = None,
) -> CritiqueConfig:
    """The message's configuration past the trust boundary: its overrides and the submission's
    model are checked against this worker's own configuration before anything is built,
    imported or called (see docs/security.md, "Who may set what"). A refusal is recorded
    (:func:`record_refusal`) and fails the task (permanent: never retried)."""
    try:
        config = runtime.config_for(overrides)
        check_submission_model(model, runtime.own_config())
    except PermanentError as exc:
        where = {"worker_id": worker_id, "iteration": iteration}
        record_refusal(task, stage, exc, run_id, exc.message, verified=True, **where)
        raise
    return config


# --- the protocol ----------------------------------------------------------------------------


class StageProtocol(CritiqueTask):
    """The one protocol every stage run follows (:meth:`process`); a task base declares its
    steps. Each step is a method, so the order is read in one place and a kind of task (a loop
    stage, the completion gate) only says what each step means for it."""

    def process(self, msg: Any, stage: str, prev: Any = None) -> Any:
        """decode → boundary → replay → run → record → refund; returns what the run hands on
        (a replayed output, or the output it recorded, or the one recorded first)."""
        job = self.decode(msg, stage, prev)
        job = self.boundary(job)
        replayed = self.replay(job)
        if replayed is not None:
            return replayed
        run = self.run_stage(job)
        handed = self.record(job, run)
        self.refund(job, run, handed)
        return handed

    def decode(self, msg: Any, stage: str, prev: Any) -> Any:
        """The message, verified and decoded, as this kind's job; a refusal fails the task."""
        raise NotImplementedError

    def boundary(self, job: Any) -> Any:
        """The job past the trust boundary (its configuration checked); a refusal fails it."""
        raise NotImplementedError

    def replay(self, job: Any) -> Any:
        """What the job hands on without running: its recorded output, if any; else None."""
        raise NotImplementedError

    def run_stage(self, job: Any) -> Any:
        """Run the job's stage (nothing is written to the store yet)."""
        raise NotImplementedError

    def record(self, job: Any, run: Any) -> Any:
        """Record the run's output unless a record of the step is there already; returns the
        output that stands (the first recorded)."""
        raise NotImplementedError

    def refund(self, job: Any, run: Any, handed: Any) -> None:
        """Give back what the run reserved and the standing output does not hold (nothing by
        default)."""


# --- the loop's stages -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """What one stage run hands on: the message for the next stage (``out``, addressed to its
    consumer), that stage's name, and the message's decoded state and overrides. ``fresh``:
    this run produced and recorded the output first, so no record of the next step can exist
    yet (a duplicate racing it is settled when that step is recorded)."""

    out: dict[str, Any]
    next: str
    state: LoopState
    overrides: dict[str, Any]
    fresh: bool = False
    held: tuple[StepRecord, ...] = ()
    """Records of this task's steps not written yet (this one's last): token-free steps whose
    next stage runs in this task too are written with the next record this task makes, or,
    when the pass ends here, only their trace events, with its result
    (:meth:`StageTask.record`)."""


@dataclasses.dataclass(frozen=True)
class StageJob:
    """One stage to run on one message: the message, its decoded ``state`` and ``overrides``,
    its pass id ``pass_id``, and ``prev``, the step this task just ran (whose ``out`` is the
    message: it is not decoded nor checked at the trust boundary again, this task made it from
    one that was)."""

    msg: dict[str, Any]
    stage: str
    state: LoopState
    overrides: dict[str, Any]
    pass_id: str
    prev: Step | None

    @property
    def run_id(self) -> str:
        return self.state.submission.run_id

    @functools.cached_property
    def passed(self) -> LoopState:
        """The state under its pass id (a state built without one, as ``runner.start(sub)``
        builds it, travels with its pass id in the message's ``sid`` only)."""
        if self.state.pass_id == self.pass_id:
            return self.state
        return self.state.model_copy(update={"pass_id": self.pass_id})

    @functools.cached_property
    def step(self) -> str:
        """The step id this run is recorded under (:func:`keys.step_id`)."""
        sub = self.state.submission
        member = pass_member(sub.iteration, sub.worker_id, self.pass_id)
        return keys.step_id(member, self.state.round, self.state.attempt, self.stage)

    @functools.cached_property
    def context(self) -> StageContext:
        """The stage context of the message's configuration (built once per process)."""
        return runtime.context_for(self.overrides)


@dataclasses.dataclass(frozen=True)
class StageRun:
    """One stage run's output, not yet recorded: the new state, the message that carries it to
    its consumer, and the trace events the stage buffered."""

    state: LoopState
    out: dict[str, Any]
    events: Sequence[str]


class ReplacingStage(CritiqueTask):
    """A task that may hand its chain on to a replacement (``Task.replace``).

    ``Task.replace`` builds the replacement (the rest of the chain, callbacks, errbacks and ids
    moved onto it) and calls :meth:`on_replace`, which publishes it and, in Celery's own,
    raises ``Ignore``; Celery then builds two ``ExceptionInfo`` of that exception (formatted
    tracebacks: milliseconds each, on every repair round). Here the task ends normally
    instead: the replacement is published the same way, then this task's own chain and
    callbacks are dropped (the replacement carries them), so Celery sends nothing after it and,
    with ``ignore_result``, stores nothing. Run eagerly (``apply``), Celery's own runs the
    replacement in place."""

    def on_replace(self, sig: Any) -> Any:
        if self.request.is_eager:
            return super().on_replace(sig)
        sig.delay()
        _send_nothing_after(self)
        return dict(REPLACED)


def _send_nothing_after(task: Task) -> None:
    """Drop the rest of this task's chain and its callbacks: Celery sends nothing after it
    (a replacement or a re-sent message carries them, or the pass is over)."""
    task.request.chain = None
    task.request.callbacks = None


class StageTask(StageProtocol, ReplacingStage):
    """A task of the loop's stages (``l0``, ``critic``, ``decide``, ``repair``): runs its stage
    by the protocol, then every stage after it that runs here (:meth:`drive`).

    At-least-once delivery can hand a step to a second worker after the first one ran it
    (e.g. killed between finishing and acknowledging). The first completed output of each
    step is recorded in the pass's step records, atomically with the step's trace events; a
    repeat returns that output unchanged (and writes no event), so every duplicate downstream
    of it replays too and the result is the same."""

    def drive(self, msg: dict[str, Any], stage: str) -> dict[str, Any]:
        """Run ``stage`` on ``msg``, then every stage after it that runs in this task
        (:func:`workers.routing.runs_here`), each with its own step record, replay and trace
        events; then hand the state on (:meth:`hand_on`), or, when the pass is over, finish it
        here (the gate) and return its summary.

        While a repair's budget reservation waits for held tokens, the task is handed back to
        the broker (:meth:`wait_for_budget`); run eagerly (no broker), it waits here."""
        step: Step | None = None
        nxt, out = stage, msg
        while True:
            try:
                step = self.process(out, nxt, step)
            except BudgetWait as wait:
                # The message is sent again from its first stage: what this run holds is
                # made again by the re-run.
                if not self.request.is_eager:
                    return self.wait_for_budget(wait)
                time.sleep(wait.retry_s)
                continue
            except PassCancelled:
                return self.end_cancelled(nxt)
            except Exception:
                self.write_held(step)
                raise
            nxt, out = step.next, step.out
            if nxt == OVER:
                return out
            if not routing.runs_here(self, nxt, step.state, step.overrides):
                self.write_held(step)  # none: a step is held only before a stage run here
                return self.hand_on(step)
            if nxt == "done":
                return self.finish_here(out, step.state, step.held)

    # The protocol's steps, for one loop stage.

    def decode(self, msg: dict[str, Any], stage: str, prev: Step | None) -> StageJob:
        """The message's state and overrides (``prev``'s when this task made the message),
        its pass; from here a failure of the task is the pass's (:func:`_attribute`)."""
        if prev is None:
            state, overrides = from_broker(self, msg, stage, runtime.decode)
            setattr(self.request, routing.FIRST_ATTEMPT, state.attempt)
        else:
            state, overrides = prev.state, prev.overrides
        pass_id = _pass_id(self, msg, state, stage)
        sub = state.submission
        _attribute(self, sub.run_id, pass_member(sub.iteration, sub.worker_id, pass_id), stage)
        return StageJob(msg, stage, state, overrides, pass_id, prev)

    def boundary(self, job: StageJob) -> StageJob:
        if job.prev is None:
            sub = job.state.submission
            boundary_config(
                self, job.overrides, job.stage, sub.run_id, sub.iteration, sub.worker_id, sub.model
            )
            _check_stage(self, job.state, job.stage)
        return job

    def replay(self, job: StageJob) -> Step | None:
        """A step whose re-run would spend tokens (:func:`_spends_tokens`),
        a ``decide`` that may reserve budget, and any repeated message read the step's record
        first and replay it; a step of a finished pass ends the chain (:meth:`end_finished`).
        Other first runs read nothing: they cost nothing to run again."""
        # A step run on the output this task just recorded first (a repair after its decide)
        # cannot have a record yet: no read; nor can a decide after a step this task holds.
        # Any other token-free stage runs without one: its record (or, when the pass ends in
        # this task, its result) is first-wins, so a duplicate replays there and a pass that
        # has its result by then (cancelled while the message waited) writes nothing.
        prev = job.prev
        if prev is not None and prev.fresh and (job.stage == "decide" or not prev.held):
            return None
        try:
            if (
                job.stage == "decide"
                or _spends_tokens(job.stage, job.context, job.passed)
                or _repeated(self)
            ):
                recorded = runtime.stores().runs.step_output(job.run_id, job.step)
                if recorded is not None:
                    return self.replayed(recorded)
        except PassFinished:
            return self.end_finished(job)
        return None

    def run_stage(self, job: StageJob) -> StageRun:
        """The stage function on the state, its trace events buffered for the record; a
        repair sends a ``task-progress`` event (Flower)."""
        buffer = BufferedTraceSink()
        sub = job.state.submission
        runs = runtime.stores().runs
        ctx = dataclasses.replace(
            job.context,
            trace=buffer,
            max_budget_wait_s=_budget_wait_cap(self),
            cancelled=lambda: runs.pass_finished(
                sub.run_id, sub.iteration, sub.worker_id, job.pass_id
            ),
            park=lambda state, ttl_s: runs.park(
                sub.run_id, state.pass_id, state.model_dump_json(), ttl_s
            ),
            parked=lambda pass_id: _parked_state(runs.parked(sub.run_id, pass_id)),
        )
        began = time.monotonic()
        with telemetry.stage_span(job.stage, job.passed, job.pass_id) as traced:
            new = STAGES[job.stage](job.passed, ctx)
            traced.ran(job.stage, new, lambda: buffer.read(job.run_id))
        runtime.metrics().observe(job.stage, time.monotonic() - began)
        if job.stage == "repair" and not task_events_off():
            self.send_event(
                "task-progress",
                run_id=job.run_id,
                worker_id=new.submission.worker_id,
                attempt=new.attempt,
            )
        to, to_id = routing.consumer(self, new.next, new, job.overrides)
        out = runtime.encode(
            new, job.overrides, pass_id=job.pass_id or None, task=to, task_id=to_id
        )
        return StageRun(new, out, buffer.payloads.get(job.run_id, ()))

    def record(self, job: StageJob, run: StageRun) -> Step:
        """The step's output and events recorded in one atomic step, unless another delivery
        recorded first: then that output stands (replayed).

        A step whose re-run costs nothing (:meth:`holds`) is held instead, and written with
        the next record this task makes, in the same script (each step first-wins in turn: at
        one recorded already, the output recorded first is replayed and the held steps after it
        are dropped); when the pass ends in this task, its result is the record and the held
        steps' trace events go with it (their records would be deleted with the result). A task
        that ends any other way (a failure included) writes what it holds first, so every
        task's steps are recorded before it ends, as the stall rule assumes."""
        held = job.prev.held if job.prev is not None else ()
        mine = StepRecord(job.step, json.dumps(run.out), tuple(run.events))
        if self.holds(job, run):
            return Step(
                run.out, run.state.next, run.state, job.overrides, fresh=True, held=(*held, mine)
            )
        try:
            stood = runtime.stores().runs.record_steps(job.run_id, (*held, mine))
        except PassFinished:
            return self.end_finished(job)
        if stood is None:
            return Step(run.out, run.state.next, run.state, job.overrides, fresh=True)
        return self.replayed(stood[1])

    def holds(self, job: StageJob, run: StageRun) -> bool:
        """Whether the step's record may wait for this task's next one: its re-run spends no
        tokens, it holds no budget lease, its next stage runs in this task (the gate
        included), and the operator does not keep step records for inspection
        (``CRITIQUE_STEPS_GRACE_S``)."""
        nxt = run.state.next
        return (
            nxt != OVER
            and run.state.lease_id is None
            and not runtime.stores().runs.keeps_steps
            and not _spends_tokens(job.stage, job.context, job.passed)
            and routing.runs_here(self, nxt, run.state, job.overrides)
        )

    def settle(self, step: Step) -> Step:
        """``step`` with what it holds written (:meth:`record`): the step that stands."""
        if not step.held:
            return step
        run_id = step.state.submission.run_id
        try:
            stood = runtime.stores().runs.record_steps(run_id, step.held)
        except PassFinished:
            log.info("steps %s belong to a finished pass: its chain ends here", self.request.id)
            _send_nothing_after(self)
            return Step(dict(FINISHED), OVER, step.state, step.overrides)
        if stood is None:
            return dataclasses.replace(step, held=())
        return self.replayed(stood[1])

    def write_held(self, step: Step | None) -> None:
        """Write the records ``step`` holds (a task ending before its next record: a stage
        that raised). Best effort: the task's own failure is what it reports."""
        if step is None:
            return
        try:
            self.settle(step)
        except Exception as exc:  # the stage's own error is the one raised
            log.warning("could not record the steps %s held: %s", self.request.id, one_line(exc))

    def refund(self, job: StageJob, run: StageRun, handed: Step) -> None:
        """A budget lease the run reserved that the standing output does not hold is refunded:
        the pass is over, or another delivery of this decide recorded first without it (it was
        refused the budget, say). A repair that ran for a pass over by now (cancelled while it
        called its model) is charged what it spent instead: the tokens were spent (a commit is
        once per lease, so a duplicate of a committed repair charges nothing more)."""
        lease = run.state.lease_id
        if lease is None:
            return
        if handed.next == OVER and job.stage == "repair":
            job.context.budget.commit(job.run_id, lease, run.state.pending_repair_tokens)
        elif handed.next == OVER or handed.state.lease_id != lease:
            job.context.budget.refund(job.run_id, lease)

    # What the protocol's steps hand on.

    def replayed(self, recorded: str) -> Step:
        """A step's recorded output, addressed to this run's consumer of it (a duplicate
        chain's next task has another id)."""
        out = dict(json.loads(recorded))
        state, overrides = runtime.decode(out)
        telemetry.event("critique.replayed", next=state.next, round=state.round)
        return Step(routing.addressed(self, out, state, overrides), state.next, state, overrides)

    def end_finished(self, job: StageJob) -> Step:
        """End this task's chain here: its pass has its result already (this is a late
        redelivery, or a duplicate chain), and its step records were released with it. Nothing
        is recorded or sent on, so the stored result and the trace stay as they are."""
        log.info("step %s belongs to a finished pass: its chain ends here", job.step)
        _send_nothing_after(self)
        return Step(dict(FINISHED), OVER, job.passed, job.overrides)

    def end_cancelled(self, stage: str) -> dict[str, Any]:
        """End this task's chain before a model call: the pass was cancelled while the stage
        ran (:class:`pipeline.runner.PassCancelled`). The cancel wrote the pass's result, so
        nothing is recorded or sent on (the stage released its own budget hold)."""
        log.info(
            "task %s: its pass was cancelled during %s: its chain ends here", self.request.id, stage
        )
        _send_nothing_after(self)
        return dict(FINISHED)

    def hand_on(self, step: Step) -> dict[str, Any]:
        """Send the state to the stage this task does not run: this task is replaced by that
        stage's task (:func:`workers.routing.stage_signature`) under its own id. Under a worker
        the replaced task returns REPLACED (:meth:`ReplacingStage.on_replace`); eagerly, the
        replacement's answer."""
        config = runtime.config_for(step.overrides)
        sig = routing.stage_signature(step.next, step.out, config, step.state.submission)
        replaced: dict[str, Any] = self.replace(sig.set(task_id=str(self.request.id)))
        return replaced

    def finish_here(
        self, msg: dict[str, Any], state: LoopState, held: Sequence[StepRecord] = ()
    ) -> dict[str, Any]:
        """The gate, run by the task that finished the loop: store the pass's result
        (:func:`finish_pass`) and, under this task's id (the one the client's signature was
        sent with, kept by every replacement), the summary in Celery's result backend, as the
        gate task stores its own, so any Celery client's ``AsyncResult`` of it returns it."""
        summary, first = _finish(self, msg, state, [e for s in held for e in s.events])
        if not self.request.is_eager and self.request.id:
            store_summary(self.backend, str(self.request.id), summary, self.request, first=first)
        return summary

    def wait_for_budget(self, wait: BudgetWait) -> dict[str, Any]:
        """Send this task's message again to run in ``wait.retry_s`` (the same message, task
        id, chain and retry count), then end this run without handing anything on: no worker
        thread is held while held budget tokens settle, waiting never uses up the retries
        transient errors get, and nothing is stored for it (a Celery retry would store a RETRY
        state, traceback included, for days). The re-run replays the critic's recorded step
        before asking the budget again; the ledger bounds the total wait (it keeps when the
        lease began to wait)."""
        request = self.request
        log.info(
            "task %s asks the repair budget again in %.1f s: %s", request.id, wait.retry_s, wait
        )
        sig = self.signature_from_request(
            request,
            countdown=wait.retry_s,
            retries=request.retries,
            headers={BUDGET_WAIT_HEADER: 1},
        )
        sig.apply_async()
        # The re-sent message carries the rest of the chain: this run sends nothing after it.
        _send_nothing_after(self)
        return {"waiting_for_budget_s": round(wait.retry_s, 3), "reason": wait.reason}


def _parked_state(doc: dict[str, Any] | None) -> LoopState | None:
    """A parked pass's state as the runner resumes it (None: none, or not a valid state)."""
    if doc is None:
        return None
    try:
        return LoopState.model_validate(doc)
    except ValueError:
        log.warning("a parked pass state does not validate: ignored")
        return None


def _pass_id(task: Task, msg: dict[str, Any], state: LoopState, stage: str) -> str:
    """The message's pass: the state's ``pass_id``, else the message's ``sid`` (which
    :func:`workers.runtime.encode` always writes). A message with neither is refused."""
    pass_id = state.pass_id or str(msg.get("sid") or "")
    if not pass_id:
        exc = SubmissionError("stage message: no pass id ('sid')")
        refuse(task, msg, stage, exc)
        raise exc
    return pass_id


def _check_stage(task: Task, state: LoopState, stage: str) -> None:
    """Refuse a message whose state is not at the task's stage: every sender (the client, the
    entry task, a replacement, a re-driven pass) sends a state to the task of its next stage."""
    if state.next == stage:
        return
    sub = state.submission
    exc = SubmissionError(f"a {stage} message carries a state at {state.next!r}")
    where = {"worker_id": sub.worker_id, "iteration": sub.iteration}
    record_refusal(task, stage, exc, sub.run_id, exc.message, verified=True, **where)
    raise exc


def _spends_tokens(stage: str, ctx: StageContext, state: LoopState) -> bool:
    """Stages whose re-run would spend tokens again: the repair, and a critic that calls an LLM.

    Only these (and ``decide``, which may reserve budget) read the step record before running.
    Re-running any other stage is harmless (pattern records and budget leases are idempotent,
    the step record keeps the first output and its events), so they skip that round trip
    unless the message is a known repeat.
    """
    if stage == "repair":
        return True
    return stage == "critic" and not is_token_free(ctx.critic, state.submission)


def _repeated(task: Task) -> bool:
    """True when Celery says this message was delivered or tried before (or it is a task
    handed back to wait for the repair budget, :meth:`StageTask.wait_for_budget`)."""
    request = task.request
    info = request.delivery_info or {}
    return (
        bool(info.get("redelivered"))
        or bool(request.retries)
        or bool(getattr(request, BUDGET_WAIT_HEADER, None))
    )


def _budget_wait_cap(task: Task) -> float:
    """The most a repair waits for held budget tokens on this worker: half the task's soft
    time limit, so the wait stays within the task's time limit (see docs/pipeline.md, "The
    repair budget")."""
    limit = task.soft_time_limit or app.conf.task_soft_time_limit or app.conf.task_time_limit
    return float(limit) / 2.0 if limit else 60.0


def finish_pass(task: Task, msg: dict[str, Any], state: LoopState) -> dict[str, Any]:
    """Store the pass's result and write its ``result`` event, both in one atomic step and
    once per pass (a re-run writes nothing); return a summary (the entry task's result):
    ``checked`` is false and ``best_score`` null for an ``unchecked`` or ``cancelled`` pass.
    Traced as the span ``critique gate``, with the verdict that stands as its
    ``gen_ai.evaluation.result`` event (:mod:`workers.telemetry`)."""
    return _finish(task, msg, state)[0]


def store_summary(backend: Any, task_id: str, summary: Any, request: Any, *, first: bool) -> None:
    """The pass's summary under ``task_id`` in Celery's result backend (``store_result``:
    ``mark_as_done`` would honour the stage tasks' ``ignore_result``). The first store of the
    pass's result writes it at once; Celery's ``store_result`` reads the key first (a stored
    ``SUCCESS`` stands), a round trip only a repeat needs (a redelivery, whose first run may
    have died between the two writes)."""
    if not first or not isinstance(backend, BaseKeyValueStoreBackend):
        backend.store_result(task_id, summary, "SUCCESS", request=request)
        return
    meta = backend._get_result_meta(  # Celery's own meta (celery 5.7: constraints.txt)
        result=summary, state="SUCCESS", traceback=None, request=request
    )
    meta["task_id"] = task_id
    backend.set(backend.get_key_for_task(task_id), backend.encode(meta))


def _finish(
    task: Task, msg: dict[str, Any], state: LoopState, before: Sequence[str] = ()
) -> tuple[dict[str, Any], bool]:
    """:func:`finish_pass`, and whether this call stored the pass's result (the first);
    ``before``: trace events of steps this task ran and holds, written with the result."""
    pass_id = _pass_id(task, msg, state, "gate")
    sub = state.submission
    _attribute(task, sub.run_id, pass_member(sub.iteration, sub.worker_id, pass_id), "gate")
    if state.pass_id != pass_id:
        state = state.model_copy(update={"pass_id": pass_id})
    began = time.monotonic()
    with telemetry.stage_span("gate", state, pass_id) as traced:
        result = finish(state)
        event = result.trace_event(round=state.round, stage="gate")
        runs = runtime.stores().runs
        # The pass leaves the pending index in the same step: it can no longer stall.
        first = runs.put_result(result, pass_id=pass_id, events=[*before, encode_event(event)])
        if first:
            _count_result(result)
            runtime.metrics().observe("gate", time.monotonic() - began)
        else:  # the result stored first stands (a cancel's, or another delivery's)
            result = runs.pass_result(sub.run_id, sub.iteration, sub.worker_id, pass_id) or result
        traced.verdict(result)
    return pass_summary(result), first


def pass_summary(result: CritiqueResult) -> dict[str, Any]:
    """What a pass's task id holds in Celery's result backend: its verdict in brief, and for
    an escalated or failed output why (its deciding defects, at most three, then what to do
    next) — a manager that cannot read the store still learns what to send back."""
    return {
        "run_id": result.run_id,
        "iteration": result.iteration,
        "worker_id": result.worker_id,
        "status": result.status,
        "stop_reason": result.stop_reason,
        "best_score": result.best_score,
        "checked": result.checked,
        "why": list(result.why()),
    }


def _count_result(result: CritiqueResult) -> None:
    """The fleet metrics of a pass's result, counted once (its first store)."""
    m = runtime.metrics()
    m.add(f"outputs:{result.status}")
    m.add("tokens:critique", max(0, result.usage.tokens - result.repair_usage.tokens))
    m.add("tokens:repair", result.repair_usage.tokens)
    m.add("budget_charged", result.budget_charged)


# --- the completion gate ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GateJob:
    """One completion-gate request, and its configuration once past the trust boundary."""

    req: runtime.GateRequest
    config: CritiqueConfig | None = None


class CompletionGateTask(StageProtocol):
    """The manager's completion gate by the protocol: the first decision per ``request_id`` is
    recorded (signed) and replayed on redelivery, and a rejection is counted once per request,
    so ``max_rejected_completions`` → partial is never double-counted; the client reads the
    recorded decision, not this task's result in Celery's backend."""

    def decode(self, msg: Any, stage: str, prev: Any) -> GateJob:
        req = from_broker(self, msg, stage, runtime.decode_gate_request)
        _attribute(self, req.run_id, completion_member(req.request_id), stage)
        return GateJob(req)

    def boundary(self, job: GateJob) -> GateJob:
        req = job.req
        config = boundary_config(self, req.config, "complete_gate", req.run_id, req.iteration)
        return dataclasses.replace(job, config=config)

    def replay(self, job: GateJob) -> dict[str, Any] | None:
        recorded: dict[str, Any] | None = runtime.stores().runs.completion(
            job.req.run_id, job.req.request_id
        )
        return recorded

    def run_stage(self, job: GateJob) -> tuple[dict[str, Any], list[str]]:
        """The decision over the run's stored results, as JSON, with its trace events."""
        req, runs = job.req, runtime.stores().runs
        assert job.config is not None  # set by boundary
        decision = evaluate_completion(
            run_id=req.run_id,
            iteration=req.iteration,
            final_result=req.final_result,
            results=runs.results(req.run_id, req.iteration),
            files=req.files,
            task=req.task,
            deliverable_expected=req.deliverable_expected,
            config=job.config,
            previous_rejections=runs.rejections(req.run_id),
            read_bytes=runtime.file_bytes,
        )
        events = [
            encode_event({"type": "gate", "stage": "complete_gate", **e.model_dump(mode="json")})
            for e in decision.events
        ]
        completion = {
            "type": "completion",
            "stage": "complete_gate",
            "iteration": req.iteration,
            "verdict": decision.verdict,
            "reasons": list(decision.reasons),
        }
        events.append(encode_event(completion))
        return json.loads(decision.model_dump_json()), events

    def record(self, job: GateJob, run: tuple[dict[str, Any], list[str]]) -> dict[str, Any]:
        """The first decision per request stands; a rejection is counted once per request."""
        req, runs = job.req, runtime.stores().runs
        out, events = run
        first = runs.record_completion(req.run_id, req.request_id, out, events)
        if first:
            out = first
        if out["verdict"] != "complete":
            runs.count_rejection_once(req.run_id, req.request_id)
        return dict(out)
