"""Forged verdicts (issue 10, item 4): with ``CRITIQUE_SECRET`` set, a worker refuses every
broker message that is unsigned, altered or signed with another key, records the refusal, and
never turns it into a result; honest submissions through the client keep working.

Attacks come as plain Celery messages (:func:`send_raw`), as someone with write access to the
broker but without the deploy secret would send them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import redis

from pipeline.loop.stages import LoopState, start
from pipeline.models import CritiqueEnvelope, Submission
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
    send_signed,
)
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.integration

ATTACKER_KEY = b"attacker-guessed-key-" + b"x" * 16
MARKER = "PAYLOAD-MARKER-7f3a"
"""A string only the attackers' payloads contain: it must never reach the worker's log."""
STAGE_QUEUES = {
    keys.TASK_L0: keys.QUEUE_CPU,
    keys.TASK_CRITIC: keys.QUEUE_CPU,
    keys.TASK_DECIDE: keys.QUEUE_CPU,
    keys.TASK_REPAIR: keys.QUEUE_LLM,
    keys.TASK_GATE: keys.QUEUE_CPU,
    keys.TASK_COMPLETE_GATE: keys.QUEUE_CPU,
}
STAGE_OF = {
    keys.TASK_L0: "l0",
    keys.TASK_CRITIC: "critic",
    keys.TASK_DECIDE: "decide",
    keys.TASK_REPAIR: "repair",
    keys.TASK_GATE: "gate",
    keys.TASK_COMPLETE_GATE: "complete_gate",
}


WORKER = HOSTILE_WORKER


def new_run(prefix: str = "forge") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def forged_finished_state(run_id: str, worker_id: str = "forger") -> LoopState:
    """A finished loop state claiming ``accepted`` at 1.0 for an output that is only TODO."""
    sub = Submission(run_id=run_id, worker_id=worker_id, task="Write the Q3 report.", output="TODO")
    env = CritiqueEnvelope(worker_id=worker_id, score=1.0, summary=f"flawless {MARKER}")
    return LoopState(
        submission=sub,
        output="TODO",
        next="done",
        round=1,
        envelope=env,
        best_output="TODO",
        best_score=1.0,
        best_envelope=env,
        best_acceptable=True,
        best_target=True,
        original_score=1.0,
        status="accepted",
        stop_reason="accepted",
    )


def stage_message(state: LoopState, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """An unsigned stage message in the documented format (what any Celery client can send)."""
    return {
        "v": 1,
        "sid": uuid.uuid4().hex[:16],
        "config": dict(ENABLED if config is None else config),
        "state": state.model_dump_json(),
    }


def honest_state(run_id: str, next_stage: str = "l0") -> LoopState:
    """The first state of a clean submission, moved to ``next_stage``."""
    sub = honest_submission(run_id, worker_id="victim")
    return start(sub).model_copy(update={"next": next_stage})


def refusal(ar: Any, timeout: float = 20.0) -> str:
    """Wait until the task failed; its error must be a refusal. Returns the readable message."""
    deadline = time.monotonic() + timeout
    while ar.state not in ("FAILURE", "SUCCESS") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ar.state == "FAILURE", f"task ended {ar.state}: {ar.result!r}"
    exc = ar.result
    assert type(exc).__name__ in ("ForgedMessageError", "SubmissionError"), repr(exc)
    return str(exc)


def refused_events(run_id: str) -> list[dict[str, Any]]:
    from workers.client import CritiqueClient

    return [e for e in CritiqueClient(ENABLED).trace(run_id) if e.get("type") == "refused"]


def assert_refused_in_trace(run_id: str, stage: str, reason: str) -> dict[str, Any]:
    events = refused_events(run_id)
    assert events, f"no refused event in run {run_id}'s trace"
    event = events[-1]
    assert event["stage"] == stage
    assert event["run_id_verified"] is False
    assert reason in event["reason"]
    assert MARKER not in json.dumps(event)
    return event


def no_result(run_id: str) -> bool:
    from workers.client import CritiqueClient

    return CritiqueClient(ENABLED).results(run_id) == []


# -- the attack from the issue --------------------------------------------------------------------
def test_forged_gate_message_stores_no_result(worker: WorkerProcess) -> None:
    """An unsigned critique.gate message with a finished `accepted` 1.0 state for a TODO output
    is refused: the task fails saying why, no result is stored, the trace records the refusal."""
    run_id = new_run()
    ar = send_raw(keys.TASK_GATE, stage_message(forged_finished_state(run_id)))
    assert "unsigned message" in refusal(ar)
    assert no_result(run_id)
    assert_refused_in_trace(run_id, "gate", "unsigned message")


def test_forged_gate_cannot_overwrite_a_verdict_or_pass_complete_gate(
    worker: WorkerProcess,
) -> None:
    """A forged `accepted` 1.0 gate for a worker whose output was honestly critiqued low leaves
    the honest verdict in place, so complete_gate does not answer `complete`."""
    from workers.client import CritiqueClient

    run_id = new_run()
    client = CritiqueClient({"enabled": True, "max_repair_attempts": 0})
    crashed = Submission(
        run_id=run_id,
        worker_id="w1",
        task="Summarise the Q3 sales report.",
        output={"error": "worker crashed"},
        required_fields=("summary", "findings"),
    )
    honest = client.wait(client.submit(crashed), timeout=30)
    assert honest.best_score < 0.6
    ar = send_raw(keys.TASK_GATE, stage_message(forged_finished_state(run_id, "w1")))
    refusal(ar)
    (stored,) = client.results(run_id)
    assert stored.best_score == honest.best_score and stored.status == honest.status
    decision = client.complete_gate(run_id, "Sales rose 4% in Q3, led by the north.", timeout=30)
    assert decision.verdict != "complete", decision


@pytest.mark.parametrize(
    "task", [keys.TASK_L0, keys.TASK_CRITIC, keys.TASK_REPAIR, keys.TASK_DECIDE, keys.TASK_GATE]
)
def test_unsigned_stage_message_is_refused(worker: WorkerProcess, task: str) -> None:
    """An unsigned message to any stage task is refused and recorded, never run."""
    run_id = new_run("unsigned")
    stage = STAGE_OF[task]
    state = forged_finished_state(run_id) if stage == "gate" else honest_state(run_id, stage)
    ar = send_raw(task, stage_message(state), queue=STAGE_QUEUES[task])
    assert "unsigned message" in refusal(ar)
    assert_refused_in_trace(run_id, stage, "unsigned message")
    assert no_result(run_id)


@pytest.mark.parametrize("task", [keys.TASK_L0, keys.TASK_GATE])
def test_message_signed_with_another_key_is_refused(worker: WorkerProcess, task: str) -> None:
    """A well-formed message signed with a key the workers do not hold is refused."""
    run_id = new_run("wrongkey")
    msg = signing.sign(stage_message(forged_finished_state(run_id)), [ATTACKER_KEY])
    ar = send_raw(task, msg, queue=STAGE_QUEUES[task])
    assert "bad signature" in refusal(ar)
    assert_refused_in_trace(run_id, STAGE_OF[task], "bad signature")
    assert no_result(run_id)


@pytest.mark.parametrize("field", ["state", "sid", "config"])
def test_validly_signed_message_altered_afterwards_is_refused(
    worker: WorkerProcess, field: str
) -> None:
    """Take a message the client signed, change its state (to a forged finished one, sent to
    the gate), its sid or its config (sent to l0): refused."""
    from workers import runtime

    run_id = new_run("altered")
    signed = runtime.encode(honest_state(run_id), ENABLED)
    assert signed["sig"].startswith("hmac-sha256:")
    altered = {
        "state": forged_finished_state(run_id, "victim").model_dump_json(),
        "sid": "another-pass",
        "config": {"enabled": False},
    }[field]
    task = keys.TASK_GATE if field == "state" else keys.TASK_L0
    ar = send_raw(task, {**signed, field: altered})
    assert "bad signature" in refusal(ar)
    assert_refused_in_trace(run_id, STAGE_OF[task], "bad signature")
    assert no_result(run_id)


def test_signature_copied_onto_another_message_is_refused(worker: WorkerProcess) -> None:
    """A signature lifted from an honest message and pasted onto a forged one does not verify."""
    from workers import runtime

    run_id = new_run("pasted")
    honest = runtime.encode(honest_state(run_id), ENABLED)
    forged = {**stage_message(forged_finished_state(run_id)), "sig": honest["sig"]}
    ar = send_raw(keys.TASK_GATE, forged)
    assert "bad signature" in refusal(ar)
    assert no_result(run_id)


# -- state carried by reference --------------------------------------------------------------------
def _big_signed_message(run_id: str) -> dict[str, Any]:
    """A client-signed stage message whose state is too big to go inline (a blob reference)."""
    from workers import runtime

    sub = Submission(
        run_id=run_id,
        worker_id="big",
        task="Summarise.",
        output={"summary": "Sales rose. " * 3000, "confidence": 0.9},
        required_fields=("summary",),
    )
    msg = runtime.encode(start(sub), ENABLED)
    assert "state_ref" in msg and "state" not in msg
    return msg


def test_blob_behind_a_signed_reference_replaced_is_refused(
    worker: WorkerProcess, hostile_url: str
) -> None:
    """Replacing the bytes stored under a signed state_ref (a forged finished state) is caught:
    the blob must hash to the reference, so the task refuses and stores nothing."""
    run_id = new_run("blobswap")
    msg = _big_signed_message(run_id)
    forged = forged_finished_state(run_id, "big").model_dump_json().encode()
    key = keys.blob_key(msg["state_ref"].removeprefix("sha256:"))
    redis.Redis.from_url(hostile_url).set(key, forged)
    ar = send_raw(keys.TASK_GATE, msg)
    assert "does not hash to its reference" in refusal(ar)
    assert no_result(run_id)


def test_signed_reference_swapped_for_another_blob_is_refused(
    worker: WorkerProcess, hostile_url: str
) -> None:
    """Pointing a signed message's state_ref at another (validly stored) blob breaks the
    signature: the reference is signed."""
    from workers import runtime

    run_id = new_run("refswap")
    msg = _big_signed_message(run_id)
    forged = forged_finished_state(run_id, "big").model_dump_json().encode()
    other_ref = runtime.stores().blobs.put(forged)
    ar = send_raw(keys.TASK_GATE, {**msg, "state_ref": other_ref})
    assert "bad signature" in refusal(ar)
    assert no_result(run_id)


# -- the completion gate ---------------------------------------------------------------------------
def _gate_request(run_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "request_id": uuid.uuid4().hex,
        "run_id": run_id,
        "iteration": 1,
        "final_result": f"All done. {MARKER}",
        "task": "",
        "files": [],
        "deliverable_expected": None,
        "config": {"enabled": True, "min_score_to_complete": 0.0},
        **extra,
    }


@pytest.mark.parametrize("key", [None, ATTACKER_KEY], ids=["unsigned", "wrong-key"])
def test_forged_complete_gate_request_is_refused(worker: WorkerProcess, key: bytes | None) -> None:
    """A complete_gate request the client did not sign gets no decision and counts no
    rejection; the refusal is in the run's trace."""
    from workers.client import CritiqueClient

    run_id = new_run("cgate")
    req = _gate_request(run_id)
    ar = send_raw(keys.TASK_COMPLETE_GATE, req if key is None else signing.sign(req, [key]))
    reason = "unsigned message" if key is None else "bad signature"
    assert reason in refusal(ar)
    assert_refused_in_trace(run_id, "complete_gate", reason)
    events = list(CritiqueClient(ENABLED).trace(run_id))
    assert not [e for e in events if e.get("type") in ("completion", "gate")]


def test_honest_complete_gate_is_signed_and_answered(worker: WorkerProcess) -> None:
    """The client signs its complete_gate request and a clean run gets `complete`; the same
    request as a raw message is answered only with the deploy secret's signature, addressed to
    the task id it is sent under."""
    from workers import runtime
    from workers.client import CritiqueClient

    run_id = new_run("honestgate")
    client = CritiqueClient(ENABLED)
    client.wait(client.submit(honest_submission(run_id)), timeout=30)
    decision = client.complete_gate(run_id, "Sales rose 4% in Q3.", timeout=30)
    assert decision.verdict == "complete", decision
    assert refused_events(run_id) == []
    req = _gate_request(run_id, final_result="Sales rose 4% in Q3.")
    assert send_signed(keys.TASK_COMPLETE_GATE, req).get(timeout=30)["verdict"]
    assert "unsigned message" in refusal(send_raw(keys.TASK_COMPLETE_GATE, req))
    unaddressed = refusal(send_raw(keys.TASK_COMPLETE_GATE, runtime.sign(req)))
    assert "signature covers no task id" in unaddressed


# -- garbage ---------------------------------------------------------------------------------------
GARBAGE: dict[str, Any] = {
    "string": "not a message",
    "list": [1, 2, 3],
    "number": 42,
    "null": None,
    "empty-dict": {},
    "wrong-version": {"v": 99, "sid": "s", "config": {}, "state": "{}"},
    "missing-state": {"v": 1, "sid": "s", "config": {}},
    "huge-string": {"v": 1, "sid": "s" * 3_000_000, "config": {}, "state": MARKER * 10},
    "junk-signature": {"v": 1, "sid": "s", "config": {}, "state": "{}", "sig": "hmac-sha256:00"},
}


@pytest.mark.parametrize("task", [keys.TASK_L0, keys.TASK_GATE, keys.TASK_COMPLETE_GATE])
@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_is_refused_and_the_worker_survives(
    worker: WorkerProcess, task: str, name: str
) -> None:
    """Not a dict, a wrong version, missing fields, huge strings, a junk signature: each task
    fails with a readable reason and the worker logs the refusal (without the payload)."""
    ar = send_raw(task, GARBAGE[name], queue=STAGE_QUEUES[task])
    reason = refusal(ar)
    assert reason and len(reason) < 1000 and MARKER not in reason
    deadline = time.monotonic() + 5
    while ar.id not in log_of(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(ln for ln in log_of(worker).splitlines() if ar.id in ln and "refused" in ln)
    assert f"refused a {STAGE_OF[task]} message" in line


def test_garbage_batch_then_the_worker_still_serves(worker: WorkerProcess) -> None:
    """After a burst of garbage on every task the worker is alive and answers honestly."""
    results = [
        send_raw(task, msg, queue=STAGE_QUEUES[task])
        for task in STAGE_QUEUES
        for msg in GARBAGE.values()
    ]
    for ar in results:
        refusal(ar)


def test_signed_garbage_from_a_key_holder_is_refused_with_its_reason(
    worker: WorkerProcess,
) -> None:
    """Even a validly signed message is refused when malformed (wrong version, bad state)."""
    from workers import runtime

    for msg, reason in (
        ({"v": 2, "sid": "s", "config": {}, "state": "{}"}, "not a critique stage message"),
        ({"v": 1, "sid": "s", "config": {}, "state": "{}"}, "malformed state"),
        ({"v": 1, "sid": "s", "config": {}}, "neither a 'state' nor a 'state_ref'"),
    ):
        assert reason in refusal(send_raw(keys.TASK_L0, runtime.sign(dict(msg))))


# -- what is recorded ------------------------------------------------------------------------------
def test_refusal_is_logged_once_without_the_payload_and_never_retried(
    worker: WorkerProcess,
) -> None:
    """The worker logs one warning per refused message naming the stage and reason, never the
    payload, and does not retry it."""
    run_id = new_run("logged")
    ar = send_raw(keys.TASK_GATE, stage_message(forged_finished_state(run_id)))
    refusal(ar)  # FAILURE is final: a retried task would be RETRY (and log "Retry in")
    wait_until(lambda: ar.id in log_of(worker), 10, what="the refusal in the worker's log")
    lines = [ln for ln in log_of(worker).splitlines() if ar.id in ln]
    warnings = [ln for ln in lines if "refused a gate message" in ln]
    assert len(warnings) == 1, lines
    assert run_id in warnings[0] and "unsigned message" in warnings[0]
    assert MARKER not in log_of(worker)
    assert not [ln for ln in lines if "Retry in" in ln]


def test_honest_submissions_run_signed_end_to_end(worker: WorkerProcess) -> None:
    """Through the client with the shared secret, a batch of honest submissions all finish,
    nothing is refused, and every stage message the worker passed on is signed."""
    from workers import runtime
    from workers.client import CritiqueClient

    run_id = new_run("honest")
    client = CritiqueClient(ENABLED)
    subs = [honest_submission(run_id, worker_id=f"w{i}") for i in range(4)]
    subs.append(
        Submission(
            run_id=run_id,
            worker_id="repairme",
            task="Summarise the Q3 sales report.",
            output='{"summary": "Sales rose 4% in Q3.", "confidence": 0.9,}',
            claimed_format="json",
        )
    )
    results = client.wait_many(client.submit_many(subs), timeout=60)
    assert [r.status for r in results[:4]] == ["accepted"] * 4
    assert results[4].attempts, results[4]  # a repair round: decide → Task.replace → repair
    assert refused_events(run_id) == []
    steps = run_steps(runtime.client(), run_id)  # kept by the suite's CRITIQUE_STEPS_GRACE_S
    assert len(steps) >= 5 * 3
    secrets = signing.parse_secrets(SECRET)
    for raw in steps.values():
        signing.verify(json.loads(raw), secrets)  # every stage message the worker sent on
