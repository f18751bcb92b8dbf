"""The Celery tasks, each a declaration over the pure stages, all on one base
(:class:`workers.steps.PipelineTask`): what a stage task does with its message (take,
replay, run, record, refund) is :mod:`workers.steps`; where a stage runs and what is sent
next, :mod:`workers.routing`.

A submission is sent as one task, ``critique.l0``, on its critic's queue. A task runs its stage
and then every stage after it that belongs on its queue (:func:`drive`): Layer-0 and
``decide`` anywhere (both token-free and cheap, so ``decide`` runs inside the task that ran the
critic), the critic where its queue is, and the gate once nothing follows. So an accepted
output is one task (``l0 → critic → decide → gate``); a repair round is a task of its own: the
task replaces itself (``Task.replace``) with ``critique.repair``, which runs ``repair → l0 →
critic → decide`` and the gate or the next round. A critic on another queue than the task's (a
token-free reviser on the CPU queue before an LLM critic, or ``mode: dedicated``) is a
replacement too. Replacements keep the task's id, as Celery's own replace does, so the id the
client sent the submission under ends up holding the summary in Celery's result backend. No
task ever waits on another. The stage tasks (``critique.critic``, ``critique.decide``,
``critique.repair``, ``critique.gate``) each take a message for their stage, so a pass resumed
at any stage (:func:`workers.routing.continuation`) goes on the same way.
"""

from __future__ import annotations

import time
from typing import Any

from celery import states
from celery.exceptions import Ignore
from celery.signals import task_postrun
from celery.utils.log import get_task_logger
from kombu.exceptions import OperationalError

from pipeline.errors import PermanentError, TransientError
from pipeline.loop.admission import admit
from pipeline.loop.stages import start
from pipeline.store import keys
from pipeline.store.runs import EntryIdTaken, RunOwnedError
from workers import entry, runtime, telemetry
from workers.app import app
from workers.routing import submission_signature
from workers.steps import (
    PipelineTask,
    boundary_config,
    drive,
    finish_pass,
    from_broker,
    record_refusal,
    refuse,
    run_completion_gate,
    run_step,
    scrubbed_line,
    settle,
    take,
)

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
# stored, under the task id the client holds.
STAGE = {**RETRY, "ignore_result": True, "store_errors_even_if_ignored": True}
log = get_task_logger(__name__)


METRICS_FLUSH_S = 0.5
"""How often a busy worker process sends its fleet-metric increments (one round trip each time):
at most this long after a task ends, where once per task cost a round trip per stage."""


@task_postrun.connect
def _flush_metrics(**_: Any) -> None:
    """After every task: its fleet-metric increments sent within :data:`METRICS_FLUSH_S`."""
    runtime.metrics().flush_soon(METRICS_FLUSH_S)


# --- the tasks -------------------------------------------------------------------------------


@app.task(name=keys.TASK_L0, bind=True, base=PipelineTask, **STAGE)
def l0(self: PipelineTask, msg: dict[str, Any]) -> dict[str, Any]:
    """Layer-0 contract checks (token-free), then what runs after them here (:func:`drive`):
    a submission's first task, sent to its critic's queue."""
    return drive(self, msg, "l0")


@app.task(name=keys.TASK_CRITIC, bind=True, base=PipelineTask, **STAGE)
def critic(self: PipelineTask, msg: dict[str, Any]) -> dict[str, Any]:
    """The configured critic (heuristic, rubric, LLM), then ``decide`` and, for an accepted or
    stopped output, the gate (:func:`drive`)."""
    return drive(self, msg, "critic")


@app.task(name=keys.TASK_REPAIR, bind=True, base=PipelineTask, **STAGE)
def repair(self: PipelineTask, msg: dict[str, Any]) -> dict[str, Any]:
    """One targeted repair attempt, charged to the run's budget; then Layer-0 again, the
    re-critique when its critic runs on this queue, decide and the gate (:func:`drive`)."""
    return drive(self, msg, "repair")


@app.task(name=keys.TASK_DECIDE, bind=True, base=PipelineTask, **STAGE)
def decide(self: PipelineTask, msg: dict[str, Any]) -> dict[str, Any]:
    """Accept, stop, escalate, or loop into another repair round (via ``Task.replace``).

    The task that ran the critic runs this stage itself; this task is for a pass resumed
    between the two (a continuation from a recorded critic step)."""
    return drive(self, msg, "decide")


@app.task(name=keys.TASK_GATE, bind=True, base=PipelineTask, **RETRY)
def gate(self: PipelineTask, msg: dict[str, Any]) -> dict[str, Any]:
    """Finish the submission pass (:func:`finish_pass`) of a pass resumed after its last
    stage.

    Only from a message that passed its signature check (``CRITIQUE_SECRET``): a forged
    finished state is refused before anything is stored."""
    state, _ = from_broker(self, msg, "gate", runtime.decode)
    return finish_pass(self, msg, state)


@app.task(name=keys.TASK_COMPLETE_GATE, bind=True, base=PipelineTask, **RETRY)
def complete_gate(self: PipelineTask, msg: dict[str, Any]) -> dict[str, Any]:
    """The manager's completion gate over the run's stored results
    (:func:`run_completion_gate`; see docs/client.md, "The Python client (for the manager)").

    Message: ``{"v": 1, "request_id", "run_id", "iteration", "final_result", "task", "files",
    "deliverable_expected", "config", "task_name", "task_id"}`` (the last two: this task, as
    addressed by the signer). Returns the ``CompletionDecision`` as JSON."""
    return run_completion_gate(self, msg)


def _stage(task: PipelineTask, msg: dict[str, Any], stage: str) -> tuple[dict[str, Any], str]:
    """One stage's body alone, as ``task`` runs it: the message it hands on and its next
    stage, its step recorded (a task that ends after the stage). Tests run single stages with
    it."""
    step = settle(task, run_step(task, stage, take(task, msg, stage)))
    return step.out, step.next


# --- the entry task (docs/entry.md) -----------------------------------------------------------

ENTRY = {
    **RETRY,
    # Nothing of the entry task's own is stored on success (it is replaced by the submission's
    # first task, under its id, which stores the summary), and a failure is stored by
    # EntryTask.on_failure alone: one line, no traceback.
    "ignore_result": True,
    "store_errors_even_if_ignored": False,
    # Nor a STARTED state, which Celery writes before the task runs when a hand-built message's
    # headers ask for results: under an id another submission's entry claimed, the refusal
    # must leave nothing at all.
    "track_started": False,
    "throws": (PermanentError,),  # a refusal is logged as one line, not a traceback
}


class EntryTask(PipelineTask):
    """``critique.submit``: a failure for good is also stored in Celery's result backend under
    the task's id as ``FAILURE`` with a one-line reason and no traceback (``result.exc_type``,
    ``result.exc_message[0]``), so a manager in any language reads why; never over a result
    already there (a message forged under a live submission's id cannot hide its verdict)."""

    def on_failure(
        self,
        exc: BaseException,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        einfo: Any,
    ) -> None:
        super().on_failure(exc, task_id, args, kwargs, einfo)
        _store_entry_failure(self, exc, task_id)


_ENTRY_OF = "critique_entry"
"""The request attribute naming the submission an entry message verified as: ``(run id,
iteration, worker id)``, set once it decoded (:func:`_store_entry_failure` reads it)."""


def _store_entry_failure(task: PipelineTask, exc: BaseException, task_id: str) -> None:
    """The one-line ``FAILURE`` of a refused entry message under its task id: never over a
    verdict (garbage sent under a finished submission's id), and never under an id another
    submission's entry claimed (:meth:`RedisRunStore.claim_entry`): that id holds, or will
    hold, that submission's verdict, so neither garbage nor another run's message sent under
    it may show its manager a failure."""
    if task.request.is_eager or not task_id or isinstance(exc, EntryIdTaken):
        return
    try:
        claim = runtime.stores().runs.entry_claim(task_id)
        mine = getattr(task.request, _ENTRY_OF, None)
        if claim is not None and mine != (
            claim.get("run_id"),
            claim.get("iteration"),
            claim.get("worker_id"),
        ):
            log.warning("entry task %s failed under another submission's id: not stored", task_id)
            return
        meta = task.backend.get_task_meta(task_id, cache=False)
        if meta.get("status") == states.SUCCESS:
            log.warning("entry task %s failed after its pass stored an outcome: kept", task_id)
            return
        exc.args = (scrubbed_line(exc),)
        task.backend.store_result(task_id, exc, states.FAILURE, traceback=None, request=None)
    except Exception as store_exc:  # never mask the task's own failure
        log.warning("could not store the failure of entry task %s: %s", task_id, store_exc)


def _check_owner(task: PipelineTask, run_id: str, signer: str | None) -> None:
    """Bind run ``run_id`` to the identity that signed its first entry message, and refuse an
    entry signed by another identity (``RunOwnedError``, one line naming the run only) before
    any pass record is written. Unsigned fleets (no key) enforce no owner. The refusal is logged
    and counted, not traced: the run is someone else's."""
    if signer is None:
        return
    try:
        runtime.stores().runs.enter_run(run_id, signer)
    except RunOwnedError as exc:
        record_refusal(task, "submit", exc, None, exc.message, verified=True)
        raise


@app.task(name=keys.TASK_SUBMIT, bind=True, base=EntryTask, **ENTRY)
def submit(self: EntryTask, msg: Any) -> dict[str, Any]:
    """The entry task: one submission as plain JSON (:mod:`workers.entry`), from a manager in
    any language. Does on the worker what ``CritiqueClient.submit`` does (check the message
    and the trust boundary, admit, start the pass, register it), then replaces itself with the
    submission's first task (:func:`submission_signature`) under its own id, so that id ends up
    holding the gate's summary in Celery's result backend.

    Idempotent under redelivery: the pass is claimed under the entry task's id, fleet-wide
    (``RedisRunStore.claim_entry``), so the same message delivered twice runs one pass (a
    redelivery sends that pass's first task again, which replays its recorded steps, or does
    nothing once the pass has its outcome), and another submission's message under the same
    id is refused with nothing written there. Before that, the run is entered as the
    message's signer (:func:`_check_owner`): another manager's run is refused."""
    # Whatever the message's headers ask: Celery stores nothing of this task's (a failure is
    # stored by EntryTask.on_failure, in one line; the replacement stores the summary).
    self.request.ignore_result = True
    began = time.monotonic()
    task_id = str(self.request.id or "")
    try:
        sub, overrides, signer = entry.decode_entry(msg, task_name=self.name, task_id=task_id)
    except PermanentError as exc:
        refuse(self, msg, "submit", exc)
        raise
    setattr(self.request, _ENTRY_OF, (sub.run_id, sub.iteration, sub.worker_id))
    with telemetry.span(
        "critique submit", run_id=sub.run_id, iteration=sub.iteration, worker_id=sub.worker_id
    ) as traced:
        _check_owner(self, sub.run_id, signer)
        config = boundary_config(
            self, overrides, "submit", sub.run_id, sub.iteration, sub.worker_id, sub.model
        )
        admit(sub, config, runtime.file_bytes)
        runs = runtime.stores().runs
        try:
            pass_id, first = runs.claim_entry(
                sub.run_id, sub.iteration, sub.worker_id, task_id, runtime.new_pass_id()
            )
        except EntryIdTaken as exc:
            record_refusal(self, "submit", exc, sub.run_id, exc.message, verified=True)
            raise
        traced.set(pass_id=pass_id)
        if not first and runs.pass_outcome(sub.run_id, sub.iteration, sub.worker_id, pass_id):
            log.info("entry task %s delivered again: its pass %s has its outcome", task_id, pass_id)
            raise Ignore()  # store nothing over the pass's summary
        first_msg = runtime.encode(
            start(sub, pass_id), overrides, pass_id=pass_id, task=keys.TASK_L0, task_id=task_id
        )
        if first or runs.latest_pass(sub.run_id, sub.iteration, sub.worker_id) is None:
            runs.open_submission(sub, pass_id, task_id=task_id, message=first_msg)
        runtime.metrics().observe("submit", time.monotonic() - began)
        replaced: dict[str, Any] = self.replace(submission_signature(first_msg, config, sub))
        return replaced
