"""The run store's signed records (issue 28, item 2) on a real Redis: with secrets, results,
failures and completion decisions are stored signed and read back only when they verify and
are filed where they belong; without secrets they are stored and read as before."""

from __future__ import annotations

import json

import pytest
import redis

from pipeline.models import CritiqueEnvelope, CritiqueResult, PassRef
from pipeline.store import keys
from pipeline.store.packing import unpack
from pipeline.store.runs import Failure, RedisRunStore

pytestmark = pytest.mark.integration

KEY = b"k" * 32
RUN = "run1"


def result(pass_id: str, score: float = 0.9, worker_id: str = "w1") -> CritiqueResult:
    return CritiqueResult(
        run_id=RUN,
        worker_id=worker_id,
        status="accepted",
        stop_reason="accepted",
        output="ok",
        original_score=score,
        best_score=score,
        envelope=CritiqueEnvelope(worker_id=worker_id, score=score),
        pass_id=pass_id,
    )


def signed_store(client: redis.Redis) -> RedisRunStore:
    return RedisRunStore(client, secrets=lambda: (KEY,))


def test_a_signed_result_reads_back_and_an_altered_one_does_not(
    redis_client: redis.Redis,
) -> None:
    """put_result signs the record; result, pass_result and results return it; the same record
    with its score raised (signature kept) reads as absent everywhere."""
    runs = signed_store(redis_client)
    runs.begin_pass(RUN, 1, "w1", "s1")
    runs.put_result(result("s1"), pass_id="s1")
    packed = redis_client.hget(
        keys.run_key(RUN, keys.PASS_RESULTS), PassRef(RUN, 1, "w1", "s1").member
    )
    assert packed is not None
    raw = unpack(packed)
    assert raw is not None and json.loads(raw)["sig"].startswith("hmac-sha256:")
    assert runs.pass_result(RUN, 1, "w1", "s1") == result("s1")
    assert runs.result(RUN, 1, "w1") == runs.results(RUN)[0] == result("s1")
    altered = json.dumps({**json.loads(raw), "best_score": 1.0})
    redis_client.hset(
        keys.run_key(RUN, keys.PASS_RESULTS), PassRef(RUN, 1, "w1", "s1").member, altered
    )
    redis_client.hset(keys.run_key(RUN, keys.RESULTS), "1:w1", altered)
    assert runs.pass_result(RUN, 1, "w1", "s1") is None
    assert runs.result(RUN, 1, "w1") is None and runs.results(RUN) == []
    assert RedisRunStore(redis_client).result(RUN, 1, "w1") is not None  # unchecked without


def test_without_secrets_results_are_stored_as_before(redis_client: redis.Redis) -> None:
    """Development: a result is stored as its JSON (no signature), packed, and read back."""
    runs = RedisRunStore(redis_client)
    runs.put_result(result("s1"), pass_id="s1")
    raw = redis_client.hget(
        keys.run_key(RUN, keys.PASS_RESULTS), PassRef(RUN, 1, "w1", "s1").member
    )
    assert raw is not None and unpack(raw) == result("s1").model_dump_json()
    assert runs.pass_result(RUN, 1, "w1", "s1") == result("s1")


def test_a_failure_is_recorded_once_and_a_result_outranks_it(redis_client: redis.Redis) -> None:
    """put_failure records the first failure of a pass (signed), takes the pass off the
    pending index, and pass_outcome answers it until a result is stored, which then wins."""
    runs = signed_store(redis_client)
    member = PassRef(RUN, 1, "w1", "s1").member
    redis_client.zadd(keys.run_key(RUN, keys.PENDING), {member: 1.0})
    assert runs.put_failure(RUN, member, stage="l0", error="E", reason="first", refused=True)
    assert not runs.put_failure(RUN, member, stage="gate", error="F", reason="later", refused=False)
    assert redis_client.zscore(keys.run_key(RUN, keys.PENDING), member) is None
    got = runs.pass_outcome(RUN, 1, "w1", "s1")
    assert isinstance(got, Failure) and (got.stage, got.reason, got.refused) == (
        "l0",
        "first",
        True,
    )
    assert runs.failures(RUN) == {member: got}
    runs.put_result(result("s1"), pass_id="s1")
    assert runs.pass_outcome(RUN, 1, "w1", "s1") == result("s1")


def test_a_cleared_failure_leaves_the_pass_pending_and_the_next_failure_is_recorded(
    redis_client: redis.Redis,
) -> None:
    """clear_failure (resume --failed) forgets a pass's failure: no outcome until the re-driven
    pass ends, and a new failure is recorded in place of the first (not refused as a repeat)."""
    runs = signed_store(redis_client)
    member = PassRef(RUN, 1, "w1", "s1").member
    runs.put_failure(RUN, member, stage="l0", error="E", reason="first", refused=True)
    assert runs.clear_failure(RUN, member)
    assert not runs.clear_failure(RUN, member)  # nothing left to clear
    assert runs.pass_outcome(RUN, 1, "w1", "s1") is None
    assert runs.put_failure(RUN, member, stage="critic", error="F", reason="again", refused=False)
    got = runs.failure(RUN, member)
    assert got is not None and (got.stage, got.reason) == ("critic", "again")


def test_records_filed_under_another_pass_or_run_are_not_trusted(
    redis_client: redis.Redis,
) -> None:
    """A validly signed result or failure copied to another pass's field (or another run's
    hash) is misfiled: absent there."""
    runs = signed_store(redis_client)
    runs.put_result(result("s1"), pass_id="s1")
    runs.put_failure(
        RUN, PassRef(RUN, 1, "w2", "s1").member, stage="l0", error="E", reason="r", refused=True
    )
    pass_results = keys.run_key(RUN, keys.PASS_RESULTS)
    failures = keys.run_key(RUN, keys.FAILURES)
    good = redis_client.hget(pass_results, PassRef(RUN, 1, "w1", "s1").member)
    failed = redis_client.hget(failures, PassRef(RUN, 1, "w2", "s1").member)
    assert good is not None and failed is not None
    redis_client.hset(pass_results, PassRef(RUN, 1, "w1", "s2").member, good)
    redis_client.hset(failures, PassRef(RUN, 1, "w1", "s2").member, failed)
    redis_client.hset(keys.run_key("run2", keys.RESULTS), "1:w1", good)
    assert runs.pass_outcome(RUN, 1, "w1", "s2") is None
    assert runs.results("run2") == []


def test_a_completion_decision_is_signed_and_the_first_one_wins(
    redis_client: redis.Redis,
) -> None:
    """record_completion stores a request's decision signed; a second one gets the first back;
    an altered record reads as absent."""
    runs = signed_store(redis_client)
    assert runs.record_completion(RUN, "q1", {"verdict": "rejected"}) is None
    assert runs.record_completion(RUN, "q1", {"verdict": "complete"}) == {"verdict": "rejected"}
    assert runs.completion(RUN, "q1") == {"verdict": "rejected"}
    steps = keys.run_key(RUN, keys.STEPS)
    raw = redis_client.hget(steps, "complete_gate:q1")
    assert raw is not None
    doc = json.loads(raw)
    doc["decision"] = {"verdict": "complete"}
    redis_client.hset(steps, "complete_gate:q1", json.dumps(doc))
    assert runs.completion(RUN, "q1") is None
