"""Redis outages and lost messages, with real processes: a private ``redis-server`` (AOF,
``appendfsync always``) that the test kills or stops and restarts, and real Celery worker
processes. Nothing is mocked; submissions need no LLM (the heuristic critic)."""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.store import keys
from tests.support.faults import (
    check_run,
    fault_submissions,
    redriven_once_after_a_loss,
    wait_for_results,
)
from tests.support.servers import RedisServer
from tests.support.submissions import CONFIG, make_sub
from tests.support.workers import WorkerStarter

RECOVERY_SLA_S = 60.0
"""The issue's bound: every submission has its result within this of Redis coming back."""
BACK_S = 5.0
"""A worker answers a ping within this of Redis coming back: its consumer's next try at most
2 s after, and the rest for its reconnect (its channels, events, remote control)."""


def _through_an_outage(
    server: RedisServer,
    start_worker: WorkerStarter,
    env: dict[str, str],
    *,
    down_s: float,
    how: str,
    pools: tuple[str, ...],
    n: int = 300,
) -> tuple[list[dict[str, Any]], float, list[float]]:
    """Submit ``n`` submissions, take Redis down once some results are in (``kill``: SIGKILL;
    ``nosave``: ``SHUTDOWN NOSAVE``; ``stop``: SIGTERM), keep it down ``down_s`` seconds,
    restart it on the same port and data (AOF), and check the run. Returns the resume events,
    the seconds from the restart to the last result, and per worker the seconds from the
    restart until it answered a remote-control ping (consuming again)."""
    from workers.client import CritiqueClient

    concurrency = {"threads": 4, "prefork": 2}
    workers = [
        start_worker(f"{pool}{i}", env, pool=pool, concurrency=concurrency[pool])
        for i, pool in enumerate(pools)
    ]
    pids = [w.proc.pid for w in workers if w.proc is not None]
    run_id = f"outage-{uuid.uuid4().hex[:8]}"
    subs = fault_submissions(run_id, n)
    CritiqueClient(CONFIG).submit_many(subs)
    assert len(wait_for_results(run_id, n // 10, 60)) >= n // 10
    {"kill": server.kill, "nosave": server.shutdown_nosave, "stop": server.stop}[how]()
    time.sleep(down_s)
    server.start()
    restarted = time.monotonic()
    back_s = [
        math.inf if w.answers_within(RECOVERY_SLA_S) is None else time.monotonic() - restarted
        for w in workers
    ]
    results = wait_for_results(run_id, n, RECOVERY_SLA_S + 30)
    took = time.monotonic() - restarted
    resumes = check_run(run_id, subs, results, workers, pids)
    assert took <= RECOVERY_SLA_S, f"the last result came {took:.1f} s after the restart"
    return resumes, took, back_s


@pytest.mark.faults
@pytest.mark.timeout(180)
def test_300_submissions_through_a_redis_sigkill_and_restart(
    redis_server: RedisServer, fault_env: dict[str, str], start_worker: WorkerStarter
) -> None:
    """Redis SIGKILLed mid-run and restarted 5 s later (AOF): both workers (threads, prefork)
    keep their process and reconnect, and every submission ends with its normal result, none
    failed, within a minute of the restart — what the kill lost (a message popped but not yet
    registered as unacknowledged) is proved lost and re-driven by the sweeper in seconds, and
    only what was lost (the stall time, 600 s here, never acts)."""
    resumes, took, _ = _through_an_outage(
        redis_server, start_worker, fault_env, down_s=5, how="kill", pools=("threads", "prefork")
    )
    assert {e.get("reason") for e in resumes} <= {"lost"}
    print(f"SIGKILL + 5 s: all results {took:.1f} s after the restart, {len(resumes)} re-driven")


@pytest.mark.faults
@pytest.mark.timeout(180)
def test_300_submissions_through_a_shutdown_nosave_and_restart(
    redis_server: RedisServer, fault_env: dict[str, str], start_worker: WorkerStarter
) -> None:
    """Redis stopped with ``SHUTDOWN NOSAVE`` mid-run and restarted 5 s later from its AOF:
    every submission ends with its normal result within a minute of the restart; the messages
    the workers held when their connections closed (no longer acknowledgeable) are restored
    by the workers' orphan sweep, not after the visibility timeout (900 s here)."""
    resumes, took, _ = _through_an_outage(
        redis_server, start_worker, fault_env, down_s=5, how="nosave", pools=("threads",)
    )
    assert {e.get("reason") for e in resumes} <= {"lost"}
    print(f"NOSAVE + 5 s: all results {took:.1f} s after the restart, {len(resumes)} re-driven")


@pytest.mark.faults
@pytest.mark.timeout(240)
def test_300_submissions_through_a_30_second_redis_outage(
    redis_server: RedisServer,
    fault_env: dict[str, str],
    start_worker: WorkerStarter,
    tmp_path: Path,
) -> None:
    """Redis shut down mid-run for 32 s, then started again: the worker rides it out (its
    publishes wait, it reconnects within 2 s of the restart) and every submission ends with its
    normal result within a minute of the restart; its consumer retried the connection at most
    2 s apart.

    Whether the consumer meets the outage while it lasts depends on what its event loop is
    doing when Redis goes (it may see the loss only once Redis is back, and then connect at
    the first try: no wait to log). So the waits Celery logs ("Trying again in N seconds") must
    all be 2 s or less, and, logged or not, the worker must answer a remote-control ping, which
    only a consumer connected again does, within 2 s of the restart plus its reconnect's own
    cost (:data:`BACK_S`): with Celery's own waits, 2, 4, 6 … up to 30 s, its next try after
    a 32 s outage comes about 10 s after the restart."""
    resumes, took, back_s = _through_an_outage(
        redis_server, start_worker, fault_env, down_s=32, how="stop", pools=("threads",)
    )
    log = (tmp_path / "worker-threads0.log").read_text(errors="replace")
    waits = [float(w) for w in re.findall(r"Trying again in ([0-9.]+) seconds?", log)]
    assert max(waits, default=0.0) <= 2.0, waits
    assert max(back_s) <= BACK_S, f"consuming again {back_s} s after the restart"
    print(
        f"32 s outage: consuming again {max(back_s):.1f} s and all results {took:.1f} s after "
        f"the restart ({len(waits)} reconnect waits logged), {len(resumes)} re-driven"
    )


@pytest.mark.timeout(120)
def test_300_submissions_through_network_blips(
    redis_server: RedisServer, fault_env: dict[str, str], start_worker: WorkerStarter
) -> None:
    """Every client connection to Redis is cut three times mid-run (CLIENT KILL, as a network
    blip or a proxy restart does): the worker keeps its process, reconnects, and every
    submission ends with its normal result.

    Redis itself stays up, so kombu requeues the lost connection's unacked messages at once and
    a stage that was running when the connection was cut runs a second time (at-least-once
    delivery): its repeat replays, and a repeated gate writes nothing twice."""
    from workers.client import CritiqueClient

    worker = start_worker("blip", fault_env)
    assert worker.proc is not None
    pid = worker.proc.pid
    run_id = f"blip-{uuid.uuid4().hex[:8]}"
    subs = fault_submissions(run_id, 300)
    CritiqueClient(CONFIG).submit_many(subs)
    admin = redis.Redis(port=redis_server.port)
    for share in (0.1, 0.3, 0.5):
        wait_for_results(run_id, int(len(subs) * share), 60)
        admin.client_kill_filter(_type="normal", skipme=True)
    results = wait_for_results(run_id, len(subs), 90)
    check_run(run_id, subs, results, [worker], [pid])


LOST_SLA_S = 30.0
"""The issue's bound: a message deleted from its queue is re-driven within this."""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("lost", "sweep_s"), [("first", "0.5"), ("next", "5")])
def test_a_message_deleted_from_its_queue_is_redriven_within_seconds(
    fault_env: dict[str, str], start_worker: WorkerStarter, lost: str, sweep_s: str
) -> None:
    """A chain whose message was deleted by hand from its queue (``first``: the submission's
    first message; ``next``: l0 ran and recorded its step, its successor is gone), with nobody
    calling ``wait``, is proved lost by the workers' sweeper and re-driven from its last step
    within 30 s of a worker running (the stall time is 600 s; ``next`` with the default sweep
    interval, 5 s, as an operator's workers run): one ``resume`` event by the sweeper, reason
    ``lost``, and the reference result."""
    from workers.client import CritiqueClient

    worker = start_worker("lost", {**fault_env, "CRITIQUE_SWEEP_S": sweep_s})
    worker.stop()
    run_id = f"lost-{uuid.uuid4().hex[:8]}"
    sub = make_sub(run_id, "w1", 1, "missing")
    client = CritiqueClient(CONFIG)
    handle = client.submit(sub)
    broker = redis.Redis.from_url(fault_env["REDIS_URL"])
    assert broker.lrem(keys.QUEUE_CPU, 0, broker.lindex(keys.QUEUE_CPU, 0) or b"") == 1
    took = redriven_once_after_a_loss(worker, handle, sub, lost, LOST_SLA_S)
    print(f"deleted {lost} message: result {took:.1f} s after the worker started")


@pytest.mark.timeout(90)
def test_a_queue_backlog_is_not_taken_for_a_lost_chain(
    fault_env: dict[str, str], start_worker: WorkerStarter
) -> None:
    """300 submissions wait in the queue with no worker running, long enough for every one to
    be a suspect (no message of it unacknowledged): when a worker starts, the probes show the
    queue was not yet drained past them until each was taken, so none is re-driven (a backlog
    is never flooded with duplicates) and every one ends once."""
    from workers.client import CritiqueClient
    from workers.recovery.base import LOST_GRACE_S, LOST_MARGIN_S

    worker = start_worker("backlog", fault_env)
    worker.stop()
    run_id = f"backlog-{uuid.uuid4().hex[:8]}"
    subs = fault_submissions(run_id, 300)
    CritiqueClient(CONFIG).submit_many(subs)
    time.sleep(LOST_MARGIN_S + LOST_GRACE_S + 1)
    worker.start(timeout=60)
    assert worker.proc is not None
    pid = worker.proc.pid
    results = wait_for_results(run_id, len(subs), 60)
    assert check_run(run_id, subs, results, [worker], [pid]) == []


@pytest.mark.parametrize("how", ["collected", "close_failed_half_way"])
def test_a_lost_connections_channel_fails_with_a_connection_error(
    redis_server: RedisServer, how: str
) -> None:
    """The transport guard behind "workers survive a Redis outage": once the worker's consumer
    has collected a lost connection, a channel of it that is used again (its close retried, an
    ack of a task that ran through the outage) raises a Redis connection error, which kombu and
    Celery log and survive. kombu's own Redis transport raises AttributeError there ('client'
    for a closed channel; 'hostname' for one whose close failed half-way, detached from its
    transport's connection), which ended the worker's main process."""
    from kombu import Connection

    from workers.recovery.transport import RedisTransport

    conn = Connection(redis_server.url(0), transport=RedisTransport)
    channel = conn.channel()
    channel._disconnect_pools()  # as a close, even one that failed half-way, leaves it
    if how == "collected":
        conn.collect()  # the consumer's cleanup of a lost connection: closes its channels
    else:
        channel.connection.client = None  # its transport detached, the channel still open
    with pytest.raises(RedisTransport.connection_errors):
        channel.qos.ack("a-delivery-tag")


@pytest.mark.faults
@pytest.mark.timeout(120)
def test_the_managers_reads_ride_through_a_redis_restart(
    redis_server: RedisServer, fault_env: dict[str, str], start_worker: WorkerStarter
) -> None:
    """Redis SIGKILLed under a finished run and restarted 3 s later (AOF): ``critique status``
    started while it is down says at once that it is retrying, then prints the whole run and
    exits 0; ``CritiqueClient.wait`` and ``results`` called while it is down return the stored
    verdicts once it is back instead of raising."""
    import subprocess
    import sys
    import threading

    from workers.client import CritiqueClient

    worker = start_worker("threads0", fault_env, pool="threads", concurrency=4)
    run_id = f"ride-{uuid.uuid4().hex[:8]}"
    subs = fault_submissions(run_id, 20)
    client = CritiqueClient(CONFIG)
    handles = client.submit_many(subs)
    assert len(wait_for_results(run_id, 20, 60)) == 20
    worker.stop()

    redis_server.kill()
    status = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "status", run_id, "--json"],
        env=fault_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    got: dict[str, Any] = {}

    def read() -> None:
        got["wait"] = client.wait(handles[-1], timeout=60)
        got["results"] = client.results(run_id)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(3)
    redis_server.start()
    back = time.monotonic()
    out, err = status.communicate(timeout=60)
    reader.join(60)
    took = time.monotonic() - back
    assert status.returncode == 0, err
    assert "cannot reach Redis" in err and "retrying" in err
    assert json.loads(out)["finished"] == 20
    assert got["wait"].worker_id == subs[-1].worker_id and len(got["results"]) == 20
    assert took < 10, f"the reads answered {took:.1f} s after Redis was back"
    print(f"reads through a 3 s Redis outage: answered {took:.1f} s after the restart")
