"""Bounded Redis: what a pass leaves behind once its result lands.

Store level (a real Redis): the result is stored once and packed, the pass's step records and
first message go with the result's write, a late step of a finished pass records nothing.
Through a real worker: 1,000 finished outputs hold at most 3 KB of Redis each, ``critique
report`` still writes every output's critique with all its rounds, and a stage message
delivered again after its pass finished writes nothing and changes no result.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline import settings
from pipeline.models import CritiqueEnvelope, CritiqueResult, PassRef
from pipeline.store import keys
from pipeline.store.runs import PassFinished, RedisRunStore
from tests.support import run_steps, wait_until
from tests.support.submissions import CONFIG, operator_sub
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url
from workers.cli import main

pytestmark = pytest.mark.integration

PER_OUTPUT_MAX = 3 * 1024
"""The most Redis bytes a finished output may hold (issue 21's bound)."""


def _result(run_id: str, worker_id: str, pass_id: str) -> CritiqueResult:
    return CritiqueResult(
        run_id=run_id,
        worker_id=worker_id,
        status="accepted",
        stop_reason="accepted",
        output={"summary": "Sales rose 4% in Q3. " * 20},
        original_score=1.0,
        best_score=1.0,
        envelope=CritiqueEnvelope(worker_id=worker_id, score=1.0),
        pass_id=pass_id,
    )


def _run(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


# -- the store --------------------------------------------------------------------------------
def test_a_result_releases_its_passs_steps_and_first_message_only(
    redis_client: redis.Redis,
) -> None:
    """put_result deletes the finished pass's step hash, first message and the sweeper's notes
    (suspect, re-drive count) in the same write; another live pass of the run keeps all of
    them, and the completion decisions stay."""
    from pipeline.store.pending import RedisPendingIndex

    runs, pending = RedisRunStore(redis_client), RedisPendingIndex(redis_client)
    run_id = _run("compact")
    for worker, pass_id in (("w1", "s1"), ("w2", "s2")):
        runs.begin_pass(run_id, 1, worker, pass_id)
        runs.mark_submitted(
            run_id, 1, worker, "t", "sig", pass_id=pass_id, message={"first": worker}
        )
        runs.record_step(run_id, f"1:{worker}:{pass_id}:1:0:l0", '{"l0": 1}')
        pending.add(run_id, f"1:{worker}:{pass_id}", 100.0)
        pending.claim(run_id, f"1:{worker}:{pass_id}", 100.0, 110.0, 5)
        pending.update_suspects(run_id, {f"1:{worker}:{pass_id}": (110.0, 120.0)}, [])
    runs.record_completion(run_id, "req", {"verdict": "complete"})
    assert runs.put_result(_result(run_id, "w1", "s1"), pass_id="s1")
    assert list(pending.suspects(run_id)) == ["1:w2:s2"]
    assert redis_client.hkeys(keys.run_key(run_id, keys.RESUMES)) == [b"1:w2:s2"]
    assert not redis_client.exists(keys.pass_steps_key(run_id, "1:w1:s1"))
    assert "message" not in (runs.submission(run_id, 1, "w1") or {})
    assert runs.latest_step(run_id, 1, "w1", "s1") is None
    assert runs.submission(run_id, 1, "w2") == {
        **runs.submitted(run_id)["1:w2"],
        "message": {"first": "w2"},
    }
    assert runs.latest_step(run_id, 1, "w2", "s2") == ("1:w2:s2:1:0:l0", '{"l0": 1}')
    assert runs.completion(run_id, "req") == {"verdict": "complete"}


def test_a_result_is_stored_once_packed_and_read_through_the_latest_pass(
    redis_client: redis.Redis,
) -> None:
    """One packed copy under the pass (``results`` stays empty); result() and results() find
    it through ``passes``; a resubmission hides it until its own result lands."""
    runs = RedisRunStore(redis_client)
    run_id = _run("once")
    runs.begin_pass(run_id, 1, "w1", "s1")
    runs.put_result(_result(run_id, "w1", "s1"), pass_id="s1")
    raw = redis_client.hget(
        keys.run_key(run_id, keys.PASS_RESULTS), PassRef(run_id, 1, "w1", "s1").member
    )
    assert raw is not None and not raw.startswith(b"{")  # packed
    assert len(raw) < len(_result(run_id, "w1", "s1").model_dump_json()) / 2
    assert not redis_client.exists(keys.run_key(run_id, keys.RESULTS))
    assert runs.result(run_id, 1, "w1") == runs.results(run_id)[0] == _result(run_id, "w1", "s1")
    runs.begin_pass(run_id, 1, "w1", "s2")
    assert runs.result(run_id, 1, "w1") is None and runs.results(run_id) == []
    assert runs.pass_result(run_id, 1, "w1", "s1") == _result(run_id, "w1", "s1")
    runs.put_result(_result(run_id, "w1", "s2"), pass_id="s2")
    assert runs.result(run_id, 1, "w1") == _result(run_id, "w1", "s2")


def test_a_step_of_a_finished_pass_records_nothing(redis_client: redis.Redis) -> None:
    """After the result: record_step and step_output raise PassFinished, and neither the step
    hash nor a trace event nor the pending index comes back."""
    runs = RedisRunStore(redis_client)
    run_id = _run("late")
    runs.begin_pass(run_id, 1, "w1", "s1")
    runs.record_step(run_id, "1:w1:s1:1:0:l0", "{}", ['{"type": "stage"}'])
    runs.put_result(_result(run_id, "w1", "s1"), pass_id="s1", events=['{"type": "result"}'])
    trace = keys.run_key(run_id, keys.TRACE)
    before = redis_client.xlen(trace)
    with pytest.raises(PassFinished):
        runs.record_step(run_id, "1:w1:s1:1:0:critic", "{}", ['{"type": "stage"}'])
    with pytest.raises(PassFinished):
        runs.step_output(run_id, "1:w1:s1:1:0:l0")
    assert not redis_client.exists(keys.pass_steps_key(run_id, "1:w1:s1"))
    assert redis_client.xlen(trace) == before
    assert redis_client.zcard(keys.run_key(run_id, keys.PENDING)) == 0


def test_a_client_recording_a_pass_after_its_result_keeps_no_first_message(
    redis_client: redis.Redis,
) -> None:
    """A fast pass can finish before its client records it: mark_submitted then keeps the
    record but not the first message (nothing would ever release it)."""
    runs = RedisRunStore(redis_client)
    run_id = _run("race")
    runs.begin_pass(run_id, 1, "w1", "s1")
    runs.put_result(_result(run_id, "w1", "s1"), pass_id="s1")
    runs.mark_submitted(run_id, 1, "w1", "t", "sig", pass_id="s1", message={"first": 1})
    assert runs.submission(run_id, 1, "w1") == runs.submitted(run_id)["1:w1"]
    assert not redis_client.exists(keys.run_key(run_id, keys.MESSAGES))


def test_a_grace_keeps_a_finished_passs_steps_for_a_while(redis_client: redis.Redis) -> None:
    """CRITIQUE_STEPS_GRACE_S (here 60 s): the steps stay readable, expiring within the grace;
    a late step still records nothing."""
    runs = RedisRunStore(redis_client, steps_grace_s=60)
    run_id = _run("grace")
    runs.record_step(run_id, "1:w1:s1:1:0:l0", "{}")
    runs.put_result(_result(run_id, "w1", "s1"), pass_id="s1")
    key = keys.pass_steps_key(run_id, "1:w1:s1")
    assert 0 < redis_client.pttl(key) <= 60_000
    with pytest.raises(PassFinished):
        runs.record_step(run_id, "1:w1:s1:1:0:critic", "{}")


def test_live_records_expire_with_the_live_ttl(redis_client: redis.Redis) -> None:
    """A live pass's steps and first message expire CRITIQUE_LIVE_TTL_S after their last write
    (shorter than the run's keys), never later than the run's."""
    runs = RedisRunStore(redis_client, ttl_s=3600, live_ttl_s=120)
    run_id = _run("live")
    runs.mark_submitted(run_id, 1, "w1", "t", "sig", pass_id="s1", message={"first": 1})
    runs.record_step(run_id, "1:w1:s1:1:0:l0", "{}")
    for key in (keys.pass_steps_key(run_id, "1:w1:s1"), keys.run_key(run_id, keys.MESSAGES)):
        assert 0 < redis_client.pttl(key) <= 120_000, key
    assert redis_client.pttl(keys.run_key(run_id, keys.SUBMITTED)) > 120_000
    capped = RedisRunStore(redis_client, ttl_s=60, live_ttl_s=120)
    capped.record_step(run_id, "1:w2:s1:1:0:l0", "{}")
    assert redis_client.pttl(keys.pass_steps_key(run_id, "1:w2:s1")) <= 60_000


def test_a_stage_state_blob_lives_the_live_ttl_and_never_shortens_a_longer_one(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live put (a stage state) expires within CRITIQUE_LIVE_TTL_S; the same bytes stored
    for the run TTL (a submission's file, say) keep the longer life, and a full put extends a
    live blob to it."""
    from pipeline.store.blobs import RedisBlobStore

    monkeypatch.setenv(settings.LIVE_TTL_S.name, "100")
    blobs = RedisBlobStore(redis_client, ttl_s=3600)
    live = f"live state {uuid.uuid4().hex}".encode()
    key = keys.blob_key(blobs.put(live, live=True).removeprefix("sha256:"))
    assert 0 < redis_client.pttl(key) <= 100_000
    blobs.put(live)
    assert redis_client.pttl(key) > 100_000
    shared = f"a file {uuid.uuid4().hex}".encode()
    key = keys.blob_key(blobs.put(shared).removeprefix("sha256:"))
    blobs.put(shared, live=True)
    assert redis_client.pttl(key) > 100_000


# -- through a real worker --------------------------------------------------------------------
@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    with client_on(worker_db_url(redis_url)) as e:
        yield e


WORKER = WorkerSpec("compaction")


def _bytes(r: redis.Redis, names: list[Any]) -> int:
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.memory_usage(name, samples=0)
    return sum(int(n or 0) for n in pipe.execute())


def test_a_thousand_finished_outputs_hold_at_most_3_kb_each_and_report_has_every_round(
    worker: WorkerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """1,000 outputs (accepted, repaired over two rounds, escalated) through a real worker:
    the run's keys plus each gate's Celery result hold <= 3 KB per output, no step hash or
    first message is left, and ``critique report`` writes every output's critique with its
    rounds."""
    from workers import runtime
    from workers.client import CritiqueClient

    run_id = _run("footprint")
    kinds = ("clean", "looping", "garbage")
    subs = [operator_sub(run_id, f"w{i:04d}", kinds[i % 3]) for i in range(1000)]
    client = CritiqueClient(CONFIG)
    handles = client.submit_many(subs)
    results = {r.worker_id: r for r in client.wait_many(handles, timeout=600)}
    assert len(results) == 1000
    assert {r.status for r in results.values()} == {"accepted", "repaired", "escalated"}

    r = runtime.client()
    run_keys = list(r.scan_iter(match=keys.run_key_pattern(run_id), count=1000))
    assert not [k for k in run_keys if b":steps:pass:" in k or k.endswith(b":messages")]
    metas = [f"celery-task-meta-{h.task_id}" for h in handles]
    kinds = {k.decode().split("}:", 1)[1]: _bytes(r, [k]) for k in run_keys}
    kinds["celery-task-meta-*"] = _bytes(r, metas)
    total = sum(kinds.values())
    shares = ", ".join(f"{k} {v / 1000:.0f}" for k, v in sorted(kinds.items(), key=lambda x: -x[1]))
    assert total / 1000 <= PER_OUTPUT_MAX, f"{total / 1000:.0f} bytes per output: {shares}"

    rc = main(["report", run_id, "--out", str(tmp_path)])
    capsys.readouterr()
    assert rc == 0
    folder = tmp_path / "runs" / run_id / "iterations" / "001" / "delegations"
    for worker_id, result in results.items():
        doc = json.loads((folder / worker_id / "critique.json").read_text(encoding="utf-8"))
        assert doc["trace"] == result.model_dump(mode="json")["trace"], worker_id
        assert len(doc["trace"]) >= (2 if result.status == "repaired" else 1), worker_id


def test_a_stage_message_delivered_after_its_pass_finished_writes_nothing(
    worker: WorkerProcess,
) -> None:
    """A pass's first message sent again with its chain after the result landed (a late
    redelivery): the chain ends at its first stage; no step record, trace event or result
    write follows, and the gate never runs again."""
    from celery.result import AsyncResult

    import workers.tasks  # noqa: F401  (registers the stage tasks the signature is built from)
    from pipeline.loop.stages import start
    from workers import runtime
    from workers.app import app
    from workers.client import CritiqueClient
    from workers.routing import submission_signature

    run_id = _run("redeliver")
    client = CritiqueClient(CONFIG)
    sub = operator_sub(run_id, "w1", "looping")
    handle = client.submit(sub)
    got = client.wait(handle, timeout=60)
    r = runtime.client()
    trace = keys.run_key(run_id, keys.TRACE)
    events = r.xlen(trace)
    stored = r.hgetall(keys.run_key(run_id, keys.PASS_RESULTS))
    assert run_steps(r, run_id) == {}

    msg = runtime.encode(start(sub, handle.pass_id), CONFIG)
    late = submission_signature(msg, runtime.config_for(CONFIG), sub).apply_async()
    wait_until(lambda: _left_the_broker(r, late.id), 30, what="the late l0 to run")
    time.sleep(1.5)  # room for a pass that went on (critic, repair, gate) to show itself
    assert not _ran(r, late.id) and AsyncResult(late.id, app=app).state == "PENDING"
    assert r.xlen(trace) == events
    assert r.hgetall(keys.run_key(run_id, keys.PASS_RESULTS)) == stored
    assert run_steps(r, run_id) == {}
    assert client.result(handle) == got


def _left_the_broker(r: redis.Redis, task_id: str) -> bool:
    """The message of ``task_id`` is neither queued nor delivered and unacknowledged."""
    tid = task_id.encode()
    queued = any(tid in m for q in keys.QUEUES for m in r.lrange(q, 0, -1))
    return not queued and not any(tid in m for m in r.hvals("unacked"))


def _ran(r: redis.Redis, task_id: str) -> bool:
    """Celery stored a state for ``task_id``."""
    return bool(r.exists(f"celery-task-meta-{task_id}"))
