"""The RabbitMQ settings, read from a fresh import of celeryconfig and a worker's start-up signal
in a child interpreter (no broker needed: the broker URL points at a closed port): quorum queues
unless ``CRITIQUE_AMQP_QUEUE_TYPE=classic``, publisher confirms, and, for workers on RabbitMQ
only, no prefetch reduction after a reconnect."""

from __future__ import annotations

import json

from pipeline.config import load_config
from tests.support.probes import config_probe

_QUEUES_PROBE = """
import json
from workers.app import app
c = app.conf
qs = [app.amqp.queues[name] for name in ("critique.cpu", "critique.llm", "critique.llm.critic")]
print(json.dumps([[q.name, q.exchange.name, q.exchange.type, q.routing_key, q.queue_arguments]
                  for q in qs]
                 + [c.broker_transport_options["confirm_publish"], c.worker_detect_quorum_queues,
                    c.task_acks_late, c.task_queues]))
"""


def test_the_pipeline_queues_are_declared_as_quorum_queues_with_publisher_confirms() -> None:
    """The three queues, each with a direct exchange of its name (Celery makes them as it meets
    them, as before, so a Redis broker's lists are the same), carry ``x-queue-type: quorum``;
    publishes wait for confirms; acks stay late."""
    out = config_probe(_QUEUES_PROBE, REDIS_URL="redis://127.0.0.1:1/0")
    assert out.returncode == 0, out.stderr
    *queues, confirm, detect, late, defined = json.loads(out.stdout)
    quorum = {"x-queue-type": "quorum"}
    assert queues == [
        [name, name, "direct", name, quorum]
        for name in ("critique.cpu", "critique.llm", "critique.llm.critic")
    ]
    assert (confirm, detect, late) == (True, True, True)
    assert defined is None  # Celery makes them as it meets them: `celery worker` without -Q
    # still consumes critique.cpu alone


def test_classic_queues_are_kept_with_critique_amqp_queue_type_classic() -> None:
    """``CRITIQUE_AMQP_QUEUE_TYPE=classic`` declares the queues without arguments (a broker
    whose queues exist as classic ones); it is a process setting, not a configuration field."""
    out = config_probe(
        _QUEUES_PROBE, REDIS_URL="redis://127.0.0.1:1/0", CRITIQUE_AMQP_QUEUE_TYPE="classic"
    )
    assert out.returncode == 0, out.stderr
    assert [q[4] for q in json.loads(out.stdout)[:3]] == [None, None, None]
    load_config(env={"CRITIQUE_AMQP_QUEUE_TYPE": "classic"})


_WORKER_PROBE = """
from celery.signals import celeryd_init
import workers.app as a
celeryd_init.send(sender=None, conf=a.app.conf, instance=None, options={})
print(a.app.conf.worker_enable_prefetch_count_reduction, a.app.conf.broker_transport)
"""


def test_a_worker_on_rabbitmq_turns_celerys_prefetch_reduction_off_and_redis_keeps_it() -> None:
    """On an amqp:// broker the worker's start-up turns ``worker_enable_prefetch_count_reduction``
    off (its restore sends basic.qos from a task thread, see workers.app) and leaves the
    transport to kombu's py-amqp one; a Redis broker keeps Celery's default and gets the guarded
    transport. An unreachable broker is left to the consumer's reconnect loop."""
    amqp = config_probe(_WORKER_PROBE, CELERY_BROKER_URL="amqp://guest:guest@127.0.0.1:1//")
    assert amqp.returncode == 0, amqp.stderr
    assert amqp.stdout.split() == ["False", "None"]
    plain = config_probe(_WORKER_PROBE, REDIS_URL="redis://127.0.0.1:1/0")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split() == ["True", "workers.recovery.transport:RedisTransport"]


def test_a_worker_on_rabbitmq_refuses_an_unknown_queue_type() -> None:
    """A mistyped ``CRITIQUE_AMQP_QUEUE_TYPE`` stops a worker on RabbitMQ at start: exit 2, one
    line naming the variable and its two values."""
    bad = config_probe(
        _WORKER_PROBE,
        CELERY_BROKER_URL="amqp://guest:guest@127.0.0.1:1//",
        CRITIQUE_AMQP_QUEUE_TYPE="quorom",
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "critique worker: CRITIQUE_AMQP_QUEUE_TYPE='quorom': use quorum (the default) or classic"
    ]
