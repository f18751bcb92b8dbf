"""The Celery app: ``celery -A workers.app worker -Q critique.cpu,critique.llm``.

Configuration comes from :mod:`celeryconfig` (JSON only, acks late, reject on worker loss,
task events on, routes per queue). The tasks live in :mod:`workers.tasks`; fault recovery (the
connection-loss guard, the stall sweeper and its probe task) in :mod:`workers.recovery`.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery, concurrency
from celery.signals import celeryd_init, worker_init

from workers import logs

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Logs: one line per stage at INFO (ids, status, timing), payloads at DEBUG only (workers.logs).
logs.install()

# ``-P threads`` is Celery's threads pool with one fix (workers.recovery.ThreadPool): an error
# raised outside a task's body ends the request instead of leaving it held forever.
concurrency.ALIASES["threads"] = "workers.recovery:ThreadPool"

app = Celery("critique", include=["workers.tasks", "workers.recovery"])
app.config_from_object("celeryconfig")
# The stall sweeper thread in every worker process (workers.recovery; CRITIQUE_SWEEP_S=0: off).
app.steps["worker"].add("workers.recovery:Sweeper")

GUARDED_TRANSPORT = "workers.recovery:RedisTransport"


@celeryd_init.connect
def _guard_the_broker_transport(conf: Any = None, **_: Any) -> None:
    """A worker starting on a redis:// or rediss:// broker uses kombu's Redis transport with the
    guard that keeps a Redis outage from ending its main process (see
    :class:`workers.recovery.RedisTransport`). Only workers: the transport's name shows in the
    broker URI, and Flower and other clients pick their broker client by that URI's scheme."""
    if conf is None or conf.broker_transport:
        return  # an operator's own choice of transport wins
    if str(conf.broker_url or "").partition("://")[0] in ("redis", "rediss"):
        conf.broker_transport = GUARDED_TRANSPORT


LLM_QUEUES = ("critique.llm", "critique.llm.critic")
"""The queues whose stages call a model (``keys.QUEUE_LLM``, ``keys.QUEUE_CRITIC``)."""


@worker_init.connect
def _load_litellm_on_llm_workers(sender: Any = None, **_: Any) -> None:
    """A worker that consumes an LLM queue imports litellm while it starts, before it takes a
    message: otherwise its first LLM calls would all wait seconds on the import (every thread
    blocked on the import lock). Only stages that may call a model are routed to these queues,
    so such a worker needs litellm for its first message. Other processes (``critique --help``,
    ``critique l0``, a ``critique.cpu`` worker) never import it."""
    queues = getattr(getattr(getattr(sender, "app", None), "amqp", None), "queues", None)
    consumed = set(getattr(queues, "consume_from", None) or ())
    if not consumed & set(LLM_QUEUES):
        return
    from pipeline.providers import load_litellm

    load_litellm()
