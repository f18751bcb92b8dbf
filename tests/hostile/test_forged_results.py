"""Forged results through the Celery task id (issue 28, item 2): with ``CRITIQUE_SECRET`` set,
nothing a broker or store writer sends or writes under a victim's task id becomes a verdict.

The client trusts only what a worker recorded in the store for the pass: a signed result, or a
signed failure record. Celery's result backend (a task id's ``FAILURE`` or ``SUCCESS``) is no
evidence, and a signed message is refused under any task or task id but the one it names.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from celery.result import AsyncResult

from pipeline.errors import SubmissionError
from pipeline.loop.stages import start
from pipeline.models import CritiqueResult, PassRef
from pipeline.security import signing
from pipeline.store import keys
from tests.support import run_steps, wait_until
from tests.support.hostile import (
    ENABLED,
    HOSTILE_WORKER,
    SECRET,
    honest_submission,
    log_of,
    send_raw,
)
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.integration

ATTACKER_KEY = b"attacker-guessed-key-" + b"y" * 16


WORKER = HOSTILE_WORKER


def new_run(prefix: str = "forged") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def registered_pass(run_id: str, worker_id: str = "victim") -> Any:
    """A pass registered as the client registers one, with its chain never sent: nothing but a
    forgery can answer it. Returns its handle."""
    from workers import runtime
    from workers.client import Handle
    from workers.recovery.base import register

    sub = honest_submission(run_id, worker_id)
    pass_id = runtime.new_pass_id()
    msg = runtime.encode(start(sub, pass_id), ENABLED, task=keys.TASK_L0, task_id=uuid.uuid4().hex)
    gate_id = uuid.uuid4().hex
    runs = runtime.stores().runs
    runs.begin_pass(run_id, 1, worker_id, pass_id)
    register(PassRef(run_id, 1, worker_id, pass_id))
    runs.mark_submitted(
        run_id, 1, worker_id, gate_id, sub.subtask_signature, pass_id=pass_id, message=msg
    )
    return Handle(run_id, 1, worker_id, gate_id, pass_id)


def forged_result(run_id: str, worker_id: str, pass_id: str) -> dict[str, Any]:
    """An `accepted` 1.0 result for a TODO output, as JSON a store writer would put there."""
    from pipeline.models import CritiqueEnvelope, CritiqueResult

    env = CritiqueEnvelope(worker_id=worker_id, score=1.0, summary="flawless")
    result = CritiqueResult(
        run_id=run_id,
        worker_id=worker_id,
        status="accepted",
        stop_reason="accepted",
        output="TODO",
        original_score=1.0,
        best_score=1.0,
        envelope=env,
        pass_id=pass_id,
    )
    return dict(json.loads(result.model_dump_json()))


def assert_no_verdict(handle: Any) -> None:
    """Neither wait(), as_completed() nor status give the handle a result or a failure."""
    from workers.client import CritiqueClient, CritiqueTimeout
    from workers.commands._runs import load_snapshot

    client = CritiqueClient(ENABLED)
    assert client.result(handle) is None
    with pytest.raises(CritiqueTimeout):
        client.wait(handle, timeout=1.0)
    with pytest.raises(CritiqueTimeout):
        list(client.as_completed([handle], timeout=1.0))
    snap = load_snapshot(handle.run_id)
    assert (snap.results, snap.failed, snap.pending) == ([], [], ["1:victim"])


# -- the attack from the issue ---------------------------------------------------------------------
def test_garbage_under_every_gate_id_leaves_every_verdict_honest(
    worker: WorkerProcess, hostile_url: str
) -> None:
    """The issue's attack on 30 honest submissions: an unsigned `{}` sent to critique.gate under
    every task id read from the `submitted` hash. Each is refused (its FAILURE shows under an id
    whose pass is still running, never over a stored summary), every wait() and as_completed()
    answers the honest verdict, no failure is recorded, status shows none failed, and in the
    end the backend holds each pass's own summary under its id."""
    from workers import runtime
    from workers.app import app
    from workers.client import CritiqueClient
    from workers.commands._runs import load_snapshot

    run_id = new_run("attack")
    client = CritiqueClient(ENABLED)
    handles = client.submit_many([honest_submission(run_id, f"w{i}") for i in range(30)])
    r = redis.Redis.from_url(hostile_url)
    gate_ids = [json.loads(v)["task_id"] for v in r.hvals(keys.run_key(run_id, keys.SUBMITTED))]
    assert sorted(gate_ids) == sorted(h.task_id for h in handles)
    for gate_id in gate_ids:
        app.send_task(keys.TASK_GATE, args=({},), queue=keys.QUEUE_CPU, task_id=gate_id)
    wait_until(
        lambda: all(f"refused a gate message (task {g}" in log_of(worker) for g in gate_ids),
        30,
        what="the worker's refusal of every forged gate message",
    )
    waited = [client.wait(h, timeout=60) for h in handles[:15]]
    completed = list(client.as_completed(handles[15:], timeout=60))
    assert [r.status for r in waited] == ["accepted"] * 15
    assert {h.worker_id for h, _ in completed} == {h.worker_id for h in handles[15:]}
    for _, got in completed:
        assert isinstance(got, CritiqueResult) and got.status == "accepted", got
    assert runtime.stores().runs.failures(run_id) == {}
    snap = load_snapshot(run_id)
    assert (len(snap.results), snap.failed, snap.pending) == (30, [], [])
    by_id = {h.task_id: h.worker_id for h in handles}

    def honest_summaries() -> bool:
        got = {g: AsyncResult(g, app=app) for g in gate_ids}
        return all(
            r.state == "SUCCESS" and r.result["worker_id"] == by_id[g] for g, r in got.items()
        )

    wait_until(honest_summaries, 30, what="each pass's own summary under its id")


# -- signed messages cover the task id -------------------------------------------------------------
def _steps(run_id: str) -> dict[str, dict[str, Any]]:
    from workers import runtime

    raw = run_steps(runtime.client(), run_id)
    return {k: json.loads(v) for k, v in raw.items()}


def _refused(ar: Any) -> str:
    """Wait until the task failed as a forged message; returns its reason."""
    wait_until(lambda: ar.state in ("FAILURE", "SUCCESS"), 20, what=f"task {ar.id} to end")
    assert ar.state == "FAILURE", ar.result
    assert type(ar.result).__name__ == "ForgedMessageError", repr(ar.result)
    return str(ar.result)


def test_signed_message_replayed_under_another_task_id_is_refused(worker: WorkerProcess) -> None:
    """Validly signed stage messages recorded by an honest pass (each addressed to the task
    that ran the next stage itself), sent again as another task id or another task (the
    finished state to the gate, or to critique.l0 under a fresh id; a critic-bound message to
    the gate; the finished state under a running victim's task id), are refused: no result, no
    failure for any pass, and the victim still gets its own honest verdict."""
    from workers import runtime
    from workers.app import app
    from workers.client import CritiqueClient

    run_id = new_run("replay")
    client = CritiqueClient(ENABLED)
    honest = client.wait(client.submit(honest_submission(run_id, "donor")), timeout=30)
    steps = _steps(run_id)
    finished = next(m for k, m in steps.items() if k.endswith(":decide"))
    to_critic = next(m for k, m in steps.items() if k.endswith(":l0"))
    assert signing.addressee(finished)[0] == signing.addressee(to_critic)[0] == keys.TASK_L0

    fresh = _refused(send_raw(keys.TASK_GATE, finished))
    assert "replayed under another task or id" in fresh
    assert "replayed under another task or id" in _refused(send_raw(keys.TASK_L0, finished))
    wrong_task = send_raw(keys.TASK_GATE, to_critic)
    assert "replayed under another task or id" in _refused(wrong_task)

    victim = client.submit(honest_submission(run_id, "victim"))
    ar = app.send_task(
        keys.TASK_GATE, args=(finished,), queue=keys.QUEUE_CPU, task_id=victim.task_id
    )
    wait_until(
        lambda: f"refused a gate message (task {victim.task_id}" in log_of(worker),
        20,
        what="the refusal of the replay under the victim's gate id",
    )
    assert ar.id == victim.task_id
    got = client.wait(victim, timeout=30)
    assert (got.worker_id, got.status, got.pass_id) == ("victim", "accepted", victim.pass_id)
    runs = runtime.stores().runs
    assert runs.failures(run_id) == {}
    assert {(r.worker_id, r.best_score) for r in client.results(run_id)} == {
        ("donor", honest.best_score),
        ("victim", got.best_score),
    }


# -- the result backend is no evidence -------------------------------------------------------------
def test_forged_backend_states_for_a_gate_id_are_not_a_verdict(worker: WorkerProcess) -> None:
    """A FAILURE or an `accepted` SUCCESS written into Celery's result backend for a gate id
    is never an answer: a pass whose chain never ran stays pending (wait and as_completed
    time out, status says pending), and a running pass gets its honest result."""
    from workers.app import app
    from workers.client import CritiqueClient

    handle = registered_pass(new_run("backend"))
    refusal = SubmissionError("submission may not set 'llm.api_base': worker-only")
    app.backend.store_result(handle.task_id, refusal, "FAILURE")
    assert AsyncResult(handle.task_id, app=app).state == "FAILURE"
    assert_no_verdict(handle)
    app.backend.store_result(handle.task_id, {"status": "accepted", "best_score": 1.0}, "SUCCESS")
    assert_no_verdict(handle)

    client = CritiqueClient(ENABLED)
    running = client.submit(honest_submission(new_run("backend"), "running"))
    app.backend.store_result(running.task_id, refusal, "FAILURE")
    assert client.wait(running, timeout=30).status == "accepted"


# -- the store's records are signed ----------------------------------------------------------------
def test_unsigned_or_misfiled_records_in_the_store_are_not_trusted(
    worker: WorkerProcess, hostile_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Results and failure records written straight into the store, unsigned, signed with
    another key, or validly signed but filed under another pass, are treated as absent (and
    logged), never as a verdict; a pass re-driven after them still ends in its honest result."""
    from workers import runtime
    from workers.client import CritiqueClient

    handle = registered_pass(new_run("store"))
    run_id, pass_id = handle.run_id, handle.pass_id
    r = redis.Redis.from_url(hostile_url)
    field, pass_field = "1:victim", PassRef(run_id, 1, "victim", pass_id).member
    forged = forged_result(run_id, "victim", pass_id)
    failure = {"run_id": run_id, "member": pass_field, "stage": "gate", "error": "X"}
    failure.update({"reason": "forged refusal", "refused": True, "task_id": "", "at": 0})
    for record, failed in (
        (forged, failure),
        (signing.sign_record("result", forged, [ATTACKER_KEY]),
         signing.sign_record("failure", failure, [ATTACKER_KEY])),
    ):  # fmt: skip
        r.hset(keys.run_key(run_id, keys.RESULTS), field, json.dumps(record))
        r.hset(keys.run_key(run_id, keys.PASS_RESULTS), pass_field, json.dumps(record))
        r.hset(keys.run_key(run_id, keys.FAILURES), pass_field, json.dumps(failed))
        with caplog.at_level("WARNING", logger="pipeline.store.runs"):
            assert_no_verdict(handle)
        assert CritiqueClient(ENABLED).results(run_id) == []
    assert "ignored the results:pass record" in caplog.text
    assert "ignored the failures record" in caplog.text

    # A genuine signed result of another pass, copied into this pass's slots: misfiled.
    secrets = signing.parse_secrets(SECRET)
    other = signing.sign_record("result", forged_result(run_id, "victim", "another"), secrets)
    r.hset(keys.run_key(run_id, keys.PASS_RESULTS), pass_field, json.dumps(other))
    r.hdel(keys.run_key(run_id, keys.FAILURES), pass_field)
    assert_no_verdict(handle)
    assert "a result filed under another run, submission or pass" in caplog.text

    # The forged records out of the way, a re-drive (addressed anew) gives the honest verdict.
    r.hdel(keys.run_key(run_id, keys.PASS_RESULTS), pass_field)
    r.hdel(keys.run_key(run_id, keys.RESULTS), field)
    client = CritiqueClient(ENABLED)
    assert client.resume(handle) == "l0"
    got = client.wait(handle, timeout=30)
    assert (got.status, got.output, got.pass_id) == (
        "accepted",
        honest_submission().output,
        pass_id,
    )
    assert runtime.stores().runs.result(run_id, 1, "victim") == got
    # Resumed once more, the pass has its result: nothing is sent again.
    assert client.resume(handle) == "finished"
    assert runtime.stores().runs.result(run_id, 1, "victim") == got
    assert client.result(handle) == got


# -- what still fails, fails at once ---------------------------------------------------------------
def test_a_refusal_of_the_clients_own_submission_is_recorded_and_reported(
    worker: WorkerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submission the worker refuses (max_repair_attempts above the worker's, from a client
    whose own limit is looser) is reported by wait() from the worker's signed failure record,
    which names the stage and the reason."""
    from pipeline.store.runs import Failure
    from tests.support.workers import _forget_configs
    from workers import runtime
    from workers.client import CritiqueClient

    run_id = new_run("refused")
    monkeypatch.setenv("CRITIQUE_MAX_REPAIR_ATTEMPTS", "3")
    _forget_configs(runtime)
    client = CritiqueClient({"enabled": True, "max_repair_attempts": 3})
    handle = client.submit(honest_submission(run_id, "w1"))
    monkeypatch.delenv("CRITIQUE_MAX_REPAIR_ATTEMPTS")
    _forget_configs(runtime)
    with pytest.raises(SubmissionError, match="was refused by the worker: submission may not"):
        client.wait(handle, timeout=30)
    member = PassRef(run_id, 1, "w1", handle.pass_id).member
    failure = runtime.stores().runs.failure(run_id, member)
    assert isinstance(failure, Failure) and failure.refused and failure.stage == "l0"
    assert "max_repair_attempts" in failure.reason
    raw = runtime.client().hget(keys.run_key(run_id, keys.FAILURES), member)
    signing.verify_record("failure", json.loads(raw), signing.parse_secrets(SECRET))
