"""In-process stores for the broker-free ``critique loop`` and the unit tests of its stages.

Each rule here has one source, the Redis store's (:mod:`pipeline.store.redis`: its Lua
scripts are the product's rule); these stores implement only the operations the broker-free
loop calls, each the same way. ``tests/integration/test_store_protocols.py`` runs the same
cases, and the same random programs, against both, so they cannot drift. What only the
distributed runtime uses is in the Redis stores alone: fleet lessons, lease holders and their
beats, blobs, the run and pending stores.
"""

from __future__ import annotations

import heapq
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.models import Pattern, ReusablePattern
from pipeline.store.base import (
    MAX_PATTERNS_PER_CRITIQUE,
    MAX_PATTERNS_PER_RUN,
    WAITER_GRACE_S,
    BudgetAnswer,
    BudgetSnapshot,
    RepairUsage,
    encode_event,
)
from pipeline.store.keys import pattern_key
from pipeline.store.leases import LeaseHolder


@dataclass
class _PatternRow:
    pattern: Pattern
    order: int


class MemoryPatternStore:
    """Pattern memory in a dict, guarded by a lock: the record and top rules of
    :class:`~pipeline.store.redis.RedisPatternStore` (once per critique key, once per pass, at
    most :data:`MAX_PATTERNS_PER_RUN` patterns per run, the least seen and then first recorded
    evicted first). No lessons: nothing broker-free reads them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, dict[str, _PatternRow]] = {}
        self._seen: set[tuple[str, str]] = set()
        self._counted: set[tuple[str, str, str]] = set()
        self._order = 0

    def record(
        self,
        run_id: str,
        critique_key: str,
        iteration: int,
        patterns: Sequence[ReusablePattern],
        pass_key: str = "",
    ) -> bool:
        if iteration < 1:
            raise ValueError(f"iteration must be ≥ 1, got {iteration}")
        counted_as = pass_key or critique_key
        with self._lock:
            if (run_id, critique_key) in self._seen:
                return False
            self._seen.add((run_id, critique_key))
            rows = self._rows.setdefault(run_id, {})
            first: dict[str, ReusablePattern] = {}
            for p in patterns:
                if len(first) >= MAX_PATTERNS_PER_CRITIQUE:
                    break
                first.setdefault(pattern_key(p.category, p.prevention_rule), p)
            for key, p in first.items():
                if (run_id, counted_as, key) in self._counted:
                    continue
                self._counted.add((run_id, counted_as, key))
                row = rows.get(key)
                if row is not None:
                    old = row.pattern
                    row.pattern = old.model_copy(
                        update={
                            "frequency": old.frequency + 1,
                            "first_seen_iteration": min(old.first_seen_iteration, iteration),
                            "last_seen_iteration": max(old.last_seen_iteration, iteration),
                        }
                    )
                    continue
                while len(rows) >= MAX_PATTERNS_PER_RUN:
                    victim = min(rows, key=lambda k: (rows[k].pattern.frequency, rows[k].order))
                    del rows[victim]
                self._order += 1
                rows[key] = _PatternRow(
                    Pattern(
                        category=p.category,
                        frequency=1,
                        description=p.description,
                        prevention_rule=p.prevention_rule,
                        first_seen_iteration=iteration,
                        last_seen_iteration=iteration,
                    ),
                    self._order,
                )
            return True

    def top(self, run_id: str, limit: int = 10) -> list[Pattern]:
        if limit <= 0:
            return []
        with self._lock:
            rows = list(self._rows.get(run_id, {}).values())
        best = heapq.nsmallest(limit, rows, key=lambda r: (-r.pattern.frequency, r.order))
        return [r.pattern for r in best]


def _us(seconds: float) -> int:
    """Seconds as the budget script counts them: whole microseconds (truncated, as
    :class:`~pipeline.store.redis.RedisBudgetLedger` sends them), so a boundary (a lease
    expiring at a tick, a wait running out) falls the same way in both."""
    return int(seconds * 1_000_000)


@dataclass
class _Lease:
    tokens: int
    expires: int
    """When its TTL ends (µs); for a waiting lease, when it began to wait."""
    state: str = "live"
    """``live`` | ``committed`` | ``refunded`` | ``waiting``."""
    charge: int = 0


@dataclass
class _Run:
    spent: int = 0
    overrun: int = 0
    leases: dict[str, _Lease] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    """Waiting lease id -> when it stops counting as queued (µs: its last ask + the grace)."""
    usage: RepairUsage = field(default_factory=RepairUsage)
    """What the run's committed rounds used (``spent`` left 0 here: :attr:`spent` is it)."""


class MemoryBudgetLedger:
    """The budget semaphore in memory: the lease rules of the Redis ledger's script
    (:class:`~pipeline.store.base.BudgetLedger`) for a ledger without a holder (one process:
    a lease ends at its TTL). Holders, beats and cancels' bulk refunds are the distributed
    runtime's, in :class:`~pipeline.store.redis.RedisBudgetLedger` only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}

    @property
    def holder(self) -> LeaseHolder | None:
        """None: no process holds a lease here; only TTLs end them."""
        return None

    def _now(self) -> int:
        return _us(self._clock())

    @staticmethod
    def _live(run: _Run, now: int) -> list[_Lease]:
        return [le for le in run.leases.values() if le.state == "live" and le.expires > now]

    def reserve(self, run_id: str, lease_id: str, tokens: int, cap: int, ttl_s: float) -> bool:
        return self.ask(run_id, lease_id, tokens, cap, ttl_s).granted

    def try_reserve(
        self, run_id: str, lease_id: str, tokens: int, cap: int, ttl_s: float
    ) -> BudgetSnapshot | None:
        answer = self.ask(run_id, lease_id, tokens, cap, ttl_s)
        return None if answer.granted else answer.budget

    def ask(
        self, run_id: str, lease_id: str, tokens: int, cap: int, ttl_s: float, wait_s: float = 0.0
    ) -> BudgetAnswer:
        if tokens < 0:
            raise ValueError(f"cannot reserve a negative number of tokens ({tokens})")
        with self._lock:
            now = self._now()
            run = self._runs.setdefault(run_id, _Run())
            lease = run.leases.get(lease_id)
            since = now
            if lease is not None:
                if lease.state == "committed":
                    return BudgetAnswer("granted", BudgetSnapshot())  # settled: nothing anew
                if lease.state == "live" and lease.expires > now:
                    return BudgetAnswer("granted", BudgetSnapshot())  # the same lease back
                if lease.state == "waiting":
                    since = lease.expires
                # Refunded, or expired unsettled (its holder died): reserve afresh.
            run.waiting = {k: v for k, v in run.waiting.items() if v > now}
            live = self._live(run, now)
            held = sum(le.tokens for le in live)
            ahead = [
                run.leases[k]
                for k in run.waiting
                if k != lease_id and (run.leases[k].expires, k) < (since, lease_id)
            ]
            queued = sum(le.tokens for le in ahead)
            snap = BudgetSnapshot(
                spent=run.spent,
                held=held,
                holders=len(live),
                overrun=run.overrun,
                queued=queued,
                waiters=len(ahead),
            )
            waited = (now - since) / 1_000_000
            if run.overrun == 0 and run.spent + held + queued + tokens <= cap:
                run.leases[lease_id] = _Lease(tokens=tokens, expires=now + _us(ttl_s))
                run.waiting.pop(lease_id, None)
                return BudgetAnswer("granted", snap, waited)
            fits = run.overrun == 0 and run.spent + tokens <= cap
            if fits and now - since < _us(max(0.0, wait_s)):
                run.leases[lease_id] = _Lease(tokens=tokens, expires=since, state="waiting")
                run.waiting[lease_id] = now + _us(WAITER_GRACE_S)
                return BudgetAnswer("wait", snap, waited)
            run.waiting.pop(lease_id, None)
            return BudgetAnswer("refused", snap, waited)

    def commit(
        self,
        run_id: str,
        lease_id: str,
        actual_tokens: int,
        *,
        outside: int = 0,
        usage: RepairUsage | None = None,
    ) -> int:
        with self._lock:
            run = self._runs.setdefault(run_id, _Run())
            lease = run.leases.get(lease_id)
            if lease is None or lease.state == "waiting":
                return 0
            if lease.state == "committed":
                return lease.charge
            charge = max(int(actual_tokens), 0)
            lease.state = "committed"
            lease.charge = charge
            run.spent += charge
            run.overrun += max(0, charge - min(max(int(outside), 0), charge) - lease.tokens)
            if usage is not None and (usage.growth > 0 or usage.reply > 0):
                seen = run.usage
                run.usage = RepairUsage(
                    rounds=seen.rounds + 1,
                    growth=max(seen.growth, usage.growth),
                    reply=max(seen.reply, usage.reply),
                )
        return charge

    def refund(self, run_id: str, lease_id: str) -> None:
        with self._lock:
            run = self._runs.setdefault(run_id, _Run())
            lease = run.leases.get(lease_id)
            if lease is not None and lease.state == "live":
                lease.state = "refunded"

    def park(self, run_id: str, lease_id: str) -> bool:
        """Whether the lease is live (no process holds it here: it already lives to its TTL)."""
        with self._lock:
            lease = self._runs.get(run_id, _Run()).leases.get(lease_id)
            return lease is not None and lease.state == "live" and lease.expires > self._now()

    def spent(self, run_id: str) -> int:
        with self._lock:
            return self._runs.get(run_id, _Run()).spent

    def snapshot(self, run_id: str) -> BudgetSnapshot:
        with self._lock:
            run = self._runs.get(run_id, _Run())
            live = self._live(run, self._now())
            return BudgetSnapshot(
                spent=run.spent,
                held=sum(le.tokens for le in live),
                holders=len(live),
                overrun=run.overrun,
            )

    def usage(self, run_id: str) -> RepairUsage:
        with self._lock:
            run = self._runs.get(run_id, _Run())
            return RepairUsage(
                rounds=run.usage.rounds,
                growth=run.usage.growth,
                reply=run.usage.reply,
                spent=run.spent,
            )


class MemoryTraceSink:
    """The trace as a list per run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, list[str]] = {}

    def emit(self, run_id: str, event: Mapping[str, Any]) -> None:
        with self._lock:
            # A JSON round trip: the stored event is a snapshot and non-JSON values are refused,
            # exactly as the Redis stream behaves.
            self._events.setdefault(run_id, []).append(encode_event(event))

    def read(self, run_id: str) -> list[dict[str, Any]]:
        with self._lock:
            encoded = list(self._events.get(run_id, []))
        return [json.loads(e) for e in encoded]


class BufferedTraceSink:
    """Holds one stage's trace events until the stage's output is recorded.

    A distributed stage writes its events together with its recorded output, in one atomic
    step, so a stage that a redelivery runs again (or replays) never writes its events twice.
    ``payloads`` holds each run's events in the stored encoding (compact JSON).
    """

    def __init__(self) -> None:
        self.payloads: dict[str, list[str]] = {}

    def emit(self, run_id: str, event: Mapping[str, Any]) -> None:
        self.payloads.setdefault(run_id, []).append(encode_event(event))

    def read(self, run_id: str) -> list[dict[str, Any]]:
        return [json.loads(p) for p in self.payloads.get(run_id, [])]


def _ttl(seconds: float) -> float:
    """A cache TTL as Redis keeps it (``PX``): whole milliseconds, at least one."""
    return max(1, int(seconds * 1000)) / 1000


class MemoryCritiqueCache:
    """In-process :class:`~pipeline.store.base.CritiqueCache` (the broker-free loop): the
    entry and claim rules of :class:`~pipeline.store.critique_entries.RedisCritiqueCache`
    (SET NX PX), unsigned (no secrets broker-free)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._items: dict[str, tuple[str, float]] = {}
        self._claims: dict[str, float] = {}

    def get(self, key: str) -> str | None:
        with self._lock:
            item = self._items.get(key)
            if item is None or item[1] <= self._clock():
                return None
            return item[0]

    def put(self, key: str, envelope_json: str, ttl_s: float) -> None:
        with self._lock:
            self._items[key] = (envelope_json, self._clock() + _ttl(ttl_s))

    def claim(self, key: str, ttl_s: float) -> bool:
        with self._lock:
            now = self._clock()
            if self._claims.get(key, 0.0) > now:
                return False
            self._claims[key] = now + _ttl(ttl_s)
            return True

    def release(self, key: str) -> None:
        with self._lock:
            self._claims.pop(key, None)
