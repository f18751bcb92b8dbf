"""How a worker rides out a broker connection loss, and what it reads from a Redis broker.

**The guard.** :class:`RedisTransport` and :class:`SentinelTransport` are kombu's Redis and
Sentinel transports whose channels refuse, with a Redis ``ConnectionError``, to rebuild a client
from a connection that was already collected (kombu 5.7 raised an ``AttributeError`` there,
which ended the worker's main process on a Redis outage); ``workers.app`` selects them for
``redis://``, ``rediss://`` and ``sentinel://`` brokers. :class:`Consumer` is Celery's worker
consumer reconnecting at most 2 s apart, and :class:`ThreadPool` Celery's threads pool where an
error raised outside a task's body ends the request (so its message is requeued) instead of
leaving it held forever. See docs/operations.md, "What survives what".

**The broker view.** :class:`RedisBroker` reads kombu's ``unacked`` hash and index through the
worker's own broker connection: the pass ids of the stage messages that are unacknowledged (the
evidence :mod:`workers.recovery.redriving` proves a pass lost with), the messages each worker
says it holds (:class:`HeldReport`, kept beside ``unacked``), and kombu's own restore of one
message to the head of its queue. :func:`open_broker` answers None on a broker that is not Redis
(RabbitMQ has no ``unacked`` hash, and redelivers a lost consumer's messages itself).

**On RabbitMQ** :class:`AmqpBroker` reads each queue's ready messages and consumers (what the
census of :mod:`workers.recovery.census` counts), and :data:`CONSUMING` is since when this
worker's consumer has held its messages steadily: :class:`Consumer` sets it when it starts
consuming, clears it when its connection goes, and moves it whenever it requeues a message.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from queue import Empty
from typing import Any

import redis
from billiard.einfo import ExceptionInfo
from billiard.exceptions import WorkerLostError
from celery.concurrency import thread as celery_thread
from celery.exceptions import CPendingDeprecationWarning
from celery.signals import worker_ready
from celery.worker import consumer as celery_consumer
from kombu.transport import redis as kombu_redis

from pipeline.security.message_checks import Refusal, check_fanout
from pipeline.store import keys
from pipeline.store.redis_common import FailoverConnection, FailoverSSLConnection, text
from workers import door
from workers.recovery.base import LOST_GRACE_S, Snapshot
from workers.recovery.census import QueueCount

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


def _pass_id_of(entry: bytes | str | None) -> str | None:
    """The pass id (the ``sid`` field) of the stage message in one ``unacked`` entry (kombu's JSON
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
        pass_id = args[0].get("sid") if args and isinstance(args[0], dict) else None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return pass_id if isinstance(pass_id, str) and pass_id else None


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
        self._pass_ids: dict[str, str | None] = {}

    def unacked(self) -> dict[str, float]:
        """Every unacknowledged message: delivery tag -> when it was delivered (unix s)."""
        rows: Any = self._r.zrange(self._index, 0, -1, withscores=True)
        return {text(tag): float(at) for tag, at in rows}

    def snapshot(self) -> Snapshot:
        """The pass ids of the unacknowledged stage messages now (each message read once)."""
        before = time.time()
        tags = self.unacked()
        new = [t for t in tags if t not in self._pass_ids]
        for i in range(0, len(new), 500):
            batch = new[i : i + 500]
            rows: Any = self._r.hmget(self._unacked, batch)
            for tag, entry in zip(batch, rows, strict=True):
                if entry is not None:  # (a tag not in the hash yet: read next time)
                    self._pass_ids[tag] = _pass_id_of(entry)
        for tag in [t for t in self._pass_ids if t not in tags]:
            del self._pass_ids[tag]
        pass_ids = frozenset(s for t in tags if (s := self._pass_ids.get(t)) is not None)
        return Snapshot(pass_ids, before, time.time())

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


class _DoorGuard:
    """The door of :class:`_Channel` and :class:`_SentinelChannel` (a mixin before kombu's
    channel class): every item popped off a queue's list is checked (:func:`workers.door.
    check_item`) before kombu parses it or builds its message; one that is refused is moved
    aside (acknowledged by never entering ``unacked``), and the poll goes on. kombu's own read
    raised on the first byte that is not JSON, ending the worker. A control (fanout) message
    too deep to parse is dropped the same way; one whose envelope kombu cannot read, too."""

    client: Any  # kombu's channel attributes, for the type checker
    connection: Any
    connection_errors: Any
    sep: str
    _queue_cycle: Any
    _in_poll: Any

    def _brpop_read(self, **options: Any) -> bool:
        """kombu's BRPOP reply reader, with the door between the reply and the delivery."""
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # the next poll reconnects
                raise
            if not reply:
                raise Empty()
            dest, item = reply
            queue = text(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            payload = door.check_item(item, queue)
            if payload is None:
                raise Empty()
            self.connection._deliver(payload, queue)
            return True
        finally:
            self._in_poll = None
            parent: Any = super()
            parent._flush_brpop_reauth()

    def _get(self, queue: str, timeout: Any = None) -> Any:
        """kombu's one-message read (``basic_get``, polling without an event loop), checked
        by the door: a refused item is moved aside and reads as an empty queue."""
        me: Any = self  # kombu's channel methods are untyped
        with me.conn_or_acquire() as client:
            for pri in me.priority_steps:
                item = client.rpop(me._q_for_pri(queue, pri))
                if item:
                    me._maybe_update_queues_expire(client, queue)
                    payload = door.check_item(item, queue)
                    if payload is None:
                        raise Empty()
                    return payload
            me._maybe_update_queues_expire(client, queue)
            raise Empty()

    def _receive_one(self, c: Any) -> Any:
        parent: Any = super()
        try:
            return parent._receive_one(c)
        except RecursionError:
            door.refuse(Refusal("depth", "a control message nested too deep"), "pidbox")
            raise Empty() from None

    def _deliver_fanout_message(self, message: Any, exchange: Any) -> Any:
        """A control or event message kombu can build a message of (an object with a
        properties object holding a string delivery tag, a base64 or absent body)."""
        refusal = check_fanout(message)
        if refusal is not None:
            door.refuse(refusal, str(exchange))
            raise Empty()
        parent: Any = super()
        return parent._deliver_fanout_message(message, exchange)


class _Channel(_DoorGuard, _ChannelGuard, kombu_redis.Channel):
    """kombu's Redis channel with the door (:class:`_DoorGuard`) and the guard
    (:class:`_ChannelGuard`)."""


class _SentinelChannel(_DoorGuard, _ChannelGuard, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel with the door and the guard, whose connections to the master are
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
    ``workers.recovery.transport:RedisTransport://…``.
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

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's task-message handler behind the door (:func:`workers.door.guard_consumer`):
        on any broker, a message that is not a well-formed message of a task this worker runs,
        or whose handling raises, is acknowledged and moved aside instead of ending the worker
        (Celery's own unknown-task path also stored a ``FAILURE`` under the message's id).

        Celery asks for the handler once per connection, right before it starts consuming: on
        RabbitMQ that is when this worker's consumer starts holding messages steadily
        (:data:`CONSUMING`), and every message it receives has its requeue watched."""
        handle = super().create_task_handler(*args, **kwargs)
        passthrough = tuple(self.connection_errors or ()) + tuple(self.channel_errors or ())
        guarded = door.guard_consumer(handle, passthrough)
        driver = getattr(getattr(self.connection, "transport", None), "driver_type", None)
        if driver != "amqp":
            return guarded
        CONSUMING.connected()

        def on_task_received(message: Any) -> Any:
            _watch_requeues(message)
            return guarded(message)

        return on_task_received

    def on_close(self) -> None:
        """The consumer's connection is gone, or the consumer stops (Celery forgets what it had
        reserved, which RabbitMQ requeues once the connection closes): this worker holds
        nothing steadily until it consumes again."""
        CONSUMING.closed()
        super().on_close()

    def shutdown(self) -> None:
        """The worker's last step: Celery closes the consumer's connection here (RabbitMQ then
        requeues whatever it still held); only now may this worker say it stopped for good
        (:meth:`ConsumerState.ended`)."""
        try:
            super().shutdown()
        finally:
            CONSUMING.ended()


class ConsumerState:
    """Since when this worker process's RabbitMQ consumer has held its messages steadily: the
    later of its last start and its last requeue; None while it is not consuming. A consumer
    that is steady since a time held, from then on, every message delivered to it until it
    acknowledged or rejected it (RabbitMQ moves a consumer's messages only when its channel
    closes, or when the consumer requeues one). The lost-chain proof on RabbitMQ reads it from
    the worker's reports (:mod:`workers.recovery.census`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None
        self._on_end: list[Callable[[], None]] = []

    @property
    def since(self) -> float | None:
        return self._since

    def connected(self) -> None:
        """The consumer starts consuming (a new connection)."""
        with self._lock:
            self._since = time.time()

    def closed(self) -> None:
        """The consumer's connection is gone."""
        with self._lock:
            self._since = None

    def requeued(self) -> None:
        """A message goes back to its queue (stamped before it does)."""
        with self._lock:
            if self._since is not None:
                self._since = time.time()

    def on_end(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the consumer's connection is closed for good."""
        self._on_end.append(callback)

    def ended(self) -> None:
        """The consumer's connection is closed for good (the worker stops): it holds nothing
        any more; the callbacks say so (a failing one is logged, the others still run)."""
        self.closed()
        for callback in list(self._on_end):
            try:
                callback()
            except Exception as exc:
                log.warning("could not report that this worker's consumer ended: %s", exc)


CONSUMING = ConsumerState()
"""This worker process's consumer (its main process consumes; pool children never do)."""


def _watch_requeues(message: Any) -> None:
    """Stamp :data:`CONSUMING` before ``message`` goes back to its queue: Celery requeues a
    message by ``reject(requeue=True)`` (a pool child lost, a time limit) or ``requeue()``."""
    original_reject, original_requeue = message.reject, message.requeue

    def watched_reject(requeue: bool = False) -> Any:
        if requeue:
            CONSUMING.requeued()
        return original_reject(requeue=requeue)

    def watched_requeue() -> Any:
        CONSUMING.requeued()
        return original_requeue()

    message.reject = watched_reject
    message.requeue = watched_requeue


class AmqpBroker:
    """What the lost-chain proof reads from a RabbitMQ broker: each queue's ready messages and
    consumers (``queue.declare`` with ``passive``: it creates nothing, and a queue that does
    not exist is left out), over a connection of its own without heartbeats (it is used once a
    sweep at most; an error closes it, and the next use opens another)."""

    def __init__(self, app: Any, vhost: str) -> None:
        self._app = app
        self.vhost = vhost
        self._conn: Any = None

    def counts(self, queues: Iterable[str]) -> dict[str, QueueCount]:
        """Ready messages and consumers of each of ``queues`` that exists."""
        import amqp

        out: dict[str, QueueCount] = {}
        try:
            if self._conn is None:
                self._conn = self._app.connection_for_write()
                self._conn.connect()
            channel = self._conn.channel()
            for queue in queues:
                try:
                    ok = channel.queue_declare(queue=queue, passive=True)
                except amqp.exceptions.NotFound:
                    channel = self._conn.channel()  # RabbitMQ closed the channel
                    continue
                out[queue] = QueueCount(int(ok.message_count), int(ok.consumer_count))
            with contextlib.suppress(Exception):
                channel.close()
        except Exception:
            self.close()
            raise
        return out

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.release()


def open_amqp(app: Any) -> AmqpBroker | None:
    """An :class:`AmqpBroker` of ``app``'s broker, or None when the broker is not RabbitMQ."""
    conn = app.connection_for_write()
    try:
        if conn.transport.driver_type != "amqp":
            return None
        return AmqpBroker(app, str(conn.virtual_host or "/"))
    finally:
        conn.release()


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
