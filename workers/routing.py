"""Where each stage of a pass runs, and the signatures that send it there.

Two kinds of decision, both made from the submission, its configuration and the task that
holds the state now:

- **Queues.** Layer-0 and the critic go to the critic's queue (:func:`critic_queue`: the LLM
  queue, the dedicated critic queue, or the CPU queue for a deterministic critic), a repair to
  its reviser's (:func:`repair_queue`), ``decide`` and the gate by celeryconfig's routes. A
  submission is sent as one task, its first stage's (:func:`submission_signature`); a pass
  resumed at any stage is sent as the task of that stage (:func:`continuation`).
- **Consumers.** After each stage the task either runs the next stage itself
  (:func:`runs_here`: Layer-0 and ``decide`` anywhere, the critic where its queue is, the first
  repair round where its queue is, and the gate) or hands the state on to the task that
  replaces it under the same id. The message it hands on is addressed (signed) to that
  consumer (:func:`addressed`).

Signatures are built from the registered stage tasks (``app.tasks``), which every process gets
by importing :mod:`workers.tasks` (a caller imports it before it calls these builders).
"""

from __future__ import annotations

from typing import Any

from celery import Task

from pipeline.config import CritiqueConfig
from pipeline.critics.base import resolve_for
from pipeline.loop.stages import LoopState
from pipeline.models import Submission
from pipeline.security import signing
from pipeline.store import keys
from workers import runtime
from workers.app import app

STAGE_TASKS: dict[str, str] = {
    "l0": keys.TASK_L0,
    "critic": keys.TASK_CRITIC,
    "decide": keys.TASK_DECIDE,
    "repair": keys.TASK_REPAIR,
    "done": keys.TASK_GATE,
}
"""The task that runs each stage when a message is sent for it (``done``: the gate)."""


# --- queues ----------------------------------------------------------------------------------


def critic_queue(config: CritiqueConfig, submission: Submission) -> str:
    """The queue the submission's critic runs on: the LLM queue (mode: inline) or the dedicated
    critic queue (mode: dedicated) for an LLM critic, the CPU queue for a deterministic one, so
    each scales with its own workers."""
    if config.uses_llm_critic(submission.model):
        return keys.QUEUE_CRITIC if config.mode == "dedicated" else keys.QUEUE_LLM
    return keys.QUEUE_CPU


def repair_queue(overrides: dict[str, Any] | None, submission: Submission) -> str | None:
    """The queue of the submission's repair when it is not celeryconfig's route (the LLM
    queue): the CPU queue when the reviser that serves it (under the submission's
    configuration ``overrides``) is token-free (deterministic), so a token-free repair never
    waits for LLM workers (KEDA scales the LLM queue to zero)."""
    reviser = runtime.context_for(overrides).reviser
    return keys.QUEUE_CPU if resolve_for(reviser, submission).token_free else None


def repair_queue_here(task: Task, state: LoopState, overrides: dict[str, Any]) -> bool:
    """Whether the state's repair would be sent to the queue ``task`` came from: its
    reviser's (:func:`repair_queue`), else celeryconfig's route for the repair task."""
    here = queue_here(task)
    if here is None:
        return False
    queue = repair_queue(overrides, state.submission)
    if queue is None:
        queue = (app.conf.task_routes or {}).get(keys.TASK_REPAIR, {}).get("queue")
    return here == queue


FIRST_ATTEMPT = "critique_first_attempt"
"""The request attribute holding the repair attempt of the state a task took off the broker
(set by :func:`workers.steps.take`): a task whose state is still at it has run
no repair yet."""


def queue_here(task: Task) -> str | None:
    """The queue this task's message came from (None when it runs eagerly, without a broker)."""
    info = task.request.delivery_info or {}
    key = info.get("routing_key")
    return str(key) if key else None


# --- consumers -------------------------------------------------------------------------------


def runs_here(task: Task, next_stage: str, state: LoopState, overrides: dict[str, Any]) -> bool:
    """Whether ``task`` runs ``next_stage`` itself, after the stage it just ran.

    Layer-0 and ``decide`` are token-free and cheap: they run wherever the state is. The
    critic runs here when this task came from the critic's queue (an LLM critic never runs on
    the CPU workers, nor a deterministic one on the LLM workers). The gate (``done``) always
    runs here. A repair runs here when it would be sent to the queue this task came
    from and this task has run no repair yet (its state is at the attempt it arrived with), so
    a task makes at most one repair round: a later round, a repair routed to another queue,
    and any repair of a pass run eagerly replace the task (``Task.replace``)."""
    if next_stage in ("l0", "decide", "done"):
        return True
    if next_stage == "critic":
        here = queue_here(task)
        return here is None or here == critic_queue(runtime.config_for(overrides), state.submission)
    if next_stage == "repair":
        return getattr(task.request, FIRST_ATTEMPT, None) == state.attempt and repair_queue_here(
            task, state, overrides
        )
    return False


def consumer(
    task: Task, next_stage: str, state: LoopState, overrides: dict[str, Any]
) -> tuple[str, str]:
    """``(task name, task id)`` the message a stage hands on (its state's next stage
    ``next_stage``) is addressed to: this task itself when it runs that stage too
    (:func:`runs_here`); else the task that replaces this one (``Task.replace``), which keeps
    this task's id, as Celery's own replace does, so the id the client holds ends up with the
    result."""
    own = str(task.request.id or "")
    if runs_here(task, next_stage, state, overrides):
        return task.name, own
    return STAGE_TASKS[next_stage], own


def addressed(
    task: Task, msg: dict[str, Any], state: LoopState, overrides: dict[str, Any]
) -> dict[str, Any]:
    """``msg`` (a pass-through or a replayed output, with its decoded ``state``) addressed to
    its consumer (:func:`consumer`): re-signed only when it names another task, and only after
    it verified (it may come from the store)."""
    return runtime.address(msg, *consumer(task, state.next, state, overrides))


# --- signatures ------------------------------------------------------------------------------


def stage_signature(
    stage: str, msg: dict[str, Any], config: CritiqueConfig, submission: Submission
) -> Any:
    """The signature of the task that runs ``stage`` on ``msg``, routed for the submission:
    Layer-0 and the critic to the critic's queue (:func:`critic_queue`: Layer-0 is a
    submission's first stage, and the critic runs after it in the same task), the repair to
    its reviser's (:func:`repair_queue`), ``decide`` and the gate by celeryconfig's routes."""
    task: Task = app.tasks[STAGE_TASKS[stage]]
    sig = task.s(msg)
    if stage in ("l0", "critic"):
        sig = sig.set(queue=critic_queue(config, submission))
    elif stage == "repair":
        queue = repair_queue(msg.get("config"), submission)
        if queue:
            sig = sig.set(queue=queue)
    return sig


def submission_signature(
    msg: dict[str, Any], config: CritiqueConfig, submission: Submission
) -> Any:
    """The one task a submission is sent as: Layer-0's, on its critic's queue, under the id
    ``msg`` is addressed to (the client picks it before signing). The loop goes on in that task
    and in the tasks that replace it, all under that id."""
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
    msg = runtime.address(msg, STAGE_TASKS[state.next], task_id)
    return stage_signature(state.next, msg, config, submission).set(task_id=task_id)
