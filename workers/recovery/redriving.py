"""Re-driving a pass: sending the rest of its chain again, from its last recorded step.

A pass's chain can stop moving in two ways (lost, stalled), and each has one rule here:

- **Lost**: no message of the pass is anywhere, proved within seconds by one rule on the
  broker's evidence (:class:`LostEvidence`): a pass the evidence finds absent on two looks at
  least :data:`~workers.recovery.base.LOST_GRACE_S` apart (a *suspect*, then *confirmed*),
  whose next stage's queue proves that no message of it was queued at the suspicion nor taken
  since, is re-driven at once (:func:`redrive_if_lost`, ``reason: lost``). The evidence is
  the broker's:

  - Redis (:class:`UnackedEvidence`): kombu's Redis transport pops a message (``BRPOP``) and
    only then writes it to its ``unacked`` hash, so a Redis restart between the two leaves the
    message nowhere. With late acknowledgement every message a worker holds (reserved,
    scheduled or running) stays in ``unacked`` until its task ends, and a stage sends its next
    message before acknowledging its own: a pass with no message in ``unacked``
    (:func:`judge`) whose queue was drained past the suspicion (:func:`drained_for_proof`,
    the sweeper's probes) has no message anywhere.
  - RabbitMQ (:class:`~workers.recovery.census.CensusEvidence`): RabbitMQ counts each queue's
    ready messages and consumers, and every worker reports the passes it holds: a pass no live
    worker holds on two censuses, whose queue had nothing ready and no consumer unaccounted
    for at the first, while every consumer stayed connected across it, has no message
    anywhere (:mod:`workers.recovery.census`).

- **Stalled** (any broker; the backstop). No step of the pass was recorded for the
  stall time, and the queue of its next stage was drained past its last progress long enough
  ago that its message, had there been one, would have run (:func:`is_stalled`,
  :func:`redrive_if_stalled`, ``reason: stalled``). Queue drains are measured by the sweeper's
  probes (:class:`DrainView`), so a long queue never reads as a stall.

All read each pass's last progress from the pending index (:mod:`pipeline.store.pending`),
where a pass is registered before its chain is sent and whose score every first record of a
step moves to now.

Only the workers' sweeper applies these rules (a client's ``wait`` only waits). It claims the
pass atomically before publishing (two sweepers never both re-drive it) and gives up after
:func:`~workers.recovery.base.max_resumes` re-drives with a ``stalled`` trace event.
:func:`redrive` is the unconditional re-drive that ``CritiqueClient.resume`` calls.
Re-driving is always safe: every stage replays its recorded output, every effect is
idempotent, and the chain ends in the gate task with its original id. See docs/operations.md,
"What survives what".
"""

from __future__ import annotations

import bisect
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.errors import PermanentError, SubmissionError
from pipeline.loop.stages import LoopState
from pipeline.models import PassRef
from pipeline.store import keys
from pipeline.store.pending import RedisPendingIndex
from workers import runtime, telemetry
from workers.recovery.base import (
    LOST_GRACE_S,
    LOST_MARGIN_S,
    RecoveryStores,
    Snapshot,
    default_stores,
    max_resumes,
    stall_after_s,
)

log = logging.getLogger(__name__)

FINISHED = "finished"
"""What :func:`redrive` answers for a pass that has its result already (nothing is sent)."""


# --- what a re-drive publishes -------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """What re-driving one pass would publish."""

    pass_id: str
    after_step: str | None
    state: LoopState
    signature: Any
    queue: str


def _plan(
    s: RecoveryStores, run_id: str, iteration: int, worker_id: str, doc: dict[str, Any] | None
) -> _Plan:
    """The continuation of the latest pass of (run, iteration, worker) from its last recorded
    step, given its submission record ``doc`` (``RedisRunStore.submission``, read by the
    caller); ``SubmissionError`` when the submission has no recorded first message."""
    # lazy: workers.routing imports workers.app, which configures Celery, logging and os.environ on
    # import; importing workers.recovery.redriving does not. workers.tasks registers the stage
    # tasks (app.tasks) the continuation is built from.
    import workers.tasks  # noqa: F401
    from workers.routing import continuation

    if not doc or "message" not in doc:
        raise SubmissionError(
            f"cannot resume {worker_id} of run {run_id}: no first message recorded for it "
            "(was it submitted by this client version?)"
        )
    pass_id = str(doc.get("sid", ""))
    latest = s.runs.latest_step(run_id, iteration, worker_id, pass_id)
    msg: dict[str, Any] = doc["message"] if latest is None else dict(json.loads(latest[1]))
    state, overrides = runtime.decode(msg)
    config = runtime.config_for(overrides)
    sig = continuation(msg, config, state.submission, str(doc["task_id"]))
    return _Plan(pass_id, None if latest is None else latest[0], state, sig, _queue_of(sig))


def _queue_of(sig: Any) -> str:
    """The queue the first task of a signature (or chain) goes to."""
    # lazy: workers.app configures Celery, logging and os.environ on import; importing
    # workers.recovery.redriving does not
    from workers.app import app

    tasks = getattr(sig, "tasks", None)
    first = tasks[0] if tasks else sig
    queue = first.options.get("queue")
    if queue:
        return str(queue)
    route = (app.conf.task_routes or {}).get(first.task) or {}
    return str(route.get("queue") or app.conf.task_default_queue)


def _publish(
    s: RecoveryStores,
    run_id: str,
    iteration: int,
    worker_id: str,
    plan: _Plan,
    by: str,
    **extra: Any,
) -> str:
    """Send the plan's chain (in a span ``critique redrive`` while tracing: the chain's tasks
    join its trace) and write the ``resume`` trace event; returns the stage."""
    telemetry.setup()  # a prefork worker's main process, whose sweeper re-drives: after its fork
    with telemetry.span(
        "critique redrive",
        run_id=run_id,
        iteration=iteration,
        worker_id=worker_id,
        pass_id=plan.pass_id,
        by=by,
        stage=plan.state.next,
        round=plan.state.round,
        after_step=plan.after_step,
        **extra,
    ):
        plan.signature.apply_async()
    fleet = runtime.metrics()
    fleet.add("redrives")
    fleet.flush()
    s.trace.emit(
        run_id,
        {
            "type": "resume",
            "by": by,
            "stage": plan.state.next,
            "worker_id": worker_id,
            "iteration": iteration,
            "round": plan.state.round,
            "after_step": plan.after_step,
            **extra,
        },
    )
    return plan.state.next


def redrive(
    run_id: str,
    iteration: int,
    worker_id: str,
    *,
    by: str = "client",
    stores: RecoveryStores | None = None,
) -> str:
    """Re-drive a submission's latest pass from its last recorded step (or from the start).

    Safe at any time: every stage replays its recorded output and every effect is idempotent,
    so a chain that was only slow, not lost, ends in the same result. The pass's progress is
    set to now, so the sweeper leaves it alone for a stall time. Returns the stage it resumed
    at (``done``: only the gate was missing), or ``finished`` when the pass has its result
    already: then nothing is sent (its step records and first message were released with it).
    """
    stores = stores or default_stores()
    doc = stores.runs.submission(run_id, iteration, worker_id)
    pass_id = str((doc or {}).get("sid") or "")
    if pass_id and stores.runs.pass_result(run_id, iteration, worker_id, pass_id) is not None:
        return FINISHED
    plan = _plan(stores, run_id, iteration, worker_id, doc)
    member = PassRef(run_id, iteration, worker_id, plan.pass_id).member
    stores.pending.touch(run_id, member, time.time())
    return _publish(stores, run_id, iteration, worker_id, plan, by)


# --- what one look at the pending passes shares ------------------------------------------------


class DrainView:
    """The queues' drain history as read once (per sweep, or per ``wait`` check): whether
    probes run on a queue, and when it was first drained past a given time."""

    def __init__(self, pending: RedisPendingIndex) -> None:
        self._pending = pending
        self._queues: dict[str, tuple[bool, list[float], list[float]]] = {}

    def _read(self, queue: str) -> tuple[bool, list[float], list[float]]:
        got = self._queues.get(queue)
        if got is None:
            probed = self._pending.probed(queue)
            history = self._pending.drained(queue) if probed else []
            got = (probed, [sent for sent, _ in history], [ran for _, ran in history])
            self._queues[queue] = got
        return got

    def probed(self, queue: str) -> bool:
        """Whether probes run on ``queue``."""
        return self._read(queue)[0]

    def drained_after(self, queue: str, t: float) -> float | None:
        """When the first probe sent after ``t`` ran on ``queue``; None if none has yet."""
        _, sent, ran = self._read(queue)
        i = bisect.bisect_right(sent, t)
        return ran[i] if i < len(sent) else None


class QueueCache:
    """Per pending pass and last progress, the queue its next stage goes to: a pass waiting in
    a long queue is then re-checked without reading its steps again. The sweeper keeps one
    across sweeps; it is emptied when it reaches ``limit`` entries."""

    def __init__(self, limit: int = 100_000) -> None:
        self._limit = limit
        self._queues: dict[str, tuple[float, str]] = {}

    def get(self, run_id: str, member: str, last_progress: float) -> str | None:
        """The queue remembered for this pass at this progress; None if none is."""
        known = self._queues.get(f"{run_id}/{member}")
        return known[1] if known is not None and known[0] == last_progress else None

    def remember(self, run_id: str, member: str, last_progress: float, queue: str) -> None:
        """Remember the pass's queue at this progress."""
        if len(self._queues) >= self._limit:
            self._queues.clear()
        self._queues[f"{run_id}/{member}"] = (last_progress, queue)

    def __len__(self) -> int:
        return len(self._queues)


@dataclass(frozen=True)
class RedriveContext:
    """What one look at pending passes shares (one sweep, or one ``wait`` check): the stores,
    the queues' drain history read once, the clock and stall time of the look, who re-drives
    (``by``, written to the trace) and the queue cache (the sweeper's, kept across sweeps)."""

    stores: RecoveryStores
    by: str
    now: float
    stall_s: float
    view: DrainView
    queues: QueueCache = field(default_factory=QueueCache)

    @classmethod
    def start(
        cls,
        *,
        by: str,
        stores: RecoveryStores | None = None,
        now: float | None = None,
        stall_s: float | None = None,
        queues: QueueCache | None = None,
    ) -> RedriveContext:
        """A context for a look starting now: the default stores, the configured stall time
        (:func:`~workers.recovery.base.stall_after_s`) and a fresh cache unless given."""
        stores = stores or default_stores()
        return cls(
            stores=stores,
            by=by,
            now=time.time() if now is None else now,
            stall_s=stall_after_s() if stall_s is None else stall_s,
            view=DrainView(stores.pending),
            queues=QueueCache() if queues is None else queues,
        )


# --- the stall rule ------------------------------------------------------------------------------


def is_stalled(
    view: DrainView, queue: str, last_progress: float, now: float, stall_s: float
) -> bool:
    """No progress for ``stall_s``, and ``queue`` drained past ``last_progress`` at least
    ``stall_s`` ago (so its next message, had it been queued, would have been taken and run
    within the task time limit). Without probes on the queue (no sweeper anywhere) age alone
    decides."""
    if now - last_progress < stall_s:
        return False
    if not view.probed(queue):
        return True
    drained = view.drained_after(queue, last_progress)
    return drained is not None and now - drained >= stall_s


def _examine(
    ctx: RedriveContext, run_id: str, member: str, last_progress: float
) -> tuple[PassRef, _Plan, dict[str, Any]] | None:
    """One pending pass's ref, re-drive plan and submission record, or None when it can
    no longer be re-driven: superseded by a resubmission, not registered (yet), its run
    expired, or its chain failed (then it leaves the index). Remembers the plan's queue."""
    s = ctx.stores
    ref = PassRef.parse(run_id, member)
    if ref is None:
        s.pending.drop(run_id, member)
        return None
    doc = s.runs.submission(run_id, ref.iteration, ref.worker_id)
    if doc is None or str(doc.get("sid", "")) != ref.pass_id or "message" not in doc:
        # Superseded by a resubmission (only the latest pass's first message is kept), or not
        # registered (yet: its submit may still be publishing; or its run expired).
        if doc is not None or ctx.now - last_progress >= max(10 * ctx.stall_s, 3600.0):
            s.pending.drop(run_id, member)
        return None
    if s.runs.failure(run_id, member) is not None:
        # A worker recorded that the pass failed (Celery's FAILURE state for the gate id is no
        # evidence: a broker writer can set it): the waiter gets the failure; a re-drive
        # would fail again.
        s.pending.drop(run_id, member)
        return None
    try:
        plan = _plan(s, run_id, ref.iteration, ref.worker_id, doc)
    except PermanentError as exc:
        log.error("cannot re-drive %s of run %s: %s", member, run_id, exc)
        s.pending.drop(run_id, member)
        return None
    ctx.queues.remember(run_id, member, last_progress, plan.queue)
    return ref, plan, doc


def _give_up(ctx: RedriveContext, ref: PassRef, plan: _Plan, reason: str) -> None:
    """Log and trace that the pass is given up on after :func:`max_resumes` re-drives."""
    log.error(
        "giving up on %s of run %s: %s again after %d re-drives",
        ref.member,
        ref.run_id,
        reason,
        max_resumes(),
    )
    ctx.stores.trace.emit(
        ref.run_id,
        {
            "type": "stalled",
            "by": ctx.by,
            "stage": plan.state.next,
            "worker_id": ref.worker_id,
            "iteration": ref.iteration,
            "after_step": plan.after_step,
            "resumes": max_resumes(),
            "gave_up": True,
        },
    )


def _claim_and_publish(
    ctx: RedriveContext, ref: PassRef, last_progress: float, plan: _Plan, reason: str
) -> str | None:
    """Claim the pass for one re-drive (atomically: two sweepers never both re-drive it) and
    publish its plan; None when someone else claimed it or it progressed, or when it was
    re-driven :func:`max_resumes` times already (then it is given up on, with a ``stalled``
    trace event)."""
    run_id, member = ref.run_id, ref.member
    claimed = ctx.stores.pending.claim(run_id, member, last_progress, ctx.now, max_resumes())
    if claimed < 0:
        return None
    if claimed == 0:
        _give_up(ctx, ref, plan, reason)
        return None
    log.warning(
        "re-driving %s of run %s at %s: %s, no progress for %.0f s",
        member,
        run_id,
        plan.state.next,
        reason,
        ctx.now - last_progress,
    )
    return _publish(
        ctx.stores,
        run_id,
        ref.iteration,
        ref.worker_id,
        plan,
        ctx.by,
        reason=reason,
        stalled_s=round(ctx.now - last_progress, 3),
        attempt=claimed,
    )


def redrive_if_stalled(
    ctx: RedriveContext, run_id: str, member: str, last_progress: float
) -> str | None:
    """Re-drive one pending pass if it is stalled (:func:`is_stalled`), claiming it atomically
    first so that two sweepers never both re-drive it.
    Returns the stage it resumed at, or None. A pass that can no longer be re-driven
    (superseded by a resubmission, its run expired, its chain failed) leaves the index. A pass
    whose queue ``ctx.queues`` knows is re-checked without reading its steps again."""
    known = ctx.queues.get(run_id, member, last_progress)
    if known is not None and not is_stalled(ctx.view, known, last_progress, ctx.now, ctx.stall_s):
        return None  # still waiting in its queue: nothing to read again
    examined = _examine(ctx, run_id, member, last_progress)
    if examined is None:
        return None
    ref, plan, _ = examined
    if not is_stalled(ctx.view, plan.queue, last_progress, ctx.now, ctx.stall_s):
        return None
    return _claim_and_publish(ctx, ref, last_progress, plan, "stalled")


# --- the proof that a pass is lost ----------------------------------------------------------------


def drained_for_proof(view: DrainView, queue: str, since: float, read_at: float) -> bool:
    """Whether ``queue`` was drained past ``since`` at least :data:`LOST_GRACE_S` before
    ``read_at``: a probe sent after ``since`` ran by then (never on a queue without probes)."""
    if not view.probed(queue):
        return False
    ran = view.drained_after(queue, since)
    return ran is not None and read_at - ran >= LOST_GRACE_S


def judge(
    member: str,
    last_progress: float,
    prior: tuple[float, float] | None,
    snap: Snapshot,
) -> str:
    """The first half of the proof that a pass is lost, on one snapshot of ``unacked``:
    ``"alive"`` (a message of it is unacknowledged: a worker holds it, or it will be restored),
    ``"young"`` (progress too recent to judge), ``"suspect"`` (no message of it seen now: record
    it with ``snap.after``), or ``"confirm"`` (none seen now either, and it was a suspect with the
    same progress at least :data:`LOST_GRACE_S` ago: check its queue drained past that time)."""
    ref = PassRef.parse("", member)
    if ref is not None and ref.pass_id in snap.pass_ids:
        return "alive"
    if snap.before - last_progress < LOST_MARGIN_S:
        return "young"
    if prior is None or prior[0] != last_progress:
        return "suspect"
    return "confirm" if snap.before - prior[1] >= LOST_GRACE_S else "wait"


class LostEvidence(Protocol):
    """One look at the broker, as the rule that proves a pass lost reads it: the unacknowledged
    messages of a Redis broker (:class:`UnackedEvidence`) or a census of a RabbitMQ broker
    (:class:`~workers.recovery.census.CensusEvidence`). The sweeper suspects, confirms and
    re-drives with :func:`redrive_if_lost` whichever it has: the rule is one, its evidence
    comes from the broker."""

    @property
    def at(self) -> float:
        """When the look was made: a pass found absent in it is a suspect since then."""
        ...

    def judge(self, member: str, last_progress: float, prior: tuple[float, float] | None) -> str:
        """One pending pass on this look (``prior``: ``(last progress, suspected at)`` when it
        is a suspect): ``"alive"``, ``"young"``, ``"suspect"``, ``"wait"`` or ``"confirm"``."""
        ...

    def proves(self, ctx: RedriveContext, queue: str, since: float) -> bool:
        """Whether ``queue`` held no message of a pass absent since ``since`` that no worker
        took since (then, with the pass confirmed absent, its message is nowhere)."""
        ...

    def may_prove(self, ctx: RedriveContext, since: float) -> bool:
        """Whether any queue could prove a suspicion of ``since`` (if not, nothing is read)."""
        ...

    def unproven(
        self, ctx: RedriveContext, run_id: str, member: str, last_progress: float, queue: str
    ) -> None:
        """What follows a confirmation that its queue, ``queue``, did not prove."""
        ...


@dataclass(frozen=True)
class UnackedEvidence:
    """A Redis broker's evidence: one snapshot of its ``unacked`` hash (:func:`judge`) and the
    queues' probes (:func:`drained_for_proof`)."""

    snap: Snapshot

    @property
    def at(self) -> float:
        return self.snap.after

    def judge(self, member: str, last_progress: float, prior: tuple[float, float] | None) -> str:
        return judge(member, last_progress, prior, self.snap)

    def proves(self, ctx: RedriveContext, queue: str, since: float) -> bool:
        return drained_for_proof(ctx.view, queue, since, self.snap.before)

    def may_prove(self, ctx: RedriveContext, since: float) -> bool:
        return any(self.proves(ctx, q, since) for q in keys.QUEUES)

    def unproven(
        self, ctx: RedriveContext, run_id: str, member: str, last_progress: float, queue: str
    ) -> None:
        """Nothing: the suspicion stands until a probe drains its queue."""


def redrive_if_lost(
    ctx: RedriveContext,
    run_id: str,
    member: str,
    last_progress: float,
    *,
    since: float,
    evidence: LostEvidence,
) -> str | None:
    """Re-drive a suspect pass that ``evidence`` confirmed (a suspect since ``since``) once the
    queue of its next stage proves it (:meth:`LostEvidence.proves`): no message of it was there
    at ``since`` nor in any worker's hands since, and none is now. A pass whose first message
    may have been sent after the suspicion is not proven. Claimed atomically, like
    :func:`redrive_if_stalled`; returns the stage it resumed at. A pass whose queue
    ``ctx.queues`` knows is checked without reading its steps; every examined pass's queue is
    remembered there."""
    known = ctx.queues.get(run_id, member, last_progress)
    if known is not None:
        if not evidence.proves(ctx, known, since):
            evidence.unproven(ctx, run_id, member, last_progress, known)
            return None
    elif not evidence.may_prove(ctx, since):
        return None  # no queue could prove it yet: read nothing
    examined = _examine(ctx, run_id, member, last_progress)
    if examined is None:
        return None
    ref, plan, doc = examined
    if not evidence.proves(ctx, plan.queue, since):
        evidence.unproven(ctx, run_id, member, last_progress, plan.queue)
        return None
    if float(doc.get("at") or 0.0) >= since:
        return None  # its first message may have been sent after the suspicion: not proven
    return _claim_and_publish(ctx, ref, last_progress, plan, "lost")
