"""Thin Celery tasks over the pure stages (DESIGN habit 1).

A submission is sent as one task, ``critique.l0``, on its critic's queue. A task runs its stage
and then every stage after it that belongs on its queue (:func:`_drive`): Layer-0 and
``decide`` anywhere (token-free and cheap: SPEC §4 lets decide run inside the critic task), the
critic where its queue is, and the gate once nothing follows. So an accepted output is one task
(``l0 → critic → decide → gate``); a repair round is a task of its own: the task replaces itself
(``Task.replace``) with ``critique.repair``, which runs ``repair → l0 → critic → decide`` and the
gate or the next round. A critic on another queue than the task's (a token-free reviser on
critique.cpu before an LLM critic, or ``mode: dedicated``) is a replacement too. Replacements
keep the task's id, as Celery's own replace does, so the id the client sent the submission
under ends up holding the summary in Celery's result backend. No task ever waits on another.
Every stage keeps its own step record and trace events, so a redelivered task replays its
stages and a pass resumed at any stage (:func:`continuation`) goes on the same way. The stage
tasks (``critique.critic``, ``critique.decide``, ``critique.repair``, ``critique.gate``) each
take a message for their stage, and chains sent by older clients (``l0 → critic → gate``) still
run: a task hands on to the next task of its chain instead of running the gate itself.

Every stage: decode the message, run one stage function, encode the new state. A task whose
stage is not the state's next one starts at the state's next (e.g. critique disabled: the
gate). Stages are idempotent under redelivery: step records, pattern records, budget leases,
trace events and the result are keyed by the submission's pass (SPEC §4: a fresh pass id per
submit, the state's ``pass_id`` and the message's ``sid``), step records and leases also by
round and attempt; the
first record of a step wins and a re-run writes nothing again. Once the pass's result has landed
its step records are gone (Redis holds live state, not history): a step of it delivered late
records nothing and ends its chain there (:class:`pipeline.store.runs.PassFinished`). Transient
errors (Redis, LLM) are retried with exponential backoff and jitter; permanent ones fail the
task at once.

A message that cannot be trusted or read (unsigned, forged or altered while ``CRITIQUE_SECRET``
is set, addressed to another task or task id, or malformed) is refused: a warning in the log
(never the payload), a ``refused`` event in the trace of the run it claims (marked
``run_id_verified: false``), and the task fails with the reason, never retried and never turned
into a result.

Every message a stage hands on is addressed (signed) to the task that consumes it: the task
itself (it runs the next stage too), the task that replaces it (under the same id), or the next
task of an older client's chain (its id was fixed when the chain was frozen). A task that
fails for good records the failure in the store for the pass
(:meth:`pipeline.store.runs.RedisRunStore.put_failure`) only when it can attribute it: the
message verified and was addressed to it. Clients read that record, never Celery's ``FAILURE``
state, which anyone who can write to the broker can set for any task id.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from celery import Task, states
from celery.exceptions import Ignore
from celery.signals import task_postrun
from celery.utils.log import get_task_logger
from kombu.exceptions import OperationalError

from pipeline import signing
from pipeline.config import CritiqueConfig, check_submission_model
from pipeline.errors import (
    ConfigError,
    CritiqueError,
    PermanentError,
    SubmissionError,
    TransientError,
)
from pipeline.gates import evaluate_completion
from pipeline.models import Submission, check_identifier
from pipeline.runner import (
    STAGES,
    BudgetWait,
    LoopState,
    StageContext,
    admit,
    finish,
    is_token_free,
    resolve_for,
    start,
)
from pipeline.store import keys
from pipeline.store.base import encode_event
from pipeline.store.memory import BufferedTraceSink
from pipeline.store.metrics import refusal_reason
from pipeline.store.runs import PassFinished, completion_member, pass_member
from workers import runtime
from workers.app import app

RETRY = {
    # OperationalError: a publish (Task.replace, an event) that still failed after
    # celeryconfig's task_publish_retry_policy, i.e. a broker outage: transient too.
    "autoretry_for": (TransientError, OperationalError),
    "retry_backoff": True,
    "retry_backoff_max": 60,
    "retry_jitter": True,
    "max_retries": 5,
}
# The loop's stages hand their state to the next stage in the message, and each stage's first
# output is already recorded in the run's steps hash: storing it again in the result backend
# (plus a STARTED state) would cost two Redis writes per stage for nothing. Errors are still
# stored, and Celery propagates them down the chain to the gate task the client waits on.
STAGE = {**RETRY, "ignore_result": True, "store_errors_even_if_ignored": True}
log = get_task_logger(__name__)

REPLACED: dict[str, Any] = {"replaced": True}
"""What a stage task that handed its chain to a repair round returns (nothing receives it)."""


_CLAIM = "critique_claim"
"""The request attribute naming what a task's failure is recorded against: ``(run id, pass or
completion member, stage)``, set only once its message verified and was addressed to it."""


class CritiqueTask(Task):  # type: ignore[misc]
    """A pipeline task: a failure for good (not a retry) is recorded in the store against the
    pass (or completion-gate request) the task's message was attributed to, if any
    (:func:`_record_failure`)."""

    def on_failure(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        _record_failure(self, exc)


class ReplacingStage(CritiqueTask):
    """A stage task that may hand its chain on to a repair round (``Task.replace``).

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


def _attribute(task: Task, run_id: str, field: str, stage: str) -> None:
    """From now on a failure of ``task`` belongs to ``field`` (a pass or completion member) of
    ``run_id``: call only once its message verified and was addressed to the task."""
    if task.request.id:
        setattr(task.request, _CLAIM, (run_id, field, stage))


def _record_failure(task: Task, exc: BaseException) -> None:
    """Record a failed task's error against the pass it was attributed to (:func:`_attribute`),
    signed, so the client reports it; a message that never got that far (forged, garbage,
    addressed to another task) records nothing and affects no pass."""
    claim = getattr(task.request, _CLAIM, None)
    if claim is None:
        return
    run_id, field, stage = claim
    message = exc.message if isinstance(exc, CritiqueError) else str(exc)
    reason = " ".join(str(message).split())[:500] or type(exc).__name__
    try:
        runtime.stores().runs.put_failure(
            run_id,
            field,
            stage=stage,
            error=type(exc).__name__,
            reason=reason,
            refused=isinstance(exc, (SubmissionError, ConfigError)),
            task_id=str(task.request.id or ""),
        )
    except Exception as store_exc:  # never mask the task's own failure
        log.warning("could not record the failure of %s of run %s: %s", field, run_id, store_exc)


def _next_in_chain(task: Task) -> tuple[str, str]:
    """``(task name, task id)`` of the task after this one in its chain (its id was fixed when
    the chain was frozen); ``("", "")`` when the chain ends here."""
    steps = task.request.chain
    if not steps:
        return "", ""
    nxt = steps[-1]
    options = nxt.get("options") or {}
    return str(nxt.get("task") or ""), str(options.get("task_id") or "")


def _queue_here(task: Task) -> str | None:
    """The queue this task's message came from (None when it runs eagerly, without a broker)."""
    info = task.request.delivery_info or {}
    key = info.get("routing_key")
    return str(key) if key else None


def critic_queue(config: CritiqueConfig, submission: Submission) -> str:
    """The queue the submission's critic runs on: critique.llm (mode: inline) or
    critique.llm.critic (mode: dedicated) for an LLM critic, critique.cpu for a deterministic
    one, so each scales with its own workers."""
    if config.uses_llm_critic(submission.model):
        return keys.QUEUE_CRITIC if config.mode == "dedicated" else keys.QUEUE_LLM
    return keys.QUEUE_CPU


def _runs_here(task: Task, next_stage: str, state: LoopState, overrides: dict[str, Any]) -> bool:
    """Whether ``task`` runs ``next_stage`` itself, after the stage it just ran.

    Layer-0 and ``decide`` are token-free and cheap: they run wherever the state is. The
    critic runs here when this task came from the critic's queue (an LLM critic never runs on
    the CPU workers, nor a deterministic one on the LLM workers). The gate (``done``) runs here
    when no task follows in the chain (a chain sent by an older client ends in
    ``critique.gate``: it is left to that). A repair is always a round of its own
    (``Task.replace``): it charges the budget and may be routed elsewhere."""
    if next_stage in ("l0", "decide"):
        return True
    if next_stage == "done":
        return not task.request.chain
    if next_stage == "critic":
        here = _queue_here(task)
        return here is None or here == critic_queue(runtime.config_for(overrides), state.submission)
    return False


def _consumer(
    task: Task, next_stage: str, state: LoopState, overrides: dict[str, Any]
) -> tuple[str, str]:
    """``(task name, task id)`` the message a stage hands on (its state's next stage
    ``next_stage``) is addressed to: this task itself when it runs that stage too
    (:func:`_runs_here`); else the next task of the chain, when a chain sent by an older client
    has one; else the task that replaces this one (``Task.replace``), which keeps this task's
    id, as Celery's own replace does, so the id the client holds ends up with the result."""
    own = str(task.request.id or "")
    if _runs_here(task, next_stage, state, overrides):
        return task.name, own
    if next_stage != "repair":
        name, task_id = _next_in_chain(task)
        if name:
            return name, task_id
    return _FIRST_TASK[next_stage], own


def _addressed(
    task: Task, msg: dict[str, Any], state: LoopState, overrides: dict[str, Any]
) -> dict[str, Any]:
    """``msg`` (a pass-through or a replayed output, with its decoded ``state``) addressed to
    its consumer (:func:`_consumer`): re-signed only when it names another task, and only after
    it verified (it may come from the store)."""
    return runtime.address(msg, *_consumer(task, state.next, state, overrides))


def _step_id(sid: str, state: LoopState, stage: str) -> str:
    sub = state.submission
    return keys.step_id(
        pass_member(sub.iteration, sub.worker_id, sid), state.round, state.attempt, stage
    )


def _pass_id(task: Task, msg: dict[str, Any], state: LoopState) -> str:
    """The message's pass: the state's ``pass_id``, else the message's ``sid``; a message with
    neither (a chain sent without the client) gets one derived from its task id, which a
    redelivery keeps, so its first stage runs as one pass however often it is delivered."""
    sid = state.pass_id or str(msg.get("sid") or "")
    if not sid and task.request.id:
        sid = "t" + str(task.request.id).replace("-", "")[:15]
    return sid


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


OVER = "over"
"""The pseudo-stage after a step of a pass that already has its result: nothing runs next."""


def _run_stage(task: Task, msg: dict[str, Any], stage: str, prev: Step | None = None) -> Step:
    """Run one stage exactly once in effect; returns what it hands on.

    At-least-once delivery can hand a step to a second worker after the first one ran it
    (e.g. killed between finishing and acknowledging). The first completed output of each
    step is recorded in the run's ``steps`` hash, atomically with the step's trace events; a
    repeat returns that output unchanged (and writes no event), so every duplicate downstream
    of it replays too and the result is the same.

    ``prev``: the step this task just ran, whose ``out`` is ``msg`` (then the message is not
    decoded nor checked at the trust boundary again: this task made it from one that was).
    """
    if prev is None:
        state, overrides = _decoded(task, msg, stage)
    else:
        state, overrides = prev.state, prev.overrides
    sub = state.submission
    sid = _pass_id(task, msg, state)
    _attribute(task, sub.run_id, pass_member(sub.iteration, sub.worker_id, sid), stage)
    if prev is None:
        _boundary_config(
            task, overrides, stage, sub.run_id, sub.iteration, sub.worker_id, sub.model
        )
    if state.next != stage:
        return Step(_addressed(task, msg, state, overrides), state.next, state, overrides)
    run_id = state.submission.run_id
    runs = runtime.stores().runs
    if state.pass_id != sid:
        state = state.model_copy(update={"pass_id": sid})
    step = _step_id(sid, state, stage)
    shared = runtime.context_for(overrides)
    # A decide run on the output this task just recorded cannot have a record yet: no read.
    reads = stage == "decide" and not (prev is not None and prev.fresh)
    try:
        if reads or _spends_tokens(stage, shared, state) or _repeated(task):
            recorded = runs.step_output(run_id, step)
            if recorded is not None:
                return _replayed(task, recorded)
    except PassFinished:
        return _end_finished(task, step, state, overrides)
    buffer = BufferedTraceSink()
    ctx = dataclasses.replace(shared, trace=buffer, max_budget_wait_s=_budget_wait_cap(task))
    began = time.monotonic()
    new = STAGES[stage](state, ctx)
    runtime.metrics().observe(stage, time.monotonic() - began)
    if stage == "repair":
        task.send_event(
            "task-progress",
            run_id=run_id,
            worker_id=state.submission.worker_id,
            attempt=new.attempt,
        )
    to, to_id = _consumer(task, new.next, new, overrides)
    out = runtime.encode(new, overrides, sid=sid or None, task=to, task_id=to_id)
    try:
        first = runs.record_step(run_id, step, json.dumps(out), buffer.payloads.get(run_id, ()))
    except PassFinished:
        if new.lease_id is not None:
            shared.budget.refund(run_id, new.lease_id)  # reserved for a pass that is over
        return _end_finished(task, step, state, overrides)
    if first is None:
        return Step(out, new.next, new, overrides, fresh=True)
    replay = _replayed(task, first)
    if new.lease_id is not None and replay.state.lease_id != new.lease_id:
        # Another delivery of this decide recorded first without this lease (it was refused
        # the budget, say): the reservation this run made would be held for nothing.
        shared.budget.refund(run_id, new.lease_id)
    return replay


def _stage(task: Task, msg: dict[str, Any], stage: str) -> tuple[dict[str, Any], str]:
    """One stage's body alone, as ``task`` runs it (:func:`_run_stage`): the message it hands
    on and its next stage. Tests run single stages with it."""
    step = _run_stage(task, msg, stage)
    return step.out, step.next


FINISHED: dict[str, Any] = {"pass_finished": True}
"""What a stage task of a pass that already has its result returns (nothing receives it)."""


def _end_finished(task: Task, step: str, state: LoopState, overrides: dict[str, Any]) -> Step:
    """End this task's chain here: its pass has its result already (this is a late
    redelivery, or a duplicate chain), and its step records were released with it. Nothing is
    recorded or sent on, so the stored result and the trace stay as they are."""
    log.info("step %s belongs to a finished pass: its chain ends here", step)
    _send_nothing_after(task)
    return Step(dict(FINISHED), OVER, state, overrides)


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
    handed back to wait for the repair budget, :func:`_wait_for_budget`)."""
    request = task.request
    info = request.delivery_info or {}
    return (
        bool(info.get("redelivered"))
        or bool(request.retries)
        or bool(getattr(request, BUDGET_WAIT_HEADER, None))
    )


BUDGET_WAIT_HEADER = "critique_budget_wait"
"""A message header marking a task sent again to ask the repair budget once more."""


def _budget_wait_cap(task: Task) -> float:
    """The most a repair waits for held budget tokens on this worker: half the task's soft
    time limit (SPEC §4: the wait stays within the task's time limit)."""
    limit = task.soft_time_limit or app.conf.task_soft_time_limit or app.conf.task_time_limit
    return float(limit) / 2.0 if limit else 60.0


def _wait_for_budget(task: Task, wait: BudgetWait) -> dict[str, Any]:
    """Send this task's message again to run in ``wait.retry_s`` (the same message, task id,
    chain and retry count), then end this run without handing anything on: no worker thread is
    held while held budget tokens settle, waiting never uses up the retries transient errors
    get, and nothing is stored for it (a Celery retry would store a RETRY state, traceback
    included, for days). The re-run replays the critic's recorded step before asking the
    budget again; the ledger bounds the total wait (it keeps when the lease began to wait)."""
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


def _replayed(task: Task, recorded: str) -> Step:
    """A step's recorded output, addressed to this run's consumer of it (a duplicate chain's
    next task has another id)."""
    out = dict(json.loads(recorded))
    state, overrides = runtime.decode(out)
    return Step(_addressed(task, out, state, overrides), state.next, state, overrides)


def _boundary_config(
    task: Task,
    overrides: dict[str, Any],
    stage: str,
    run_id: str,
    iteration: int,
    worker_id: str | None = None,
    model: str | None = None,
) -> CritiqueConfig:
    """The message's configuration past the trust boundary (SPEC §3): its overrides and the
    submission's model are checked against this worker's own configuration before anything is
    built, imported or called. A refusal is logged, recorded as a ``refused`` event in the
    run's trace, and fails the task (permanent: never retried)."""
    try:
        config = runtime.config_for(overrides)
        check_submission_model(model, runtime.own_config())
    except PermanentError as exc:
        reason = exc.message
        runtime.metrics().add(f"refused:{refusal_reason(exc)}")
        log.warning("refused a %s message of run %s: %s", stage, run_id, reason)
        event = {
            "type": "refused",
            "stage": stage,
            "worker_id": worker_id,
            "iteration": iteration,
            "reason": reason,
            "error": type(exc).__name__,
            "task_id": task.request.id,
        }
        try:
            runtime.stores().trace.emit(run_id, event)
        except CritiqueError as store_exc:
            log.warning("could not record the refusal in run %s's trace: %s", run_id, store_exc)
        raise
    return config


def _decoded(task: Task, msg: Any, stage: str) -> tuple[LoopState, dict[str, Any]]:
    """``runtime.decode`` of a message off the broker, which must be addressed to this task and
    its id (with ``CRITIQUE_SECRET`` set); a refused message is recorded first."""
    try:
        return runtime.decode(msg, task=task.name, task_id=str(task.request.id or ""))
    except PermanentError as exc:
        _refuse(task, msg, stage, exc)
        raise


def _gate_request(task: Task, msg: Any) -> runtime.GateRequest:
    """``runtime.decode_gate_request`` of a message off the broker (addressed to this task and
    its id, with ``CRITIQUE_SECRET`` set), refusals recorded."""
    try:
        return runtime.decode_gate_request(msg, task=task.name, task_id=str(task.request.id or ""))
    except PermanentError as exc:
        _refuse(task, msg, "complete_gate", exc)
        raise


_CLAIM_LIMIT = 1 << 20
"""Largest inline state a refused message may carry for its claimed run id to be looked up."""


def _refuse(task: Task, msg: Any, stage: str, exc: Exception) -> None:
    """Record a refused message: a warning log line (never the payload), and a ``refused``
    event in the trace of the run the message claims, marked unverified (nothing in a refused
    message is trusted: the run id only files the refusal where the run's owner looks)."""
    run_id = _claimed_run_id(msg)
    reason = str(exc)[:500]
    runtime.metrics().add(f"refused:{refusal_reason(exc)}")
    log.warning(
        "refused a %s message (task %s, claimed run %s): %s: %s",
        stage,
        task.request.id,
        run_id or "-",
        type(exc).__name__,
        reason,
    )
    if run_id is None:
        return
    event = {
        "type": "refused",
        "stage": stage,
        "reason": reason,
        "error": type(exc).__name__,
        "task_id": task.request.id,
        "run_id_verified": False,
    }
    try:
        runtime.stores().trace.emit(run_id, event)
    except CritiqueError as store_exc:
        log.warning("could not record the refusal in run %s's trace: %s", run_id, store_exc)


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


def _drive(task: Task, msg: dict[str, Any], stage: str) -> dict[str, Any]:
    """Run ``stage`` on ``msg``, then every stage after it that runs in this task
    (:func:`_runs_here`), each with its own step record, replay and trace events; then hand the
    state on: to a repair round or a critic on another queue that replaces this task
    (``Task.replace``, keeping its id), to the next task of an older client's chain, or, when
    the pass is over, finish it here (the gate) and return its summary.

    So an accepted output is one task (Layer-0, critic, decide and gate), and each repair
    round one more; a pass resumed at any stage goes on the same way. While a repair's budget
    reservation waits for held tokens, the task is handed back to the broker
    (:func:`_wait_for_budget`); run eagerly (no broker), it waits here."""
    step: Step | None = None
    nxt, out = stage, msg
    while True:
        try:
            step = _run_stage(task, out, nxt, step)
        except BudgetWait as wait:
            if not task.request.is_eager:
                return _wait_for_budget(task, wait)
            time.sleep(wait.retry_s)
            continue
        nxt, out = step.next, step.out
        if nxt == OVER:
            return out
        if not _runs_here(task, nxt, step.state, step.overrides):
            return _hand_on(task, step)
        if nxt == "done":
            return _finish_here(task, out, step.state)


def _hand_on(task: Task, step: Step) -> dict[str, Any]:
    """Send the state to the stage this task does not run: an older client's chain takes it
    on (its next task is what ``step.out`` is addressed to); else this task is replaced by that
    stage's task (:func:`stage_signature`) under its own id. Under a worker the replaced task
    returns REPLACED (:meth:`ReplacingStage.on_replace`); eagerly, the replacement's answer."""
    if step.next != "repair" and task.request.chain:
        return step.out
    config = runtime.config_for(step.overrides)
    sig = stage_signature(step.next, step.out, config, step.state.submission)
    replaced: dict[str, Any] = task.replace(sig.set(task_id=str(task.request.id)))
    return replaced


def _finish_here(task: Task, msg: dict[str, Any], state: LoopState) -> dict[str, Any]:
    """The gate, run by the task that finished the loop: store the pass's result
    (:func:`_finish_pass`) and, under this task's id (the one the client's signature was sent
    with, kept by every replacement), the summary in Celery's result backend, as the gate task
    stores its own, so any Celery client's ``AsyncResult`` of it returns the summary."""
    summary = _finish_pass(task, msg, state)
    if not task.request.is_eager and task.request.id:
        # store_result: mark_as_done would honour the stage tasks' ignore_result.
        task.backend.store_result(str(task.request.id), summary, "SUCCESS", request=task.request)
    return summary


@app.task(name=keys.TASK_L0, bind=True, base=ReplacingStage, **STAGE)
def l0(self: Task, msg: dict[str, Any]) -> dict[str, Any]:
    """Layer-0 contract checks (token-free), then what runs after them here (:func:`_drive`):
    a submission's first task, sent to its critic's queue."""
    return _drive(self, msg, "l0")


@app.task(name=keys.TASK_CRITIC, bind=True, base=ReplacingStage, **STAGE)
def critic(self: Task, msg: dict[str, Any]) -> dict[str, Any]:
    """The configured critic (heuristic, rubric, LLM), then ``decide`` and, for an accepted or
    stopped output, the gate (:func:`_drive`)."""
    return _drive(self, msg, "critic")


@app.task(name=keys.TASK_REPAIR, bind=True, base=ReplacingStage, **STAGE)
def repair(self: Task, msg: dict[str, Any]) -> dict[str, Any]:
    """One targeted repair attempt, charged to the run's budget; then Layer-0 again, the
    re-critique when its critic runs on this queue, decide and the gate (:func:`_drive`)."""
    return _drive(self, msg, "repair")


@app.task(name=keys.TASK_DECIDE, bind=True, base=ReplacingStage, **STAGE)
def decide(self: Task, msg: dict[str, Any]) -> dict[str, Any]:
    """Accept, stop, escalate, or loop into another repair round (via ``Task.replace``).

    The task that ran the critic runs this stage itself; the task stays for a pass resumed
    between the two (:func:`continuation` from a recorded critic step) and for messages
    already queued."""
    return _drive(self, msg, "decide")


def _finish_pass(task: Task, msg: dict[str, Any], state: LoopState) -> dict[str, Any]:
    """Store the pass's result and write its ``result`` event, both in one atomic step and
    once per pass (a re-run writes nothing); return a summary."""
    sid = _pass_id(task, msg, state)
    sub = state.submission
    _attribute(task, sub.run_id, pass_member(sub.iteration, sub.worker_id, sid), "gate")
    if state.pass_id != sid:
        state = state.model_copy(update={"pass_id": sid})
    began = time.monotonic()
    result = finish(state)
    event = result.trace_event(round=state.round, stage="gate")
    # The pass leaves the pending index in the same step: it can no longer stall.
    if runtime.stores().runs.put_result(result, sid=sid, events=[encode_event(event)]):
        _count_result(result)
        runtime.metrics().observe("gate", time.monotonic() - began)
    return {
        "run_id": result.run_id,
        "iteration": result.iteration,
        "worker_id": result.worker_id,
        "status": result.status,
        "stop_reason": result.stop_reason,
        "best_score": result.best_score,
    }


def _count_result(result: Any) -> None:
    """The fleet metrics of a pass's result, counted once (its first store)."""
    m = runtime.metrics()
    m.add(f"outputs:{result.status}")
    m.add("tokens:critique", max(0, result.usage.tokens - result.repair_usage.tokens))
    m.add("tokens:repair", result.repair_usage.tokens)
    m.add("budget_charged", result.budget_charged)


@task_postrun.connect
def _flush_metrics(**_: Any) -> None:
    """After every task: its fleet-metric increments in one round trip."""
    runtime.metrics().flush()


@app.task(name=keys.TASK_GATE, bind=True, base=CritiqueTask, **RETRY)
def gate(self: Task, msg: dict[str, Any]) -> dict[str, Any]:
    """Finish the submission pass (:func:`_finish_pass`): the end of a chain sent by an older
    client, and of a pass resumed after its last stage.

    Only from a message that passed its signature check (``CRITIQUE_SECRET``): a forged
    finished state is refused before anything is stored."""
    state, _ = _decoded(self, msg, "gate")
    return _finish_pass(self, msg, state)


@app.task(name=keys.TASK_COMPLETE_GATE, bind=True, base=CritiqueTask, **RETRY)
def complete_gate(self: Task, msg: dict[str, Any]) -> dict[str, Any]:
    """The manager's completion gate (SPEC §5.6) over the run's stored results.

    Message: ``{"v": 1, "request_id", "run_id", "iteration", "final_result", "task", "files",
    "deliverable_expected", "config", "task_name", "task_id"}`` (the last two: this task, as
    addressed by the signer). Returns the ``CompletionDecision`` as JSON. The first decision per
    ``request_id`` is recorded (signed) and replayed on redelivery, and a rejection is counted
    once per request, so ``max_rejected_completions`` → partial is never double-counted; the
    client reads the recorded decision, not this task's result in Celery's backend.
    """
    req = _gate_request(self, msg)
    _attribute(self, req.run_id, completion_member(req.request_id), "complete_gate")
    s = runtime.stores()
    recorded = s.runs.completion(req.run_id, req.request_id)
    if recorded is not None:
        return recorded
    config = _boundary_config(self, req.config, "complete_gate", req.run_id, req.iteration)
    results = s.runs.results(req.run_id, req.iteration)
    decision = evaluate_completion(
        run_id=req.run_id,
        iteration=req.iteration,
        final_result=req.final_result,
        results=results,
        files=req.files,
        task=req.task,
        deliverable_expected=req.deliverable_expected,
        config=config,
        previous_rejections=s.runs.rejections(req.run_id),
        read_bytes=runtime.file_bytes,
    )
    events = [
        encode_event({"type": "gate", "stage": "complete_gate", **e.model_dump(mode="json")})
        for e in decision.events
    ]
    events.append(
        encode_event(
            {
                "type": "completion",
                "stage": "complete_gate",
                "iteration": req.iteration,
                "verdict": decision.verdict,
                "reasons": list(decision.reasons),
            }
        )
    )
    out: dict[str, Any] = json.loads(decision.model_dump_json())
    first = s.runs.record_completion(req.run_id, req.request_id, out, events)
    if first:
        out = first
    if out["verdict"] != "complete":
        s.runs.count_rejection_once(req.run_id, req.request_id)
    return dict(out)


def repair_queue(msg: dict[str, Any], submission: Submission) -> str | None:
    """The queue of the submission's repair when it is not celeryconfig's route (critique.llm):
    critique.cpu when the reviser that serves it is token-free (deterministic), so a token-free
    repair never waits for LLM workers (KEDA scales critique.llm to zero). ``msg`` carries the
    submission's configuration overrides."""
    reviser = runtime.context_for(msg.get("config")).reviser
    return keys.QUEUE_CPU if resolve_for(reviser, submission).token_free else None


def stage_signature(
    stage: str, msg: dict[str, Any], config: CritiqueConfig, submission: Submission
) -> Any:
    """The signature of the task that runs ``stage`` on ``msg``, routed for the submission:
    Layer-0 and the critic to the critic's queue (:func:`critic_queue`: Layer-0 is a
    submission's first stage, and the critic runs after it in the same task), the repair to
    its reviser's (:func:`repair_queue`), ``decide`` and the gate by celeryconfig's routes."""
    task = _STAGE_TASKS[stage]
    sig = task.s(msg)
    if stage in ("l0", "critic"):
        sig = sig.set(queue=critic_queue(config, submission))
    elif stage == "repair":
        queue = repair_queue(msg, submission)
        if queue:
            sig = sig.set(queue=queue)
    return sig


_STAGE_TASKS: dict[str, Task] = {
    "l0": l0,
    "critic": critic,
    "decide": decide,
    "repair": repair,
    "done": gate,
}

_FIRST_TASK = {stage: task.name for stage, task in _STAGE_TASKS.items()}
"""The task that runs each stage when a message is sent for it."""


def submission_signature(
    msg: dict[str, Any], config: CritiqueConfig, submission: Submission
) -> Any:
    """The one task a submission is sent as: ``critique.l0`` on its critic's queue, under the
    id ``msg`` is addressed to (the client picks it before signing). The loop goes on in that
    task and in the tasks that replace it (:func:`_drive`), all under that id."""
    sig = stage_signature("l0", msg, config, submission)
    first_id = signing.addressee(msg)[1]
    return sig.set(task_id=first_id) if first_id else sig


def continuation(
    msg: dict[str, Any], config: CritiqueConfig, submission: Submission, task_id: str
) -> Any:
    """The rest of a submission's pass from a stage message (its ``state.next``): the task
    that runs that stage, under the pass's task id (the submission's, which the result lands
    under). ``msg`` (read back from the store: it must verify) is re-addressed to it."""
    state, _ = runtime.decode(msg)
    msg = runtime.address(msg, _FIRST_TASK[state.next], task_id)
    return stage_signature(state.next, msg, config, submission).set(task_id=task_id)


# --- the entry task (docs/entry.md) -----------------------------------------------------------

ENTRY = {
    **RETRY,
    # Nothing of the entry task's own is stored on success (it is replaced by the submission's
    # first task, under its id, which stores the summary), and a failure is stored by
    # EntryTask.on_failure alone: one line, no traceback.
    "ignore_result": True,
    "store_errors_even_if_ignored": False,
    "throws": (PermanentError,),  # a refusal is logged as one line, not a traceback
}


class EntryTask(ReplacingStage):
    """``critique.submit``: a failure for good is stored in Celery's result backend under the
    task's id as ``FAILURE`` with a one-line reason and no traceback (``result.exc_type``,
    ``result.exc_message[0]``), so a manager in any language reads why; never over a result
    already there (a message forged under a live submission's id cannot hide its verdict)."""

    def on_failure(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        super().on_failure(exc, task_id, args, kwargs, einfo)
        _store_entry_failure(self, exc, task_id)

    def on_replace(self, sig: Any) -> Any:
        """Celery's own: publish the replacement, then ``Ignore``, so nothing of this task's is
        stored even when its message asks for results (a hand-built message's
        ``ignore_result: false`` header overrides the task's): the replacement stores the
        summary under this id."""
        return Task.on_replace(self, sig)


def one_line(exc: BaseException) -> str:
    """An error's message on one line (at most 500 characters), else its type's name."""
    message = exc.message if isinstance(exc, CritiqueError) else str(exc)
    return " ".join(str(message).split())[:500] or type(exc).__name__


def _store_entry_failure(task: Task, exc: BaseException, task_id: str) -> None:
    if task.request.is_eager or not task_id:
        return
    try:
        # Never over a verdict (garbage sent under a finished submission's id).
        meta = task.backend.get_task_meta(task_id, cache=False)
        if meta.get("status") == states.SUCCESS:
            log.warning("entry task %s failed after its pass stored an outcome: kept", task_id)
            return
        exc.args = (one_line(exc),)
        task.backend.store_result(task_id, exc, states.FAILURE, traceback=None, request=None)
    except Exception as store_exc:  # never mask the task's own failure
        log.warning("could not store the failure of entry task %s: %s", task_id, store_exc)


@app.task(name=keys.TASK_SUBMIT, bind=True, base=EntryTask, **ENTRY)
def submit(self: Task, msg: Any) -> dict[str, Any]:
    """The entry task: one submission as plain JSON (:mod:`workers.entry`), from a manager in
    any language. Does on the worker what ``CritiqueClient.submit`` does (check the message
    and the trust boundary, admit, start the pass, register it), then replaces itself with the
    submission's first task (:func:`submission_signature`) under its own id, so that id ends up
    holding the gate's summary in Celery's result backend.

    Idempotent under redelivery: the pass is claimed under the entry task's id
    (``RedisRunStore.claim_entry``), so the same message delivered twice runs one pass (a
    redelivery sends that pass's first task again, which replays its recorded steps, or does
    nothing once the pass has its outcome)."""
    from workers import entry
    from workers.recovery import register

    # Whatever the message's headers ask: Celery stores nothing of this task's (a failure is
    # stored by EntryTask.on_failure, in one line; the replacement stores the summary).
    self.request.ignore_result = True
    began = time.monotonic()
    task_id = str(self.request.id or "")
    try:
        sub, overrides = entry.decode_entry(msg, task_name=self.name, task_id=task_id)
    except PermanentError as exc:
        _refuse(self, msg, "submit", exc)
        raise
    config = _boundary_config(
        self, overrides, "submit", sub.run_id, sub.iteration, sub.worker_id, sub.model
    )
    admit(sub, config, runtime.file_bytes)
    runs = runtime.stores().runs
    sid, first = runs.claim_entry(
        sub.run_id, sub.iteration, sub.worker_id, task_id, runtime.new_pass_id()
    )
    if not first and runs.pass_outcome(sub.run_id, sub.iteration, sub.worker_id, sid):
        log.info("entry task %s delivered again: its pass %s has its outcome", task_id, sid)
        raise Ignore()  # store nothing over the pass's summary
    first_msg = runtime.encode(
        start(sub, sid), overrides, sid=sid, task=keys.TASK_L0, task_id=task_id
    )
    if first or runs.latest_pass(sub.run_id, sub.iteration, sub.worker_id) is None:
        runs.begin_pass(sub.run_id, sub.iteration, sub.worker_id, sid)
        register(sub.run_id, sub.iteration, sub.worker_id, sid)
        runs.mark_submitted(
            sub.run_id,
            sub.iteration,
            sub.worker_id,
            task_id,
            sub.subtask_signature,
            sid=sid,
            message=first_msg,
        )
    runtime.metrics().observe("submit", time.monotonic() - began)
    replaced: dict[str, Any] = self.replace(submission_signature(first_msg, config, sub))
    return replaced
