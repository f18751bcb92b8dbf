"""The store contract: one suite for every stateful rule that has an in-memory version.

Each rule's one source is the Redis store (``pipeline.store.redis``, its Lua scripts;
``pipeline.store.critique_entries``); ``pipeline.store.memory`` implements the operations the
broker-free ``critique loop`` calls, the same way. Every case of the pattern memory (record, top),
the budget ledger without holders (ask, commit, refund, park, usage), the trace and the critique
cache runs against both, and the same random programs run on both with every answer compared,
so the two cannot drift. What the distributed runtime alone uses runs against Redis only, here
(lessons, run and fleet scope; blobs) and in test_lease_liveness.py / test_lease_handover.py
(lease holders and beats).
"""

from __future__ import annotations

import random
import threading

import pytest
import redis

from pipeline import settings
from pipeline.errors import PermanentError
from pipeline.models import ReusablePattern
from pipeline.store.base import (
    MAX_LESSONS,
    MAX_LESSONS_PER_RUN,
    MAX_PATTERNS_PER_RUN,
    WAITER_GRACE_S,
    BudgetLedger,
    BudgetSnapshot,
    CritiqueCache,
    PatternStore,
    RepairUsage,
    TraceSink,
)
from pipeline.store.blobs import BlobCorruptError, BlobMissingError, RedisBlobStore, blob_ref
from pipeline.store.critique_entries import RedisCritiqueCache
from pipeline.store.memory import (
    MemoryBudgetLedger,
    MemoryCritiqueCache,
    MemoryPatternStore,
    MemoryTraceSink,
)
from pipeline.store.redis import RedisBudgetLedger, RedisPatternStore, RedisTraceSink
from tests.support import wait_until
from tests.support.stores import PREFIX, FakeClock

pytestmark = pytest.mark.integration

IMPLS = ["memory", "redis"]
TTL_S = 3600
CAP = 100


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=IMPLS)
def patterns(request: pytest.FixtureRequest) -> PatternStore:
    if request.param == "memory":
        return MemoryPatternStore()
    return RedisPatternStore(request.getfixturevalue("redis_client"), prefix=PREFIX, ttl_s=TTL_S)


@pytest.fixture
def fleet_patterns(redis_client: redis.Redis) -> RedisPatternStore:
    """A pattern store whose lessons are the fleet's (CRITIQUE_LESSONS_SCOPE=fleet): Redis
    only (lessons have one implementation)."""
    return RedisPatternStore(redis_client, prefix=PREFIX, ttl_s=TTL_S, lessons_scope="fleet")


@pytest.fixture
def run_patterns(redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> RedisPatternStore:
    """A pattern store with the default lessons scope (CRITIQUE_LESSONS_SCOPE unset: the run's
    own): Redis only."""
    monkeypatch.delenv(settings.LESSONS_SCOPE.name, raising=False)
    return RedisPatternStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)


@pytest.fixture(params=IMPLS)
def ledger(request: pytest.FixtureRequest, clock: FakeClock) -> BudgetLedger:
    if request.param == "memory":
        return MemoryBudgetLedger(clock=clock)
    client = request.getfixturevalue("redis_client")
    return RedisBudgetLedger(client, prefix=PREFIX, ttl_s=TTL_S, clock=clock)


@pytest.fixture(params=IMPLS)
def trace(request: pytest.FixtureRequest) -> TraceSink:
    if request.param == "memory":
        return MemoryTraceSink()
    return RedisTraceSink(request.getfixturevalue("redis_client"), prefix=PREFIX, ttl_s=TTL_S)


@pytest.fixture
def blobs(redis_client: redis.Redis) -> RedisBlobStore:
    """Blobs: Redis only (nothing broker-free stores one)."""
    return RedisBlobStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)


@pytest.fixture(params=IMPLS)
def cache(request: pytest.FixtureRequest) -> CritiqueCache:
    if request.param == "memory":
        return MemoryCritiqueCache()
    return RedisCritiqueCache(request.getfixturevalue("redis_client"), prefix=PREFIX)


def rp(category: str, rule: str, description: str = "d") -> ReusablePattern:
    return ReusablePattern(category=category, description=description, prevention_rule=rule)


# --- pattern memory --------------------------------------------------------------------------


def test_pattern_recorded_once_per_critique_key(patterns: PatternStore) -> None:
    """A critique key delivered twice counts its patterns once and the second call says so."""
    assert patterns.record("run1", "c1", 1, [rp("missing_data", "Include summary")]) is True
    assert patterns.record("run1", "c1", 1, [rp("missing_data", "Include summary")]) is False
    [top] = patterns.top("run1")
    assert top.frequency == 1


def test_empty_critique_still_marks_key_seen(patterns: PatternStore) -> None:
    """Recording no patterns still consumes the critique key, so a redelivery adds nothing."""
    assert patterns.record("run1", "c1", 1, []) is True
    assert patterns.record("run1", "c1", 2, [rp("stale", "Check dates")]) is False
    assert patterns.top("run1") == []


def test_top_orders_by_frequency_then_first_recorded(patterns: PatternStore) -> None:
    """Most frequent first; equal frequencies keep the order in which patterns were first seen."""
    patterns.record("run1", "c1", 1, [rp("b", "rule b"), rp("a", "rule a")])
    patterns.record("run1", "c2", 2, [rp("c", "rule c"), rp("a", "rule a")])
    patterns.record("run1", "c3", 3, [rp("z", "rule z")])
    top = patterns.top("run1")
    assert [(p.category, p.frequency) for p in top] == [("a", 2), ("b", 1), ("c", 1), ("z", 1)]
    assert [p.category for p in patterns.top("run1", limit=2)] == ["a", "b"]
    assert patterns.top("run1", limit=0) == []


def test_pattern_identity_folds_case_and_whitespace(patterns: PatternStore) -> None:
    """Rules differing only in case/spacing are one pattern, counted once per critique."""
    patterns.record(
        "run1",
        "c1",
        2,
        [rp("fmt", "Use  JSON", "first words"), rp("fmt", "use json", "second words")],
    )
    patterns.record("run1", "c2", 1, [rp("fmt", "USE JSON ", "third words")])
    [top] = patterns.top("run1")
    assert top.frequency == 2
    assert (top.description, top.prevention_rule) == ("first words", "Use  JSON")
    assert (top.first_seen_iteration, top.last_seen_iteration) == (1, 2)


def test_patterns_are_per_run(patterns: PatternStore) -> None:
    """Two runs never see each other's patterns, even for the same critique key."""
    assert patterns.record("run1", "c1", 1, [rp("a", "rule a")]) is True
    assert patterns.record("run2", "c1", 1, [rp("b", "rule b")]) is True
    assert [p.category for p in patterns.top("run1")] == ["a"]
    assert [p.category for p in patterns.top("run2")] == ["b"]


def test_unicode_pattern_text_round_trips(patterns: PatternStore) -> None:
    """Non-ASCII and JSON-special characters survive storage unchanged."""
    text = 'Évitez les "guillemets" / \\ 表 \n'
    patterns.record("run1", "c1", 1, [rp("fmt", text, text)])
    [top] = patterns.top("run1")
    assert (top.description, top.prevention_rule) == (text, text)


def test_concurrent_redelivery_records_once(patterns: PatternStore) -> None:
    """Eight threads delivering the same critique at once count it exactly once."""
    barrier = threading.Barrier(8)
    results: list[bool] = []

    def deliver() -> None:
        barrier.wait()
        results.append(patterns.record("run1", "same", 1, [rp("a", "rule a"), rp("b", "rule b")]))

    threads = [threading.Thread(target=deliver) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]
    assert [p.frequency for p in patterns.top("run1")] == [1, 1]


def test_frequencies_sum_across_fifty_critiques(patterns: PatternStore) -> None:
    """Fifty distinct critiques, each with a random subset of patterns, add up exactly."""
    rng = random.Random(7)
    pool = [rp(f"cat{i}", f"rule {i}") for i in range(6)]
    expected: dict[str, int] = {}
    for n in range(50):
        chosen = rng.sample(pool, rng.randint(1, len(pool)))
        patterns.record("run1", f"critique-{n}", n % 5 + 1, chosen)
        for p in chosen:
            expected[p.category] = expected.get(p.category, 0) + 1
    top = patterns.top("run1", limit=100)
    assert {p.category: p.frequency for p in top} == expected
    assert [p.frequency for p in top] == sorted(expected.values(), reverse=True)


def test_a_pattern_counts_once_per_pass(patterns: PatternStore) -> None:
    """A pass's repair rounds count a pattern once (a new one in round 2 still counts); a
    redelivered round adds nothing; a resubmission (a new pass) counts it again."""
    a, b = rp("missing_data", "rule a"), rp("stale", "rule b")
    assert patterns.record("run1", "w:1:p1:1", 1, [a], pass_key="w:1:p1") is True
    assert patterns.record("run1", "w:1:p1:2", 1, [a, b], pass_key="w:1:p1") is True
    assert patterns.record("run1", "w:1:p1:2", 1, [a, b], pass_key="w:1:p1") is False
    assert patterns.record("run1", "w:1:p1:3", 1, [a, b], pass_key="w:1:p1") is True
    assert [(p.category, p.frequency) for p in patterns.top("run1")] == [
        ("missing_data", 1),
        ("stale", 1),
    ]
    patterns.record("run1", "w:1:p2:1", 1, [a], pass_key="w:1:p2")
    first = patterns.top("run1")[0]
    assert (first.category, first.frequency) == ("missing_data", 2)


def test_a_run_keeps_at_most_max_patterns_evicting_the_least_seen_first_recorded(
    patterns: PatternStore,
) -> None:
    """Past MAX_PATTERNS_PER_RUN distinct patterns a new one evicts the least-seen pattern
    (of those, the first recorded); a pattern that recurs stays."""
    keep = rp("keep", "seen twice")
    patterns.record("run1", "c0", 1, [keep])
    patterns.record("run1", "c1", 1, [keep])
    flood = [rp("flood", f"rule {i}") for i in range(MAX_PATTERNS_PER_RUN)]
    for n in range(0, len(flood), 20):
        patterns.record("run1", f"f{n}", 1, flood[n : n + 20])
    top = patterns.top("run1", limit=2 * MAX_PATTERNS_PER_RUN)
    assert len(top) == MAX_PATTERNS_PER_RUN
    assert (top[0].category, top[0].frequency) == ("keep", 2)
    rules = {p.prevention_rule for p in top}
    assert "rule 0" not in rules and f"rule {MAX_PATTERNS_PER_RUN - 1}" in rules
    assert [p.prevention_rule for p in top[1:3]] == ["rule 1", "rule 2"]


def test_top_with_many_ties_returns_the_first_recorded(patterns: PatternStore) -> None:
    """A full run of tied patterns answers the limit asked for, first recorded first."""
    for n in range(0, MAX_PATTERNS_PER_RUN, 20):
        patterns.record("run1", f"c{n}", 1, [rp("tie", f"rule {i}") for i in range(n, n + 20)])
    assert [p.prevention_rule for p in patterns.top("run1")] == [f"rule {i}" for i in range(10)]


# --- budget semaphore ------------------------------------------------------------------------


def test_reserve_refuses_past_cap(ledger: BudgetLedger) -> None:
    """Holds count against the cap: spent + held + new ≤ cap, else the reserve is refused."""
    assert ledger.reserve("run1", "a:1", 60, CAP, 30) is True
    assert ledger.reserve("run1", "b:1", 41, CAP, 30) is False
    assert ledger.reserve("run1", "b:2", 40, CAP, 30) is True
    assert ledger.commit("run1", "a:1", 60) == 60
    assert ledger.reserve("run1", "c:1", 1, CAP, 30) is False
    assert ledger.spent("run1") == 60


def test_try_reserve_answers_the_budget_its_refusal_saw(ledger: BudgetLedger) -> None:
    """A refused try_reserve returns spent/held/holders as of the refusal (so a refusal's
    reason can never show a later state in which the reservation would have fitted);
    a grant returns None and holds the tokens."""
    assert ledger.try_reserve("run1", "a:1", 60, CAP, 30) is None
    refused = ledger.try_reserve("run1", "b:1", 41, CAP, 30)
    assert refused == BudgetSnapshot(spent=0, held=60, holders=1, overrun=0)
    assert refused.spent + refused.held + 41 > CAP
    ledger.commit("run1", "a:1", 70)  # an overrun closes the budget
    closed = ledger.try_reserve("run1", "c:1", 1, CAP, 30)
    assert closed == BudgetSnapshot(spent=70, held=0, holders=0, overrun=10)


def test_reserve_is_idempotent_per_lease(ledger: BudgetLedger) -> None:
    """Reserving the same lease twice holds its tokens once."""
    assert ledger.reserve("run1", "t:1", 60, CAP, 30) is True
    assert ledger.reserve("run1", "t:1", 60, CAP, 30) is True
    assert ledger.reserve("run1", "u:1", 40, CAP, 30) is True
    assert ledger.reserve("run1", "v:1", 1, CAP, 30) is False


def test_commit_charges_the_real_figure_once(ledger: BudgetLedger) -> None:
    """A commit charges what it is given (never under-counted) and releases the hold; a repeat
    charges nothing more and answers the first charge."""
    ledger.reserve("run1", "t:1", 50, CAP, 30)
    assert ledger.commit("run1", "t:1", 40) == 40
    assert ledger.commit("run1", "t:1", 80) == 40
    ledger.reserve("run1", "t:2", 30, CAP, 30)
    assert ledger.commit("run1", "t:2", 10) == 10
    ledger.reserve("run1", "t:3", 5, CAP, 30)
    assert ledger.commit("run1", "t:3", -4) == 0
    assert ledger.spent("run1") == 50
    assert ledger.snapshot("run1") == BudgetSnapshot(spent=50)
    assert ledger.reserve("run1", "t:4", 50, CAP, 30) is True


def test_an_over_report_is_charged_in_full_and_closes_the_budget(ledger: BudgetLedger) -> None:
    """A commit above its reservation (a provider reported more than it was allowed) charges
    the real figure, records the overrun, and no new lease is granted in that run after it;
    leases already granted still commit."""
    assert ledger.reserve("run1", "a:1", 30, CAP, 30) is True
    assert ledger.reserve("run1", "b:1", 20, CAP, 30) is True
    assert ledger.commit("run1", "a:1", 45) == 45
    assert ledger.snapshot("run1") == BudgetSnapshot(spent=45, held=20, holders=1, overrun=15)
    assert ledger.reserve("run1", "c:1", 1, CAP, 30) is False
    assert ledger.reserve("run1", "b:1", 20, CAP, 30) is True  # its own lease, still held
    assert ledger.commit("run1", "b:1", 20) == 20
    assert ledger.spent("run1") == 65
    assert ledger.reserve("run2", "c:1", 1, CAP, 30) is True  # per run


def test_tokens_spent_outside_are_charged_but_never_an_overrun(ledger: BudgetLedger) -> None:
    """A commit whose excess was spent outside the service (a worker's re-run, as reported)
    charges it all without an overrun, so the run's next reservation is still granted; only
    the part inside the service counts against the reservation."""
    assert ledger.reserve("run1", "w:1", 30, CAP, 30) is True
    assert ledger.commit("run1", "w:1", 80, outside=60) == 80
    assert ledger.snapshot("run1") == BudgetSnapshot(spent=80)
    assert ledger.reserve("run1", "w:2", 10, CAP, 30) is True
    assert ledger.commit("run1", "w:2", 50, outside=5) == 50  # 45 inside: 35 over
    assert ledger.snapshot("run1").overrun == 35


def test_commits_keep_the_largest_usage_once_per_lease(ledger: BudgetLedger) -> None:
    """Each first commit brings its round's growth and re-critique reply to the run's usage,
    which keeps the largest of each and counts the rounds; a repeated commit, a commit of a
    waiting or unknown lease, and a round with no figures bring nothing; ``usage`` reads them
    back with the run's spent tokens; runs are separate."""
    assert ledger.usage("run1") == RepairUsage()
    ledger.reserve("run1", "a:1", 30, CAP, 30)
    ledger.reserve("run1", "b:1", 30, CAP, 30)
    ledger.reserve("run1", "c:1", 10, CAP, 30)
    assert ledger.commit("run1", "a:1", 20, usage=RepairUsage(growth=1500, reply=40)) == 20
    assert ledger.usage("run1") == RepairUsage(rounds=1, growth=1500, reply=40, spent=20)
    assert ledger.commit("run1", "a:1", 20, usage=RepairUsage(growth=9000, reply=900)) == 20
    assert ledger.commit("run1", "b:1", 25, usage=RepairUsage(growth=1200, reply=70)) == 25
    assert ledger.commit("run1", "c:1", 5, usage=RepairUsage()) == 5
    assert ledger.commit("run1", "zz:1", 5, usage=RepairUsage(growth=9000, reply=900)) == 0
    assert ledger.usage("run1") == RepairUsage(rounds=2, growth=1500, reply=70, spent=50)
    assert ledger.snapshot("run1") == BudgetSnapshot(spent=50)
    assert ledger.usage("run2") == RepairUsage()


def test_a_committed_lease_is_granted_again_without_holding(ledger: BudgetLedger) -> None:
    """A re-run reserve after its commit gets the same (settled) lease back: True, and nothing
    is held or charged anew."""
    ledger.reserve("run1", "t:1", 10, CAP, 30)
    ledger.commit("run1", "t:1", 10)
    assert ledger.reserve("run1", "t:1", 10, CAP, 30) is True
    assert ledger.snapshot("run1") == BudgetSnapshot(spent=10)
    assert ledger.commit("run1", "t:1", 10) == 10
    assert ledger.spent("run1") == 10


def test_refund_releases_once_and_the_lease_can_be_reserved_afresh(
    ledger: BudgetLedger,
) -> None:
    """Refund frees the hold without charging (repeats do nothing); reserving the lease again
    reserves afresh, against the cap, and its commit charges once."""
    ledger.reserve("run1", "t:1", 70, CAP, 30)
    ledger.refund("run1", "t:1")
    ledger.refund("run1", "t:1")
    assert ledger.spent("run1") == 0
    assert ledger.snapshot("run1").held == 0
    assert ledger.reserve("run1", "u:1", 40, CAP, 30) is True
    assert ledger.reserve("run1", "t:1", 70, CAP, 30) is False
    assert ledger.reserve("run1", "t:1", 60, CAP, 30) is True
    assert ledger.commit("run1", "t:1", 60) == 60
    ledger.refund("run1", "t:1")  # committed: a refund changes nothing
    assert ledger.spent("run1") == 60


def test_unknown_lease_commit_and_refund_do_nothing(ledger: BudgetLedger) -> None:
    """Commit or refund of a lease never reserved charges nothing and leaves the id usable."""
    assert ledger.commit("run1", "ghost:1", 50) == 0
    ledger.refund("run1", "ghost:1")
    assert ledger.spent("run1") == 0
    assert ledger.reserve("run1", "ghost:1", 50, CAP, 30) is True


def test_expired_lease_tokens_come_back(ledger: BudgetLedger, clock: FakeClock) -> None:
    """A holder that dies stops holding after its TTL; its tokens serve others."""
    assert ledger.reserve("run1", "dead:1", 100, CAP, 5) is True
    assert ledger.reserve("run1", "live:1", 1, CAP, 5) is False
    clock.advance(5)
    assert ledger.reserve("run1", "live:1", 100, CAP, 5) is True
    # The redelivered work asks for the dead lease again: a fresh reservation, against the cap.
    assert ledger.reserve("run1", "dead:1", 100, CAP, 5) is False
    ledger.refund("run1", "live:1")
    assert ledger.reserve("run1", "dead:1", 100, CAP, 5) is True
    assert ledger.commit("run1", "dead:1", 60) == 60
    assert ledger.spent("run1") == 60


def test_commit_after_expiry_charges_the_real_figure_once(
    ledger: BudgetLedger, clock: FakeClock
) -> None:
    """A late commit of an expired, unreleased lease still charges what it really spent, once."""
    ledger.reserve("run1", "slow:1", 40, CAP, 5)
    clock.advance(10)
    assert ledger.commit("run1", "slow:1", 25) == 25
    assert ledger.commit("run1", "slow:1", 25) == 25
    assert ledger.spent("run1") == 25


def test_budgets_are_per_run(ledger: BudgetLedger) -> None:
    """One run's holds and spending never count against another's cap."""
    ledger.reserve("run1", "t:1", 100, CAP, 30)
    ledger.commit("run1", "t:1", 100)
    assert ledger.reserve("run2", "t:1", 100, CAP, 30) is True
    assert (ledger.spent("run1"), ledger.spent("run2")) == (100, 0)


def test_budget_never_exceeds_cap_under_contention(ledger: BudgetLedger) -> None:
    """16 threads × 50 random reserve/commit/refund cycles: spent ≤ cap and equals the charges."""
    cap = 5_000
    charges: list[int] = []
    refusals: list[str] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        rng = random.Random(n)
        for i in range(50):
            lease = f"task{n}-{i}:1"
            tokens = rng.randint(1, 400)
            if not ledger.reserve("run1", lease, tokens, cap, 60):
                with lock:
                    refusals.append(lease)
                continue
            if rng.random() < 0.2:
                ledger.refund("run1", lease)
                continue
            charge = ledger.commit("run1", lease, rng.randint(0, tokens))
            with lock:
                charges.append(charge)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.spent("run1") == sum(charges)
    assert 0 < ledger.spent("run1") <= cap
    assert refusals, "the cap was never contested"


def test_concurrent_reserve_of_one_lease_holds_once(ledger: BudgetLedger) -> None:
    """Eight redeliveries reserving one lease at once all succeed and hold its tokens once."""
    barrier = threading.Barrier(8)
    results: list[bool] = []

    def reserve() -> None:
        barrier.wait()
        results.append(ledger.reserve("run1", "dup:1", 60, CAP, 30))

    threads = [threading.Thread(target=reserve) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8
    assert ledger.reserve("run1", "other:1", 41, CAP, 30) is False
    assert ledger.reserve("run1", "other:2", 40, CAP, 30) is True


# --- budget waits (the budget waits, rather than refuses, while tokens are only held) ----------


def test_a_reservation_blocked_only_by_held_tokens_waits_then_is_granted(
    ledger: BudgetLedger, clock: FakeClock
) -> None:
    """Fits cap − spent but not cap − spent − held: ``wait`` (holding nothing, and a commit of
    it charges nothing); once the holder commits, granted, with how long it waited."""
    assert ledger.ask("run1", "a:1", 60, CAP, 30).granted
    first = ledger.ask("run1", "b:1", 50, CAP, 30, wait_s=10)
    assert first.verdict == "wait" and first.waited_s == 0
    assert first.budget == BudgetSnapshot(spent=0, held=60, holders=1)
    assert ledger.snapshot("run1") == BudgetSnapshot(held=60, holders=1)
    assert ledger.commit("run1", "b:1", 50) == 0  # a waiting lease holds nothing to charge
    clock.advance(2)
    assert ledger.ask("run1", "b:1", 50, CAP, 30, wait_s=10).verdict == "wait"
    ledger.commit("run1", "a:1", 45)
    clock.advance(1.5)
    granted = ledger.ask("run1", "b:1", 50, CAP, 30, wait_s=10)
    assert granted.granted and granted.waited_s == pytest.approx(3.5)
    assert ledger.snapshot("run1") == BudgetSnapshot(spent=45, held=50, holders=1)
    assert ledger.ask("run1", "b:1", 50, CAP, 30, wait_s=10).granted  # the same lease back


def test_a_wait_is_bounded_per_lease_and_then_refused(
    ledger: BudgetLedger, clock: FakeClock
) -> None:
    """The wait is measured from the lease's first wait, across asks: once it ran out and the
    tokens are still held, refused, saying how long it waited; asked again, refused at once."""
    ledger.ask("run1", "a:1", 60, CAP, 300)
    assert ledger.ask("run1", "b:1", 50, CAP, 30, wait_s=5).verdict == "wait"
    for _ in range(4):
        clock.advance(1)
        assert ledger.ask("run1", "b:1", 50, CAP, 30, wait_s=5).verdict == "wait"
    clock.advance(1)
    refused = ledger.ask("run1", "b:1", 50, CAP, 30, wait_s=5)
    assert refused.verdict == "refused" and refused.waited_s == pytest.approx(5)
    assert refused.budget.held == 60
    clock.advance(1)
    assert ledger.ask("run1", "b:1", 50, CAP, 30, wait_s=5).verdict == "refused"


def test_past_the_cap_or_closed_a_reservation_is_refused_without_waiting(
    ledger: BudgetLedger,
) -> None:
    """spent + asked > cap, or an overrun: refused at once whatever the wait; no wait at all
    (wait_s 0) refuses what held tokens block, as ``reserve`` does."""
    ledger.ask("run1", "a:1", 60, CAP, 30)
    ledger.commit("run1", "a:1", 60)
    past = ledger.ask("run1", "b:1", 41, CAP, 30, wait_s=60)
    assert past.verdict == "refused" and past.budget.spent + 41 > CAP
    ledger.ask("run1", "c:1", 20, CAP, 30)
    assert ledger.ask("run1", "d:1", 30, CAP, 30).verdict == "refused"  # held, no wait
    ledger.commit("run1", "c:1", 25)  # overran its reservation: the run is closed
    closed = ledger.ask("run1", "e:1", 1, CAP, 30, wait_s=60)
    assert closed.verdict == "refused" and closed.budget.overrun == 5


def test_waiting_reservations_are_served_first_come_first_served(
    ledger: BudgetLedger, clock: FakeClock
) -> None:
    """An older waiter's tokens count as queued for a younger ask, so freed tokens go to the
    one that waited longest; a waiter that stops asking stops counting after the grace."""
    ledger.ask("run1", "held:1", 70, CAP, 300)
    assert ledger.ask("run1", "old:1", 60, CAP, 30, wait_s=60).verdict == "wait"
    clock.advance(1)
    young = ledger.ask("run1", "young:1", 30, CAP, 30, wait_s=60)
    assert young.verdict == "wait"  # 30 would fit beside the 70 held, but old:1 came first
    assert (young.budget.queued, young.budget.waiters) == (60, 1)
    ledger.commit("run1", "held:1", 20)
    assert ledger.ask("run1", "young:1", 30, CAP, 30, wait_s=60).verdict == "wait"
    assert ledger.ask("run1", "old:1", 60, CAP, 30, wait_s=60).granted
    assert ledger.ask("run1", "young:1", 30, CAP, 30, wait_s=60).verdict == "wait"
    clock.advance(1)
    assert ledger.ask("run1", "last:1", 20, CAP, 30, wait_s=60).verdict == "wait"
    ledger.commit("run1", "old:1", 40)  # spent 60: 40 left, and young:1 (30) is first in line
    assert ledger.ask("run1", "last:1", 20, CAP, 30, wait_s=60).verdict == "wait"
    clock.advance(WAITER_GRACE_S + 1)  # young:1 stopped asking (its task died, say)
    assert ledger.ask("run1", "last:1", 20, CAP, 30, wait_s=60).granted


# --- trace -----------------------------------------------------------------------------------


def test_trace_preserves_order(trace: TraceSink) -> None:
    """Events come back in emission order, one run at a time."""
    for i in range(25):
        trace.emit("run1", {"stage": "critic", "i": i, "nested": {"ok": True, "xs": [1, 2]}})
    trace.emit("run2", {"stage": "other"})
    events = trace.read("run1")
    assert [e["i"] for e in events] == list(range(25))
    assert events[0]["nested"] == {"ok": True, "xs": [1, 2]}
    assert trace.read("run2") == [{"stage": "other"}]
    assert trace.read("nobody") == []


def test_trace_read_is_a_snapshot(trace: TraceSink) -> None:
    """Mutating what read() returned does not change the stored trace."""
    trace.emit("run1", {"i": 1})
    trace.read("run1")[0]["i"] = 99
    assert trace.read("run1") == [{"i": 1}]


# --- blobs -----------------------------------------------------------------------------------


def test_blob_round_trip_and_content_addressing(blobs: RedisBlobStore) -> None:
    """put returns sha256:<hex> of the bytes; the same bytes give the same ref; get returns them."""
    data = bytes(range(256)) * 4
    ref = blobs.put(data)
    assert ref == blob_ref(data)
    assert ref.startswith("sha256:")
    assert blobs.put(data) == ref
    assert blobs.get(ref) == data


def test_missing_blob_raises_a_permanent_key_error(blobs: RedisBlobStore) -> None:
    """An unknown or malformed ref raises BlobMissingError, a KeyError and a PermanentError."""
    with pytest.raises(BlobMissingError) as missing:
        blobs.get(blob_ref(b"never stored"))
    assert isinstance(missing.value, KeyError)
    assert isinstance(missing.value, PermanentError)
    with pytest.raises(BlobMissingError):
        blobs.get("md5:abc")
    assert not issubclass(BlobMissingError, BlobCorruptError)


@pytest.mark.parametrize("size", [0, 5 * 1024 * 1024])
def test_blob_sizes(blobs: RedisBlobStore, size: int) -> None:
    """Empty and 5 MB blobs round-trip byte for byte."""
    data = random.Random(size).randbytes(size)
    assert blobs.get(blobs.put(data)) == data


def test_lessons_count_runs_and_survive_the_run(fleet_patterns: RedisPatternStore) -> None:
    """A fleet lesson counts the runs it occurred in (not its critiques); a redelivered
    critique adds nothing; below min_runs it is not a lesson yet; it names no run, and says
    whether the run reading it taught it."""
    patterns = fleet_patterns
    a = rp("missing_data", "always include summary")
    b = rp("stale", "use this year's prices")
    patterns.record("lr1", "c1", 1, [a, b])
    patterns.record("lr1", "c2", 2, [a])
    patterns.record("lr1", "c2", 2, [a])  # redelivered
    assert patterns.lessons() == []
    patterns.record("lr2", "c1", 1, [a])
    patterns.record("lr3", "c1", 1, [a, b])
    got = [(x.prevention_rule, x.runs, x.this_run) for x in patterns.lessons(run_id="lr2")]
    assert got == [("always include summary", 3, True), ("use this year's prices", 2, False)]
    assert [x.runs for x in patterns.lessons(limit=1)] == [3]
    assert all("lr" not in x.model_dump_json() for x in patterns.lessons(run_id="lr2"))


def test_lessons_keep_at_most_max_lessons_evicting_the_fewest_runs_first_learned(
    fleet_patterns: RedisPatternStore,
) -> None:
    """Past MAX_LESSONS lessons a new one evicts the one seen in the fewest runs (of those, the
    first learned); a lesson from two runs stays, and ties list first learned first. Each
    flooding run brings at most its share (MAX_LESSONS_PER_RUN)."""
    patterns = fleet_patterns
    keep = rp("keep", "two runs")
    patterns.record("lr1", "c0", 1, [keep])
    patterns.record("lr2", "c0", 1, [keep])
    flood = [rp("flood", f"rule {i}") for i in range(MAX_LESSONS)]
    for n in range(0, len(flood), 20):
        run = f"lr3-{n // 40}"  # forty each: within a run's share
        patterns.record(run, f"f{n}", 1, flood[n : n + 20])
    got = patterns.lessons(limit=2 * MAX_LESSONS, min_runs=1)
    assert len(got) == MAX_LESSONS
    assert (got[0].prevention_rule, got[0].runs) == ("two runs", 2)
    assert [x.prevention_rule for x in got[1:3]] == ["rule 1", "rule 2"]
    assert [x.prevention_rule for x in patterns.lessons()] == ["two runs"]


def test_a_run_flooding_distinct_patterns_brings_at_most_its_share_of_fleet_lessons(
    fleet_patterns: RedisPatternStore,
) -> None:
    """One run teaching 200 distinct patterns brings its first MAX_LESSONS_PER_RUN as fleet
    lessons and no more (its own memory keeps all 200); it still counts a lesson others
    brought, and another run's lessons stay."""
    patterns = fleet_patterns
    honest = rp("stale", "use this year's prices")
    patterns.record("h1", "c0", 1, [honest])
    for n in range(0, 200, 20):
        patterns.record("flood", f"f{n}", 1, [rp("flood", f"rule {i}") for i in range(n, n + 20)])
    patterns.record("flood", "last", 1, [honest])
    got = patterns.lessons(limit=2 * MAX_LESSONS, min_runs=1)
    flooded = {x.prevention_rule for x in got if x.category == "flood"}
    assert flooded == {f"rule {i}" for i in range(MAX_LESSONS_PER_RUN)}
    assert [(x.prevention_rule, x.runs) for x in patterns.lessons()] == [
        (honest.prevention_rule, 2)
    ]
    assert len(patterns.top("flood", 1000)) == 201


def test_run_scope_lessons_are_the_runs_own_patterns(run_patterns: RedisPatternStore) -> None:
    """By default (CRITIQUE_LESSONS_SCOPE unset) a run's lessons are its own patterns, most
    frequent first, each taught by this run; another run's patterns never appear, and no
    lesson is shared (none without a run id)."""
    patterns = run_patterns
    patterns.record("own", "c1", 1, [rp("a", "rule a")])
    patterns.record("own", "c2", 1, [rp("a", "rule a"), rp("b", "rule b")])
    patterns.record("other", "c1", 1, [rp("evil", "rule evil"), rp("a", "rule a")])
    got = patterns.lessons(run_id="own")
    assert [(x.prevention_rule, x.runs, x.scope, x.this_run) for x in got] == [
        ("rule a", 1, "run", True),
        ("rule b", 1, "run", True),
    ]
    assert patterns.lessons() == [] and patterns.lessons(min_runs=1) == []


def test_fleet_lessons_count_runs_not_critiques_and_min_runs_filters(
    fleet_patterns: RedisPatternStore,
) -> None:
    """A pattern counts once per run for its lesson, however often the run repeats it; only
    patterns seen in at least min_runs runs are lessons (was tests/unit/test_pitfalls.py,
    on the in-memory store)."""
    a, b = rp("missing_data", "rule a"), rp("stale", "rule b")
    fleet_patterns.record("run1", "c1", 1, [a, b])
    fleet_patterns.record("run1", "c2", 1, [a])
    assert fleet_patterns.lessons() == []
    fleet_patterns.record("run2", "c1", 1, [a])
    [lesson] = fleet_patterns.lessons()
    assert (lesson.prevention_rule, lesson.runs, lesson.scope) == ("rule a", 2, "fleet")
    assert [x.runs for x in fleet_patterns.lessons(min_runs=1)] == [2, 1]


def _flood(store: PatternStore, run_id: str, count: int, start: int = 0) -> None:
    """``count`` distinct patterns taught by ``run_id``, twenty per critique."""
    for n in range(start, start + count, 20):
        batch = [rp("missing_data", f"rule {i}") for i in range(n, min(n + 20, start + count))]
        store.record(run_id, f"c{n}", 1, batch)


def test_run_scope_shows_a_run_only_its_own_patterns_whatever_another_floods(
    run_patterns: RedisPatternStore,
) -> None:
    """A run's own lessons are untouched by another run's flood of 200 patterns, which are
    that run's lessons alone (was tests/unit/test_lessons_scope.py, in memory)."""
    run_patterns.record("honest", "c1", 1, [rp("missing_data", "rule a")])
    run_patterns.record(
        "honest", "c2", 1, [rp("missing_data", "rule a"), rp("missing_data", "rule b")], "p2"
    )
    _flood(run_patterns, "attacker", 200)
    mine = run_patterns.lessons(run_id="honest")
    assert [(x.prevention_rule, x.runs, x.this_run) for x in mine] == [
        ("rule a", 1, True),
        ("rule b", 1, True),
    ]
    assert len(run_patterns.lessons(1000, run_id="attacker")) == 200


def test_fleet_lessons_mark_the_runs_that_taught_them(fleet_patterns: RedisPatternStore) -> None:
    """Past a flood, another run's recurring lesson stays and is marked as taught by the run
    that reads it, and not by the flooding run (was tests/unit/test_lessons_scope.py)."""
    keep = rp("stale", "rule keep")
    fleet_patterns.record("honest1", "c1", 1, [keep])
    fleet_patterns.record("honest2", "c1", 1, [keep])
    _flood(fleet_patterns, "attacker", 200)
    flooded = [
        x for x in fleet_patterns.lessons(2 * MAX_LESSONS, min_runs=1) if x.category != "stale"
    ]
    assert {x.prevention_rule for x in flooded} == {f"rule {i}" for i in range(50)}
    [kept] = fleet_patterns.lessons(run_id="honest2")
    assert (kept.prevention_rule, kept.runs, kept.this_run) == ("rule keep", 2, True)
    assert fleet_patterns.lessons(run_id="attacker")[0].this_run is False


def test_an_evicted_lesson_frees_its_bringers_share(fleet_patterns: RedisPatternStore) -> None:
    """Past MAX_LESSONS, a new lesson evicts the least seen (a recurring one stays); a run
    whose lessons were all evicted may bring new ones again, up to its share (was
    tests/unit/test_lessons_scope.py, in memory)."""
    keep = rp("stale", "rule keep")
    fleet_patterns.record("a", "k", 1, [keep])
    fleet_patterns.record("b", "k", 1, [keep])
    for r in range(MAX_LESSONS // MAX_LESSONS_PER_RUN):
        _flood(fleet_patterns, f"flood{r}", MAX_LESSONS_PER_RUN, start=r * 1000)
    assert len(fleet_patterns.lessons(2 * MAX_LESSONS, min_runs=1)) == MAX_LESSONS
    assert [x.prevention_rule for x in fleet_patterns.lessons()] == ["rule keep"]
    _flood(fleet_patterns, "flood0", 2 * MAX_LESSONS_PER_RUN, start=50_000)
    rules = {x.prevention_rule for x in fleet_patterns.lessons(2 * MAX_LESSONS, min_runs=1)}
    assert len(rules & {f"rule {i}" for i in range(50_000, 50_100)}) == MAX_LESSONS_PER_RUN
    assert "rule keep" in rules


# --- more of the pattern and budget rules, on both ---------------------------------------


def test_a_critique_records_at_most_twenty_distinct_patterns(patterns: PatternStore) -> None:
    """The store itself keeps only the first MAX_PATTERNS_PER_CRITIQUE distinct patterns of
    one critique, in the order given."""
    given = [rp("missing_data", f"rule {i}", f"d{i}") for i in range(50)]
    assert patterns.record("run", "w:1:1", 1, given)
    top = patterns.top("run", limit=100)
    assert [p.prevention_rule for p in top] == [f"rule {i}" for i in range(20)]


def test_record_refuses_iteration_zero(patterns: PatternStore) -> None:
    """Iterations count from 1: 0 is a caller's bug, refused before anything is recorded."""
    with pytest.raises(ValueError, match="iteration"):
        patterns.record("run1", "c1", 0, [rp("a", "rule a")])
    assert patterns.record("run1", "c1", 1, [rp("a", "rule a")]) is True


def test_a_lease_with_no_holder_lives_to_its_ttl_and_park_only_says_whether_it_is_live(
    ledger: BudgetLedger, clock: FakeClock
) -> None:
    """Without a holder (the broker-free loop) a lease holds until its TTL, whatever happens
    meanwhile; park changes nothing and answers whether the lease is live (not once it is
    settled, refused, expired or unknown)."""
    assert ledger.holder is None
    assert ledger.ask("run1", "a:1", 40, CAP, 100).granted
    assert ledger.park("run1", "a:1") is True
    clock.advance(99)
    assert ledger.snapshot("run1") == BudgetSnapshot(held=40, holders=1)
    clock.advance(1)
    assert ledger.snapshot("run1") == BudgetSnapshot()
    assert ledger.park("run1", "a:1") is False
    assert ledger.park("run1", "ghost:1") is False
    assert ledger.ask("run1", "b:1", 10, CAP, 100).granted
    ledger.commit("run1", "b:1", 10)
    assert ledger.park("run1", "b:1") is False


def test_a_refunded_lease_committed_late_is_charged(ledger: BudgetLedger) -> None:
    """A commit after a refund (a cancelled repair whose call had gone out) charges what was
    really spent, once: the tokens were spent; a waiting lease's commit charges nothing."""
    assert ledger.ask("run1", "a:1", 40, CAP, 30).granted
    ledger.refund("run1", "a:1")
    assert ledger.commit("run1", "a:1", 35) == 35
    assert ledger.commit("run1", "a:1", 50) == 35
    assert ledger.snapshot("run1") == BudgetSnapshot(spent=35)


def test_negative_reservations_are_refused(ledger: BudgetLedger) -> None:
    """Asking for fewer than 0 tokens is a caller's bug: ValueError, nothing held."""
    with pytest.raises(ValueError, match="negative"):
        ledger.ask("run1", "a:1", -1, CAP, 30)
    assert ledger.snapshot("run1") == BudgetSnapshot()


# --- critique cache ----------------------------------------------------------------------


def test_cache_entries_are_served_until_their_ttl(cache: CritiqueCache) -> None:
    """A miss is None; a put entry is served under its key only, a second put replaces it, and
    it is gone once its TTL passed."""
    assert cache.get("k1") is None
    cache.put("k1", '{"v": 1}', 60)
    cache.put("k1", '{"v": 2}', 60)
    assert (cache.get("k1"), cache.get("k2")) == ('{"v": 2}', None)
    cache.put("short", '{"v": 3}', 0.05)
    wait_until(lambda: cache.get("short") is None, 5, what="the entry's TTL to pass")


def test_a_claim_is_held_once_until_released_or_its_ttl(cache: CritiqueCache) -> None:
    """The first claim of a key wins, every other is refused (one critique runs, the others
    wait for its envelope); a release or the claim's TTL lets the next one claim it."""
    assert cache.claim("k1", 60) is True
    assert cache.claim("k1", 60) is False
    assert cache.claim("k2", 60) is True
    cache.release("k1")
    assert cache.claim("k1", 0.05) is True
    wait_until(lambda: cache.claim("k1", 60), 5, what="the claim's TTL to pass")
    assert cache.claim("k1", 60) is False
    cache.release("never-claimed")


def test_concurrent_claims_of_one_key_grant_one(cache: CritiqueCache) -> None:
    """Eight identical critiques claiming at once: exactly one runs."""
    barrier = threading.Barrier(8)
    results: list[bool] = []

    def claim() -> None:
        barrier.wait()
        results.append(cache.claim("same", 60))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]


# --- the same random programs on both (differences the cases above do not name) -------------


def _ledgers(request: pytest.FixtureRequest, clock: FakeClock) -> list[BudgetLedger]:
    client = request.getfixturevalue("redis_client")
    return [
        MemoryBudgetLedger(clock=clock),
        RedisBudgetLedger(client, prefix=PREFIX, ttl_s=TTL_S, clock=clock),
    ]


@pytest.mark.parametrize("seed", range(6))
def test_random_budget_programs_answer_alike(
    seed: int, request: pytest.FixtureRequest, clock: FakeClock
) -> None:
    """One random program of asks (with and without a wait), commits (with outside tokens and
    usage), refunds, parks, snapshots and clock steps of fractions of a second, run on the
    in-memory ledger and on the Lua script with one clock: every answer is the same, step by
    step, how long a lease waited included (both count whole microseconds)."""
    memory, lua = _ledgers(request, clock)
    rng = random.Random(seed)
    leases = [f"l{n}:1" for n in range(8)]
    for step in range(300):
        op = rng.choice(("ask", "ask", "ask", "commit", "refund", "park", "read", "tick"))
        lease = rng.choice(leases)
        if op == "ask":
            args = (lease, rng.randint(0, 60), CAP, rng.choice((0.3, 4.9, 5.0, 30.0)))
            wait = rng.choice((0.0, 0.0, 4.0, 20.0))
            got = [lg.ask("run1", *args, wait_s=wait) for lg in (memory, lua)]
        elif op == "commit":
            actual, outside = rng.randint(-5, 80), rng.randint(0, 20)
            usage = RepairUsage(growth=rng.randint(-1, 3000), reply=rng.randint(0, 500))
            got = [
                lg.commit("run1", lease, actual, outside=outside, usage=usage)
                for lg in (memory, lua)
            ]
        elif op == "refund":
            got = [lg.refund("run1", lease) for lg in (memory, lua)]
        elif op == "park":
            got = [lg.park("run1", lease) for lg in (memory, lua)]
        elif op == "read":
            got = [
                (lg.snapshot("run1"), lg.usage("run1"), lg.spent("run1")) for lg in (memory, lua)
            ]
        else:
            clock.advance(rng.choice((0.1, 0.3, 0.7, 1.9, 4.9, WAITER_GRACE_S)))
            continue
        assert got[0] == got[1], f"step {step}: {op} {lease}: memory {got[0]} != lua {got[1]}"


@pytest.mark.parametrize("seed", range(4))
def test_random_pattern_programs_answer_alike(seed: int, request: pytest.FixtureRequest) -> None:
    """One random program of records (redelivered critique keys, passes with several rounds,
    iterations out of order, rules that differ only in case and spacing) run on the in-memory
    store and on the Lua script: every record answer and every ``top`` is the same."""
    client = request.getfixturevalue("redis_client")
    memory = MemoryPatternStore()
    lua = RedisPatternStore(client, prefix=PREFIX, ttl_s=TTL_S)
    rng = random.Random(seed)
    pool = [rp(f"cat{i % 4}", f"Rule  {i}" if i % 3 else f"rule {i}", f"d{i}") for i in range(12)]
    for step in range(150):
        run = rng.choice(("run1", "run2"))
        pass_key = f"w{rng.randint(0, 3)}:p{rng.randint(0, 2)}"
        key = f"{pass_key}:{rng.randint(1, 4)}"
        chosen = [rng.choice(pool) for _ in range(rng.randint(0, 25))]
        iteration = rng.randint(1, 5)
        got = [st.record(run, key, iteration, chosen, pass_key=pass_key) for st in (memory, lua)]
        assert got[0] == got[1], f"step {step}: record"
        limit = rng.choice((1, 3, 10, 100))
        assert memory.top(run, limit) == lua.top(run, limit), f"step {step}: top({limit})"
