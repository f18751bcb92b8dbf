"""How every task of the pipeline runs: one Task base, :class:`PipelineTask`, and plain
functions for what a task does with its message. The tasks themselves are declarations in
:mod:`workers.tasks`.

A loop stage's task (:func:`drive`) *takes* its message off the broker (:func:`take`: it must
be addressed to this task and verify, carry a pass id, pass the *trust boundary*, its
configuration overrides and model checked against this worker's own, and be at the task's
stage), then runs stage after stage (:func:`run_step`): it *replays* a step's recorded output if
it has one, else *runs* the stage, *records* its output (the first record of a step wins: a
duplicate returns that one), and *refunds* a budget reservation the recorded output does not
hold. Step records, pattern records, budget leases, trace events and the result are keyed by
the submission's pass (a fresh pass id per submit: the state's ``pass_id``, the message's
``sid``; see docs/client.md, "Passes: submitting the same submission again"), step records and
leases also by round and attempt, so a redelivered task writes nothing again. Once the pass's
result has landed its step records are gone (Redis holds live state, not history): a step of
it delivered late records nothing and ends its task there
(:class:`pipeline.store.runs.PassFinished`). Transient errors (Redis, LLM) are retried with
exponential backoff and jitter; permanent ones fail the task at once. The manager's completion
gate (:func:`run_completion_gate`) follows the same steps over a request.

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
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from celery import Signature, Task
from celery.app.task import Context
from celery.backends.base import Backend, BaseKeyValueStoreBackend
from celery.utils.log import get_task_logger

from pipeline.config import CritiqueConfig, check_submission_model
from pipeline.errors import (
    ConfigError,
    CritiqueError,
    PermanentError,
    SubmissionError,
    error_line,
)
from pipeline.loop.gates import evaluate_completion
from pipeline.loop.stages import (
    STAGES,
    BudgetWait,
    LoopState,
    PassCancelled,
    StageContext,
    finish,
    is_token_free,
)
from pipeline.models import CritiqueResult, PassRef, check_identifier
from pipeline.security.redaction import scrub
from pipeline.store import keys
from pipeline.store.base import encode_event
from pipeline.store.memory import BufferedTraceSink
from pipeline.store.metrics import refusal_reason
from pipeline.store.redis_common import fenced_writes
from pipeline.store.runs import PassFinished, StepRecord, completion_member
from workers import routing, runtime, telemetry
from workers.app import app, task_events_off

log = get_task_logger(__name__)

REPLACED: dict[str, Any] = {"replaced": True}
"""What a task that replaced itself returns (nothing receives it)."""

FINISHED: dict[str, Any] = {"pass_finished": True}
"""What a stage task of a pass that already has its result returns (nothing receives it)."""

BUDGET_WAIT_HEADER = "critique_budget_wait"
"""A message header marking a task sent again to ask the repair budget once more."""

_CLAIM = "critique_claim"
"""The request attribute naming what a task's failure is recorded against: ``(run id, pass or
completion member, stage)``, set only once its message verified and was addressed to it."""

_CLAIM_LIMIT = 1 << 20
"""Largest inline state a refused message may carry for its claimed run id to be looked up."""

T = TypeVar("T")


# --- the task base ---------------------------------------------------------------------------


class PipelineTask(Task):  # type: ignore[misc]
    """Every task of the pipeline.

    Its body runs with its acknowledged store writes applied again on the current master if a
    Sentinel failover happened meanwhile (:func:`fenced_writes`). A failure for good (not a
    retry) is recorded in the store against the pass (or completion-gate request) its message
    was attributed to, if any (:func:`_record_failure`).

    ``Task.replace`` builds the replacement (the rest of the chain, callbacks, errbacks and ids
    moved onto it) and calls :meth:`on_replace`, which publishes it and, in Celery's own,
    raises ``Ignore``; Celery then builds two ``ExceptionInfo`` of that exception (formatted
    tracebacks: milliseconds each, on every repair round). Here the task ends normally
    instead: the replacement is published the same way, then this task's own chain and
    callbacks are dropped (the replacement carries them), so Celery sends nothing after it and,
    with ``ignore_result``, stores nothing. Run eagerly (``apply``), Celery's own runs the
    replacement in place."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with fenced_writes():
            return super().__call__(*args, **kwargs)

    def on_failure(
        self,
        exc: BaseException,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        einfo: Any,
    ) -> None:
        _record_failure(self, exc)

    def on_replace(self, sig: Signature) -> Any:
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


# --- failures and refusals -------------------------------------------------------------------


def _attribute(task: Task, run_id: str, field: str, stage: str) -> None:
    """From now on a failure of ``task`` belongs to ``field`` (a pass or completion member) of
    ``run_id``: call only once its message verified and was addressed to the task."""
    if task.request.id:
        setattr(task.request, _CLAIM, (run_id, field, stage))


def scrubbed_line(exc: BaseException) -> str:
    """An error's line (:func:`pipeline.errors.error_line`) with anything key-like hidden
    (:func:`pipeline.security.redaction.scrub`, before the cut to 500 characters): managers
    read it (a failure reason, an entry task's ``FAILURE``), and an error from a library may
    quote a provider."""
    return scrub(error_line(exc, None))[:500]


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
            reason=scrubbed_line(exc),
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


# --- the loop's stages -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """A pass between two of its stages: the message carrying its state to the next stage
    (``out``, addressed to its consumer), that state (under its pass id) and the message's
    configuration overrides. ``fresh``: this task produced and recorded the output first, so no
    record of the next step can exist yet (a duplicate racing it is settled when that step is
    recorded)."""

    out: dict[str, Any]
    state: LoopState
    overrides: dict[str, Any]
    fresh: bool = False
    held: tuple[StepRecord, ...] = ()
    """Records of this task's steps not written yet (this one's last): token-free steps whose
    next stage runs in this task too are written with the next record this task makes, or,
    when the pass ends here, only their trace events, with its result (:func:`record`)."""

    @property
    def next(self) -> str:
        """The stage the state goes to next (``done``: the gate)."""
        return self.state.next

    @property
    def run_id(self) -> str:
        return self.state.submission.run_id


def drive(task: PipelineTask, msg: dict[str, Any], stage: str) -> dict[str, Any]:
    """A loop stage's task: run ``stage`` on ``msg``, then every stage after it that runs in
    this task (:func:`workers.routing.runs_here`), each with its own step record, replay and
    trace events; then hand the state on (:func:`hand_on`), or, when the pass is over, finish
    it here (the gate) and return its summary.

    While a repair's budget reservation waits for held tokens, the task is handed back to the
    broker (:func:`wait_for_budget`); run eagerly (no broker), it waits here. A pass that ended
    meanwhile (its result landed, or it was cancelled) ends the task: nothing is recorded or
    sent on."""
    before = take(task, msg, stage)
    while True:
        try:
            after = run_step(task, stage, before)
        except BudgetWait as wait:
            # The message is sent again from its first stage: what this run holds is made
            # again by the re-run.
            if not task.request.is_eager:
                return wait_for_budget(task, wait)
            time.sleep(wait.retry_s)
            continue
        except (PassFinished, PassCancelled) as over:
            return _end_over(task, stage, over)
        except Exception:
            write_held(task, before)
            raise
        stage = after.next
        if not routing.runs_here(task, stage, after.state, after.overrides):
            write_held(task, after)  # none: a step is held only before a stage run here
            return hand_on(task, after)
        if stage == "done":
            return finish_here(task, after)
        before = after


def take(task: PipelineTask, msg: dict[str, Any], stage: str) -> Step:
    """The message off the broker as the step before ``stage``: verified and addressed to this
    task (:func:`from_broker`), with its pass id, past the trust boundary
    (:func:`boundary_config`) and at the task's stage. From here a failure of the task is the
    pass's (:func:`_attribute`)."""
    state, overrides = from_broker(task, msg, stage, runtime.decode)
    setattr(task.request, routing.FIRST_ATTEMPT, state.attempt)
    pass_id = _pass_id(task, msg, state, stage)
    if state.pass_id != pass_id:
        state = state.model_copy(update={"pass_id": pass_id})
    sub = state.submission
    _attribute(task, sub.run_id, PassRef.of(sub, pass_id).member, stage)
    boundary_config(task, overrides, stage, sub.run_id, sub.iteration, sub.worker_id, sub.model)
    _check_stage(task, state, stage)
    return Step(msg, state, overrides)


def run_step(task: PipelineTask, stage: str, before: Step) -> Step:
    """One stage on the step before it: its recorded output replayed (:func:`replay`), else
    the stage run (:func:`run_stage`) and its output recorded (:func:`record`); a budget
    lease the run reserved and the output that stands does not hold is refunded
    (:func:`refund`). Returns the step that stands."""
    sub = before.state.submission
    _attribute(task, sub.run_id, PassRef.of(sub, before.state.pass_id).member, stage)
    replayed = replay(task, stage, before)
    if replayed is not None:
        return replayed
    ran = run_stage(task, stage, before)
    try:
        stood = record(task, stage, ran)
    except PassFinished:
        refund(stage, ran, None)
        raise
    refund(stage, ran, stood)
    return stood


def _step_id(state: LoopState, stage: str) -> str:
    """The id ``stage`` run on ``state`` is recorded under (:func:`keys.step_id`)."""
    member = PassRef.of(state.submission, state.pass_id).member
    return keys.step_id(member, state.round, state.attempt, stage)


def replay(task: PipelineTask, stage: str, before: Step) -> Step | None:
    """The output recorded for ``stage`` on ``before``, addressed to its consumer; None when
    there is none (or none is read). A step whose re-run would spend tokens
    (:func:`_spends_tokens`), a ``decide`` that may reserve budget, and any repeated message
    read the step's record first; a step of a finished pass raises ``PassFinished``. Other
    first runs read nothing: they cost nothing to run again."""
    # A step run on the output this task just recorded first (a repair after its decide)
    # cannot have a record yet: no read; nor can a decide after a step this task holds.
    # Any other token-free stage runs without one: its record (or, when the pass ends in
    # this task, its result) is first-wins, so a duplicate replays there and a pass that
    # has its result by then (cancelled while the message waited) writes nothing; a result
    # writes no events of a held step that another delivery recorded (and traced) meanwhile.
    if before.fresh and (stage == "decide" or not before.held):
        return None
    context = runtime.context_for(before.overrides)
    if not (stage == "decide" or _spends_tokens(stage, context, before.state) or _repeated(task)):
        return None
    recorded = runtime.stores().runs.step_output(before.run_id, _step_id(before.state, stage))
    return None if recorded is None else replayed(task, recorded)


def replayed(task: PipelineTask, recorded: str) -> Step:
    """A step's recorded output, addressed to this run's consumer of it (a duplicate
    delivery's next task may have another id)."""
    out = dict(json.loads(recorded))
    state, overrides = runtime.decode(out)
    telemetry.event("critique.replayed", next=state.next, round=state.round)
    return Step(routing.addressed(task, out, state, overrides), state, overrides)


def run_stage(task: PipelineTask, stage: str, before: Step) -> Step:
    """The stage function on ``before``'s state, nothing written yet: the new step, its own
    record held last (with its trace events, buffered); a repair sends a ``task-progress``
    event (Flower)."""
    state, overrides = before.state, before.overrides
    sub = state.submission
    buffer = BufferedTraceSink()
    runs = runtime.stores().runs
    ctx = dataclasses.replace(
        runtime.context_for(overrides),
        trace=buffer,
        max_budget_wait_s=_budget_wait_cap(task),
        cancelled=lambda: runs.pass_finished(
            sub.run_id, sub.iteration, sub.worker_id, state.pass_id
        ),
        park=lambda waiting, ttl_s: runs.park(
            sub.run_id, waiting.pass_id, waiting.model_dump_json(), ttl_s
        ),
        parked=lambda pass_id: _parked_state(runs.parked(sub.run_id, pass_id)),
    )
    began = time.monotonic()
    with telemetry.stage_span(stage, state, state.pass_id) as traced:
        new = STAGES[stage](state, ctx)
        traced.ran(stage, new, lambda: buffer.read(sub.run_id))
    runtime.metrics().observe(stage, time.monotonic() - began)
    if stage == "repair" and not task_events_off():
        task.send_event(
            "task-progress",
            run_id=sub.run_id,
            worker_id=new.submission.worker_id,
            attempt=new.attempt,
        )
    to, to_id = routing.consumer(task, new.next, new, overrides)
    out = runtime.encode(new, overrides, pass_id=state.pass_id or None, task=to, task_id=to_id)
    events = tuple(buffer.payloads.get(sub.run_id, ()))
    mine = StepRecord(_step_id(state, stage), json.dumps(out), events)
    return Step(out, new, overrides, fresh=True, held=(*before.held, mine))


def record(task: PipelineTask, stage: str, ran: Step) -> Step:
    """The records ``ran`` holds (its own last) written in one atomic step, unless another
    delivery recorded first: then that output stands (replayed).

    A step whose re-run costs nothing (:func:`holds`) is held instead, and written with the
    next record this task makes, in the same script (each step first-wins in turn: at one
    recorded already, the output recorded first is replayed and the held steps after it are
    dropped); when the pass ends in this task, its result is the record and the held steps'
    trace events go with it (their records would be deleted with the result), those of a step
    another delivery recorded excepted (its record wrote them: a delivery that ran the step
    too, then failed, and whose message this task's was not known to repeat). A task that
    ends any other way (a failure included) writes what it holds first (:func:`write_held`),
    so every task's steps are recorded before it ends, as the stall rule assumes."""
    if holds(task, stage, ran):
        return ran
    return settle(task, ran)


def holds(task: PipelineTask, stage: str, ran: Step) -> bool:
    """Whether the step's record may wait for this task's next one: its re-run spends no
    tokens, it holds no budget lease, its next stage runs in this task (the gate included),
    and the operator does not keep step records for inspection (``CRITIQUE_STEPS_GRACE_S``)."""
    context = runtime.context_for(ran.overrides)
    return (
        ran.state.lease_id is None
        and not runtime.stores().runs.keeps_steps
        and not _spends_tokens(stage, context, ran.state)
        and routing.runs_here(task, ran.next, ran.state, ran.overrides)
    )


def settle(task: PipelineTask, step: Step) -> Step:
    """``step`` with what it holds written (:func:`record`): the step that stands. A step of
    a finished pass raises ``PassFinished``."""
    if not step.held:
        return step
    stood = runtime.stores().runs.record_steps(step.run_id, step.held)
    if stood is None:
        return dataclasses.replace(step, held=())
    return replayed(task, stood[1])


def write_held(task: PipelineTask, step: Step) -> None:
    """Write the records ``step`` holds (a task ending before its next record: a stage that
    raised). Best effort: the task's own failure is what it reports."""
    try:
        settle(task, step)
    except PassFinished:
        log.info("steps %s belong to a finished pass: not recorded", task.request.id)
    except Exception as exc:  # the stage's own error is the one raised
        log.warning("could not record the steps %s held: %s", task.request.id, scrubbed_line(exc))


def refund(stage: str, ran: Step, stood: Step | None) -> None:
    """A budget lease the run reserved that the standing output does not hold is refunded:
    the pass is over (``stood`` None), or another delivery of this decide recorded first
    without it (it was refused the budget, say). A repair that ran for a pass over by now
    (cancelled while it called its model) is charged what it spent instead: the tokens were
    spent (a commit is once per lease, so a duplicate of a committed repair charges nothing
    more)."""
    lease = ran.state.lease_id
    if lease is None:
        return
    budget = runtime.context_for(ran.overrides).budget
    if stood is None and stage == "repair":
        budget.commit(ran.run_id, lease, ran.state.pending_repair_tokens)
    elif stood is None or stood.state.lease_id != lease:
        budget.refund(ran.run_id, lease)


def _end_over(task: PipelineTask, stage: str, over: Exception) -> dict[str, Any]:
    """End this task here: its pass has its result already (a late redelivery, a duplicate
    delivery, or a cancel, seen before a model call: :class:`pipeline.loop.stages.PassCancelled`),
    and its step records were released with it. Nothing is recorded or sent on, so the stored
    result and the trace stay as they are (a cancelled stage released its own budget hold)."""
    log.info(
        "task %s: its pass is over (%s) at %s: it ends here",
        task.request.id,
        "cancelled" if isinstance(over, PassCancelled) else "finished",
        stage,
    )
    _send_nothing_after(task)
    return dict(FINISHED)


def hand_on(task: PipelineTask, step: Step) -> dict[str, Any]:
    """Send the state to the stage this task does not run: this task is replaced by that
    stage's task (:func:`workers.routing.stage_signature`) under its own id. Under a worker
    the replaced task returns REPLACED (:meth:`PipelineTask.on_replace`); eagerly, the
    replacement's answer."""
    config = runtime.config_for(step.overrides)
    sig = routing.stage_signature(step.next, step.out, config, step.state.submission)
    replaced: dict[str, Any] = task.replace(sig.set(task_id=str(task.request.id)))
    return replaced


def finish_here(task: PipelineTask, step: Step) -> dict[str, Any]:
    """The gate, run by the task that finished the loop: store the pass's result
    (:func:`finish_pass`, with the trace events of the steps ``step`` holds) and, under this
    task's id (the one the client's signature was sent with, kept by every replacement), the
    summary in Celery's result backend, as the gate task stores its own, so any Celery
    client's ``AsyncResult`` of it returns it."""
    summary, first = _finish(task, step.out, step.state, step.held)
    request = task.request
    if not request.is_eager and request.id:
        store_summary(task.backend, str(request.id), summary, request, first=first)
    return summary


def wait_for_budget(task: PipelineTask, wait: BudgetWait) -> dict[str, Any]:
    """Send this task's message again to run in ``wait.retry_s`` (the same message, task id,
    chain and retry count), then end this run without handing anything on: no worker thread
    is held while held budget tokens settle, waiting never uses up the retries transient
    errors get, and nothing is stored for it (a Celery retry would store a RETRY state,
    traceback included, for days). The re-run replays the critic's recorded step before
    asking the budget again; the ledger bounds the total wait (it keeps when the lease began
    to wait)."""
    request = task.request
    log.info("task %s asks the repair budget again in %.1f s: %s", request.id, wait.retry_s, wait)
    sig = task.signature_from_request(
        request,
        countdown=wait.retry_s,
        retries=request.retries,
        headers={BUDGET_WAIT_HEADER: 1},
    )
    sig.apply_async()
    # The re-sent message carries the rest of the chain: this run sends nothing after it.
    _send_nothing_after(task)
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
    handed back to wait for the repair budget, :func:`wait_for_budget`)."""
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


def store_summary(
    backend: Backend,
    task_id: str,
    summary: dict[str, Any],
    request: Context | None,
    *,
    first: bool,
) -> None:
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
    task: Task, msg: dict[str, Any], state: LoopState, held: Sequence[StepRecord] = ()
) -> tuple[dict[str, Any], bool]:
    """:func:`finish_pass`, and whether this call stored the pass's result (the first);
    ``held``: the steps this task ran and holds, whose trace events are written with the
    result (those of a step another delivery recorded meanwhile are not: its record wrote
    them)."""
    pass_id = _pass_id(task, msg, state, "gate")
    sub = state.submission
    _attribute(task, sub.run_id, PassRef.of(sub, pass_id).member, "gate")
    if state.pass_id != pass_id:
        state = state.model_copy(update={"pass_id": pass_id})
    began = time.monotonic()
    with telemetry.stage_span("gate", state, pass_id) as traced:
        result = finish(state)
        event = result.trace_event(round=state.round, stage="gate")
        runs = runtime.stores().runs
        # The pass leaves the pending index in the same step: it can no longer stall.
        first = runs.put_result(result, pass_id=pass_id, events=[encode_event(event)], steps=held)
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


def run_completion_gate(task: PipelineTask, msg: Any) -> dict[str, Any]:
    """The manager's completion gate, by the same steps as a stage: the request taken off the
    broker and past the trust boundary; the first decision per ``request_id`` is recorded
    (signed) and replayed on redelivery, and a rejection is counted once per request, so
    ``max_rejected_completions`` → partial is never double-counted; the client reads the
    recorded decision, not this task's result in Celery's backend."""
    stage = "complete_gate"
    req = from_broker(task, msg, stage, runtime.decode_gate_request)
    _attribute(task, req.run_id, completion_member(req.request_id), stage)
    config = boundary_config(task, req.config, stage, req.run_id, req.iteration)
    runs = runtime.stores().runs
    recorded: dict[str, Any] | None = runs.completion(req.run_id, req.request_id)
    if recorded is not None:
        return recorded
    out, events = _completion(req, config)
    first = runs.record_completion(req.run_id, req.request_id, out, events)
    if first:
        out = first
    if out["verdict"] != "complete":
        runs.count_rejection_once(req.run_id, req.request_id)
    return dict(out)


def _completion(
    req: runtime.GateRequest, config: CritiqueConfig
) -> tuple[dict[str, Any], list[str]]:
    """The decision over the run's stored results, as JSON, with its trace events."""
    runs = runtime.stores().runs
    decision = evaluate_completion(
        run_id=req.run_id,
        iteration=req.iteration,
        final_result=req.final_result,
        results=runs.results(req.run_id, req.iteration),
        files=req.files,
        task=req.task,
        deliverable_expected=req.deliverable_expected,
        config=config,
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
