"""RabbitMQ as the broker (SPEC §4 shape c), the store on a private Redis: consumers come back
within seconds when the broker drops their connections. Runs where ``rabbitmqctl`` can manage a
RabbitMQ on 127.0.0.1:5672 (guest/guest); each test uses a vhost of its own and touches no
other (a whole-broker restart, ``stop_app``/``start_app``, would: it is measured by hand, see
docs/operations.md)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from tests.faults.conftest import _forget_app_connections
from tests.faults.test_redis_outage import _submissions, _wait_for_results
from tests.integration.test_distributed import CONFIG, reference
from tests.integration.workers import WorkerProcess

StartWorker = Callable[..., WorkerProcess]
RECONNECT_SLA_S = 60.0
"""Every submission has its result within this of the broker dropping the connections."""


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, timeout=60, check=False
    )


def _rabbitmq_here() -> bool:
    if shutil.which("rabbitmqctl") is None:
        return False
    with socket.socket() as s:
        s.settimeout(1.0)
        if s.connect_ex(("127.0.0.1", 5672)) != 0:
            return False
    return True


@pytest.fixture
def amqp_url(fault_env: dict[str, str]) -> Iterator[str]:
    """A vhost of this test's own on the local RabbitMQ (deleted afterwards), set as this
    process's broker; the store stays the private Redis."""
    if not _rabbitmq_here():
        pytest.skip("no RabbitMQ managed by rabbitmqctl on 127.0.0.1:5672")
    from workers.app import app

    vhost = f"critique-test-{uuid.uuid4().hex[:8]}"
    if _ctl("add_vhost", vhost).returncode != 0:
        pytest.skip("rabbitmqctl cannot add a vhost here")
    try:
        assert _ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*").returncode == 0
        url = f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
        saved = app.conf.broker_url
        os.environ["CELERY_BROKER_URL"] = url
        app.conf.broker_url = url
        _forget_app_connections()
        try:
            yield url
        finally:
            app.conf.broker_url = saved
            _forget_app_connections()
    finally:
        _ctl("delete_vhost", vhost)


@pytest.mark.faults
@pytest.mark.timeout(180)
def test_consumers_are_back_within_seconds_when_rabbitmq_drops_their_connections(
    amqp_url: str, start_worker: StartWorker
) -> None:
    """300 submissions on RabbitMQ through two workers (threads, prefork); at 10 % of the
    results, submission still going on, the broker closes every connection of the vhost (as a
    broker restart does): both workers keep their process, reconnect at once (at most 2 s
    apart), RabbitMQ requeues what they held unacknowledged, and every submission ends once
    with its reference result within a minute."""
    from workers.client import CritiqueClient

    vhost = amqp_url.rsplit("/", 1)[1]
    env = {"CELERY_BROKER_URL": amqp_url}
    workers = [
        start_worker("threads", pool="threads", concurrency=4, env=env),
        start_worker("prefork", pool="prefork", concurrency=2, env=env),
    ]
    pids = [w.proc.pid for w in workers if w.proc is not None]
    run_id = f"rabbit-{uuid.uuid4().hex[:8]}"
    subs = _submissions(run_id, 300)
    # Submitting through RabbitMQ takes seconds: submit while the run goes, drop mid-run.
    submitter = threading.Thread(target=CritiqueClient(CONFIG).submit_many, args=(subs,))
    submitter.start()
    assert len(_wait_for_results(run_id, 30, 60)) >= 30
    closed = _ctl("close_all_connections", "-p", vhost, "critique test: broker restart")
    assert closed.returncode == 0, closed.stderr
    dropped = time.monotonic()
    submitter.join(60)
    results = _wait_for_results(run_id, len(subs), RECONNECT_SLA_S + 30)
    took = time.monotonic() - dropped
    assert len(results) == len(subs), f"{len(subs) - len(results)} have no result"
    assert took <= RECONNECT_SLA_S, f"the last result came {took:.1f} s after the drop"
    want, _ = reference(subs, CONFIG)
    for key, ref in want.items():
        assert (results[key].status, results[key].stop_reason) == (ref.status, ref.stop_reason)
    for w, pid in zip(workers, pids, strict=True):
        assert w.proc is not None and w.proc.poll() is None and w.proc.pid == pid
        log = w.log.read_text(errors="replace") if w.log else ""
        assert "Connection to broker lost" in log  # the drop reached this worker
    events = list(CritiqueClient(CONFIG).trace(run_id))
    gates = Counter((e["iteration"], e["worker_id"]) for e in events if e["type"] == "result")
    assert len(gates) == len(subs) and set(gates.values()) == {1}
    print(f"RabbitMQ connections dropped: all results {took:.1f} s later")
