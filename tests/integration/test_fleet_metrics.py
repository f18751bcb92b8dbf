"""The fleet counters in the store (pipeline.store.metrics): buffered increments land in one
flush, the histogram reads back cumulative, each key sits in its own cluster slot, and the budget
gauges count the runs with a pass in flight."""

from __future__ import annotations

import time

import redis
from redis.crc import key_slot

from pipeline.store import keys
from pipeline.store.metrics import BUCKETS, FleetMetrics

PREFIX = "fleet-test"


def test_increments_land_at_flush_and_add_up_across_processes(
    redis_client: redis.Redis,
) -> None:
    """Two buffers (two workers) add to the same counters; nothing is sent before flush."""
    a, b = FleetMetrics(redis_client, prefix=PREFIX), FleetMetrics(redis_client, prefix=PREFIX)
    a.add("outputs:accepted")
    b.add("outputs:accepted", 2)
    a.add("tokens:repair", 0)
    assert a.read() == ({}, {})
    a.flush()
    b.flush()
    b.flush()  # nothing left to send: counted once
    counts, _ = a.read()
    assert counts == {"outputs:accepted": 3}


def test_the_stage_histogram_reads_back_cumulative(redis_client: redis.Redis) -> None:
    """Observations fall in the first bucket at or above them; +Inf holds the count."""
    m = FleetMetrics(redis_client, prefix=PREFIX)
    for seconds in (0.001, 0.004, 0.2, 7.0, 1000.0):
        m.observe("l0", seconds)
    m.observe("not-a-stage", 1.0)  # unbounded labels are dropped
    m.flush()
    _, durations = m.read()
    buckets, total = m.histogram(durations, "l0")
    got = dict(buckets)
    assert got[repr(BUCKETS[0])] == 2
    assert got["0.25"] == 3
    assert got["10.0"] == 4
    assert got["+Inf"] == 5
    assert abs(total - 1007.205) < 1e-6
    assert not any(k.startswith("not-a-stage") for k in durations)


def test_each_metrics_key_has_its_own_slot() -> None:
    """The two metrics keys hash to different slots (never in one script with run keys)."""
    slots = {key_slot(keys.shared_key(k, PREFIX).encode()) for k in keys.METRICS_KEYS}
    assert len(slots) == len(keys.METRICS_KEYS)


def test_active_runs_are_the_runs_with_a_pass_in_flight_not_a_recent_submit(
    redis_client: redis.Redis,
) -> None:
    """critique_budget_active_runs counts a run while it has a pending pass or a live repair
    lease, and stops counting it the moment its last pass settles (the sweeper's index keeps
    such a run a stall time longer); spent and cap sum over the counted runs only."""
    from pipeline.store.pending import RedisPendingIndex
    from pipeline.store.redis import RedisBudgetLedger

    pending = RedisPendingIndex(redis_client, prefix=PREFIX)
    budget = RedisBudgetLedger(redis_client, prefix=PREFIX)
    metrics = FleetMetrics(redis_client, prefix=PREFIX)
    now = time.time()
    for run_id in ("busy", "settled", "leasing"):
        pending.add(run_id, f"1:w1:{run_id}", now)
    assert budget.reserve("busy", "busy-l1", 100, 1000, ttl_s=600)
    budget.commit("busy", "busy-l1", 40)
    assert budget.reserve("settled", "settled-l1", 100, 500, ttl_s=600)
    budget.commit("settled", "settled-l1", 70)
    pending.drop("settled", "1:w1:settled")  # its result landed: nothing in flight
    pending.drop("leasing", "1:w1:leasing")
    assert budget.reserve("leasing", "leasing-l1", 10, 300, ttl_s=600)  # a repair holds tokens
    assert {r for r, _ in pending.runs()} == {"busy", "settled", "leasing"}  # all still indexed

    assert metrics.active_budgets() == (2, 40, 1300)
    budget.refund("leasing", "leasing-l1")
    assert metrics.active_budgets() == (1, 40, 1000)
    pending.drop("busy", "1:w1:busy")
    assert metrics.active_budgets() == (0, 0, 0)


def test_active_runs_read_past_the_newest_batch_of_settled_runs(redis_client: redis.Redis) -> None:
    """An in-flight run behind more settled runs than one batch of the index is still found,
    and ``limit`` caps the runs counted."""
    from pipeline.store import metrics as m
    from pipeline.store.pending import RedisPendingIndex

    pending = RedisPendingIndex(redis_client, prefix=PREFIX)
    now = time.time()
    pending.add("old-busy", "1:w1:a", now - 10)
    pending.add("old-busy-2", "1:w1:b", now - 9)
    for i in range(m.ACTIVE_BATCH + 5):
        pending.add(f"settled-{i}", "1:w1:x", now + i / 1000)
        pending.drop(f"settled-{i}", "1:w1:x")
    metrics = FleetMetrics(redis_client, prefix=PREFIX)
    assert metrics.active_budgets() == (2, 0, 0)
    assert metrics.active_budgets(limit=1) == (1, 0, 0)


def test_flush_soon_sends_at_most_every_interval_and_the_rest_within_it(
    redis_client: redis.Redis,
) -> None:
    """The first flush_soon sends at once; increments that follow within the interval wait
    for one timer (no round trip per task) and land within it; nothing is lost."""
    import time

    metrics = FleetMetrics(redis_client, prefix=PREFIX)
    metrics.add("outputs:accepted")
    metrics.flush_soon(0.5)
    assert metrics.read()[0].get("outputs:accepted") == 1
    for _ in range(5):
        metrics.add("outputs:accepted")
        metrics.flush_soon(0.5)
    assert metrics.read()[0].get("outputs:accepted") == 1  # buffered: not due yet
    deadline = time.monotonic() + 3
    while metrics.read()[0].get("outputs:accepted") != 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics.read()[0].get("outputs:accepted") == 6
    assert metrics._timer is None  # the one timer ran and is gone
