"""The fleet counters in the store (pipeline.store.metrics): buffered increments land in one
flush, the histogram reads back cumulative, and each key sits in its own cluster slot."""

from __future__ import annotations

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
