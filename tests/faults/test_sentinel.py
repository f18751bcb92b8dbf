"""A Redis Sentinel failover with real processes: a master with AOF, two replicas, three
Sentinels (``redis-server --sentinel``), real Celery worker processes (threads and prefork) and
this process's client all on ``sentinel://`` URLs with ``CRITIQUE_REDIS_MASTER`` and
``CRITIQUE_STORE_REPLICAS=1`` (N + 1 replicas for N required: a master's loss leaves one). The
master is SIGKILLed mid-run (or demoted by ``SENTINEL FAILOVER``) and a Sentinel promotes a
replica: the broker, the result backend, the store and the sweeper follow the new master, the
workers keep their processes and consume again, and every submission ends with its normal
result, its pattern counts and budget as a run without a failover; ``critique status`` and
``resume`` on the Sentinel URL then see the run whole.

Nothing is mocked; submissions need no LLM (the heuristic critic). Every server runs on a free
loopback port in the test's temp dir and is stopped afterwards."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from pipeline import settings
from pipeline.models import CritiqueResult, Submission
from pipeline.store import keys
from pipeline.store.pending import RedisPendingIndex
from pipeline.store.redis_common import FailoverConnection, celery_url
from tests.support import wait_until
from tests.support.faults import DEDUPE_SKIP, Waiters, event_key, pattern_counts, run_results
from tests.support.sentinel import MASTER, RedisNode, SentinelSetup, SentinelWorker, tasks_run
from tests.support.submissions import CONFIG, KINDS, make_sub, reference
from tests.support.workers import WorkerProcess, WorkerStarter

N = 2000
AGAIN = 40
"""The second wave, sent after the failover: each worker process must run some of it."""
SLA_S = 240.0
"""The issue's bound: every submission has its result within this of its submit."""

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not on PATH: the Sentinel failover test needs real redis-server "
    "processes (a master, a replica, three Sentinels); install Redis to run it",
)


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSetup]:
    """This module's deployment (``sentinel_env`` is built on it): two replicas."""
    setup = SentinelSetup(tmp_path / "redis", replicas=2)
    try:
        yield setup.start()
    finally:
        setup.stop()


def _is_replica(server: RedisNode) -> bool:
    """The demoted master has been turned into a replica (its writes since the switch gone)."""
    try:
        return bool(server.client().info("replication").get("role") == "slave")
    except redis.exceptions.RedisError:
        return False


@pytest.mark.faults
@pytest.mark.timeout(330)
@pytest.mark.parametrize("how", ["kill", "demote"])
def test_2000_submissions_and_their_waits_through_a_sentinel_failover(
    sentinels: SentinelSetup,
    sentinel_env: dict[str, str],
    start_worker: WorkerStarter,
    how: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kill``: the master is SIGKILLed mid-run and a Sentinel promotes the replica.
    ``demote``: ``SENTINEL FAILOVER`` mid-run: the replica is promoted and the old master turned
    into its replica, answering ``UNBLOCKED`` to the consumers' BRPOPs and ``READONLY`` to
    writes. Either way the workers keep their processes, reconnect to the new master and
    consume again (each runs tasks of a second wave sent after it), and every submission ends
    with its reference result within 4 minutes of its submit: one ``result`` event each, no
    trace event twice, the pattern counts and the budget equal to the broker-free reference
    (nothing counted twice, nothing lost), nothing left pending. A manager waiting on every
    handle meanwhile, one by one with ``CritiqueClient.wait`` and all at once with
    ``AsyncCritiqueClient``, gets every verdict and no error: its waits ride through the
    failover and end within 10 s of the last result being stored. What
    the failover lost (asynchronous replication: the last writes before the kill; with
    ``demote``, what the old master took before the clients saw the switch) is re-driven by the
    sweeper; a task that saw the switch part-way applies its acknowledged writes again on the
    new master (``fenced_writes``)."""
    from workers import runtime
    from workers.cli import main
    from workers.client import CritiqueClient
    from workers.recovery.transport import SentinelTransport

    monkeypatch.setenv(settings.STORE_REPLICAS.name, "1")
    env = {**sentinel_env, settings.STORE_REPLICAS.name: "1"}
    url = sentinels.url()
    # The workers' transport keeps kombu's health check on Sentinel connections, and uses the
    # failover-aware connection class.
    from kombu import Connection

    from workers.app import app

    conn = Connection(
        celery_url(url, setting="REDIS_URL"),
        transport=SentinelTransport,
        transport_options=app.conf.broker_transport_options,
    )
    try:
        pool = conn.default_channel.pool
        assert pool.connection_kwargs.get("health_check_interval") == 10
        assert issubclass(pool.connection_class, FailoverConnection)
    finally:
        conn.release()

    began = time.monotonic()
    workers: list[WorkerProcess] = []
    try:
        run_id = f"sentinel-{how}-{uuid.uuid4().hex[:8]}"
        subs: list[Submission] = [
            make_sub(run_id, f"w{i:04d}", 1, KINDS[i % len(KINDS)]) for i in range(N)
        ]
        # All queued before a worker starts: the workers would otherwise finish a run this
        # size while it is still being submitted, before the failover.
        submitted = time.monotonic()
        handles = CritiqueClient(CONFIG).submit_many(subs)
        submit_s = time.monotonic() - submitted
        waiters = Waiters(handles, SLA_S).start()
        for name, pool_kind, conc in (("threads0", "threads", 4), ("prefork1", "prefork", 2)):
            workers.append(
                start_worker(
                    name,
                    env,
                    process=SentinelWorker,
                    pool=pool_kind,
                    concurrency=conc,
                    started=False,
                )
            )
        # Started side by side: started one after the other, the first ran the queue alone
        # for as long as the second took to start (on a loaded machine, most of the run).
        with ThreadPoolExecutor(len(workers)) as starting:
            for started in [starting.submit(w.start, 60.0) for w in workers]:
                started.result()
        pids = [w.proc.pid for w in workers if w.proc is not None]

        # Failed over as soon as a tenth of the run is stored, read closely and cheaply (a
        # count, nothing decoded: one task per output makes a run quick).
        ready = time.monotonic()
        stored = runtime.stores().runs.key(run_id, keys.PASS_RESULTS)
        at_failover = 0
        while at_failover < N // 10 and time.monotonic() - ready < 90:
            at_failover = int(runtime.client().hlen(stored))
            time.sleep(0.02)
        assert at_failover >= N // 10, f"only {at_failover} results before the failover"
        assert at_failover < N, "the run ended before the failover: nothing was tested"
        old_port = sentinels.master.port
        failed_over = time.monotonic()
        if how == "kill":
            sentinels.master.kill()
        else:
            sentinels.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", MASTER)

        # The first result after the failover: the first one read from the new master beyond
        # what the old one held when the failover began. The run may finish on the old master
        # before anyone sees the switch (``demote``: it stays writable until a Sentinel turns
        # it into a replica, up to ~10 s later, dropping what it took meanwhile): the results
        # count only once the failover has settled, read from the new master.
        promoted_s = first_s = None
        settled = False
        got: dict[str, CritiqueResult] = {}
        while time.monotonic() - submitted < SLA_S:
            now = time.monotonic()
            if promoted_s is None and sentinels.master_port() not in (None, old_port):
                promoted_s = now - failed_over
            if not settled and promoted_s is not None:
                settled = how == "kill" or _is_replica(sentinels.master)
            current = run_results(run_id)
            if current is not None:
                got = current
                if first_s is None and promoted_s is not None and len(got) > at_failover:
                    first_s = now - failed_over
                if len(got) >= N and settled:
                    break
            time.sleep(0.1)
        all_stored = time.monotonic()
        done_s = all_stored - submitted
        assert sentinels.master_port() in {r.port for r in sentinels.replicas}, "none promoted"
        waiters.join(SLA_S)
        assert not waiters.errors, (len(waiters.errors), waiters.errors[:5])
        for kind, verdicts in (("sync", waiters.sync), ("async", waiters.asynchronous)):
            assert len(verdicts) == N, f"{kind}: {len(verdicts)} of {N} waits returned"
            differ = [w for w, r in verdicts.items() if r.status != got[f"1:{w}"].status]
            assert not differ, (kind, differ[:5])
        assert waiters.sync_done is not None and waiters.async_done is not None
        sync_late_s = waiters.sync_done - all_stored
        async_late_s = waiters.async_done - all_stored
        assert sync_late_s <= 10 and async_late_s <= 10, (sync_late_s, async_late_s)
        if how == "kill":  # the killed master's clients saw it go: the waits rode an outage
            assert waiters.outages, "no wait met the failover: nothing was ridden out"

        assert len(got) == N, f"{N - len(got)} submissions have no result after {done_s:.0f} s"
        assert done_s <= SLA_S
        want, _ = reference(subs, CONFIG)
        wrong = {
            k: ((r.status, r.stop_reason), (want[k].status, want[k].stop_reason))
            for k, r in got.items()
            if (r.status, r.stop_reason) != (want[k].status, want[k].stop_reason)
        }
        assert not wrong, wrong
        assert "failed" not in Counter(r.status for r in got.values())

        # The same worker processes, consuming again after the failover.
        for w, pid in zip(workers, pids, strict=True):
            assert w.proc is not None and w.proc.poll() is None, f"{w.nodename} exited"
            assert w.proc.pid == pid
            log = w.log.read_text(errors="replace") if w.log else ""
            assert "transport:   workers.recovery.transport:SentinelTransport://" in log
            assert "Unrecoverable error" not in log
        # Consuming again, not only reconnected (celery #8030): each worker process runs tasks
        # of a second wave sent once the failover has settled.
        before = tasks_run(url, workers)
        wave = f"{run_id}-again"
        CritiqueClient(CONFIG).submit_many(
            [make_sub(wave, f"a{i:02d}", 1, KINDS[i % len(KINDS)]) for i in range(AGAIN)]
        )
        wait_until(lambda: len(run_results(wave) or {}) == AGAIN, 60, what="the second wave")
        after = tasks_run(url, workers)
        idle = {n: (before.get(n), after.get(n)) for n in after if after[n] <= before.get(n, 0)}
        assert len(after) == len(workers) and not idle, (before, after)

        # Nothing counted twice, nothing lost: as a run without a failover.
        patterns, ref = pattern_counts(run_id, subs)
        lost_counts = sum(ref.values()) - sum(patterns.values())
        assert patterns == ref, {k: (patterns.get(k), ref.get(k)) for k in {*ref, *patterns}}
        budget = runtime.stores().budget.snapshot(run_id)
        assert (budget.spent, budget.held, budget.overrun) == (0, 0, 0)  # token-free repairs
        events = list(CritiqueClient(CONFIG).trace(run_id))
        finals = Counter((e["iteration"], e["worker_id"]) for e in events if e["type"] == "result")
        assert len(finals) == N and set(finals.values()) == {1}
        counted = Counter(event_key(e) for e in events if e["type"] not in DEDUPE_SKIP)
        repeated = {k: n for k, n in counted.items() if n > 1}
        assert not repeated, repeated
        resumes = [e for e in events if e["type"] == "resume"]
        assert {e["by"] for e in resumes} <= {"sweeper"}
        assert RedisPendingIndex(runtime.client()).count(run_id) == 0

        # The operator's commands on the Sentinel URL, after the failover.
        capsys.readouterr()
        assert main(["status", run_id, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert (doc["submitted"], doc["finished"], doc["failed"]) == (N, N, [])
        assert main(["resume", run_id]) == 0
        assert "nothing pending" in capsys.readouterr().out
        print(
            f"\nSentinel {how}: {N} submissions (submit {submit_s:.1f} s); "
            f"promoted {promoted_s if promoted_s is None else round(promoted_s, 1)} s and the "
            f"first result {first_s if first_s is None else round(first_s, 1)} s after the "
            f"failover began; all results {done_s:.1f} s after the submit; "
            f"{len(resumes)} re-driven; {lost_counts} pattern counts lost; the sync waits done "
            f"{sync_late_s:+.1f} s and the async ones {async_late_s:+.1f} s after the last "
            f"result was stored, riding {len(waiters.outages)} outage(s); "
            f"test {time.monotonic() - began:.1f} s"
        )
    finally:
        for w in workers:
            w.stop()
