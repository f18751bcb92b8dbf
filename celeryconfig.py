"""Every Celery setting of critique-pipeline, documented, overridable from the environment.

Loaded by ``workers.app`` with ``app.config_from_object("celeryconfig")``. Environment variables:
``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``) is the store and, unless
``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND`` say otherwise, also the broker and the result
backend; each may be a Sentinel URL (``sentinel://host:port;sentinel://host:port;…/db``, with
``CRITIQUE_REDIS_MASTER`` and, optionally, ``CRITIQUE_SENTINEL_PASSWORD``).
``CRITIQUE_TASK_TIME_LIMIT_S`` bounds the longest task (an LLM call with its retries).
``CRITIQUE_OUTAGE_S`` (default 120) is how long a Redis outage is ridden out before anything
gives up: every publish (a chain's next stage, ``Task.replace``, a retry, the client's submit)
and every result-backend write retries with backoff for that long. Workers themselves never
give up reconnecting, and retry at most 2 s apart (``interval_max``, applied by
``workers.recovery.transport.Consumer``). ``CRITIQUE_STALL_S`` and ``CRITIQUE_SWEEP_S`` tune the
sweeper (``workers.recovery.sweeper``). ``CRITIQUE_TASK_EVENTS`` (1 or 0) switches task events
(Flower): on by default, off in the processes of ``critique worker`` unless set (a monitor turns
them on).

What survives what, with these settings (measured by ``tests/faults``, see
docs/operations.md): a killed worker (a pool child's message is requeued at once; the messages
a dead main process held are restored by the other workers within seconds, as soon as its
held-message reports stop, not after the visibility timeout); a Redis restart or a network blip
shorter than ``CRITIQUE_OUTAGE_S`` (publishes wait, workers reconnect within 2 s of Redis being
back, a message the restart lost is proved lost and re-driven within seconds; the stall time,
the task time limit + 30 s, stays the backstop where nothing can be proved: a non-Redis broker);
a RabbitMQ restart (quorum queues, publisher confirms; consumers reconnect within 2 s and
RabbitMQ redelivers what they held; dead connections are noticed by 10 s heartbeats and TCP
keepalive after about 25 s). A Redis restart without persistence loses every
queued message and the submissions' records: nothing can re-drive those (run Redis with
``appendonly yes``).
"""

from __future__ import annotations

import math
import os

from pipeline import settings
from pipeline.store import keys
from pipeline.store.redis_common import celery_url, dead_peer_options, sentinel_transport_options

_redis = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
# Every CRITIQUE_* variable read here is declared in pipeline.settings (read once, at import).
_time_limit = settings.integer(settings.TASK_TIME_LIMIT_S)
_outage = settings.number(settings.OUTAGE_S)

# --- transport -------------------------------------------------------------------------------
# Any of the three may be Redis Sentinel's ``sentinel://host:port;sentinel://host:port;…/db``
# (kombu's ``sentinel`` transport, Celery's Sentinel result backend), with the master's name in
# ``CRITIQUE_REDIS_MASTER`` and the Sentinels' own password, if any, in
# ``CRITIQUE_SENTINEL_PASSWORD`` (see ``pipeline.store.redis_common``). The URL is rewritten with
# its database and password on every part, which kombu and Celery read differently otherwise;
# the transport options below gain ``master_name`` and ``sentinel_kwargs``. Workers follow the
# current master: a failover is a reconnect (``workers.recovery.transport.SentinelTransport``).
# (Celery reads CELERY_BROKER_URL / CELERY_RESULT_BACKEND from the environment before these
# settings, so a Sentinel URL there is rewritten in place too.)
for _env in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
    if os.environ.get(_env):
        os.environ[_env] = celery_url(os.environ[_env], setting=_env)
broker_url = celery_url(os.environ.get("CELERY_BROKER_URL", _redis), setting="CELERY_BROKER_URL")
result_backend = celery_url(
    os.environ.get("CELERY_RESULT_BACKEND", _redis), setting="CELERY_RESULT_BACKEND"
)
# Redis redelivers an unacked message after the visibility timeout: keep it well above the
# longest task so a slow LLM call is never run twice just for being slow.
_visibility = int(settings.given(settings.VISIBILITY_TIMEOUT_S) or max(3600, 2 * _time_limit))
# TCP keepalive on every broker connection: a peer that vanished without closing it (a host
# gone, a network cut, a broker restart behind NAT) is found dead by the kernel after 10 s idle
# + 3 probes 5 s apart, where the defaults took minutes (py-amqp: 60 s + 9 x 10 s; Linux: 2 h),
# and a command it leaves unacknowledged for 10 s (TCP_USER_TIMEOUT: a partition that drops
# packets) drops the connection too. ``socket_keepalive_options`` is the Redis transport's name
# for it, ``socket_settings`` py-amqp's (RabbitMQ); each transport ignores the other's.
_KEEPALIVE = dead_peer_options()
# A killed worker's unacked messages come back when a live worker sweeps the unacked index:
# kombu's defaults sweep about every 100 s (interval 10 s × throttle 10) and a sweeper that dies
# holding the sweep mutex blocks others for 300 s. Sweep every interval; free the mutex sooner.
broker_transport_options = {
    "visibility_timeout": _visibility,
    "unacked_restore_interval": settings.number(settings.RESTORE_INTERVAL_S),
    "unacked_restore_throttle": 1,
    "unacked_mutex_expire": settings.integer(settings.RESTORE_MUTEX_S),
    # Never block forever on a dead socket (a blackholed network, a failover): a publish or an
    # ack times out after 10 s and is retried on a new connection (not on the same one:
    # retry_on_timeout stays off). kombu's health check (every 10 s, its default 25 s) pings the
    # pub/sub connection and drops a BRPOP connection whose reply is overdue, so a consumer on
    # a half-open connection is back within about 21 s (51 s with kombu's defaults).
    "socket_timeout": 10.0,
    "socket_connect_timeout": 5.0,
    "socket_keepalive": True,
    "socket_keepalive_options": _KEEPALIVE,
    "socket_settings": _KEEPALIVE,
    "retry_on_timeout": False,
    "health_check_interval": 10,
    # Reconnecting to a lost broker: attempts 0, 1, 2, then every 2 s (Celery's consumer waits
    # 2, 4, 6 … up to 30 s between attempts: after a 30 s outage it came back up to 12 s late).
    # workers.recovery.transport.Consumer applies them to the worker's consumer; kombu to new
    # channels.
    "interval_start": 0,
    "interval_step": 1,
    "interval_max": 2,
    # RabbitMQ (amqp://) only: every publish waits for the broker's confirm (basic.ack), so a
    # publish into a connection the broker is closing (a restart) raises and is retried on a
    # new one instead of being lost in a socket buffer; quorum queues confirm once a majority
    # of their replicas hold the message. (kombu's Redis transport ignores it.)
    "confirm_publish": True,
    # sentinel:// only: master_name, sentinel_kwargs (timeouts, CRITIQUE_SENTINEL_PASSWORD).
    **sentinel_transport_options(broker_url),
}

# --- riding out a Redis outage -----------------------------------------------------------------
# The worker reconnects forever (Celery's default gives up after 100 tries, then the process
# exits), also when the broker fails while the worker is still starting.
broker_connection_retry = True
broker_connection_retry_on_startup = True
broker_connection_max_retries = None
broker_channel_error_retry = True
broker_connection_timeout = 4.0
# The worker's consumer reconnects at most 2 s apart (the transport options above), where
# Celery's own consumer waits up to 30 s between attempts.
worker_consumer = "workers.recovery.transport:Consumer"
# RabbitMQ (amqp://): heartbeats every 10 s (Celery's default 120 s), so a consumer whose
# connection died without a close (a broker restart behind a proxy, a network cut) notices
# within about 20 s rather than 4 minutes and reconnects; RabbitMQ requeues what it held
# unacknowledged at once. Celery sends them from the worker's event loop, which the prefork
# and the threads pools both run (rabbitmqctl list_connections shows timeout 10 for both):
# a loop blocked for ~3 heartbeats gets its connection closed by RabbitMQ.
broker_heartbeat = 10
# A Redis outage must not end the worker's main process: workers (only they: Flower and other
# clients read the broker URL's scheme) use kombu's Redis transport with one guard,
# workers.recovery.transport.RedisTransport, which workers.app selects for redis:// and
# rediss:// brokers when a worker starts (workers.recovery.transport.SentinelTransport for
# sentinel:// ones). (A lost
# connection's channel raised AttributeError('hostname') instead of a connection error, which
# Celery treats as unrecoverable.)
# On a connection loss, let running stages finish (they are idempotent, and their successors'
# publishes wait for Redis) rather than cancel them: Redis would only redeliver a cancelled one
# after the visibility timeout. (Celery 6 turns this on by default; say it explicitly.)
worker_cancel_long_running_tasks_on_connection_loss = False
# Every publish retries with backoff (0, 0.5, 1, 1.5, then every 2 s) for CRITIQUE_OUTAGE_S:
# the chain's next stage after a task (Celery caps these callback publishes at max_retries, so
# it must be a number), Task.replace, autoretry's re-publish, and the client's submit.
_INTERVAL_STEP, _INTERVAL_MAX = 0.5, 2.0
task_publish_retry = True
task_publish_retry_policy = {
    "max_retries": max(3, 4 + math.ceil((_outage - 3.0) / _INTERVAL_MAX)),
    "interval_start": 0,
    "interval_step": _INTERVAL_STEP,
    "interval_max": _INTERVAL_MAX,
}
# Result-backend writes (a gate's result, a failure) retry the same way, bounded by time too.
# (Not result_backend_always_retry: it would wrap these retries in a second retry loop.)
result_backend_transport_options = {
    "retry_policy": {
        "max_retries": task_publish_retry_policy["max_retries"],
        "interval_start": 0,
        "interval_step": _INTERVAL_STEP,
        "interval_max": _INTERVAL_MAX,
        "timeout": _outage,
    },
    # sentinel:// only: master_name, sentinel_kwargs (Celery's Sentinel backend reads both).
    **sentinel_transport_options(result_backend),
}
redis_socket_timeout = 30.0
redis_socket_connect_timeout = 5.0
redis_socket_keepalive = True
# Celery's own results (the gate's summary, stage errors) live as long as the run's records
# (CRITIQUE_RUN_TTL_S, 7 days by default) unless CRITIQUE_RESULT_EXPIRES_S says otherwise.
result_expires = int(
    settings.given(settings.RESULT_EXPIRES_S)
    or settings.given(settings.RUN_TTL_S)
    or str(keys.DEFAULT_RUN_TTL_S)
)

# --- security: JSON only, never pickle ------------------------------------------------------
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

# --- delivery semantics --------------------------------------------------------------------
# Ack after the task body ran, and requeue when the worker process dies mid-task: a killed
# worker never loses a submission (stages are idempotent, so a redelivery is harmless).
task_acks_late = True
task_reject_on_worker_lost = True
# One message at a time per process: LLM stages are long, and prefetching starves siblings.
worker_prefetch_multiplier = settings.integer(settings.PREFETCH_MULTIPLIER)

# --- time limits on every task ---------------------------------------------------------------
task_time_limit = _time_limit
task_soft_time_limit = max(1, _time_limit - 30)

# --- routing: CPU stages and LLM stages scale separately ---------------------------------------
# The pipeline's three queues are made by Celery as it meets them (a direct exchange of the
# queue's name), as before. On RabbitMQ they are quorum queues (replicated by Raft; a message
# is confirmed once a majority holds it, and a consumer's unacknowledged messages are
# redelivered when its connection or channel goes), declared with ``x-queue-type: quorum`` by
# every worker and client; ``CRITIQUE_AMQP_QUEUE_TYPE=classic`` keeps classic queues (a broker
# whose queues exist as classic ones: RabbitMQ refuses to redeclare a queue with another type,
# see docs/operations.md, "Upgrading to quorum queues"; any other value stops a worker on
# RabbitMQ at start, workers.app.settle_amqp_settings). Pidbox (remote control) and event
# queues stay as Celery makes them (transient, auto-delete). Redis ignores queue arguments:
# there the queues are the same lists as before.
amqp_queue_type = (
    "classic" if settings.given(settings.AMQP_QUEUE_TYPE).lower() == "classic"
    else "quorum"
)  # fmt: skip
task_default_queue_type = amqp_queue_type
task_create_missing_queue_type = amqp_queue_type
# Quorum queues have no global QoS: with a quorum queue among its queues Celery sets the
# prefetch per consumer (worker_prefetch_multiplier x concurrency, fixed while it runs).
worker_detect_quorum_queues = True
task_default_queue = keys.QUEUE_CPU
task_routes = {
    keys.TASK_L0: {"queue": keys.QUEUE_CPU},
    keys.TASK_DECIDE: {"queue": keys.QUEUE_CPU},
    keys.TASK_GATE: {"queue": keys.QUEUE_CPU},
    keys.TASK_COMPLETE_GATE: {"queue": keys.QUEUE_CPU},
    # The entry task (docs/entry.md): token-free validation, then it replaces itself with the
    # submission's first task on its critic's queue.
    keys.TASK_SUBMIT: {"queue": keys.QUEUE_SUBMIT},
    # Layer-0 and the critic run on the CPU queue unless the critic calls an LLM: then a
    # submission's first task (Layer-0, which runs the critic after it) and a critic sent on
    # its own go to the LLM queue (mode: inline) or the dedicated critic queue (mode:
    # dedicated), per submission (workers.routing.stage_signature).
    keys.TASK_CRITIC: {"queue": keys.QUEUE_CPU},
    # A repair runs on the LLM queue unless its reviser is token-free: then it is routed to
    # the CPU queue (workers.routing.repair_queue), so it never waits for LLM workers.
    keys.TASK_REPAIR: {"queue": keys.QUEUE_LLM},
}
"""Each task's queue unless its signature names one (workers.routing); every name is a
``pipeline.store.keys`` constant."""

# --- monitoring: Flower sees everything ----------------------------------------------------------
# Task events (task-sent, -received, -started, -succeeded) are what Flower shows. Each is a
# PUBLISH with the task's arguments in it, four per stage: about 12 % of an LLM-bound worker's
# CPU (bench/README.md, "LLM-bound throughput"). ``CRITIQUE_TASK_EVENTS`` (1 or 0, default 1)
# switches them; ``critique worker`` sets it to 0 for its processes unless it is set, because a
# monitor turns a worker's task events on when it wants them: Flower sends ``enable_events``
# every 5 s, so a running Flower still lists every task a ``critique worker`` receives.
worker_send_task_events = settings.flag(settings.TASK_EVENTS)
task_send_sent_event = worker_send_task_events
task_track_started = True

worker_hijack_root_logger = False
