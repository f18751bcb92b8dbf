"""In-process store implementations for the broker-free runner and unit tests.

They follow the protocols of :mod:`pipeline.store.base` exactly, including idempotency and
lease expiry, so the same tests can run against them and against the Redis implementations.
"""

from __future__ import annotations

import heapq
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.models import Lesson, LessonScope, Pattern, ReusablePattern
from pipeline.store.base import (
    MAX_LESSONS,
    MAX_LESSONS_PER_RUN,
    MAX_PATTERNS_PER_CRITIQUE,
    MAX_PATTERNS_PER_RUN,
    WAITER_GRACE_S,
    BudgetAnswer,
    BudgetSnapshot,
    RepairUsage,
    encode_event,
    run_lesson,
)
from pipeline.store.blobs import BlobMissingError, blob_ref, parse_ref, verified
from pipeline.store.keys import lessons_scope, pattern_key
from pipeline.store.keys import lessons_ttl_s as lessons_ttl
from pipeline.store.leases import Beat, LeaseHolder


@dataclass
class _PatternRow:
    pattern: Pattern
    order: int


@dataclass
class _LessonRow:
    lesson: Lesson
    order: int  # first learned
    by: str  # the run that brought it (counted against its share, never shown)


class MemoryPatternStore:
    """Pattern memory in a dict, guarded by a lock, with the Redis store's rules: once per
    critique key, once per pass, at most :data:`MAX_PATTERNS_PER_RUN` patterns per run and
    lessons by ``lessons_scope`` (default ``$CRITIQUE_LESSONS_SCOPE``, read at each call): the
    run's own patterns, or fleet lessons, at most :data:`MAX_LESSONS` (least seen, then first
    recorded, evicted first; at most :data:`MAX_LESSONS_PER_RUN` brought by one run) that
    expire ``lessons_ttl_s`` after the last write (``clock`` in seconds)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        lessons_ttl_s: float | None = None,
        lessons_scope: LessonScope | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._lessons_scope = lessons_scope
        self._lessons_ttl_s = lessons_ttl_s if lessons_ttl_s is not None else lessons_ttl()
        if self._lessons_ttl_s <= 0:
            raise ValueError(f"lessons TTL must be positive, got {self._lessons_ttl_s!r}")
        self._rows: dict[str, dict[str, _PatternRow]] = {}
        self._seen: set[tuple[str, str]] = set()
        self._counted: set[tuple[str, str, str]] = set()
        self._learned: set[tuple[str, str]] = set()
        self._order = 0
        self._lessons: dict[str, _LessonRow] = {}
        self._held: dict[str, int] = {}  # run id -> fleet lessons it brought, still kept
        self._lesson_order = 0
        self._lessons_written = clock()

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
        fleet = (self._lessons_scope or lessons_scope()) == "fleet"
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
                if (run_id, key) not in self._learned:
                    self._learned.add((run_id, key))
                    if fleet:
                        self._learn(run_id, key, p)
            return True

    def top(self, run_id: str, limit: int = 10) -> list[Pattern]:
        if limit <= 0:
            return []
        with self._lock:
            rows = list(self._rows.get(run_id, {}).values())
        best = heapq.nsmallest(limit, rows, key=lambda r: (-r.pattern.frequency, r.order))
        return [r.pattern for r in best]

    def _expire_lessons(self) -> None:
        """Forget every lesson when none was written for the lessons TTL (lock held), as the
        Redis keys expire together."""
        if self._clock() - self._lessons_written >= self._lessons_ttl_s:
            self._lessons.clear()
            self._held.clear()

    def _learn(self, run_id: str, key: str, p: ReusablePattern) -> None:
        """A pattern's first occurrence in a run: one more run for its fleet lesson, or a new
        lesson while the run brought fewer than its share (lock held)."""
        self._expire_lessons()
        self._lessons_written = self._clock()
        got = self._lessons.get(key)
        if got is not None:
            got.lesson = got.lesson.model_copy(update={"runs": got.lesson.runs + 1})
            return
        if self._held.get(run_id, 0) >= MAX_LESSONS_PER_RUN:
            return
        while len(self._lessons) >= MAX_LESSONS:
            rows = self._lessons
            victim = min(rows, key=lambda k: (rows[k].lesson.runs, rows[k].order))
            by = rows.pop(victim).by
            self._held[by] -= 1
            if self._held[by] <= 0:
                del self._held[by]
        self._lesson_order += 1
        lesson = Lesson(
            category=p.category,
            runs=1,
            description=p.description,
            prevention_rule=p.prevention_rule,
            scope="fleet",
        )
        self._lessons[key] = _LessonRow(lesson, self._lesson_order, run_id)
        self._held[run_id] = self._held.get(run_id, 0) + 1

    def lessons(
        self, limit: int = 50, min_runs: int = 2, *, run_id: str | None = None
    ) -> list[Lesson]:
        if limit <= 0:
            return []
        if (self._lessons_scope or lessons_scope()) == "run":
            return [] if run_id is None else [run_lesson(p) for p in self.top(run_id, limit)]
        with self._lock:
            self._expire_lessons()
            own = set(self._rows.get(run_id, {})) if run_id is not None else set()
            rows = [(k, v) for k, v in self._lessons.items() if v.lesson.runs >= min_runs]
        best = heapq.nsmallest(limit, rows, key=lambda r: (-r[1].lesson.runs, r[1].order))
        return [v.lesson.model_copy(update={"this_run": k in own}) for k, v in best]


def _us(seconds: float) -> int:
    """Seconds as the script counts them: whole microseconds (truncated, as its caller sends
    them), so a boundary (a lease expiring at a tick, a wait running out) falls alike."""
    return int(seconds * 1_000_000)


@dataclass
class _Lease:
    tokens: int
    expires: int
    """When its TTL ends (µs); for a waiting lease, when it began to wait."""
    state: str = "live"
    """``live`` | ``committed`` | ``refunded`` | ``waiting``."""
    charge: int = 0
    holder: str = ""
    """The process that holds it ("" none: only its TTL ends it)."""
    until: int = 0
    """When a live lease stops holding (µs): its TTL, or sooner its holder's liveness deadline."""


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
    """The budget semaphore in memory, with the same lease rules as the Redis one
    (:class:`~pipeline.store.base.BudgetLedger`), holders and liveness included (``holder``:
    :class:`~pipeline.store.leases.LeaseHolder`; :meth:`with_holder` is another process on the
    same budget)."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, holder: LeaseHolder | None = None
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._holder = holder

    @property
    def holder(self) -> LeaseHolder | None:
        """Who holds the leases this ledger grants (None: no one; only TTLs apply)."""
        return self._holder

    def with_holder(self, holder: LeaseHolder | None) -> MemoryBudgetLedger:
        """This ledger's budget (the same runs, lock and clock) for another holder."""
        other = MemoryBudgetLedger(self._clock, holder=holder)
        other._lock, other._runs = self._lock, self._runs
        return other

    def _now(self) -> int:
        return _us(self._clock())

    def _until(self, expires: int, now: int) -> int:
        if self._holder is None:
            return expires
        return min(expires, now + _us(self._holder.dead_s))

    @staticmethod
    def _live(run: _Run, now: int) -> list[_Lease]:
        return [le for le in run.leases.values() if le.state == "live" and le.until > now]

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
                if lease.state == "live" and lease.until > now:
                    if self._holder is not None:  # whoever asks for a live lease holds it
                        lease.holder = self._holder.id
                        lease.until = self._until(lease.expires, now)
                        self._holder.hold(self, run_id, lease_id)
                    return BudgetAnswer("granted", BudgetSnapshot())
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
            holder = self._holder.id if self._holder is not None else ""
            if run.overrun == 0 and run.spent + held + queued + tokens <= cap:
                expires = now + _us(ttl_s)
                run.leases[lease_id] = _Lease(
                    tokens=tokens, expires=expires, holder=holder, until=self._until(expires, now)
                )
                run.waiting.pop(lease_id, None)
                if self._holder is not None:
                    self._holder.hold(self, run_id, lease_id)
                return BudgetAnswer("granted", snap, waited)
            if (
                run.overrun == 0
                and run.spent + tokens <= cap
                and now - since < _us(max(0.0, wait_s))
            ):
                run.leases[lease_id] = _Lease(
                    tokens=tokens, expires=since, state="waiting", holder=holder
                )
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
        if self._holder is not None:
            self._holder.drop(self, run_id, lease_id)
        return charge

    def refund(self, run_id: str, lease_id: str) -> None:
        with self._lock:
            run = self._runs.setdefault(run_id, _Run())
            lease = run.leases.get(lease_id)
            if lease is not None and lease.state == "live":
                lease.state = "refunded"
        if self._holder is not None:
            self._holder.drop(self, run_id, lease_id)

    def beat(self, run_id: str, lease_ids: Sequence[str]) -> dict[str, Beat]:
        """As :meth:`RedisBudgetLedger.beat`: move this holder's live leases' deadlines on."""
        if self._holder is None:
            return dict.fromkeys(lease_ids, "gone")
        out: dict[str, Beat] = {}
        with self._lock:
            now = self._now()
            run = self._runs.get(run_id, _Run())
            for lease_id in lease_ids:
                lease = run.leases.get(lease_id)
                if lease is None or lease.state != "live" or lease.holder != self._holder.id:
                    out[lease_id] = "gone"
                elif lease.until > now:
                    lease.until = self._until(lease.expires, now)
                    out[lease_id] = "kept"
                else:
                    out[lease_id] = "lapsed"
        return out

    def park(self, run_id: str, lease_id: str) -> bool:
        """As :meth:`RedisBudgetLedger.park`: a live lease held by no process (TTL only)."""
        with self._lock:
            now = self._now()
            lease = self._runs.get(run_id, _Run()).leases.get(lease_id)
            parked = lease is not None and lease.state == "live" and lease.until > now
            if lease is not None and parked:
                lease.holder = ""
                lease.until = lease.expires
        if self._holder is not None:
            self._holder.drop(self, run_id, lease_id)
        return parked

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

    def holds(self, run_id: str) -> dict[str, int]:
        """Live leases and the tokens each holds (as :meth:`RedisBudgetLedger.holds`)."""
        with self._lock:
            run = self._runs.get(run_id, _Run())
            now = self._now()
            return {
                lid: le.tokens
                for lid, le in run.leases.items()
                if le.state == "live" and le.until > now
            }

    def holders(self, run_id: str) -> dict[str, str]:
        """Live leases and the holder of each (as :meth:`RedisBudgetLedger.holders`)."""
        with self._lock:
            run = self._runs.get(run_id, _Run())
            now = self._now()
            return {
                lid: le.holder
                for lid, le in run.leases.items()
                if le.state == "live" and le.until > now
            }


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


class MemoryBlobStore:
    """Content-addressed blobs in a dict; same references and errors as the Redis store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blobs: dict[str, bytes] = {}

    def put(self, data: bytes, *, live: bool = False) -> str:
        ref = blob_ref(data)
        with self._lock:
            self._blobs.setdefault(ref, bytes(data))
        return ref

    def get(self, ref: str) -> bytes:
        parse_ref(ref)
        with self._lock:
            data = self._blobs.get(ref)
        if data is None:
            raise BlobMissingError(ref)
        return verified(ref, data)


class MemoryCritiqueCache:
    """In-process :class:`~pipeline.store.base.CritiqueCache` (tests, the broker-free loop)."""

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
            self._items[key] = (envelope_json, self._clock() + ttl_s)

    def claim(self, key: str, ttl_s: float) -> bool:
        with self._lock:
            now = self._clock()
            if self._claims.get(key, 0.0) > now:
                return False
            self._claims[key] = now + ttl_s
            return True

    def release(self, key: str) -> None:
        with self._lock:
            self._claims.pop(key, None)
