"""Fleet-wide product metrics in the store, for ``critique exporter`` (docs/operations.md).

Every worker adds to the same two Redis hashes, so one exporter serves the whole fleet however
many workers run:

* ``<prefix>:metrics:{counters}``: ``outputs:<status>``, ``tokens:critique``,
  ``tokens:repair``, ``budget_charged``, ``cache_hits``, ``cache_refused``, ``redrives``,
  ``refused:<reason>``;
* ``<prefix>:metrics:{durations}``: per stage, ``<stage>:b<i>`` (observations in bucket ``i`` of
  :data:`BUCKETS`, the last one ``+Inf``; not cumulative) and ``<stage>:sum`` (seconds).

Each key has a hash tag of its own (its own Redis Cluster slot) and is never written inside a
run's script: a process buffers its increments (:class:`FleetMetrics`) and sends them in one
pipelined round trip (``HINCRBY``/``HINCRBYFLOAT``) when told to flush (a worker: once per task).
Labels are bounded: statuses, stages and refusal reasons come from fixed lists, never from an
output. The counters are best effort (a process killed before its flush loses its last
increments); the results in the store stay the truth.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
import typing
from collections import Counter
from typing import Any

import redis

from pipeline.errors import ConfigError, ForgedMessageError, RefusedOverrideError, SubmissionError
from pipeline.models import Status
from pipeline.store import keys
from pipeline.store.redis_common import StoreClient, resolve_prefix, text

log = logging.getLogger(__name__)

BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
"""Upper bounds (seconds) of the stage-duration histogram's buckets, ``+Inf`` after them."""
STAGES = ("submit", "l0", "critic", "decide", "repair", "gate")
"""The stages timed (``submit``: the entry task's own work, before its first stage)."""
STATUSES: tuple[str, ...] = typing.get_args(Status)
"""Result statuses, derived from :data:`pipeline.models.Status` so the labels never drift
(``unchecked`` and ``cancelled`` included)."""
PHASES = ("critique", "repair")
"""Token phases: critique (first critique and pass-through), repair (repairs, re-critiques)."""
REFUSALS = ("forged", "override", "malformed", "config", "other")
"""Why a message was refused (:func:`refusal_reason`)."""
ACTIVE_BATCH = 1000
"""Runs of the sweeper's index read per round trip by :meth:`FleetMetrics.active_budgets`."""


def refusal_reason(exc: BaseException) -> str:
    """The bounded label of a refusal: ``forged`` (signature or address), ``override`` (a
    worker-only field or a limit), ``malformed`` (input), ``config``, else ``other``."""
    if isinstance(exc, ForgedMessageError):
        return "forged"
    if isinstance(exc, RefusedOverrideError):
        return "override"
    if isinstance(exc, SubmissionError):
        return "malformed"
    if isinstance(exc, ConfigError):
        return "config"
    return "other"


class FleetMetrics:
    """A process's buffer of fleet-metric increments, and the reader the exporter uses."""

    def __init__(self, client: StoreClient, *, prefix: str | None = None) -> None:
        self._r = client
        self._prefix = resolve_prefix(prefix)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._durations: Counter[str] = Counter()
        self._sums: dict[str, float] = {}
        self._flushed_at = -math.inf
        self._timer: threading.Timer | None = None

    @property
    def counters_key(self) -> str:
        return keys.shared_key(keys.METRICS_COUNTERS, self._prefix)

    @property
    def durations_key(self) -> str:
        return keys.shared_key(keys.METRICS_DURATIONS, self._prefix)

    def add(self, field: str, n: int = 1) -> None:
        """Count ``n`` more of ``field`` (sent at the next :meth:`flush`)."""
        if n:
            with self._lock:
                self._counts[field] += int(n)

    def observe(self, stage: str, seconds: float) -> None:
        """One run of ``stage`` took ``seconds`` (sent at the next :meth:`flush`)."""
        if stage not in STAGES:
            return
        i = bisect.bisect_left(BUCKETS, seconds)
        with self._lock:
            self._durations[f"{stage}:b{i}"] += 1
            field = f"{stage}:sum"
            self._sums[field] = self._sums.get(field, 0.0) + max(0.0, seconds)

    def flush_soon(self, every_s: float) -> None:
        """:meth:`flush` now if the last flush is ``every_s`` old, else within ``every_s`` (one
        timer thread, at most, waits to send what is buffered): a busy process sends its
        increments a few times a second, not once per task. What a process killed meanwhile
        held is lost (at most ``every_s`` of increments)."""
        now = time.monotonic()
        with self._lock:
            if not (self._counts or self._durations):
                return
            due = now - self._flushed_at >= every_s
            if not due:
                if self._timer is None:
                    self._timer = threading.Timer(every_s, self._flush_later)
                    self._timer.daemon = True
                    self._timer.start()
                return
        self.flush()

    def _flush_later(self) -> None:
        with self._lock:
            self._timer = None
        self.flush()

    def flush(self) -> None:
        """Send what was buffered in one pipelined round trip; on a Redis error keep it for the
        next flush (never raises: metrics never fail a stage)."""
        with self._lock:
            self._flushed_at = time.monotonic()
            counts, durations, sums = self._counts, self._durations, self._sums
            if not (counts or durations):
                return
            self._counts, self._durations, self._sums = Counter(), Counter(), {}
        try:
            pipe = self._r.pipeline(transaction=False)
            for field, n in counts.items():
                pipe.hincrby(self.counters_key, field, n)
            for field, n in durations.items():
                pipe.hincrby(self.durations_key, field, n)
            for field, total in sums.items():
                pipe.hincrbyfloat(self.durations_key, field, total)
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("could not send the fleet metrics (kept for the next flush): %s", exc)
            with self._lock:
                self._counts.update(counts)
                self._durations.update(durations)
                for field, total in sums.items():
                    self._sums[field] = self._sums.get(field, 0.0) + total

    def read(self) -> tuple[dict[str, int], dict[str, float]]:
        """The fleet's counters and stage-duration fields, as stored."""
        pipe = self._r.pipeline(transaction=False)
        pipe.hgetall(self.counters_key)
        pipe.hgetall(self.durations_key)
        raw_counts, raw_durations = pipe.execute()
        counts = {text(k): int(text(v)) for k, v in raw_counts.items()}
        durations = {text(k): float(text(v)) for k, v in raw_durations.items()}
        return counts, durations

    def histogram(self, durations: dict[str, float], stage: str) -> tuple[list[Any], float]:
        """``([(le, cumulative count)…, ("+Inf", count)], sum)`` of one stage."""
        out: list[Any] = []
        total = 0
        for i, bound in enumerate((*BUCKETS, float("inf"))):
            total += int(durations.get(f"{stage}:b{i}", 0))
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out, float(durations.get(f"{stage}:sum", 0.0))

    def active_budgets(self, limit: int = 1000, scan: int = 10_000) -> tuple[int, int, int]:
        """``(runs, spent, cap)`` over the runs with a pass in flight: a pending pass (submitted,
        no result yet) or a live repair-budget lease, the newest ``limit`` of them among the
        newest ``scan`` runs of the sweeper's index. A run whose last pass settled counts no
        more at once (the index itself keeps it until a sweep prunes it, a stall time later).
        Spent is the repair tokens charged, cap the budget cap the run reserved against (0 for
        a run that reserved nothing). Bounded: a fleet total, never per run."""
        index = keys.shared_key(keys.PENDING_RUNS, self._prefix)
        runs = spent = cap = 0
        for start in range(0, scan, ACTIVE_BATCH):
            rows: Any = self._r.zrevrange(index, start, start + ACTIVE_BATCH - 1)
            for got in self._in_flight([text(r) for r in rows]):
                if runs < limit:
                    runs += 1
                    spent += int(text(got[0] or b"0"))
                    cap += int(text(got[1] or b"0"))
            if len(rows) < ACTIVE_BATCH or runs >= limit:
                break
        return runs, spent, cap

    def _in_flight(self, run_ids: list[str]) -> list[Any]:
        """``[spent, cap]`` (the budget hash's fields) of each of ``run_ids`` that has a pending
        pass or an unexpired live lease (on the Redis server's clock, as the ledger's)."""
        if not run_ids:
            return []
        seconds, micros = self._r.time()
        now_us = int(seconds) * 1_000_000 + int(micros)
        pipe = self._r.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.zcard(keys.run_key(run_id, keys.PENDING, self._prefix))
            pipe.zcount(keys.run_key(run_id, keys.BUDGET_LIVE, self._prefix), f"({now_us}", "+inf")
            pipe.hmget(keys.run_key(run_id, keys.BUDGET, self._prefix), "spent", "cap")
        got = pipe.execute()
        rows = zip(got[0::3], got[1::3], got[2::3], strict=True)
        return [budget for pending, live, budget in rows if int(pending) or int(live)]
