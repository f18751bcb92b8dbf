"""Every Celery setting of critique-pipeline, documented, overridable from the environment.

Loaded by ``workers.app`` with ``app.config_from_object("celeryconfig")``. Environment variables:
``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``) is the store and, unless
``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND`` say otherwise, also the broker and the result
backend.
``CRITIQUE_TASK_TIME_LIMIT_S`` bounds the longest task (an LLM call with its retries).
"""

from __future__ import annotations

import os

_redis = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
_time_limit = int(os.environ.get("CRITIQUE_TASK_TIME_LIMIT_S", "600"))

# --- transport -------------------------------------------------------------------------------
broker_url = os.environ.get("CELERY_BROKER_URL", _redis)
result_backend = os.environ.get("CELERY_RESULT_BACKEND", _redis)
# Redis redelivers an unacked message after the visibility timeout: keep it well above the
# longest task so a slow LLM call is never run twice just for being slow.
_visibility = int(os.environ.get("CRITIQUE_VISIBILITY_TIMEOUT_S", str(max(3600, 2 * _time_limit))))
# A killed worker's unacked messages come back when a live worker sweeps the unacked index:
# kombu's defaults sweep about every 100 s (interval 10 s × throttle 10) and a sweeper that dies
# holding the sweep mutex blocks others for 300 s. Sweep every interval; free the mutex sooner.
broker_transport_options = {
    "visibility_timeout": _visibility,
    "unacked_restore_interval": float(os.environ.get("CRITIQUE_RESTORE_INTERVAL_S", "10")),
    "unacked_restore_throttle": 1,
    "unacked_mutex_expire": int(os.environ.get("CRITIQUE_RESTORE_MUTEX_S", "60")),
}
result_backend_transport_options = {"retry_policy": {"timeout": 5.0}}
broker_connection_retry_on_startup = True
result_expires = int(os.environ.get("CRITIQUE_RESULT_EXPIRES_S", str(7 * 24 * 3600)))

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
worker_prefetch_multiplier = int(os.environ.get("CRITIQUE_PREFETCH_MULTIPLIER", "1"))

# --- time limits on every task ---------------------------------------------------------------
task_time_limit = _time_limit
task_soft_time_limit = max(1, _time_limit - 30)

# --- routing: CPU stages and LLM stages scale separately ---------------------------------------
task_default_queue = "critique.cpu"
task_routes = {
    "critique.l0": {"queue": "critique.cpu"},
    "critique.decide": {"queue": "critique.cpu"},
    "critique.gate": {"queue": "critique.cpu"},
    "critique.complete_gate": {"queue": "critique.cpu"},
    # The critic runs on the CPU queue unless it calls an LLM: then the chain routes it to
    # critique.llm (mode: inline) or critique.llm.critic (mode: dedicated), per submission.
    "critique.critic": {"queue": "critique.cpu"},
    "critique.repair": {"queue": "critique.llm"},
}

# --- monitoring: Flower sees everything ----------------------------------------------------------
worker_send_task_events = True
task_send_sent_event = True
task_track_started = True

worker_hijack_root_logger = False
