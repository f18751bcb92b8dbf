"""The Celery app: ``celery -A workers.app worker -Q critique.cpu,critique.llm``.

Configuration comes from :mod:`celeryconfig` (JSON only, acks late, reject on worker loss,
task events on, routes per queue). The tasks live in :mod:`workers.tasks` (how they run in
:mod:`workers.steps`, their routing in :mod:`workers.routing`); fault recovery (the
connection-loss guard, the stall sweeper and its probe task) in the mechanism modules of
:mod:`workers.recovery`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from celery import Celery, concurrency
from celery.signals import (
    celeryd_init,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from kombu.utils.objects import cached_property

from pipeline import settings
from pipeline.errors import ConfigError
from pipeline.llm.providers import configured_models, warm_up
from pipeline.store import keys
from pipeline.store.urls import check_urls, is_sentinel_url, parse_sentinel_url, sentinel_master
from workers import logs, telemetry
from workers.exit_codes import EXIT_INTERRUPTED

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Logs: one line per task at INFO (ids, status, timing), payloads at DEBUG only (workers.logs).
logs.install()

# ``-P threads`` is Celery's threads pool with one fix (workers.recovery.transport.ThreadPool):
# an error raised outside a task's body ends the request instead of leaving it held forever.
concurrency.ALIASES["threads"] = "workers.recovery.transport:ThreadPool"


class CritiqueCelery(Celery):  # type: ignore[misc]
    """Celery with the product's worker program: its banner tells the truth about task events
    (:mod:`workers.banner`; imported only when a worker starts)."""

    @cached_property
    def Worker(self) -> Any:  # Celery's name for it
        return self.subclass_with_self("workers.banner:Worker")


# Every critique.* message shows monitors (Flower, `celery events`) a summary of its arguments,
# never the worker's output (workers.publishing).
# A worker imports ``include`` before it sends ``worker_init``: the door (workers.door) drops
# Celery's built-in tasks on that signal.
app = CritiqueCelery(
    "critique",
    include=["workers.tasks", "workers.recovery.sweeper", "workers.door"],
    amqp="workers.publishing:SummarisingAMQP",
)
app.config_from_object("celeryconfig")
# The stall sweeper thread in every worker process (workers.recovery.sweeper;
# CRITIQUE_SWEEP_S=0: off).
app.steps["worker"].add("workers.recovery.sweeper:Sweeper")

GUARDED_TRANSPORT = "workers.recovery.transport:RedisTransport"
GUARDED_SENTINEL_TRANSPORT = "workers.recovery.transport:SentinelTransport"
GUARDED_TRANSPORTS = {
    "redis": GUARDED_TRANSPORT,
    "rediss": GUARDED_TRANSPORT,
    "sentinel": GUARDED_SENTINEL_TRANSPORT,
}
"""The guarded transport a worker uses for each broker URL scheme."""


def check_sentinel_settings(conf: Any, env: Any = None) -> None:
    """Raise ``ConfigError`` (one line naming what to set) when the broker or the result
    backend is a ``sentinel://`` URL that does not parse or has no master name; otherwise give
    it the form kombu and Celery read alike (:func:`~pipeline.store.redis_common.celery_url`)
    and fill in the Sentinel transport options (``master_name``, ``sentinel_kwargs``) where they
    are missing (a broker URL given on the command line, ``-b sentinel://…``)."""
    from pipeline.store import redis_common as rc  # lazy: it loads redis; the app does not

    env = os.environ if env is None else env
    for url_key, opts_key, setting in (
        ("broker_url", "broker_transport_options", "CELERY_BROKER_URL"),
        ("result_backend", "result_backend_transport_options", "CELERY_RESULT_BACKEND"),
    ):
        url = str(conf.get(url_key) or "")
        if not is_sentinel_url(url):
            continue
        if not env.get(setting):
            setting = "REDIS_URL"  # where the URL came from (celeryconfig's default)
        parse_sentinel_url(url, setting=setting)
        conf[url_key] = rc.celery_url(url, setting=setting)  # the db and password on every part
        opts = dict(conf.get(opts_key) or {})
        if not opts.get("master_name"):
            opts["master_name"] = sentinel_master(env, setting=setting)
        opts.setdefault("sentinel_kwargs", rc.sentinel_kwargs(env))
        conf[opts_key] = opts


AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")
"""Broker URL schemes of RabbitMQ (kombu's py-amqp transport)."""


def settle_amqp_settings(conf: Any, env: Any = None) -> None:
    """A worker on RabbitMQ: ``CRITIQUE_AMQP_QUEUE_TYPE`` must be ``quorum`` or ``classic``
    (``ConfigError`` otherwise), and Celery's prefetch reduction after a reconnect is off.

    That reduction (``worker_enable_prefetch_count_reduction``) lowers the prefetch count while
    the tasks that ran through the connection loss finish, then raises it by one on each
    acknowledgement: a synchronous ``basic.qos`` sent from whichever thread acknowledges. In a
    threads-pool worker that is a task thread, reading the consumer's connection while its event
    loop reads it too: the two split the AMQP frame stream (``UnexpectedFrame: Received
    frame_end 0x04 while expecting 0xce``), the connection drops again, every acknowledgement in
    flight fails ("Couldn't ack … connection already closed") and the consumer came back in
    bursts 30 s apart for minutes after a 5 s broker restart. Quorum queues (per-consumer
    prefetch) skip the reduction in Celery 5.7 already; classic ones (``CRITIQUE_AMQP_QUEUE_TYPE
    =classic``) would not. Without it, a reconnected consumer asks for its full prefetch at
    once: at most the tasks still running from before are reserved in addition, and they wait
    for a free slot. Redis brokers keep Celery's default (the reduction is client-side there)."""
    env = os.environ if env is None else env
    name = settings.AMQP_QUEUE_TYPE.name
    raw = settings.given(settings.AMQP_QUEUE_TYPE, env).lower()
    if raw and raw not in ("quorum", "classic"):
        raise ConfigError(
            f"{name}={raw!r}: use quorum (the default) or classic",
            key=name,
        )
    conf.worker_enable_prefetch_count_reduction = False


def amqp_queue_refused(reply_text: str, vhost: str) -> Any:
    """The ``ConfigError`` for RabbitMQ refusing to declare a pipeline queue as configured
    (``PRECONDITION_FAILED``, ``reply_text`` naming the queue and the argument): the queue exists
    with another type, which RabbitMQ cannot change in place. Workers (at start) and clients (on
    submit) raise it."""
    wanted = str(app.conf.get("amqp_queue_type") or "quorum")  # celeryconfig's reading
    other = "classic" if wanted == "quorum" else "quorum"
    return ConfigError(
        f"RabbitMQ (vhost {vhost!r}) refused the {wanted} queue: {reply_text}. RabbitMQ cannot "
        "change a queue's type in place: move the queues over as docs/operations.md says "
        f'("Upgrading to quorum queues"), or set CRITIQUE_AMQP_QUEUE_TYPE={other} on every '
        "worker and client to keep the queues the broker has",
        key=settings.AMQP_QUEUE_TYPE.name,
    )


def check_amqp_queues(conf: Any) -> None:
    """Declare the pipeline's queues as configured (quorum, or classic with
    ``CRITIQUE_AMQP_QUEUE_TYPE=classic``) before the worker starts consuming, and raise
    ``ConfigError`` naming the queue and the way out when RabbitMQ refuses because the queue
    exists with another type (``PRECONDITION_FAILED - inequivalent arg 'x-queue-type'``): a
    queue's type cannot change in place, and the worker's consumer would otherwise reconnect
    forever on that channel error. A broker that does not answer yet is left to the worker's
    own reconnect loop."""
    import amqp

    conn = app.connection_for_write(url=conf.broker_url)
    try:
        try:
            conn.connect()
        except Exception:
            return  # not reachable yet: the consumer retries and says so
        queues = app.amqp.Queues(conf.task_queues)  # a copy: the worker's own is untouched
        for queue in (queues[name] for name in keys.QUEUES):
            try:
                with conn.channel() as channel:
                    queue(channel).declare()
            except amqp.exceptions.PreconditionFailed as exc:
                raise amqp_queue_refused(str(exc.reply_text), str(conn.virtual_host)) from None
            except conn.connection_errors:
                return
    finally:
        conn.release()


@celeryd_init.connect
def _guard_the_broker_transport(conf: Any = None, **_: Any) -> None:
    """A worker starting on a redis://, rediss:// or sentinel:// broker uses kombu's Redis (or
    Sentinel) transport with the guard that keeps a Redis outage, or a failover, from ending its
    main process (see :class:`workers.recovery.transport.RedisTransport`). Only workers: the
    transport's name shows in the broker URI, and Flower and other clients pick their broker client
    by that URI's scheme. A Sentinel URL without ``CRITIQUE_REDIS_MASTER`` stops the worker here
    with one line saying so (exit 2). A worker on RabbitMQ (amqp://) settles its settings
    (:func:`settle_amqp_settings`) and declares its queues first (:func:`check_amqp_queues`): a
    queue that exists with another type stops it the same way."""
    if conf is None:
        return

    scheme = str(conf.broker_url or "").partition("://")[0].lower()
    try:
        check_urls()  # a worker started by `celery -A workers.app worker` checks them too
        check_sentinel_settings(conf)
        if scheme in AMQP_SCHEMES:
            settle_amqp_settings(conf)
            check_amqp_queues(conf)
    except ConfigError as exc:
        print(f"critique worker: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if conf.broker_transport:
        return  # an operator's own choice of transport wins
    if scheme in GUARDED_TRANSPORTS:
        conf.broker_transport = GUARDED_TRANSPORTS[scheme]
    if scheme == "sentinel":
        # kombu treats the Sentinels of a sentinel:// URL as failover alternates: after a
        # failed connect it switches to the next one *by URL*, which names the transport by its
        # scheme again; in a worker that scheme is the guarded transport too.
        from kombu import transport as kombu_transport

        kombu_transport.TRANSPORT_ALIASES["sentinel"] = GUARDED_SENTINEL_TRANSPORT
        kombu_transport._transport_cache.pop("sentinel", None)


LLM_QUEUES = (keys.QUEUE_LLM, keys.QUEUE_CRITIC)
"""The queues whose stages call a model."""


@worker_init.connect
def _load_litellm_on_llm_workers(sender: Any = None, **_: Any) -> None:
    """A worker that consumes an LLM queue imports litellm while it starts, before it takes a
    message: otherwise its first LLM calls would all wait seconds on the import (every thread
    blocked on the import lock). Only stages that may call a model are routed to these queues,
    so such a worker needs litellm for its first message. Other processes (``critique --help``,
    ``critique l0``, a ``critique.cpu`` worker) never import it. The tokenizers of the models
    the operator configured and litellm's first-call imports load here too
    (:func:`pipeline.llm.providers.warm_up`); a prefork pool's children inherit them."""
    queues = getattr(getattr(getattr(sender, "app", None), "amqp", None), "queues", None)
    consumed = set(getattr(queues, "consume_from", None) or ())
    if not consumed & set(LLM_QUEUES):
        return

    # lazy: workers.runtime loads redis, which importing workers.app does not
    from workers import runtime

    try:
        models = configured_models(runtime.own_config())
    except ConfigError:  # the worker's start reports it; warm litellm's default tokenizer
        models = ()
    warm_up(models)


@worker_init.connect
def _trace_a_worker_without_forks(sender: Any = None, **_: Any) -> None:
    """Tracing (:mod:`workers.telemetry`, when ``OTEL_*`` asks for it) starts in the process
    that runs the tasks: here for the threads, solo, gevent and eventlet pools; a prefork pool's
    children start it after their fork (:func:`_trace_a_pool_process`), never its parent before
    it forks them (the batch exporter's thread would not survive the fork)."""
    from celery.concurrency.prefork import TaskPool as Prefork

    pool = concurrency.get_implementation(getattr(sender, "pool_cls", None) or "prefork")
    if not (isinstance(pool, type) and issubclass(pool, Prefork)):
        telemetry.setup()


@worker_process_init.connect
def _trace_a_pool_process(**_: Any) -> None:
    telemetry.setup()
    _freeze_what_is_loaded()


@worker_ready.connect
def _freeze_the_started_worker(**_: Any) -> None:
    _freeze_what_is_loaded()


_DISPATCHER: list[tuple[int, Any]] = []
"""The worker's task event dispatcher and the process it lives in, once the worker is ready."""


@worker_ready.connect
def _note_the_event_dispatcher(sender: Any = None, **_: Any) -> None:
    dispatcher = getattr(sender, "event_dispatcher", None)
    if dispatcher is not None:
        _DISPATCHER[:] = [(os.getpid(), dispatcher)]


def task_events_off() -> bool:
    """True when this worker sends no task events now: a task's own ``send_event`` (Celery
    sends it whatever the worker's setting) would publish an event nobody asked for. False
    when that cannot be known here (not a worker; a prefork child, whose parent holds the
    dispatcher that Flower's ``enable_events`` turns on)."""
    if not _DISPATCHER or _DISPATCHER[0][0] != os.getpid():
        return False
    dispatcher = _DISPATCHER[0][1]
    return not (dispatcher.enabled and (not dispatcher.groups or "task" in dispatcher.groups))


def _freeze_what_is_loaded() -> None:
    """Move every object alive once the worker has started (its modules: litellm's alone are
    hundreds of thousands) out of the cyclic garbage collector's reach (``gc.freeze``): a full
    collection then walks what the tasks allocate, not the imports. Measured on the LLM-bound
    bench: the GC's share fell from ~0.8 to ~0.3 ms per model call, its longest pause from
    ~340 ms to ~4 ms (bench/README.md)."""
    import gc

    gc.freeze()


@worker_process_shutdown.connect
def _flush_the_traces(**_: Any) -> None:
    """A prefork child exports the spans and sends the fleet metrics it still holds before it
    exits."""
    # lazy: workers.runtime loads redis, which importing workers.app does not
    from workers import runtime, telemetry

    runtime.metrics().flush()
    telemetry.shutdown()


_shutdown_by: dict[str, str] = {}
"""The signal that began this worker's shutdown (``SIGINT``, ``SIGTERM``…), once there is one."""


@worker_shutting_down.connect
def _note_the_shutdown_signal(sig: str = "", **_: Any) -> None:
    _shutdown_by.setdefault("sig", str(sig))


@worker_shutdown.connect
def _send_the_last_metrics(**_: Any) -> None:
    """A threads (or solo) worker sends the fleet metrics its tasks still hold."""
    # lazy: workers.runtime loads redis, which importing workers.app does not
    from workers import runtime

    runtime.metrics().flush()


@worker_shutdown.connect
def _ctrl_c_exits_130(sender: Any = None, **_: Any) -> None:
    """Ctrl-C (SIGINT) ends the worker with 130 once its warm shutdown is done, as the exit-code
    table of ``critique --help`` says (a shell's code for an interrupted process); Celery's own
    code for it is 1, which a service manager or script reads as a failure. SIGTERM keeps
    Celery's 0."""
    if _shutdown_by.get("sig") == "SIGINT" and getattr(sender, "exitcode", None) in (None, 1):
        sender.exitcode = EXIT_INTERRUPTED
