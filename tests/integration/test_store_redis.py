"""Redis-only store behaviour: server-time lease expiry, key layout, TTLs, streams, errors."""

from __future__ import annotations

import hashlib
import json
import math
import socket
import threading
import time
from collections.abc import Callable

import pytest
import redis

from pipeline import settings
from pipeline.errors import ConfigError, StoreUnavailableError
from pipeline.models import PassRef, ReusablePattern
from pipeline.store import keys
from pipeline.store.blobs import RedisBlobStore, blob_ref
from pipeline.store.pending import RedisPendingIndex
from pipeline.store.redis import (
    ORDER_SPACE,
    RedisBudgetLedger,
    RedisPatternStore,
    RedisTraceSink,
)
from pipeline.store.runs import PassFinished, RedisRunStore, StepRecord
from tests.support import wait_until
from tests.support.submissions import accepted_result

pytestmark = pytest.mark.integration

PREFIX = "critique-test"
TTL_S = 3600


def rp(category: str, rule: str) -> ReusablePattern:
    return ReusablePattern(category=category, description=f"about {rule}", prevention_rule=rule)


def test_expired_lease_comes_back_by_server_time(redis_client: redis.Redis) -> None:
    """With the server clock, a 0.2 s lease stops holding once it has passed."""
    ledger = RedisBudgetLedger(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    assert ledger.reserve("run1", "dead:1", 100, 100, 0.2) is True
    assert ledger.reserve("run1", "other:1", 1, 100, 30) is False
    wait_until(lambda: ledger.holds("run1") == {}, 10, what="the 0.2 s lease to pass")
    assert ledger.reserve("run1", "other:1", 100, 100, 30) is True
    assert ledger.holds("run1") == {"other:1": 100}


def test_holds_lists_live_leases_and_forgets_released_ones(redis_client: redis.Redis) -> None:
    """Introspection lists live leases and their tokens, and forgets committed or refunded ones."""
    ledger = RedisBudgetLedger(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    ledger.reserve("run1", "a:1", 10, 100, 30)
    ledger.reserve("run1", "b:1", 20, 100, 30)
    assert ledger.holds("run1") == {"a:1": 10, "b:1": 20}
    ledger.commit("run1", "a:1", 5)
    ledger.refund("run1", "b:1")
    assert ledger.holds("run1") == {}


def test_budget_rejects_negative_reservation(redis_client: redis.Redis) -> None:
    """A negative reservation is a caller bug, refused before it can inflate the cap."""
    ledger = RedisBudgetLedger(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    with pytest.raises(ValueError):
        ledger.reserve("run1", "neg:1", -5, 100, 30)


def exercise_every_store(
    client: redis.Redis, prefix: str | None = None, ttl_s: float | None = None
) -> None:
    """Write through every write path of every store for run ``run1``."""
    run_id = "run1"
    patterns = RedisPatternStore(client, prefix=prefix, ttl_s=ttl_s, lessons_scope="fleet")
    patterns.record(run_id, "c1", 1, [rp("a", "rule a")])
    ledger = RedisBudgetLedger(client, prefix=prefix, ttl_s=ttl_s)
    ledger.reserve(run_id, "t:1", 10, 100, 60)
    ledger.commit(run_id, "t:1", 5)
    ledger.reserve(run_id, "t:2", 10, 100, 60)
    ledger.refund(run_id, "t:2")
    ledger.reserve(run_id, "t:3", 10, 100, 60)
    ledger.ask(run_id, "t:4", 90, 100, 60, wait_s=60)  # waits for t:3's hold
    sink = RedisTraceSink(client, prefix=prefix, ttl_s=ttl_s)
    sink.emit(run_id, {"stage": "l0"})
    sink.emit_capped(run_id, {"type": "refused"}, "refused_unverified", 1)
    RedisBlobStore(client, prefix=prefix, ttl_s=ttl_s).put(b"blob bytes")
    runs = RedisRunStore(client, prefix=prefix, ttl_s=ttl_s)
    runs.mark_submitted(run_id, 1, "w1", "task-1", "sig")
    runs.begin_pass(run_id, 1, "w1", "sid")
    runs.open_pass(
        PassRef(run_id, 1, "w4", "sid4"), task_id="t4", signature="sig", message={"m": 4}
    )
    runs.record_step(run_id, "1:w1:sid:1:0:l0", "{}")  # released below with the pass's result
    # A second pass still live: its first message and a step record stay.
    runs.mark_submitted(run_id, 1, "w3", "task-3", "sig", pass_id="live", message={"m": 1})
    runs.record_step(run_id, "1:w3:live:1:0:l0", "{}")
    runs.record_completion(run_id, "req", {"verdict": "complete"})
    result = accepted_result(run_id)
    runs.put_result(result)
    runs.put_result(result, pass_id="sid")
    runs.count_rejection_once(run_id, "req")
    runs.claim_entry(run_id, 1, "w1", "entry-task-id", "sid")
    runs.claim_owner(run_id, "entry:alice")
    runs.put_failure(run_id, "1:w2:sid", stage="l0", error="E", reason="r", refused=True)
    pending = RedisPendingIndex(client, prefix=prefix, ttl_s=ttl_s)
    pending.add(run_id, "1:w1:sid", 1.0)
    pending.claim(run_id, "1:w1:sid", 1.0, 2.0, 5)
    pending.update_suspects(run_id, {"1:w1:sid": (2.0, 3.0)}, [])
    pending.try_lock("me", 30)
    pending.probe_due(keys.QUEUE_CPU, 1.0, 5, 15)
    pending.probe_done(keys.QUEUE_CPU, 1.0, 2.0)


def test_every_key_is_prefixed_and_expires(redis_client: redis.Redis) -> None:
    """Every key written lives under the prefix, run keys with the {run_id} tag, all with a TTL:
    run keys the run TTL, the lessons keys (which outlive runs) the lessons TTL."""
    exercise_every_store(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    found = sorted(k.decode() for k in redis_client.scan_iter(match="*"))
    run_keys = {keys.run_key("run1", s, PREFIX) for s in keys.RUN_KEY_SUFFIXES}
    run_keys.add(keys.pass_steps_key("run1", "1:w3:live", PREFIX))
    blob = keys.blob_key(blob_ref(b"blob bytes").removeprefix("sha256:"), PREFIX)
    lessons = {keys.shared_key(k, PREFIX) for k in keys.LESSONS_KEYS}
    probe = keys.shared_key(f"{keys.PROBE}:{{{keys.QUEUE_CPU}}}", PREFIX)
    shared = (keys.PENDING_RUNS, keys.SWEEP_LOCK, keys.ARCHIVE_RUNS)
    recovery = {keys.shared_key(k, PREFIX) for k in shared} | {
        probe,
        f"{probe}:{keys.PROBE_DRAINED}",
    }
    claim = keys.entry_claim_key("entry-task-id", PREFIX)
    assert set(found) - run_keys == {blob, claim} | lessons | recovery
    assert run_keys <= set(found)
    for key in found:
        if key in lessons:
            assert TTL_S * 1000 < redis_client.pttl(key) <= keys.DEFAULT_LESSONS_TTL_S * 1000, key
        else:
            assert 0 < redis_client.pttl(key) <= TTL_S * 1000, key


def test_environment_sets_prefix_and_ttl(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CRITIQUE_KEY_PREFIX and CRITIQUE_RUN_TTL_S apply when no prefix or TTL is passed."""
    monkeypatch.setenv(settings.KEY_PREFIX.name, "envpfx")
    monkeypatch.setenv(settings.RUN_TTL_S.name, "120")
    exercise_every_store(redis_client)
    found = [k.decode() for k in redis_client.scan_iter(match="*")]
    assert found and all(k.startswith("envpfx:") for k in found)
    assert all(0 < redis_client.pttl(k) <= 120_000 for k in found if ":lessons:" not in k)


@pytest.mark.parametrize(
    ("suffix", "write"),
    [
        (
            keys.PATTERNS_FREQ,
            lambda c: RedisPatternStore(c, prefix=PREFIX, ttl_s=TTL_S).record(
                "run1", "c2", 1, [rp("b", "rule b")]
            ),
        ),
        (
            keys.BUDGET_LEASES,
            lambda c: RedisBudgetLedger(c, prefix=PREFIX, ttl_s=TTL_S).commit("run1", "t:3", 7),
        ),
        (
            keys.TRACE,
            lambda c: RedisTraceSink(c, prefix=PREFIX, ttl_s=TTL_S).emit("run1", {"x": 1}),
        ),
    ],
)
def test_writes_refresh_run_ttl(
    redis_client: redis.Redis, suffix: str, write: Callable[[redis.Redis], object]
) -> None:
    """A write pushes the run keys' expiry back out to the full run TTL."""
    exercise_every_store(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    key = keys.run_key("run1", suffix, PREFIX)
    redis_client.pexpire(key, 5_000)
    write(redis_client)
    assert redis_client.pttl(key) > 5_000


def test_pattern_storage_layout(redis_client: redis.Redis) -> None:
    """Ranks live in a sorted set (the frequency is the integer part, the fraction orders ties)
    and details in a hash of JSON, keyed by pattern identity."""
    store = RedisPatternStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    store.record("run1", "c1", 2, [rp("fmt", "Use JSON")])
    store.record("run1", "c2", 3, [rp("fmt", "use  json")])
    member = "fmt|use json"
    rank = redis_client.zscore(keys.run_key("run1", keys.PATTERNS_FREQ, PREFIX), member)
    assert rank is not None and math.floor(rank) == 2 and rank > 2
    raw = redis_client.hget(keys.run_key("run1", keys.PATTERNS_DETAIL, PREFIX), member)
    assert raw is not None
    assert json.loads(raw) == {
        "category": "fmt",
        "description": "about Use JSON",
        "prevention_rule": "Use JSON",
        "first_seen_iteration": 2,
        "last_seen_iteration": 3,
        "order": 1,
    }


def test_top_reads_only_the_limit_whatever_the_ties(redis_client: redis.Redis) -> None:
    """With 50,000 patterns tied at the same count, the top script reads and returns only the
    ``limit`` entries asked for: first recorded first for ranks the store wrote, and still
    ``limit`` for plain integer counts (keys written before ranks had a tiebreak)."""
    store = RedisPatternStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    freq, detail = (
        keys.run_key("run1", s, PREFIX) for s in (keys.PATTERNS_FREQ, keys.PATTERNS_DETAIL)
    )
    ties = 50_000
    for start in range(0, ties, 5_000):
        pipe = redis_client.pipeline(transaction=False)
        ranks = {
            f"tie|rule {i}": 1 + (ORDER_SPACE - (i + 1)) / ORDER_SPACE
            for i in range(start, start + 5_000)
        }
        pipe.zadd(freq, ranks)
        pipe.hset(
            detail,
            mapping={
                m: json.dumps(
                    {
                        "category": "tie",
                        "description": "d",
                        "prevention_rule": m[4:],
                        "first_seen_iteration": 1,
                        "last_seen_iteration": 1,
                        "order": i + 1,
                    }
                )
                for i, m in zip(range(start, start + 5_000), ranks, strict=True)
            },
        )
        pipe.execute()
    script_keys = [freq, detail]
    assert len(store._top(keys=script_keys, args=[10])) == 3 * 10
    assert [p.prevention_rule for p in store.top("run1")] == [f"rule {i}" for i in range(10)]
    assert all(p.frequency == 1 for p in store.top("run1", limit=50))
    redis_client.zadd(freq, {f"tie|rule {i}": 1 for i in range(ties)})  # integer counts only
    assert len(store._top(keys=script_keys, args=[10])) == 3 * 10
    assert [p.frequency for p in store.top("run1")] == [1] * 10


def test_lessons_expire_after_the_lessons_ttl_and_each_write_renews_it(
    redis_client: redis.Redis,
) -> None:
    """Lessons keys carry the lessons TTL (not the run TTL); a run teaching a lesson pushes
    their expiry back out."""
    store = RedisPatternStore(
        redis_client, prefix=PREFIX, ttl_s=TTL_S, lessons_ttl_s=7200, lessons_scope="fleet"
    )
    store.record("run1", "c1", 1, [rp("a", "rule a")])
    lesson_keys = [keys.shared_key(k, PREFIX) for k in keys.LESSONS_KEYS]
    assert all(TTL_S * 1000 < redis_client.pttl(k) <= 7_200_000 for k in lesson_keys)
    for k in lesson_keys:
        redis_client.pexpire(k, 5_000)
    store.record("run2", "c1", 1, [rp("a", "rule a")])
    assert all(redis_client.pttl(k) > 5_000 for k in lesson_keys)
    assert [x.runs for x in store.lessons()] == [2]


def test_lessons_ttl_comes_from_the_environment(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CRITIQUE_LESSONS_TTL_S sets the lessons TTL; a value that is not a positive number is a
    configuration error naming the variable."""
    monkeypatch.setenv(settings.LESSONS_TTL_S.name, "600")
    monkeypatch.setenv(settings.LESSONS_SCOPE.name, "fleet")
    RedisPatternStore(redis_client, prefix=PREFIX, ttl_s=TTL_S).record(
        "run1", "c1", 1, [rp("a", "r")]
    )
    assert 0 < redis_client.pttl(keys.shared_key(keys.LESSONS_RUNS, PREFIX)) <= 600_000
    monkeypatch.setenv(settings.LESSONS_TTL_S.name, "soon")
    with pytest.raises(ConfigError, match="CRITIQUE_LESSONS_TTL_S"):
        RedisPatternStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)


def test_run_scope_writes_no_shared_lessons_key(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With CRITIQUE_LESSONS_SCOPE unset, recording patterns of two runs writes no lessons key:
    nothing one run taught reaches a store another run reads."""
    monkeypatch.delenv(settings.LESSONS_SCOPE.name, raising=False)
    store = RedisPatternStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    store.record("run1", "c1", 1, [rp("a", "rule a")])
    store.record("run2", "c1", 1, [rp("a", "rule a")])
    assert [k for k in redis_client.scan_iter(match="*") if b":lessons:" in k] == []
    assert [x.prevention_rule for x in store.lessons(run_id="run2")] == ["rule a"]


def test_fleet_rows_name_no_run_and_an_old_row_loses_its_run_ids(
    redis_client: redis.Redis,
) -> None:
    """A fleet lesson row stores its bringer only as a hash, and the share counts by it; a row
    written before lessons were scoped (first_run/last_run) loses those ids when next counted,
    and a planted row that is not a lesson is skipped on read."""
    store = RedisPatternStore(redis_client, prefix=PREFIX, ttl_s=TTL_S, lessons_scope="fleet")
    detail = keys.shared_key(keys.LESSONS_DETAIL, PREFIX)
    runs = keys.shared_key(keys.LESSONS_RUNS, PREFIX)
    old = {"category": "a", "description": "d", "prevention_rule": "rule old", "order": 1}
    redis_client.hset(
        detail, "a|rule old", json.dumps({**old, "first_run": "x1", "last_run": "x2"})
    )
    redis_client.zadd(runs, {"a|rule old": 1.5})
    redis_client.hset(detail, "a|junk", "not json")
    redis_client.zadd(runs, {"a|junk": 9})
    store.record("secret-run", "c1", 1, [rp("a", "rule old"), rp("a", "rule new")])
    stored = b" ".join(redis_client.hvals(detail))
    assert b"secret-run" not in stored and b"x1" not in stored and b"x2" not in stored
    held = keys.shared_key(keys.LESSONS_HELD, PREFIX)
    assert redis_client.hgetall(held) == {hashlib.sha1(b"secret-run").hexdigest().encode(): b"1"}
    got = [(x.prevention_rule, x.runs) for x in store.lessons(min_runs=1)]
    assert got == [("rule old", 2), ("rule new", 1)]


def test_pattern_store_rejects_iteration_zero(redis_client: redis.Redis) -> None:
    """Iterations count from 1; a zero would store a pattern that cannot be read back."""
    store = RedisPatternStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    with pytest.raises(ValueError):
        store.record("run1", "c1", 0, [rp("a", "rule a")])


def test_scripts_reload_after_script_flush(redis_client: redis.Redis) -> None:
    """A server that lost its script cache (restart, failover) still runs the stores."""
    store = RedisPatternStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    ledger = RedisBudgetLedger(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    store.record("run1", "c1", 1, [rp("a", "rule a")])
    redis_client.script_flush()
    assert store.record("run1", "c2", 1, [rp("a", "rule a")]) is True
    assert store.top("run1")[0].frequency == 2
    assert ledger.reserve("run1", "t:1", 5, 10, 30) is True


def test_text_clients_work_too(redis_text_client: redis.Redis) -> None:
    """Stores give the same answers through a decode_responses=True client."""
    store = RedisPatternStore(redis_text_client, prefix=PREFIX, ttl_s=TTL_S)
    assert store.record("run1", "c1", 1, [rp("a", "règle")]) is True
    assert store.top("run1")[0].prevention_rule == "règle"
    ledger = RedisBudgetLedger(redis_text_client, prefix=PREFIX, ttl_s=TTL_S)
    assert ledger.reserve("run1", "t:1", 10, 100, 30) is True
    assert ledger.holds("run1") == {"t:1": 10}
    assert ledger.commit("run1", "t:1", 7) == 7
    assert ledger.spent("run1") == 7
    sink = RedisTraceSink(redis_text_client, prefix=PREFIX, ttl_s=TTL_S)
    sink.emit("run1", {"é": "ü"})
    assert sink.read("run1") == [{"é": "ü"}]
    assert [e for _, e in sink.iterate("run1", block_ms=20, idle_limit=1)] == [{"é": "ü"}]


def test_trace_read_pages_through_long_streams(redis_client: redis.Redis) -> None:
    """A trace longer than one XRANGE page comes back whole and in order."""
    sink = RedisTraceSink(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    for i in range(2_345):
        sink.emit("run1", {"i": i})
    assert [e["i"] for e in sink.read("run1")] == list(range(2_345))


def test_trace_trims_to_approximate_maxlen(redis_client: redis.Redis) -> None:
    """With a small maxlen the stream keeps the newest events and drops old ones."""
    sink = RedisTraceSink(redis_client, prefix=PREFIX, ttl_s=TTL_S, maxlen=10)
    for i in range(1_000):
        sink.emit("run1", {"i": i})
    events = sink.read("run1")
    assert 10 <= len(events) < 1_000
    assert events[-1] == {"i": 999}


def test_trace_refuses_non_json_events(redis_client: redis.Redis) -> None:
    """Only JSON-safe events enter the stream (NaN and arbitrary objects are refused)."""
    sink = RedisTraceSink(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    with pytest.raises(ValueError):
        sink.emit("run1", {"score": float("nan")})
    with pytest.raises(TypeError):
        sink.emit("run1", {"obj": object()})
    assert sink.read("run1") == []


def test_iterate_resumes_after_last_id(redis_client: redis.Redis) -> None:
    """iterate yields what follows last_id, and its ids resume exactly where it stopped."""
    sink = RedisTraceSink(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    for i in range(3):
        sink.emit("run1", {"i": i})
    first = list(sink.iterate("run1", block_ms=20, idle_limit=1))
    assert [e["i"] for _, e in first] == [0, 1, 2]
    sink.emit("run1", {"i": 3})
    rest = list(sink.iterate("run1", block_ms=20, last_id=first[-1][0], idle_limit=1))
    assert [e["i"] for _, e in rest] == [3]


def test_iterate_follows_live_events(redis_client: redis.Redis) -> None:
    """A watcher started before the events sees each one as another thread emits it."""
    sink = RedisTraceSink(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    started = threading.Event()

    def produce() -> None:
        started.wait()
        for i in range(5):
            sink.emit("run1", {"i": i})
            time.sleep(0.01)

    producer = threading.Thread(target=produce)
    producer.start()
    seen: list[int] = []
    # From the stream's position before any event ("0-0": it is empty). With "$" the first
    # XREAD, sent only at the first next(), could miss an event emitted before it.
    stream = sink.iterate("run1", block_ms=200, last_id="0-0", idle_limit=10)
    started.set()
    for _, event in stream:
        seen.append(event["i"])
        if len(seen) == 5:
            break
    producer.join()
    assert seen == [0, 1, 2, 3, 4]


def test_iterate_rejects_block_beyond_socket_timeout(redis_url: str) -> None:
    """A block longer than the socket timeout would surface as a bogus outage; refuse it early."""
    client = redis.Redis.from_url(redis_url, socket_timeout=1)
    sink = RedisTraceSink(client, prefix=PREFIX, ttl_s=TTL_S)
    with pytest.raises(ValueError):
        next(sink.iterate("run1", block_ms=5_000))


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


@pytest.mark.parametrize(
    "call",
    [
        lambda c: RedisPatternStore(c, prefix=PREFIX, ttl_s=TTL_S).record("r", "c", 1, []),
        lambda c: RedisPatternStore(c, prefix=PREFIX, ttl_s=TTL_S).top("r"),
        lambda c: RedisBudgetLedger(c, prefix=PREFIX, ttl_s=TTL_S).reserve("r", "l", 1, 9, 9),
        lambda c: RedisBudgetLedger(c, prefix=PREFIX, ttl_s=TTL_S).spent("r"),
        lambda c: RedisTraceSink(c, prefix=PREFIX, ttl_s=TTL_S).emit("r", {}),
        lambda c: RedisTraceSink(c, prefix=PREFIX, ttl_s=TTL_S).read("r"),
        lambda c: next(RedisTraceSink(c, prefix=PREFIX, ttl_s=TTL_S).iterate("r", block_ms=10)),
        lambda c: RedisBlobStore(c, prefix=PREFIX, ttl_s=TTL_S).put(b"x"),
    ],
)
def test_unreachable_redis_is_a_transient_store_error(
    call: Callable[[redis.Redis], object],
) -> None:
    """A dead server surfaces as StoreUnavailableError naming the URL and REDIS_URL."""
    url = _dead_url()
    client = redis.Redis.from_url(url, socket_connect_timeout=1, retry=None)
    with pytest.raises(StoreUnavailableError) as err:
        call(client)
    assert url in str(err.value)
    assert err.value.hint is not None and "REDIS_URL" in err.value.hint


def test_record_step_writes_output_and_events_once(redis_client: redis.Redis) -> None:
    """The first record of a step stores its output and appends its trace events (returns None);
    a repeat writes nothing and returns the first output, so a redelivered stage never
    duplicates its events."""
    runs = RedisRunStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    trace = RedisTraceSink(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    events = [json.dumps({"type": "stage", "n": 1}), json.dumps({"type": "gate", "n": 2})]
    assert runs.record_step("rs1", "1:w1:s:1:0:l0", '{"a": 1}', events) is None
    assert runs.record_step("rs1", "1:w1:s:1:0:l0", '{"a": 2}', events) == '{"a": 1}'
    assert runs.step_output("rs1", "1:w1:s:1:0:l0") == '{"a": 1}'
    assert [e["n"] for e in trace.read("rs1")] == [1, 2]
    assert runs.record_step("rs1", "1:w1:s:1:0:critic", "{}") is None
    assert len(trace.read("rs1")) == 2
    assert redis_client.pttl(keys.run_key("rs1", keys.TRACE, PREFIX)) > 0


def test_record_steps_writes_in_order_and_stops_at_the_first_step_recorded_already(
    redis_client: redis.Redis,
) -> None:
    """Steps recorded together are written in turn, each with its events, while each is the
    first record of its step; at one recorded already nothing more is written (the later
    steps were made from an output that does not stand) and its position and the first output
    are returned; a pass with its result writes nothing."""
    runs = RedisRunStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    trace = RedisTraceSink(redis_client, prefix=PREFIX, ttl_s=TTL_S)

    def ev(n: int) -> tuple[str, ...]:
        return (json.dumps({"type": "stage", "n": n}),)

    p = "1:w1:s"
    runs.record_step("rb1", f"{p}:1:0:critic", "critic first", ev(0))
    stood = runs.record_steps(
        "rb1",
        [
            StepRecord(f"{p}:1:0:l0", "l0 mine", ev(1)),
            StepRecord(f"{p}:1:0:critic", "critic mine", ev(2)),
            StepRecord(f"{p}:1:0:decide", "decide mine", ev(3)),
        ],
    )
    assert stood == (1, "critic first")
    assert runs.step_output("rb1", f"{p}:1:0:l0") == "l0 mine"
    assert runs.step_output("rb1", f"{p}:1:0:decide") is None
    assert [e["n"] for e in trace.read("rb1")] == [0, 1]
    both = [StepRecord(f"{p}:1:0:decide", "d", ev(4)), StepRecord(f"{p}:1:1:repair", "r", ev(5))]
    assert runs.record_steps("rb1", both) is None
    assert [e["n"] for e in trace.read("rb1")] == [0, 1, 4, 5]
    assert runs.latest_step("rb1", 1, "w1", "s") == (f"{p}:1:1:repair", "r")
    with pytest.raises(ValueError, match="more than one pass"):
        runs.record_steps("rb1", [StepRecord(f"{p}:2:0:l0", "x"), StepRecord("1:w2:s:2:0:l0", "y")])
    result = accepted_result("rb1")
    assert runs.put_result(result, pass_id="s")
    with pytest.raises(PassFinished):
        runs.record_steps("rb1", [StepRecord(f"{p}:2:0:l0", "late", ev(6))])
    assert [e["n"] for e in trace.read("rb1")] == [0, 1, 4, 5]


def test_a_result_writes_the_events_of_the_steps_it_holds_that_no_delivery_recorded(
    redis_client: redis.Redis,
) -> None:
    """A result written with the steps its task ran and holds appends each step's events only
    while no record of that step is there (the delivery that recorded it traced it), then its
    own events; a repeat writes nothing."""
    runs = RedisRunStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    trace = RedisTraceSink(redis_client, prefix=PREFIX, ttl_s=TTL_S)

    def ev(n: int) -> tuple[str, ...]:
        return (json.dumps({"type": "stage", "n": n}),)

    p = "1:w1:s"
    runs.record_step("rh1", f"{p}:1:0:l0", "l0 first", ev(0))
    held = [
        StepRecord(f"{p}:1:0:l0", "l0 again", ev(1)),
        StepRecord(f"{p}:1:0:critic", "critic", ev(2)),
        StepRecord(f"{p}:1:0:decide", "decide", ev(3)),
    ]
    result = accepted_result("rh1")
    assert runs.put_result(result, pass_id="s", events=ev(4), steps=held)
    assert not runs.put_result(result, pass_id="s", events=ev(5), steps=held)
    assert [e["n"] for e in trace.read("rh1")] == [0, 2, 3, 4]
    with pytest.raises(ValueError, match="pass id"):
        runs.put_result(accepted_result("rh2"), steps=held)


def test_open_pass_records_the_pass_and_withdraw_takes_back_an_unsent_one(
    redis_client: redis.Redis,
) -> None:
    """open_pass makes the pass the submission's latest (an earlier pass's result leaves
    ``results``), puts it and its run on the stall sweeper's pending index, and records the
    submission with the first message a re-drive starts from; withdraw (its send failed) takes
    the record and the message back, only while the record is that pass's."""
    runs = RedisRunStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    pending = RedisPendingIndex(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    redis_client.hset(keys.run_key("op1", keys.RESULTS, PREFIX), "1:w1", "earlier pass's")
    before = time.time()
    runs.open_pass(PassRef("op1", 1, "w1", "sid2"), task_id="t2", signature="sig", message={"m": 2})
    assert runs.latest_pass("op1", 1, "w1") == "sid2"
    assert not redis_client.hexists(keys.run_key("op1", keys.RESULTS, PREFIX), "1:w1")
    [(member, at)] = pending.stale("op1", time.time(), 10)
    assert member == "1:w1:sid2" and before <= at <= time.time()
    assert "op1" in dict(pending.runs())
    doc = runs.submission("op1", 1, "w1")
    assert doc is not None
    assert (doc["task_id"], doc["sid"], doc["message"]) == ("t2", "sid2", {"m": 2})
    runs.withdraw(PassRef("op1", 1, "w1", "other-pass"))  # not the recorded pass: its record stays
    assert runs.submission("op1", 1, "w1") is not None
    runs.withdraw(PassRef("op1", 1, "w1", "sid2"))
    assert runs.submission("op1", 1, "w1") is None


def test_count_rejection_once_per_request(redis_client: redis.Redis) -> None:
    """A completion-gate rejection is counted once per request id, however often it is sent."""
    runs = RedisRunStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    assert runs.count_rejection_once("cr1", "req-a") == 1
    assert runs.count_rejection_once("cr1", "req-a") == 1
    assert runs.count_rejection_once("cr1", "req-b") == 2
    assert runs.rejections("cr1") == 2


def test_latest_step_follows_the_loop_order(redis_client: redis.Redis) -> None:
    """latest_step orders a pass's steps by (round, attempt, stage) — l0 < critic < decide <
    repair — ignores other passes and workers, and is None before the first step."""
    runs = RedisRunStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    assert runs.latest_step("ls1", 1, "w1", "sid") is None
    for step in ("0:0:l0", "0:0:critic", "1:0:decide", "1:0:repair", "1:1:l0", "1:1:critic"):
        runs.record_step("ls1", f"1:w1:sid:{step}", step)
    runs.record_step("ls1", "1:w1:other:9:9:repair", "other pass")
    runs.record_step("ls1", "1:w2:sid:9:9:repair", "other worker")
    assert runs.latest_step("ls1", 1, "w1", "sid") == ("1:w1:sid:1:1:critic", "1:1:critic")
    runs.record_step("ls1", "1:w1:sid:2:1:decide", "2:1:decide")
    assert runs.latest_step("ls1", 1, "w1", "sid") == ("1:w1:sid:2:1:decide", "2:1:decide")


def test_an_entry_task_id_claims_one_pass(redis_client: redis.Redis) -> None:
    """The first claim of an entry task id wins its pass; a redelivery gets that pass back, and
    the same id for another submission is refused, in the same run or in any other: the claim
    is fleet-wide, and names the submission that holds it."""
    from pipeline.store.runs import EntryIdTaken, RedisRunStore

    runs = RedisRunStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    assert runs.claim_entry("run-e", 1, "w1", "t1", "first") == ("first", True)
    assert runs.claim_entry("run-e", 1, "w1", "t1", "second") == ("first", False)
    with pytest.raises(EntryIdTaken, match="another submission of run run-e"):
        runs.claim_entry("run-e", 1, "w2", "t1", "third")
    with pytest.raises(EntryIdTaken, match="another run's entry"):
        runs.claim_entry("run-f", 1, "w1", "t1", "fourth")
    assert runs.entry_claim("t1") == {
        "run_id": "run-e",
        "iteration": 1,
        "worker_id": "w1",
        "pass_id": "first",
    }
    assert runs.entry_claim("t2") is None
    key = keys.entry_claim_key("t1", PREFIX)
    assert 0 < redis_client.pttl(key) <= TTL_S * 1000


def test_a_run_is_bound_to_the_identity_that_opened_it(redis_client: redis.Redis) -> None:
    """The first identity to enter a run owns it (SET NX, the run TTL); the same identity keeps
    entering, any other is refused naming the run only, and refreshes nothing."""
    from pipeline.store.runs import RedisRunStore, RunOwnedError

    runs = RedisRunStore(redis_client, prefix=PREFIX, ttl_s=TTL_S)
    runs.enter_run("run-o", "entry:alice")
    runs.enter_run("run-o", "entry:alice")
    owner = keys.run_key("run-o", keys.OWNER, PREFIX)
    redis_client.pexpire(owner, 5_000)
    for other in ("entry:bob", "entry", "fleet"):
        with pytest.raises(RunOwnedError, match=r"^run run-o belongs to another manager$"):
            runs.enter_run("run-o", other)
    assert redis_client.pttl(owner) <= 5_000
    assert runs.claim_owner("run-o", "entry:alice") == "entry:alice"
    assert redis_client.pttl(owner) > 5_000
