"""The pending index, its claims and the queue-drain probes on a real Redis (a private server),
and the stall rule built on them (``workers.recovery.redriving.is_stalled``)."""

from __future__ import annotations

import redis

from pipeline.models import CritiqueResult
from pipeline.store import keys
from pipeline.store.pending import RedisPendingIndex
from pipeline.store.runs import RedisRunStore
from tests.support.servers import RedisServer
from tests.support.submissions import accepted_result

RUN = "run1"
PASS = "1:w1:sid1"
Q = keys.QUEUE_CPU


def _stores(server: RedisServer) -> tuple[RedisRunStore, RedisPendingIndex]:
    r = redis.Redis.from_url(server.url(0))
    return RedisRunStore(r), RedisPendingIndex(r)


def _result() -> CritiqueResult:
    return accepted_result(RUN)


def test_a_pass_is_pending_from_submit_to_result_and_steps_are_its_progress(
    redis_server: RedisServer,
) -> None:
    """add indexes the pass and its run; a first step record moves its last progress to now (a
    replayed one does not; another pass's step touches nothing); put_result with the pass id
    removes it."""
    runs, pending = _stores(redis_server)
    pending.add(RUN, PASS, 100.0)
    assert pending.runs() == [(RUN, 100.0)]
    assert pending.stale(RUN, 150.0, 10) == [(PASS, 100.0)]
    runs.record_step(RUN, "1:w1:sid1:1:0:l0", "{}")
    moved = pending.last_progress(RUN, PASS)
    assert moved is not None and moved > 1_000_000_000
    pending.touch(RUN, PASS, 200.0)
    runs.record_step(RUN, "1:w1:sid1:1:0:l0", "{}")  # a replay is no progress
    runs.record_step(RUN, "1:w2:other:1:0:l0", "{}")  # another pass: not indexed, not added
    assert pending.last_progress(RUN, PASS) == 200.0
    assert pending.count(RUN) == 1
    runs.put_result(_result(), pass_id="sid1")
    assert pending.last_progress(RUN, PASS) is None
    assert runs.result(RUN, 1, "w1") is not None


def test_a_claim_is_atomic_counted_and_bounded(redis_server: RedisServer) -> None:
    """A claim succeeds only while the pass has made no progress since the time the claimer
    saw, moves its progress to now (the next claim waits a stall time), and after the maximum
    number of claims the pass is dropped (0)."""
    _, pending = _stores(redis_server)
    pending.add(RUN, PASS, 100.0)
    assert pending.claim(RUN, PASS, 100.0, 110.0, 2) == 1
    assert pending.claim(RUN, PASS, 100.0, 111.0, 2) == -1  # someone claimed it: progress
    assert pending.claim(RUN, PASS, 110.0, 120.0, 2) == 2
    assert pending.claim(RUN, PASS, 120.0, 130.0, 2) == 0
    assert pending.last_progress(RUN, PASS) is None
    assert pending.claim(RUN, PASS, 130.0, 140.0, 2) == -1


def test_a_run_leaves_the_run_index_only_if_nobody_added_to_it_since(
    redis_server: RedisServer,
) -> None:
    """prune_run compares the run's index score: a submit in between keeps the run indexed."""
    _, pending = _stores(redis_server)
    pending.add(RUN, PASS, 100.0)
    pending.add(RUN, "1:w2:sid2", 105.0)
    assert not pending.prune_run(RUN, 100.0)
    assert pending.prune_run(RUN, 105.0)
    assert pending.runs() == []


def test_probes_one_outstanding_per_queue_and_the_drain_history(
    redis_server: RedisServer,
) -> None:
    """A probe is due when none is outstanding and the last was sent an interval ago, or the
    outstanding one is older than the resend time; a probe run records that the queue was
    drained past its sent time, and drained_after finds the earliest such probe."""
    from workers.recovery.redriving import DrainView

    _, pending = _stores(redis_server)
    assert not pending.probed(Q)
    assert pending.probe_due(Q, 100.0, 5, 15)
    assert pending.probed(Q)
    assert not pending.probe_due(Q, 104.0, 5, 15)  # outstanding
    assert not pending.probe_due(Q, 110.0, 5, 15)  # outstanding, not yet presumed lost
    assert pending.probe_due(Q, 116.0, 5, 15)  # presumed lost: another
    pending.probe_done(Q, 116.0, 117.0)
    assert not pending.probe_due(Q, 119.0, 5, 15)  # none outstanding, sent 3 s ago
    assert pending.probe_due(Q, 121.0, 5, 15)
    pending.probe_done(Q, 121.0, 140.0)
    assert pending.drained(Q) == [(116.0, 117.0), (121.0, 140.0)]
    view = DrainView(pending)
    assert view.drained_after(Q, 90.0) == 117.0
    assert view.drained_after(Q, 116.0) == 140.0
    assert view.drained_after(Q, 121.0) is None


def test_the_sweep_lock_has_one_holder(redis_server: RedisServer) -> None:
    """One sweeper at a time: the lock is taken once until it expires."""
    _, pending = _stores(redis_server)
    assert pending.try_lock("a", 30)
    assert not pending.try_lock("b", 30)


def test_stalled_means_old_and_drained_past_long_enough_ago(redis_server: RedisServer) -> None:
    """is_stalled: younger than the stall time never; with probes on the queue, only once a
    probe sent after the last progress ran at least a stall time ago (a queue not yet drained
    past it is a backlog, not a stall); with no probes at all, age alone."""
    from workers.recovery.redriving import DrainView, is_stalled

    _, pending = _stores(redis_server)
    assert not is_stalled(DrainView(pending), Q, 100.0, 102.0, 3.0)
    assert is_stalled(DrainView(pending), Q, 100.0, 104.0, 3.0)  # no probes: age alone
    pending.probe_due(Q, 99.0, 1, 3)
    pending.probe_done(Q, 99.0, 99.5)
    # not drained past 100 yet: a backlog, not a stall
    assert not is_stalled(DrainView(pending), Q, 100.0, 200.0, 3.0)
    pending.probe_due(Q, 150.0, 1, 3)
    pending.probe_done(Q, 150.0, 198.0)
    view = DrainView(pending)
    assert pending.drained(Q) == [(99.0, 99.5), (150.0, 198.0)]
    assert not is_stalled(view, Q, 100.0, 200.0, 3.0)  # drained 2 s ago: it may still run
    assert is_stalled(view, Q, 100.0, 201.0, 3.0)
