"""celeryconfig and the worker start-up with a ``sentinel://`` URL, read in a fresh interpreter
per environment (the URL parsing and checks are in tests/unit/test_sentinel_settings.py)."""

from __future__ import annotations

import json

from tests.support.probes import config_probe

_CONF_PROBE = """
import json, celeryconfig as c
print(json.dumps([c.broker_url, c.result_backend,
                  c.broker_transport_options.get("master_name"),
                  c.broker_transport_options.get("sentinel_kwargs", {}).get("password"),
                  c.broker_transport_options.get("health_check_interval"),
                  c.result_backend_transport_options.get("master_name"),
                  sorted(c.result_backend_transport_options)]))
"""


def test_celeryconfig_hands_celery_and_kombu_the_sentinel_settings() -> None:
    out = config_probe(
        _CONF_PROBE,
        REDIS_URL="sentinel://h1:1;sentinel://h2:2/5",
        CRITIQUE_REDIS_MASTER="mymaster",
        CRITIQUE_SENTINEL_PASSWORD="sp",
    )
    assert out.returncode == 0, out.stderr
    broker, backend, master, spw, hci, bmaster, bkeys = json.loads(out.stdout)
    assert broker == backend == "sentinel://h1:1/5;sentinel://h2:2/5"
    assert (master, spw, hci, bmaster) == ("mymaster", "sp", 10, "mymaster")
    assert {"retry_policy", "master_name", "sentinel_kwargs"} <= set(bkeys)
    # Celery prefers CELERY_BROKER_URL / CELERY_RESULT_BACKEND from the environment to the
    # settings: the app still gets the database on every part there.
    app = config_probe(
        "import workers.app as a; a.app.conf.task_serializer; "  # (loads celeryconfig)
        "print(a.app.conf.broker_url); print(a.app.conf.result_backend)",
        CELERY_BROKER_URL="sentinel://h1:1;sentinel://h2:2/5",
        CELERY_RESULT_BACKEND="sentinel://h1:1;sentinel://h2:2/6",
        CRITIQUE_REDIS_MASTER="mymaster",
    )
    assert app.returncode == 0, app.stderr
    assert app.stdout.split() == [
        "sentinel://h1:1/5;sentinel://h2:2/5",
        "sentinel://h1:1/6;sentinel://h2:2/6",
    ]
    plain = config_probe(_CONF_PROBE, REDIS_URL="redis://127.0.0.1:1/0")
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)[2:4] == [None, None]


_WORKER_PROBE = """
from celery.signals import celeryd_init
import workers.app as a
celeryd_init.send(sender=None, conf=a.app.conf, instance=None, options={})
print(a.app.conf.broker_transport, a.app.conf.broker_transport_options["master_name"])
from kombu.transport import get_transport_cls
from workers.recovery.transport import SentinelTransport
print(get_transport_cls("sentinel") is SentinelTransport)  # also after a switch to a fallback
"""


def test_a_worker_on_a_sentinel_broker_uses_the_guarded_sentinel_transport() -> None:
    ok = config_probe(_WORKER_PROBE, REDIS_URL="sentinel://h1:1/0", CRITIQUE_REDIS_MASTER="m1")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["workers.recovery.transport:SentinelTransport", "m1", "True"]
    bad = config_probe(_WORKER_PROBE, REDIS_URL="sentinel://h1:1/0")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "critique worker: REDIS_URL is a sentinel:// URL but CRITIQUE_REDIS_MASTER is not set: "
        "set it to the name the Sentinels monitor (their 'sentinel monitor <name> <ip> <port> "
        "<quorum>' line)"
    ]
