"""The sweeper: a thread in every worker process that keeps lost and stuck work moving.

Every ``CRITIQUE_SWEEP_S`` seconds (default 5) the :class:`SweeperThread` of each worker

1. reports the delivery tags of the messages it holds (:func:`held_tags`) beside the Redis
   broker's ``unacked`` hash, and restores to the head of their queue the unacknowledged
   messages that no live worker reported on two ticks in a row (:func:`orphans`): their holder
   was killed or lost its connection, and kombu would bring them back only after the
   visibility timeout (1 h). On RabbitMQ it reports, in the store, the pass ids of the messages
   it holds and since when its consumer has held them steadily (:func:`held_pass_ids`,
   :class:`~workers.recovery.census.ConsumerReport`); RabbitMQ requeues a lost consumer's
   messages itself, so there is nothing to restore;
2. sends a probe (``critique.probe``, a no-op task, one outstanding per queue fleet-wide) to
   each of its queues that is due one (:func:`send_probes`): when a probe runs, its queue has
   been drained past the time it was sent, which is how a long queue is told from a lost or
   stalled chain;
3. if it takes the fleet-wide sweep lock, sweeps (:func:`sweep`): every pending pass that is
   proved lost or is stalled is re-driven (:mod:`workers.recovery.redriving`), and runs with no
   pending pass left are forgotten. On RabbitMQ the proof reads a census first
   (:func:`take_census`: the reports, then each queue's ready and consumer counts);
4. archives the runs that are due (``workers.archiving``, under a fleet-wide lock of its own);
5. publishes this worker's posture, the keys it requires (:func:`publish_posture`), so a client
   without them is refused before it sends anything.

``CRITIQUE_SWEEP_S=0`` turns the restore and steps 2 to 4 off; the reports and the posture
stay, so other workers never take this worker's messages for orphans (nor, on RabbitMQ, leave
a consumer unaccounted for). The thread is started by the :class:`Sweeper` worker bootstep
(registered in ``workers.app``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

from celery import bootsteps, shared_task

from pipeline.errors import CritiqueError, PermanentError, StoreUnavailableError
from pipeline.security.posture import fresh_for, posture_of
from pipeline.store import keys
from pipeline.store.fleet import RedisFleetPosture
from pipeline.store.redis_common import STORE_TIMEOUTS, StoreClient, store_client_from_url
from workers import runtime, telemetry
from workers.app import app
from workers.archiving import archive_due_runs
from workers.recovery.base import (
    DEFAULT_SWEEP_S,
    LOST_GRACE_S,
    LOST_MARGIN_S,
    SWEEP_BATCH,
    RecoveryStores,
    default_stores,
    stores_on,
    sweep_interval_s,
)
from workers.recovery.census import (
    Census,
    CensusEvidence,
    CensusLook,
    CensusStore,
    ConsumerReport,
    broker_id,
)
from workers.recovery.redriving import (
    LostEvidence,
    QueueCache,
    RedriveContext,
    UnackedEvidence,
    redrive_if_lost,
    redrive_if_stalled,
)
from workers.recovery.transport import (
    CONSUMING,
    AmqpBroker,
    HeldReport,
    RedisBroker,
    open_amqp,
    open_broker,
)

log = logging.getLogger(__name__)


# --- one sweep -----------------------------------------------------------------------------------


def sweep(
    ctx: RedriveContext, broker: RedisBroker | None = None, look: CensusLook | None = None
) -> list[tuple[str, str, str]]:
    """One sweep over every run with pending passes: re-drive the lost and the stalled ones and
    forget runs with none left. With ``broker`` (a Redis broker: :class:`UnackedEvidence`) or
    ``look`` (a census of a RabbitMQ broker: :class:`CensusEvidence`) a pass is proved lost
    within seconds (:func:`~workers.recovery.redriving.redrive_if_lost`); without either, only
    the stall time applies. A pass is examined in full (its steps read) at most
    :data:`SWEEP_BATCH` times per sweep; one whose queue ``ctx.queues`` knows costs no Redis
    read. Returns what was re-driven as ``(run_id, member, stage)``."""
    s = ctx.stores
    evidence: LostEvidence | None = None
    examined = 0
    done: list[tuple[str, str, str]] = []
    proving = broker is not None or look is not None
    oldest = ctx.now - (LOST_MARGIN_S if proving else ctx.stall_s)
    for run_id, run_seen in s.pending.runs():
        stale = s.pending.stale(run_id, oldest, 100_000)
        if not stale:
            if ctx.now - run_seen >= ctx.stall_s and s.pending.count(run_id) == 0:
                s.pending.prune_run(run_id, run_seen)
            if proving:
                s.pending.clear_suspects(run_id)
            continue
        lost: list[tuple[str, float, float]] = []
        if evidence is None:  # one look per sweep, made only when a pass may need it
            if broker is not None:
                evidence = UnackedEvidence(broker.snapshot())
            elif look is not None:
                evidence = CensusEvidence(look)
        if evidence is not None:
            lost = _suspects(ctx, run_id, stale, evidence)
        work: list[tuple[str, float, float | None]] = [
            (m, seen, None) for m, seen in stale if ctx.now - seen >= ctx.stall_s
        ]
        work += [(m, seen, since) for m, seen, since in lost]
        for member, seen, since in work:
            if ctx.queues.get(run_id, member, seen) is None:
                if examined >= SWEEP_BATCH:
                    continue  # the next sweep gets to it
                examined += 1
            stage = _redrive_one(ctx, run_id, member, seen, since, evidence)
            if stage is not None:
                done.append((run_id, member, stage))
    return done


def _redrive_one(
    ctx: RedriveContext,
    run_id: str,
    member: str,
    seen: float,
    since: float | None,
    evidence: LostEvidence | None,
) -> str | None:
    """Re-drive one pass by the stall rule (``since`` None) or the lost proof (a suspect since
    ``since``, on ``evidence``). A permanent error drops the pass from the index; any other
    (the store is unavailable) ends the sweep, which the next tick retries."""
    try:
        if since is None:
            return redrive_if_stalled(ctx, run_id, member, seen)
        assert evidence is not None
        return redrive_if_lost(ctx, run_id, member, seen, since=since, evidence=evidence)
    except CritiqueError as exc:
        if not isinstance(exc, PermanentError):
            raise  # the store is unavailable: the whole sweep waits for the next
        log.error("cannot re-drive %s of run %s: %s", member, run_id, exc)
        ctx.stores.pending.drop(run_id, member)
        return None


def _suspects(
    ctx: RedriveContext,
    run_id: str,
    stale: list[tuple[str, float]],
    evidence: LostEvidence,
) -> list[tuple[str, float, float]]:
    """Judge the run's passes younger than the stall time on ``evidence``, update its
    suspects, and return the ones to confirm: ``(member, last progress, suspected at)``."""
    prior = ctx.stores.pending.suspects(run_id)
    add: dict[str, tuple[float, float]] = {}
    keep: set[str] = set()
    confirm: list[tuple[str, float, float]] = []
    for member, seen in stale:
        if ctx.now - seen >= ctx.stall_s:
            continue  # the stall rule's
        was = prior.get(member)
        verdict = evidence.judge(member, seen, was)
        if verdict == "suspect":
            add[member] = (seen, evidence.at)
        elif verdict in ("wait", "confirm"):
            keep.add(member)
            if verdict == "confirm" and was is not None:
                confirm.append((member, seen, was[1]))
    drop = [m for m in prior if m not in keep and m not in add]
    ctx.stores.pending.update_suspects(run_id, add, drop)
    return confirm


def take_census(store: CensusStore, amqp: AmqpBroker, queues: Iterable[str]) -> CensusLook:
    """A census (:class:`~workers.recovery.census.Census`): the workers' reports first, then
    each queue's counts; its quiet queues are remembered for the confirmations to come."""
    reports = store.reports(time.time())
    at = time.time()
    census = Census(reports, amqp.counts(queues), at)
    quiet = census.quiet()
    if quiet:
        store.record_quiet(at, quiet)
    return CensusLook(census, store)


# --- dead holders (Redis broker) ---------------------------------------------------------------


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
    tags = (getattr(getattr(r, "message", None), "delivery_tag", None) for r in _held_requests())
    return frozenset(str(t) for t in tags if t)


def held_pass_ids() -> frozenset[str]:
    """The pass ids (``sid``) of the stage messages this worker process holds (reserved,
    scheduled, running: :func:`held_tags`' requests); what a worker on RabbitMQ reports."""
    out: set[str] = set()
    for request in _held_requests():
        args = getattr(request, "args", None)
        first = args[0] if isinstance(args, list | tuple) and args else None
        sid = first.get("sid") if isinstance(first, dict) else None
        if isinstance(sid, str) and sid:
            out.add(sid)
    return frozenset(out)


def _held_requests() -> list[Any]:
    """Every request of Celery's worker state: reserved, scheduled, running."""
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
    return requests


# --- queue-drain probes ----------------------------------------------------------------------


@shared_task(name=keys.TASK_PROBE, ignore_result=True, acks_late=False, send_events=False)
def probe(queue: str, sent: float) -> None:
    """Record that ``queue`` was drained past ``sent`` (this message was enqueued then)."""
    default_stores().pending.probe_done(str(queue), float(sent), time.time())


def send_probes(stores: RecoveryStores, queues: list[str], now: float, every_s: float) -> None:
    """Send a probe to each of ``queues`` that is due one (one outstanding per queue,
    cluster-wide; one presumed lost after three intervals is replaced)."""
    for queue in queues:
        if stores.pending.probe_due(queue, now, every_s, 3 * every_s):
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


# --- the fleet's posture -----------------------------------------------------------------------


def publish_posture(fleet: RedisFleetPosture, worker: str, interval_s: float) -> None:
    """This worker's posture (:mod:`pipeline.security.posture`: its keys' ids, never the keys),
    current for a few of its ``interval_s`` ticks."""
    posture = posture_of(
        worker,
        runtime.secrets(),
        runtime.entry_keys(),
        now=time.time(),
        fresh_s=fresh_for(interval_s),
    )
    fleet.publish(posture)


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
        self.worker = name
        self.token = f"{name}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop_event = threading.Event()
        self._stop_by = 0.0
        self._last_error = 0.0
        self._queues = QueueCache()
        self._broker: RedisBroker | None = None
        self._no_redis_broker = False
        self._orphans: dict[str, float] = {}
        self._amqp: AmqpBroker | None = None
        self._no_amqp = False
        self._census: CensusStore | None = None
        self._census_client: StoreClient | None = None
        self._first_report = time.time()  # before its consumer starts (see ConsumerReport)
        self._report_lock = threading.Lock()
        self._ended = False

    def run(self) -> None:
        # The store (CRITIQUE_STORE_URL, else REDIS_URL): a sentinel:// one follows the current
        # master, a redis+cluster:// one is a cluster client. The broker's own reads (unacked,
        # the holders' reports) go through the broker connection (RedisBroker), never here.
        client: StoreClient | None = None
        stores: RecoveryStores | None = None
        fleet: RedisFleetPosture | None = None
        while True:
            with _tick_lock:
                try:
                    if stores is None or fleet is None:
                        client, stores = self._store()
                        fleet = RedisFleetPosture(client)
                    self.tick(stores)
                    publish_posture(fleet, self.worker, self.interval_s)
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
            else:  # still connected, maybe: "stopped" only once it is not (see stopped)
                self.report_census(time.time())
        with contextlib.suppress(Exception):
            if fleet is not None:
                fleet.withdraw(self.worker)  # a stopped worker requires nothing any more
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
                **STORE_TIMEOUTS,
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
            self._broker = open_broker(app)
            self._no_redis_broker = self._broker is None
        return self._broker

    def _drop_broker(self) -> None:
        broker, self._broker = self._broker, None
        if broker is not None:
            broker.close()
        if self._amqp is not None:
            self._amqp.close()

    def amqp(self) -> tuple[AmqpBroker, CensusStore] | None:
        """This thread's view of a RabbitMQ broker and the store of its census (opened on first
        use, the store over a client of its own), None when the broker is not RabbitMQ."""
        if self._amqp is None and not self._no_amqp:
            self._amqp = open_amqp(app)
            self._no_amqp = self._amqp is None
        if self._amqp is None:
            return None
        if self._census is None:
            self._census_client = store_client_from_url(
                runtime.store_url(),
                setting=runtime.store_setting(),
                socket_connect_timeout=5,
                socket_timeout=30,
            )
            self._census = CensusStore(self._census_client, broker_id(self._amqp.vhost))
            CONSUMING.on_end(self.stopped)
        return self._amqp, self._census

    def stopped(self) -> None:
        """This worker's consumer connection is closed for good (RabbitMQ requeued what it still
        held): report it stopped, so that it no longer counts for any census after now, and
        report nothing after that. Called by the worker's consumer as it shuts down
        (:meth:`ConsumerState.ended`); a worker that dies without it is known gone once its
        reports stop for their liveness window."""
        with self._report_lock:
            self._ended = True
            if self._census is not None:
                self._census.report(self.token, self.consumer_report(time.time(), stopped=True))

    def report_census(self, now: float) -> None:
        """Report what this worker holds to the census store (RabbitMQ), unless it stopped."""
        amqp = self.amqp()
        if amqp is None:
            return
        with self._report_lock:
            if not self._ended:
                amqp[1].report(self.token, self.consumer_report(now))

    def consumer_report(self, now: float, *, stopped: bool = False) -> ConsumerReport:
        """What this worker holds at ``now`` (read before its consumer's ``since``: a requeue
        or a lost connection in between shows as a later ``since``)."""
        held = frozenset() if stopped else held_pass_ids()
        since = None if stopped else CONSUMING.since
        return ConsumerReport(
            now, self.interval_s, self._first_report, since, frozenset(self.queues), held, stopped
        )

    def report(self) -> None:
        """Report the messages this worker holds now."""
        broker = self.broker()
        if broker is not None:
            broker.report(self.token, time.time(), self.interval_s, held_tags())
            return
        self.report_census(time.time())

    def tick(self, stores: RecoveryStores) -> None:
        now = time.time()
        broker = self.broker()
        amqp = None if broker is not None else self.amqp()
        if broker is not None:
            broker.report(self.token, now, self.interval_s, held_tags())
            if self.sweeping and not self._stop_event.is_set():
                self.restore_orphans(broker, time.time())
        elif amqp is not None:
            self.report_census(now)
        if not self.sweeping or self._stop_event.is_set():
            return
        locked = stores.pending.try_lock(self.token, self.interval_s)
        # The census before this tick's probes: a probe not yet taken is a ready message.
        look = self.census(*amqp) if locked and amqp is not None else None
        send_probes(stores, self.queues, now, self.interval_s)
        if locked:
            ctx = RedriveContext.start(by="sweeper", stores=stores, now=now, queues=self._queues)
            sweep(ctx, broker, look)
        self.archive(now)

    def census(self, amqp: AmqpBroker, store: CensusStore) -> CensusLook | None:
        """A census of the pipeline's queues (:func:`take_census`), or None when the broker
        cannot be read now (this sweep then re-drives by the stall rule only)."""
        try:
            return take_census(store, amqp, keys.QUEUES)
        except StoreUnavailableError:
            raise
        except Exception as exc:
            log.debug("no census of the RabbitMQ queues this sweep: %s", exc)
            return None

    def archive(self, now: float) -> None:
        """Archive the runs that are due (:func:`workers.archiving.archive_due_runs`, which
        takes its own fleet-wide lock); a failure is logged and never stops the sweeper."""
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

    name = "workers.recovery.Sweeper"  # its name in the worker's blueprint, as before the split
    label = "Stall sweeper"
    requires = ("celery.worker.components:Pool",)

    def info(self, w: Any) -> dict[str, Any]:
        """What ``celery inspect stats`` adds for this worker: the sizes of its configuration
        and stage-context caches (:func:`workers.runtime.cache_sizes`), whether it traces
        (:func:`workers.telemetry.status`) and how many objects its start left out of the
        cyclic GC's reach (``gc.freeze``, ``workers.app``); under ``prefork``, the main
        process's own, not its children's."""
        import gc

        return {
            "critique_caches": runtime.cache_sizes(),
            "critique_tracing": telemetry.status(),
            "critique_gc_frozen": gc.get_freeze_count(),
        }

    def create(self, w: Any) -> _SweeperService:
        interval = sweep_interval_s()
        consumed = w.app.amqp.queues.consume_from or w.app.amqp.queues
        queues = sorted(str(q) for q in consumed)
        name = str(getattr(w, "hostname", "worker"))
        if interval <= 0:
            return _SweeperService(queues, DEFAULT_SWEEP_S, name, sweeping=False)
        return _SweeperService(queues, interval, name, sweeping=True)
