"""How workers ride out faults: a broker connection loss, a lost message, a dead holder.

**Connection loss.** :class:`RedisTransport` is kombu's Redis transport with one guard (workers
select it when they start, see ``workers.app``): Celery 5.7 with kombu 5.7 could turn a Redis
outage into an exit of the worker's main process (see the class). :class:`Consumer` is Celery's
worker consumer reconnecting at most 2 s apart (celeryconfig's ``interval_max``).

**Lost chains, proved in seconds (Redis broker).** kombu's Redis transport pops a message
(``BRPOP``) and only then writes it to its ``unacked`` hash; a Redis restart (or a kill) between
the two loses the message: it is in no queue and in no worker's hands. (That window lost the
one chain in 300 of the SIGKILL fault test.) With ``task_acks_late`` every message a worker
holds, reserved, scheduled or running, is in ``unacked`` until its task ends, and a stage's next
message is sent before the stage's own is acknowledged. So a pass is *lost* when, twice, no
message of it (matched by its pass id, ``sid``) is in ``unacked`` (:func:`judge`: a *suspect*,
then a *confirm* at least :data:`LOST_GRACE_S` later, with no progress in between), and its
queue was drained past the first sighting (a probe sent after it ran, the grace before the
second look: :func:`redrive_if_lost`): whatever was queued then has been popped since and would
be in ``unacked``. The sweeper then re-drives it at once, typically 5-15 s after the loss.

**Dead holders (Redis broker).** A worker killed, or one whose connection dropped mid-task (it
can no longer acknowledge what it held), leaves its messages in ``unacked`` until the
visibility timeout (1 h). Every worker reports, each sweep interval, the delivery tags it holds
(:func:`held_tags`, in the broker beside ``unacked``); each worker restores the messages that
no live worker has reported for two ticks in a row (:func:`orphans`) to the head of their
queue, with kombu's own restore (one transaction: never twice).

**Stalls, the backstop.** A pass is stalled when no step of it was recorded for the stall time
(:func:`stall_after_s`) *and* the queue its next stage goes to has been drained past its last
progress long enough ago that the message, if it existed, would have run. This holds for any
broker, and on RabbitMQ it is the only rule: RabbitMQ has no ``unacked`` hash to read
(:func:`open_broker` answers None there), so the sweeper reports no held messages, restores no
orphans (RabbitMQ redelivers a lost consumer's messages itself) and proves nothing lost; it
still sends probes and sweeps, and a stalled pass is re-driven with ``reason: stalled``.
The pending index (:mod:`pipeline.store.pending`) holds every pass's last progress; probes
(``critique.probe``, a no-op task each worker sends to its queues every sweep interval) measure
how far each queue has been drained, so a long queue never reads as a stall or a loss and is
never flooded with duplicates.

Every worker process runs a :class:`Sweeper` thread (a bootstep, registered in
``workers.app``): every ``CRITIQUE_SWEEP_S`` seconds (default 5; 0 turns sweeping off, the
held-message reports stay) it reports what it holds and restores orphans, sends the probes due
on its queues, and the worker holding the cluster-wide sweep lock re-drives the lost and
stalled passes (:func:`sweep`). Re-driving is :func:`redrive`, the one function behind
``CritiqueClient.resume`` too: re-publish the rest of the chain from the last recorded step
(every stage replays its recorded output, every effect is idempotent), ending in the gate task
with its original id, and write a ``resume`` trace event naming who re-drove it (``by``) and
why (``reason``: ``lost`` or ``stalled``). A pass is re-driven at most :data:`MAX_RESUMES`
times; then it is dropped from the index with a ``stalled`` trace event and an error in the log.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import functools
import json
import logging
import os
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import redis
from billiard.einfo import ExceptionInfo
from billiard.exceptions import WorkerLostError
from celery import bootsteps, shared_task
from celery.concurrency import thread as celery_thread
from celery.exceptions import CPendingDeprecationWarning
from celery.signals import worker_ready
from celery.worker import consumer as celery_consumer
from kombu.transport import redis as kombu_redis

from pipeline.errors import CritiqueError, PermanentError, StoreUnavailableError, SubmissionError
from pipeline.runner import LoopState
from pipeline.store import keys
from pipeline.store.pending import RedisPendingIndex, parse_member
from pipeline.store.redis import RedisTraceSink
from pipeline.store.redis_common import (
    FailoverConnection,
    FailoverSSLConnection,
    StoreClient,
    store_client_from_url,
    text,
)
from pipeline.store.runs import RedisRunStore, pass_member
from workers import runtime

log = logging.getLogger(__name__)


@worker_ready.connect
def _quiet_the_cancel_on_loss_warning(**_: Any) -> None:
    """celeryconfig sets worker_cancel_long_running_tasks_on_connection_loss explicitly (False,
    with its reason), yet Celery warns about its coming default on every connection loss. (Once
    the worker is ready: Celery's logging setup turns its deprecation warnings to "always".)"""
    warnings.filterwarnings(
        "ignore",
        message=r"\s*In Celery 5\.1 we introduced an optional breaking change",
        category=CPendingDeprecationWarning,
    )


STALL_ENV = "CRITIQUE_STALL_S"  # seconds without progress before a pass may be re-driven
SWEEP_ENV = "CRITIQUE_SWEEP_S"  # seconds between sweeps (0: no sweeper, no probes)
MAX_RESUMES_ENV = "CRITIQUE_STALL_MAX_RESUMES"  # re-drives of one pass before giving up
DEFAULT_SWEEP_S = 5.0
MAX_RESUMES = 5
SWEEP_BATCH = 200
"""Most passes one sweep examines in full (reading their steps): a sweep stays short, the rest
waits for the next."""


def stall_after_s() -> float:
    """Seconds without progress before a pass counts as stalled: ``$CRITIQUE_STALL_S``, else
    the task time limit + 30 s (a stage that runs can take up to its time limit)."""
    raw = os.environ.get(STALL_ENV)
    if raw:
        return max(0.1, float(raw))
    from workers.app import app

    return float(app.conf.task_time_limit or 600) + 30.0


def sweep_interval_s() -> float:
    """Seconds between two sweeps (and probes): ``$CRITIQUE_SWEEP_S``, default 5; 0 = off."""
    return max(0.0, float(os.environ.get(SWEEP_ENV) or DEFAULT_SWEEP_S))


def max_resumes() -> int:
    """Re-drives of one pass before the sweeper gives up on it (``$CRITIQUE_STALL_MAX_RESUMES``)."""
    return max(1, int(os.environ.get(MAX_RESUMES_ENV) or MAX_RESUMES))


# --- the stores recovery uses --------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryStores:
    """The stores recovery reads and writes, over one Redis client."""

    runs: RedisRunStore
    trace: RedisTraceSink
    pending: RedisPendingIndex


@functools.lru_cache(maxsize=4)
def stores_on(client: StoreClient) -> RecoveryStores:
    """The recovery stores over ``client`` (one set per client); the run store verifies what
    workers recorded with ``CRITIQUE_SECRET`` (:func:`workers.runtime.secrets`)."""
    return RecoveryStores(
        RedisRunStore(client, secrets=runtime.secrets),
        RedisTraceSink(client),
        RedisPendingIndex(client),
    )


def default_stores() -> RecoveryStores:
    """The recovery stores over this process's Redis client (:func:`workers.runtime.client`)."""
    return stores_on(runtime.client())


def register(run_id: str, iteration: int, worker_id: str, sid: str) -> None:
    """Index a pass as pending from now (call before its chain is sent)."""
    member = pass_member(iteration, worker_id, sid)
    default_stores().pending.add(run_id, member, time.time())


# --- re-driving ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """What re-driving one pass would publish."""

    sid: str
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
    from workers.tasks import continuation

    if not doc or "message" not in doc:
        raise SubmissionError(
            f"cannot resume {worker_id} of run {run_id}: no first message recorded for it "
            "(was it submitted by this client version?)"
        )
    sid = str(doc.get("sid", ""))
    latest = s.runs.latest_step(run_id, iteration, worker_id, sid)
    msg: dict[str, Any] = doc["message"] if latest is None else dict(json.loads(latest[1]))
    state, overrides = runtime.decode(msg)
    config = runtime.config_for(overrides)
    sig = continuation(msg, config, state.submission, str(doc["task_id"]))
    return _Plan(sid, None if latest is None else latest[0], state, sig, _queue_of(sig))


def _queue_of(sig: Any) -> str:
    """The queue the first task of a signature (or chain) goes to."""
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
    """Send the plan's chain and write the ``resume`` trace event; returns the stage."""
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


FINISHED = "finished"
"""What :func:`redrive` answers for a pass that has its result already (nothing is sent)."""


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
    s = stores or default_stores()
    doc = s.runs.submission(run_id, iteration, worker_id)
    sid = str((doc or {}).get("sid") or "")
    if sid and s.runs.pass_result(run_id, iteration, worker_id, sid) is not None:
        return FINISHED
    plan = _plan(s, run_id, iteration, worker_id, doc)
    s.pending.touch(run_id, pass_member(iteration, worker_id, plan.sid), time.time())
    return _publish(s, run_id, iteration, worker_id, plan, by)


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


_QUEUE_CACHE_MAX = 100_000


def _examine(
    s: RecoveryStores,
    run_id: str,
    member: str,
    last_progress: float,
    now: float,
    stall_s: float,
) -> tuple[_Plan, dict[str, Any]] | None:
    """The re-drive plan of one pending pass and its submission record, or None when it can
    no longer be re-driven: superseded by a resubmission, not registered (yet), its run
    expired, or its chain failed (then it leaves the index)."""
    parsed = parse_member(member)
    if parsed is None:
        s.pending.drop(run_id, member)
        return None
    iteration, worker_id, sid = parsed
    doc = s.runs.submission(run_id, iteration, worker_id)
    if doc is None or str(doc.get("sid", "")) != sid or "message" not in doc:
        # Superseded by a resubmission (only the latest pass's first message is kept), or not
        # registered (yet: its submit may still be publishing; or its run expired).
        if doc is not None or now - last_progress >= max(10 * stall_s, 3600.0):
            s.pending.drop(run_id, member)
        return None
    if s.runs.failure(run_id, member) is not None:
        # A worker recorded that the pass failed (Celery's FAILURE state for the gate id is no
        # evidence: a broker writer can set it): the waiter gets the failure; a re-drive
        # would fail again.
        s.pending.drop(run_id, member)
        return None
    try:
        plan = _plan(s, run_id, iteration, worker_id, doc)
    except PermanentError as exc:
        log.error("cannot re-drive %s of run %s: %s", member, run_id, exc)
        s.pending.drop(run_id, member)
        return None
    return plan, doc


def _claim_and_publish(
    s: RecoveryStores,
    run_id: str,
    member: str,
    last_progress: float,
    plan: _Plan,
    *,
    by: str,
    now: float,
    reason: str,
) -> str | None:
    """Claim the pass for one re-drive (atomically: two sweepers, or a sweeper and a waiting
    client, never both re-drive it) and publish its plan; None when someone else claimed it or
    it progressed, or when it was re-driven :func:`max_resumes` times already (then it is given
    up on, with a ``stalled`` trace event)."""
    iteration, worker_id, _ = parse_member(member) or (0, "", "")
    claimed = s.pending.claim(run_id, member, last_progress, now, max_resumes())
    if claimed < 0:
        return None
    if claimed == 0:
        log.error(
            "giving up on %s of run %s: %s again after %d re-drives",
            member,
            run_id,
            reason,
            max_resumes(),
        )
        s.trace.emit(
            run_id,
            {
                "type": "stalled",
                "by": by,
                "stage": plan.state.next,
                "worker_id": worker_id,
                "iteration": iteration,
                "after_step": plan.after_step,
                "resumes": max_resumes(),
                "gave_up": True,
            },
        )
        return None
    log.warning(
        "re-driving %s of run %s at %s: %s, no progress for %.0f s",
        member,
        run_id,
        plan.state.next,
        reason,
        now - last_progress,
    )
    return _publish(
        s,
        run_id,
        iteration,
        worker_id,
        plan,
        by,
        reason=reason,
        stalled_s=round(now - last_progress, 3),
        attempt=claimed,
    )


def _remember_queue(
    queues: dict[str, tuple[float, str]] | None, cache_key: str, last_progress: float, queue: str
) -> None:
    if queues is not None:
        if len(queues) >= _QUEUE_CACHE_MAX:
            queues.clear()
        queues[cache_key] = (last_progress, queue)


def redrive_if_stalled(
    run_id: str,
    member: str,
    last_progress: float,
    *,
    by: str,
    now: float | None = None,
    stall_s: float | None = None,
    stores: RecoveryStores | None = None,
    view: DrainView | None = None,
    queues: dict[str, tuple[float, str]] | None = None,
) -> str | None:
    """Re-drive one pending pass if it is stalled (:func:`is_stalled`), claiming it atomically
    first so that two sweepers (or a sweeper and a waiting client) never both re-drive it.
    Returns the stage it resumed at, or None. A pass that can no longer be re-driven
    (superseded by a resubmission, its run expired, its chain failed) leaves the index.

    ``queues`` remembers, per pass and last progress, the queue its next stage goes to: a pass
    waiting in a long queue is then re-checked without reading its steps again."""
    s = stores or default_stores()
    now = time.time() if now is None else now
    stall_s = stall_after_s() if stall_s is None else stall_s
    view = view or DrainView(s.pending)
    cache_key = f"{run_id}/{member}"
    known = None if queues is None else queues.get(cache_key)
    if (
        known is not None
        and known[0] == last_progress
        and not is_stalled(view, known[1], last_progress, now, stall_s)
    ):
        return None  # still waiting in its queue: nothing to read again
    examined = _examine(s, run_id, member, last_progress, now, stall_s)
    if examined is None:
        return None
    plan, _ = examined
    _remember_queue(queues, cache_key, last_progress, plan.queue)
    if not is_stalled(view, plan.queue, last_progress, now, stall_s):
        return None
    return _claim_and_publish(
        s, run_id, member, last_progress, plan, by=by, now=now, reason="stalled"
    )


# --- proving a pass lost (Redis broker) ------------------------------------------------------

LOST_MARGIN_S = 1.0
"""A pass becomes a suspect no sooner than this after its last step record: the stage that
records a step sends the next message right after it (and holds its own, unacknowledged,
until then)."""
LOST_GRACE_S = 3.0
"""How long a worker may take from popping a message off its queue to registering it in
kombu's ``unacked`` hash (the next thing kombu does): a message popped before a probe ran is
finished or in ``unacked`` this long after the probe ran. Also the slack on held reports."""


@dataclass(frozen=True)
class Snapshot:
    """The pass ids of every message in the broker's ``unacked`` set, read between ``before``
    and ``after`` (wall clock)."""

    sids: frozenset[str]
    before: float
    after: float


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
    if member.rpartition(":")[2] in snap.sids:
        return "alive"
    if snap.before - last_progress < LOST_MARGIN_S:
        return "young"
    if prior is None or prior[0] != last_progress:
        return "suspect"
    return "confirm" if snap.before - prior[1] >= LOST_GRACE_S else "wait"


def redrive_if_lost(
    run_id: str,
    member: str,
    last_progress: float,
    since: float,
    *,
    by: str,
    snap: Snapshot,
    now: float,
    stall_s: float,
    stores: RecoveryStores,
    view: DrainView,
    queues: dict[str, tuple[float, str]],
) -> str | None:
    """Re-drive a suspect pass (:func:`judge` said ``confirm``) once its queue was drained past
    the time it was first seen without a message (:func:`drained_for_proof`): any message of it
    that was queued then has been taken since and would now be in ``unacked``, and none is.
    Claimed atomically, like :func:`redrive_if_stalled`; returns the stage it resumed at."""
    cache_key = f"{run_id}/{member}"
    known = queues.get(cache_key)
    if known is not None and known[0] == last_progress:
        if not drained_for_proof(view, known[1], since, snap.before):
            return None
    elif not any(drained_for_proof(view, q, since, snap.before) for q in keys.QUEUES):
        return None  # no queue could prove it yet: read nothing
    examined = _examine(stores, run_id, member, last_progress, now, stall_s)
    if examined is None:
        return None
    plan, doc = examined
    _remember_queue(queues, cache_key, last_progress, plan.queue)
    if not drained_for_proof(view, plan.queue, since, snap.before):
        return None
    if float(doc.get("at") or 0.0) >= since:
        return None  # its first message may have been sent after the suspicion: not proven
    return _claim_and_publish(
        stores, run_id, member, last_progress, plan, by=by, now=now, reason="lost"
    )


def sweep(
    *,
    now: float | None = None,
    stores: RecoveryStores | None = None,
    by: str = "sweeper",
    queues: dict[str, tuple[float, str]] | None = None,
    broker: RedisBroker | None = None,
) -> list[tuple[str, str, str]]:
    """One sweep over every run with pending passes: re-drive the lost and the stalled ones and
    forget runs with none left. With ``broker`` (a Redis broker) a pass is proved lost within
    seconds (:func:`judge`, :func:`redrive_if_lost`); without, only the stall time applies. A
    pass is examined in full (its steps read) at most :data:`SWEEP_BATCH` times per sweep; one
    whose queue is known from ``queues`` costs no Redis read. Returns what was re-driven as
    ``(run_id, member, stage)``."""
    s = stores or default_stores()
    now = time.time() if now is None else now
    stall_s = stall_after_s()
    view = DrainView(s.pending)
    queues = {} if queues is None else queues
    snap: Snapshot | None = None
    examined = 0
    done: list[tuple[str, str, str]] = []
    oldest = now - (LOST_MARGIN_S if broker is not None else stall_s)
    for run_id, run_seen in s.pending.runs():
        stale = s.pending.stale(run_id, oldest, 100_000)
        if not stale:
            if now - run_seen >= stall_s and s.pending.count(run_id) == 0:
                s.pending.prune_run(run_id, run_seen)
            if broker is not None:
                s.pending.clear_suspects(run_id)
            continue
        lost: list[tuple[str, float, float]] = []
        if broker is not None:
            if snap is None:
                snap = broker.snapshot()
            lost = _suspects(s, run_id, stale, snap, now, stall_s)
        work: list[tuple[str, float, float | None]] = [
            (m, seen, None) for m, seen in stale if now - seen >= stall_s
        ]
        work += [(m, seen, since) for m, seen, since in lost]
        for member, seen, since in work:
            known = queues.get(f"{run_id}/{member}")
            if known is None or known[0] != seen:
                if examined >= SWEEP_BATCH:
                    continue  # the next sweep gets to it
                examined += 1
            try:
                if since is None:
                    stage = redrive_if_stalled(
                        run_id,
                        member,
                        seen,
                        by=by,
                        now=now,
                        stall_s=stall_s,
                        stores=s,
                        view=view,
                        queues=queues,
                    )
                else:
                    assert snap is not None
                    stage = redrive_if_lost(
                        run_id,
                        member,
                        seen,
                        since,
                        by=by,
                        snap=snap,
                        now=now,
                        stall_s=stall_s,
                        stores=s,
                        view=view,
                        queues=queues,
                    )
            except CritiqueError as exc:
                if not isinstance(exc, PermanentError):
                    raise  # the store is unavailable: the whole sweep waits for the next
                log.error("cannot re-drive %s of run %s: %s", member, run_id, exc)
                s.pending.drop(run_id, member)
                continue
            if stage is not None:
                done.append((run_id, member, stage))
    return done


def _suspects(
    s: RecoveryStores,
    run_id: str,
    stale: list[tuple[str, float]],
    snap: Snapshot,
    now: float,
    stall_s: float,
) -> list[tuple[str, float, float]]:
    """Judge the run's passes younger than the stall time on ``snap`` (:func:`judge`), update
    its suspects, and return the ones to confirm: ``(member, last progress, suspected at)``."""
    prior = s.pending.suspects(run_id)
    add: dict[str, tuple[float, float]] = {}
    keep: set[str] = set()
    confirm: list[tuple[str, float, float]] = []
    for member, seen in stale:
        if now - seen >= stall_s:
            continue  # the stall rule's
        was = prior.get(member)
        verdict = judge(member, seen, was, snap)
        if verdict == "suspect":
            add[member] = (seen, snap.after)
        elif verdict in ("wait", "confirm"):
            keep.add(member)
            if verdict == "confirm" and was is not None:
                confirm.append((member, seen, was[1]))
    drop = [m for m in prior if m not in keep and m not in add]
    s.pending.update_suspects(run_id, add, drop)
    return confirm


# --- the Redis broker's unacknowledged messages, and who holds them --------------------------


@dataclass(frozen=True)
class HeldReport:
    """What one worker process said it holds: the delivery tags of its reserved, scheduled and
    running messages, at ``at``; it reports every ``every`` seconds."""

    at: float
    every: float
    tags: frozenset[str]

    def live(self, now: float) -> bool:
        """Whether the worker still reports: three reports missed (plus a grace) means gone."""
        return now - self.at <= 3.0 * self.every + LOST_GRACE_S


def orphans(
    unacked: dict[str, float], reports: dict[str, HeldReport], now: float
) -> dict[str, float]:
    """The unacknowledged messages (delivery tag -> when it was delivered) that no live worker
    holds: every live worker reported at least :data:`LOST_GRACE_S` after the delivery, and
    none named it. Their holder was killed, or lost its connection and can no longer
    acknowledge them (a Redis restart); kombu would bring them back only after the visibility
    timeout. Nothing is an orphan while no worker reports at all."""
    live = [r for r in reports.values() if r.live(now)]
    if not live:
        return {}
    held = frozenset().union(*(r.tags for r in live))
    reported = min(r.at for r in live)
    return {
        tag: at for tag, at in unacked.items() if tag not in held and at <= reported - LOST_GRACE_S
    }


def held_tags() -> frozenset[str]:
    """Delivery tags of the messages this worker process holds: reserved (prefetched),
    scheduled (an ETA or countdown) and running, from Celery's worker state. Celery adds a
    request there as soon as its message arrives, right after kombu wrote it to ``unacked``."""
    from celery.worker import state

    for _ in range(10):
        try:
            requests = [
                *list(state.requests.values()),
                *list(state.reserved_requests),
                *list(state.active_requests),
                *list(state.scheduled_requests),
            ]
            break
        except RuntimeError:  # changed size while being copied (another thread): again
            continue
    else:
        raise RuntimeError("the worker's request sets kept changing while being read")
    tags = (getattr(getattr(r, "message", None), "delivery_tag", None) for r in requests)
    return frozenset(str(t) for t in tags if t)


def _sid_of(entry: bytes | str | None) -> str | None:
    """The pass id (``sid``) of the stage message in one ``unacked`` entry (kombu's JSON
    ``[payload, exchange, routing key]``, the body base64-encoded JSON ``[args, kwargs,
    embed]``); None for any other message (a probe, an entry task, something unreadable)."""
    if entry is None:
        return None
    try:
        payload = json.loads(entry)[0]
        body: Any = payload["body"]
        if (payload.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        sid = args[0].get("sid") if args and isinstance(args[0], dict) else None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return sid if isinstance(sid, str) and sid else None


class RedisBroker:
    """A Redis broker's unacknowledged messages, read through a kombu channel of the worker's
    own broker connection (so kombu's key names, ``global_keyprefix`` and Sentinel apply):
    kombu's ``unacked`` hash (delivery tag -> message) and ``unacked_index`` (delivery tag ->
    when a worker popped it). Beside them, :data:`keys.HOLDERS` keeps what each worker holds."""

    def __init__(self, connection: Any, channel: Any) -> None:
        self._conn = connection
        self._ch = channel
        prefix = str(getattr(channel, "global_keyprefix", "") or "")
        self._unacked = prefix + str(channel.unacked_key)
        self._index = prefix + str(channel.unacked_index_key)
        self._holders = f"{prefix}{channel.unacked_key}.{keys.HOLDERS}"
        self._r = redis.Redis(connection_pool=channel.pool)
        self._sids: dict[str, str | None] = {}

    def unacked(self) -> dict[str, float]:
        """Every unacknowledged message: delivery tag -> when it was delivered (unix s)."""
        rows: Any = self._r.zrange(self._index, 0, -1, withscores=True)
        return {text(tag): float(at) for tag, at in rows}

    def snapshot(self) -> Snapshot:
        """The pass ids of the unacknowledged stage messages now (each message read once)."""
        before = time.time()
        tags = self.unacked()
        new = [t for t in tags if t not in self._sids]
        for i in range(0, len(new), 500):
            batch = new[i : i + 500]
            rows: Any = self._r.hmget(self._unacked, batch)
            for tag, entry in zip(batch, rows, strict=True):
                if entry is not None:  # (a tag not in the hash yet: read next time)
                    self._sids[tag] = _sid_of(entry)
        for tag in [t for t in self._sids if t not in tags]:
            del self._sids[tag]
        sids = frozenset(s for t in tags if (s := self._sids.get(t)) is not None)
        return Snapshot(sids, before, time.time())

    def report(self, token: str, at: float, every: float, tags: frozenset[str]) -> None:
        """Say which messages this worker holds (and that it is alive)."""
        doc = json.dumps({"at": at, "every": every, "tags": sorted(tags)})
        pipe = self._r.pipeline(transaction=False)
        pipe.hset(self._holders, token, doc)
        pipe.pexpire(self._holders, int(max(600.0, 20 * every) * 1000))
        pipe.execute()

    def withdraw(self, token: str) -> None:
        """This worker holds nothing any more (it stopped)."""
        self._r.hdel(self._holders, token)

    def reports(self, now: float) -> dict[str, HeldReport]:
        """Every worker's last report; reports of workers gone for ten minutes are deleted."""
        raw: Any = self._r.hgetall(self._holders)
        out: dict[str, HeldReport] = {}
        gone: list[str] = []
        for field, value in raw.items():
            try:
                doc = json.loads(value)
                rep = HeldReport(
                    float(doc["at"]), float(doc["every"]), frozenset(map(str, doc["tags"]))
                )
            except (ValueError, KeyError, TypeError):
                gone.append(text(field))
                continue
            if now - rep.at > max(600.0, 20 * rep.every):
                gone.append(text(field))
            else:
                out[text(field)] = rep
        if gone:
            self._r.hdel(self._holders, *gone)
        return out

    def restore(self, tag: str) -> None:
        """Put one unacknowledged message back at the head of its queue, as kombu's visibility
        timeout does (kombu's own restore: one transaction watching ``unacked``, so two
        sweepers never both restore it; the message is marked redelivered)."""
        self._ch.qos.restore_by_tag(tag)

    def close(self) -> None:
        """Close the broker connection."""
        with contextlib.suppress(Exception):
            self._conn.release()


def open_broker(app: Any) -> RedisBroker | None:
    """A :class:`RedisBroker` over a new connection to ``app``'s broker, or None when the
    broker is not Redis (RabbitMQ redelivers what a lost consumer held by itself)."""
    conn = app.connection_for_write()
    try:
        if conn.transport.driver_type != "redis":
            conn.release()
            return None
        channel = conn.channel()
    except Exception:
        conn.release()
        raise
    if not isinstance(channel, kombu_redis.Channel):
        conn.release()
        return None
    return RedisBroker(conn, channel)


# --- queue-drain probes ----------------------------------------------------------------------


@shared_task(name=keys.TASK_PROBE, ignore_result=True, acks_late=False, send_events=False)
def probe(queue: str, sent: float) -> None:
    """Record that ``queue`` was drained past ``sent`` (this message was enqueued then)."""
    default_stores().pending.probe_done(str(queue), float(sent), time.time())


def send_probes(s: RecoveryStores, queues: list[str], now: float, every_s: float) -> None:
    """Send a probe to each of ``queues`` that is due one (one outstanding per queue,
    cluster-wide; one presumed lost after three intervals is replaced)."""
    for queue in queues:
        if s.pending.probe_due(queue, now, every_s, 3 * every_s):
            # No long publish retries here: a probe that is not sent is replaced later.
            # No task events either: a probe is plumbing, not work a monitor should list (its
            # own are off by send_events=False; this drops the "task-sent" its sender would
            # publish when CRITIQUE_TASK_EVENTS is on).
            probe.apply_async((queue, now), queue=queue, retry=False, event_dispatcher=_NO_EVENTS)


class _NoEvents:
    """An event dispatcher that publishes nothing (for :func:`send_probes`)."""

    def publish(self, *args: Any, **kwargs: Any) -> None:
        return None


_NO_EVENTS = _NoEvents()


# --- the sweeper thread ------------------------------------------------------------------------

_tick_lock = threading.Lock()
"""Held while the sweeper works; a fork (a prefork pool replacing a child) waits for it, so a
child never inherits a lock the sweeper held mid-call."""


def _before_fork() -> None:
    _tick_lock.acquire()


def _after_fork() -> None:
    if _tick_lock.locked():
        _tick_lock.release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)


class SweeperThread(threading.Thread):
    """Every interval: report the messages this worker holds and restore the ones no live worker
    holds (Redis broker: every worker does, each interval); send the probes due on this
    worker's queues; take the sweep lock if it is free and sweep. Its own Redis client and
    broker connection, so pool children never share its connections.

    With ``sweeping`` False (``CRITIQUE_SWEEP_S=0``) it only reports what it holds (other
    workers' sweepers must not take its messages for orphans). Asked to stop, it stops sweeping
    at once and keeps reporting while the worker still runs a task (a warm shutdown)."""

    def __init__(
        self, queues: list[str], interval_s: float, name: str, *, sweeping: bool = True
    ) -> None:
        super().__init__(name=f"critique-sweeper-{name}", daemon=True)
        self.queues = queues
        self.interval_s = interval_s
        self.sweeping = sweeping
        self.token = f"{name}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop_event = threading.Event()
        self._stop_by = 0.0
        self._last_error = 0.0
        self._queues: dict[str, tuple[float, str]] = {}
        self._broker: RedisBroker | None = None
        self._no_redis_broker = False
        self._orphans: dict[str, float] = {}

    def run(self) -> None:
        # The store (CRITIQUE_STORE_URL, else REDIS_URL): a sentinel:// one follows the current
        # master, a redis+cluster:// one is a cluster client. The broker's own reads (unacked,
        # the holders' reports) go through the broker connection (RedisBroker), never here.
        client: StoreClient | None = None
        s: RecoveryStores | None = None
        while True:
            with _tick_lock:
                try:
                    if s is None:
                        client, s = self._store()
                    self.tick(s)
                except Exception as exc:  # an outage, mostly: say so now and then, carry on
                    self._drop_broker()
                    now = time.monotonic()
                    if now - self._last_error >= 60:
                        self._last_error = now
                        log.warning("stall sweeper: %s: %s", type(exc).__name__, exc)
            if not self._stop_event.is_set():
                self._stop_event.wait(self.interval_s)
            elif self._finished():
                break
            else:
                time.sleep(self.interval_s)
        with contextlib.suppress(Exception):
            if self._broker is not None:
                self._broker.withdraw(self.token)
        self._drop_broker()
        if client is not None:
            client.close()

    def _store(self) -> tuple[StoreClient, RecoveryStores]:
        """This thread's own client of the store and the stores on it. A cluster client asks
        the cluster for its slots as it is built: while the cluster is away this raises
        ``StoreUnavailableError``, after the tick's report to the broker (this worker's
        messages are never taken for orphans meanwhile), and the next tick tries again."""
        try:
            client = store_client_from_url(
                runtime.store_url(),
                setting=runtime.store_setting(),
                socket_connect_timeout=5,
                socket_timeout=30,
            )
        except StoreUnavailableError:
            self.report()
            raise
        return client, stores_on(client)

    def _finished(self) -> bool:
        """After a stop: no task running here any more, or the longest task's time is up."""
        from celery.worker import state

        return not state.active_requests or time.monotonic() >= self._stop_by

    def broker(self) -> RedisBroker | None:
        """This thread's view of the Redis broker (opened on first use), None when the broker
        is not Redis."""
        if self._broker is None and not self._no_redis_broker:
            from workers.app import app

            self._broker = open_broker(app)
            self._no_redis_broker = self._broker is None
        return self._broker

    def _drop_broker(self) -> None:
        broker, self._broker = self._broker, None
        if broker is not None:
            broker.close()

    def report(self) -> None:
        """Report the messages this worker holds now."""
        broker = self.broker()
        if broker is not None:
            broker.report(self.token, time.time(), self.interval_s, held_tags())

    def tick(self, s: RecoveryStores) -> None:
        now = time.time()
        broker = self.broker()
        if broker is not None:
            broker.report(self.token, now, self.interval_s, held_tags())
            if self.sweeping and not self._stop_event.is_set():
                self.restore_orphans(broker, time.time())
        if not self.sweeping or self._stop_event.is_set():
            return
        send_probes(s, self.queues, now, self.interval_s)
        if s.pending.try_lock(self.token, self.interval_s):
            sweep(now=now, stores=s, queues=self._queues, broker=broker)
        self.archive(now)

    def archive(self, now: float) -> None:
        """Archive the runs that are due (:func:`workers.archiving.archive_due_runs`, which
        takes its own fleet-wide lock); a failure is logged and never stops the sweeper."""
        from workers.archiving import archive_due_runs

        try:
            archive_due_runs(now)
        except CritiqueError as exc:
            log.warning("archiver: %s (retried next sweep)", exc)

    def restore_orphans(self, broker: RedisBroker, now: float) -> int:
        """Restore the unacknowledged messages that no live worker held on this tick and on the
        one before (:func:`orphans`, twice: an acknowledgement in flight is never taken for
        one). Returns how many were restored."""
        found = orphans(broker.unacked(), broker.reports(now), now)
        confirmed = [t for t, at in found.items() if self._orphans.get(t) == at]
        self._orphans = {t: at for t, at in found.items() if t not in confirmed}
        for tag in confirmed:
            broker.restore(tag)
        if confirmed:
            log.warning(
                "restored %d unacknowledged message(s) that no live worker holds (a worker "
                "was killed, or lost its broker connection mid-task): they run again",
                len(confirmed),
            )
        return len(confirmed)

    def stop(self) -> None:
        from workers.app import app

        self._stop_by = time.monotonic() + float(app.conf.task_time_limit or 600)
        self._stop_event.set()


class _SweeperService:
    """The sweeper thread as a bootstep service (start, stop)."""

    def __init__(self, queues: list[str], interval_s: float, name: str, sweeping: bool) -> None:
        self.thread = SweeperThread(queues, interval_s, name, sweeping=sweeping)

    def start(self) -> None:
        # Report (holding nothing yet) before the consumer takes a message: a message this
        # worker takes is never mistaken for an orphan before its first report.
        try:
            self.thread.report()
        except Exception as exc:  # the broker is away: the thread's first tick reports
            log.warning("stall sweeper: could not report to the broker yet: %s", exc)
            self.thread._drop_broker()
        self.thread.start()

    def stop(self) -> None:
        self.thread.stop()


class Sweeper(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Worker bootstep: the sweeper thread in the worker's main process (after the pool
    started, so prefork children are forked before it runs; before the consumer, so it has
    reported before the first message arrives)."""

    label = "Stall sweeper"
    requires = ("celery.worker.components:Pool",)

    def create(self, w: Any) -> _SweeperService:
        interval = sweep_interval_s()
        consumed = w.app.amqp.queues.consume_from or w.app.amqp.queues
        queues = sorted(str(q) for q in consumed)
        name = str(getattr(w, "hostname", "worker"))
        if interval <= 0:
            return _SweeperService(queues, DEFAULT_SWEEP_S, name, sweeping=False)
        return _SweeperService(queues, interval, name, sweeping=True)


# --- the broker connection guard ---------------------------------------------------------------


class _ChannelGuard:
    """The guard of :class:`_Channel` and :class:`_SentinelChannel` (a mixin before kombu's
    channel class): refuse with a *connection error* to build a Redis client once the
    channel's broker connection was closed, instead of dereferencing the closed connection;
    one shared Redis client per connection pool."""

    connection: Any  # kombu's channel attributes, for the type checker
    pool: Any

    def _connparams(self, asynchronous: bool = False) -> Any:
        transport = self.connection
        if transport is None or transport.client is None:
            raise redis.exceptions.ConnectionError(
                "this channel's broker connection was closed (a connection loss); "
                "a new connection takes over"
            )
        parent: Any = super()  # kombu's _connparams is untyped
        return parent._connparams(asynchronous=asynchronous)

    def _create_client(self, asynchronous: bool = False) -> Any:
        """kombu builds a new Redis client for every publish, ack and event (a client's
        constructor costs more than the command); one client per connection pool serves them
        all here (a Redis client is safe to share between threads). ``self.pool`` is read each
        time, so a closed connection still refuses (:meth:`_connparams`)."""
        parent: Any = super()
        if asynchronous:
            return parent._create_client(asynchronous=True)
        pool = self.pool
        cached = self.__dict__.get("_critique_client")
        if cached is None or cached[0] is not pool:
            cached = (pool, parent._create_client(asynchronous=False))
            self.__dict__["_critique_client"] = cached
        return cached[1]


class _Channel(_ChannelGuard, kombu_redis.Channel):
    """kombu's Redis channel with the guard (:class:`_ChannelGuard`)."""


class _SentinelChannel(_ChannelGuard, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel with the guard, whose connections to the master are
    :class:`~pipeline.store.redis_common.FailoverConnection`: a demoted master's ``READONLY``
    *and* ``UNBLOCKED`` replies (the latter to the BRPOP a consumer has in flight when Sentinel
    turns its server into a replica) drop the connection as a connection error, so the consumer
    reconnects to the current master instead of taking a plain ``ResponseError``."""

    connection_class = FailoverConnection
    connection_class_ssl = FailoverSSLConnection  # type: ignore[assignment]


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport (``redis://``, ``rediss://``) with :class:`_Channel`, so that a
    Redis outage can no longer end the worker's main process.

    What happened (Celery 5.7, kombu 5.7): on a connection loss the worker's consumer
    ``collect()``s the broken connection, which detaches its transport
    (``transport.client = None``), and then ``close()``s it. A channel of that connection that
    is still around rebuilds its Redis client from the detached transport when it is used
    again: ``AttributeError("'NoneType' object has no attribute 'hostname'")`` in
    ``Channel._connparams``. Two such uses were seen: closing the default channel a second time
    when its first close failed half-way (a BRPOP in flight), which requeues its unacked
    messages; and acknowledging, after the reconnect, a task that ran through the outage. An
    AttributeError is no connection error, so it escaped ``ignore_errors`` (the close) and
    ``Message.ack_log_error`` (the ack) and ended the process ("Unrecoverable error").

    Raising a Redis ``ConnectionError`` there instead puts both on the path kombu and Celery
    already handle: the close is skipped, the ack is logged as failed ("Couldn't ack"). Nothing
    is lost: those messages stay in Redis's unacked index, and the visibility-timeout restore
    brings them back (their stages replay their recorded outputs). A worker selects this
    transport (``broker_transport``) for ``redis://`` and ``rediss://`` brokers as it starts
    (``workers.app``); its banner and logs then name the broker
    ``workers.recovery:RedisTransport://…``.
    """

    Channel = _Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Sentinel transport (``sentinel://``) with the guard of :class:`RedisTransport`
    and failover-aware connections (:class:`_SentinelChannel`); ``workers.app`` selects it for
    ``sentinel://`` brokers. Every new connection asks the Sentinels for the current master, so
    after a failover the consumer's reconnect (at most 2 s apart, :class:`Consumer`) lands on
    the promoted replica; the holders report, the orphan restore and the lost-chain proof
    (:class:`RedisBroker`) read through this channel's pool, so they follow it too. kombu's
    health check (``health_check_interval``) stays on: kombu keeps it for connection classes
    that take ``**kwargs``, as Sentinel's do."""

    Channel = _SentinelChannel


# --- reconnecting to a lost broker ----------------------------------------------------------


class Consumer(celery_consumer.Consumer):  # type: ignore[misc]  # celery is untyped
    """Celery's worker consumer, reconnecting to a lost broker every ``interval_max`` seconds
    at most (``broker_transport_options``, 2 s in celeryconfig) instead of Celery's waits,
    which grow by 2 s per attempt to 30 s: after a 30 s outage the consumer came back up to
    12 s late, after a longer one up to 30 s. celeryconfig selects it (``worker_consumer``)."""

    def ensure_connected(self, conn: Any) -> Any:
        opts = conn.transport_options or {}
        conn.ensure_connection = functools.partial(
            conn.ensure_connection,
            interval_start=float(opts.get("interval_start", 0)),
            interval_step=float(opts.get("interval_step", 1)),
            interval_max=float(opts.get("interval_max", 2)),
        )
        return super().ensure_connected(conn)


# --- the threads pool ------------------------------------------------------------------------


class ThreadPool(celery_thread.TaskPool):  # type: ignore[misc]  # celery is untyped
    """Celery's threads pool, where an error raised outside a task's body reaches the request.

    Celery's tracer writes to the result backend around the body (a ``STARTED`` state, the
    result, a failure) and lets an error there escape. The prefork pool hands it to the
    request's error callback; Celery's threads pool drops it, so the request never finished:
    its message was never acknowledged nor rejected, and the worker kept reporting it as held
    (seen on a gate task whose result write met a Redis restart: the chain waited for the stall
    time). Here such an error is reported as the worker's own failure (``WorkerLostError``),
    so the request ends and, with ``task_reject_on_worker_lost``, its message is requeued and
    runs again (it replays). ``workers.app`` makes ``-P threads`` select this pool."""

    def on_apply(
        self,
        target: Any,
        args: Any = None,
        kwargs: Any = None,
        callback: Any = None,
        accept_callback: Any = None,
        error_callback: Any = None,
        **options: Any,
    ) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            try:
                return target(*a, **kw)
            except Exception as exc:
                if error_callback is None:
                    raise
                try:
                    why = f"raised outside the task body: {type(exc).__name__}: {exc}"
                    raise WorkerLostError(why) from exc
                except WorkerLostError:
                    error_callback(ExceptionInfo())
                raise

        return super().on_apply(run, args, kwargs, callback, accept_callback, **options)
