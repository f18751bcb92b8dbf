"""How workers ride out faults: a broker connection loss, and a chain that stopped moving.

**Connection loss.** :class:`RedisTransport` is kombu's Redis transport with one guard (workers
select it when they start, see ``workers.app``): Celery 5.7 with kombu 5.7 could turn a Redis
outage into an exit of the worker's main process (see the class).

**Stalls.** A submission pass is stalled when no step of it was recorded for the stall time
(:func:`stall_after_s`) *and* the queue its next stage goes to has been drained past its last
progress long enough ago that the message, if it existed, would have run: its message was lost
(a Redis restart between a worker's pop and its unacked record, a chain publish that failed).
The pending index (:mod:`pipeline.store.pending`) holds every pass's last progress; probes
(``critique.probe``, a no-op task each worker sends to its queues every sweep interval) measure
how far each queue has been drained, so a long queue never reads as a stall and is never
flooded with duplicates.

Every worker process runs a :class:`Sweeper` thread (a bootstep, registered in
``workers.app``): every ``CRITIQUE_SWEEP_S`` seconds (default 5; 0 turns it off) it sends the
probes due on its queues, and the worker holding the cluster-wide sweep lock re-drives the
stalled passes (:func:`sweep`). Re-driving is :func:`redrive`, the one function behind
``CritiqueClient.resume`` too: re-publish the rest of the chain from the last recorded step
(every stage replays its recorded output, every effect is idempotent), ending in the gate task
with its original id, and write a ``resume`` trace event naming who re-drove it (``by``). A pass
is re-driven at most :data:`MAX_RESUMES` times; then it is dropped from the index with a
``stalled`` trace event and an error in the log.
"""

from __future__ import annotations

import bisect
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
from celery import bootsteps, shared_task
from celery.exceptions import CPendingDeprecationWarning
from celery.signals import worker_ready
from kombu.transport import redis as kombu_redis

from pipeline.errors import CritiqueError, PermanentError, SubmissionError
from pipeline.runner import LoopState
from pipeline.store import keys
from pipeline.store.pending import RedisPendingIndex, parse_member
from pipeline.store.redis import RedisTraceSink
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
def stores_on(client: redis.Redis) -> RecoveryStores:
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


def _plan(s: RecoveryStores, run_id: str, iteration: int, worker_id: str) -> _Plan:
    """The continuation of the latest pass of (run, iteration, worker) from its last recorded
    step; ``SubmissionError`` when the submission has no recorded first message."""
    from workers.tasks import continuation

    doc = s.runs.submission(run_id, iteration, worker_id)
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
    at (``done``: only the gate was missing).
    """
    s = stores or default_stores()
    plan = _plan(s, run_id, iteration, worker_id)
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
        plan = _plan(s, run_id, iteration, worker_id)
    except PermanentError as exc:
        log.error("cannot re-drive %s of run %s: %s", member, run_id, exc)
        s.pending.drop(run_id, member)
        return None
    if queues is not None:
        if len(queues) >= _QUEUE_CACHE_MAX:
            queues.clear()
        queues[cache_key] = (last_progress, plan.queue)
    if not is_stalled(view, plan.queue, last_progress, now, stall_s):
        return None
    claimed = s.pending.claim(run_id, member, last_progress, now, max_resumes())
    if claimed < 0:
        return None
    if claimed == 0:
        log.error(
            "giving up on %s of run %s: stalled again after %d re-drives",
            member,
            run_id,
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
        "re-driving %s of run %s at %s: no progress for %.0f s",
        member,
        run_id,
        plan.state.next,
        now - last_progress,
    )
    return _publish(
        s,
        run_id,
        iteration,
        worker_id,
        plan,
        by,
        stalled_s=round(now - last_progress, 3),
        attempt=claimed,
    )


def sweep(
    *,
    now: float | None = None,
    stores: RecoveryStores | None = None,
    by: str = "sweeper",
    queues: dict[str, tuple[float, str]] | None = None,
) -> list[tuple[str, str, str]]:
    """One sweep over every run with pending passes: re-drive the stalled ones and forget runs
    with none left. A pass is examined in full (its steps read) at most :data:`SWEEP_BATCH`
    times per sweep; one whose queue is known from ``queues`` costs no Redis read. Returns what
    was re-driven as ``(run_id, member, stage)``."""
    s = stores or default_stores()
    now = time.time() if now is None else now
    stall_s = stall_after_s()
    view = DrainView(s.pending)
    queues = {} if queues is None else queues
    examined = 0
    done: list[tuple[str, str, str]] = []
    for run_id, run_seen in s.pending.runs():
        stale = s.pending.stale(run_id, now - stall_s, 100_000)
        if not stale:
            if now - run_seen >= stall_s and s.pending.count(run_id) == 0:
                s.pending.prune_run(run_id, run_seen)
            continue
        for member, seen in stale:
            known = queues.get(f"{run_id}/{member}")
            if known is None or known[0] != seen:
                if examined >= SWEEP_BATCH:
                    continue  # the next sweep gets to it
                examined += 1
            try:
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
            except CritiqueError as exc:
                if not isinstance(exc, PermanentError):
                    raise  # the store is unavailable: the whole sweep waits for the next
                log.error("cannot re-drive %s of run %s: %s", member, run_id, exc)
                s.pending.drop(run_id, member)
                continue
            if stage is not None:
                done.append((run_id, member, stage))
    return done


# --- queue-drain probes ----------------------------------------------------------------------


@shared_task(name=keys.TASK_PROBE, ignore_result=True, acks_late=False)
def probe(queue: str, sent: float) -> None:
    """Record that ``queue`` was drained past ``sent`` (this message was enqueued then)."""
    default_stores().pending.probe_done(str(queue), float(sent), time.time())


def send_probes(s: RecoveryStores, queues: list[str], now: float, every_s: float) -> None:
    """Send a probe to each of ``queues`` that is due one (one outstanding per queue,
    cluster-wide; one presumed lost after three intervals is replaced)."""
    for queue in queues:
        if s.pending.probe_due(queue, now, every_s, 3 * every_s):
            # No long publish retries here: a probe that is not sent is replaced later.
            probe.apply_async((queue, now), queue=queue, retry=False)


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
    """Every interval: send the probes due on this worker's queues; take the sweep lock if it is
    free and sweep. Its own Redis client, so pool children never share its connections."""

    def __init__(self, queues: list[str], interval_s: float, name: str) -> None:
        super().__init__(name=f"critique-sweeper-{name}", daemon=True)
        self.queues = queues
        self.interval_s = interval_s
        self.token = f"{name}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop_event = threading.Event()
        self._last_error = 0.0
        self._queues: dict[str, tuple[float, str]] = {}

    def run(self) -> None:
        client = redis.Redis.from_url(
            runtime.redis_url(), socket_connect_timeout=5, socket_timeout=30
        )
        s = stores_on(client)
        while not self._stop_event.is_set():
            with _tick_lock:
                try:
                    self.tick(s)
                except Exception as exc:  # an outage, mostly: say so now and then, carry on
                    now = time.monotonic()
                    if now - self._last_error >= 60:
                        self._last_error = now
                        log.warning("stall sweeper: %s: %s", type(exc).__name__, exc)
            self._stop_event.wait(self.interval_s)
        client.close()

    def tick(self, s: RecoveryStores) -> None:
        now = time.time()
        send_probes(s, self.queues, now, self.interval_s)
        if s.pending.try_lock(self.token, self.interval_s):
            sweep(now=now, stores=s, queues=self._queues)

    def stop(self) -> None:
        self._stop_event.set()


class _SweeperService:
    """The sweeper thread as a bootstep service (start, stop)."""

    def __init__(self, queues: list[str], interval_s: float, name: str) -> None:
        self.thread = SweeperThread(queues, interval_s, name)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.thread.stop()


class Sweeper(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Worker bootstep: the stall sweeper thread in the worker's main process (after the pool
    started, so prefork children are forked before it runs)."""

    label = "Stall sweeper"
    requires = ("celery.worker.components:Pool",)

    def create(self, w: Any) -> _SweeperService | None:
        interval = sweep_interval_s()
        if interval <= 0:
            return None
        consumed = w.app.amqp.queues.consume_from or w.app.amqp.queues
        queues = sorted(str(q) for q in consumed)
        return _SweeperService(queues, interval, str(getattr(w, "hostname", "worker")))


# --- the broker connection guard ---------------------------------------------------------------


class _Channel(kombu_redis.Channel):
    """kombu's Redis channel, refusing with a *connection error* to build a Redis client once
    its broker connection was closed, instead of dereferencing the closed connection."""

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
