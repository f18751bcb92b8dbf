"""Runs have an owner (issue 33, medium): against a real signed worker whose managers' keys are
named (``CRITIQUE_ENTRY_SECRET=alice=…,alice=…,bob=…,<bare>``), a run is bound to the identity
whose key signed its first entry message (``fleet`` for the Python client's path), and an entry
signed by any other key is refused with one line before any pass record is written: a holder of
an entry key can no longer submit into another manager's run and flip its completion gate.

The worker is the hostile suite's (the deploy secret, ``hostile_env``) with the named managers'
keys added: a one-secret fleet has one identity only, so it cannot show two managers apart."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import redis

from pipeline.errors import SubmissionError
from pipeline.store import keys
from tests.support.entry import hand_built, refusal
from tests.support.hostile import ENABLED, HOSTILE_WORKER, honest_submission, new_run_id
from tests.support.rawcelery import entry_body, push, task_meta
from tests.support.submissions import CONFIG
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.integration

ALICE, ALICE_OLD = "alice-current-key-" + "a" * 16, "alice-retired-key-" + "o" * 16
BOB = "bob-entry-key-" + "b" * 16
UNNAMED = "unnamed-entry-key-" + "u" * 16

WORKER = dataclasses.replace(
    HOSTILE_WORKER,
    name="hostile-owners",
    more_env={
        **HOSTILE_WORKER.more_env,
        "CRITIQUE_ENTRY_SECRET": f"alice={ALICE},bob={BOB},alice={ALICE_OLD},{UNNAMED}",
    },
)


def _entry(r: redis.Redis, key: str, sub: dict[str, object]) -> dict[str, object]:
    """One entry message signed with ``key``; its result record once ready."""
    task_id = str(uuid.uuid4())
    push(r, keys.TASK_SUBMIT, task_id, entry_body(sub, task_id, CONFIG, key))
    return task_meta(r, task_id)


def _stub(run_id: str, worker_id: str = "w1") -> dict[str, object]:
    """An output the gates refuse: a placeholder where the findings should be."""
    return {**hand_built(run_id, worker_id), "output": {"summary": "TODO", "findings": "TODO"}}


def test_another_managers_key_cannot_flip_a_python_managers_completion_gate(
    worker: WorkerProcess, r: redis.Redis
) -> None:
    """The attack: a Python manager's run (bound to `fleet`) is rejected at its completion
    gate; bob, holding only an entry key, sends a clean output for the same worker id. It is
    refused ("run R belongs to another manager", one line), no pass of his is recorded, and
    the manager's gate still rejects."""
    from workers import runtime
    from workers.client import CritiqueClient

    client = CritiqueClient(CONFIG)
    sub = honest_submission(new_run_id("python"), worker_id="w1")
    stub = sub.model_copy(update={"output": {"summary": "TODO: fill in"}})
    assert client.wait(client.submit(stub), timeout=60).status != "accepted"
    final = "Sales rose 4% in Q3."
    assert client.complete_gate(sub.run_id, final).verdict == "rejected"
    before = runtime.stores().runs.submitted(sub.run_id)
    meta = _entry(r, BOB, hand_built(sub.run_id, "w1"))
    exc_type, reason = refusal(meta)
    assert (exc_type, reason) == ("RunOwnedError", f"run {sub.run_id} belongs to another manager")
    assert runtime.stores().runs.submitted(sub.run_id) == before
    assert client.complete_gate(sub.run_id, final).verdict == "rejected"


def test_a_run_opened_with_a_named_key_takes_only_that_managers_entries(
    worker: WorkerProcess, r: redis.Redis
) -> None:
    """alice opens a run; bob's and the unnamed key's entries into it are refused, while
    alice's own keep coming in, signed with her current key or with her retired one (a
    name repeats for rotation: one identity)."""
    from workers import runtime

    run_id = new_run_id("alice")
    assert _entry(r, ALICE, hand_built(run_id, "w1"))["status"] == "SUCCESS"
    for key in (BOB, UNNAMED):
        exc_type, reason = refusal(_entry(r, key, hand_built(run_id, "w2")))
        assert (exc_type, reason) == ("RunOwnedError", f"run {run_id} belongs to another manager")
    assert set(runtime.stores().runs.submitted(run_id)) == {"1:w1"}
    for worker_id, key in (("w3", ALICE), ("w4", ALICE_OLD)):
        meta = _entry(r, key, hand_built(run_id, worker_id))
        assert (meta["status"], meta["result"]["status"]) == ("SUCCESS", "accepted"), meta
    assert r.get(keys.run_key(run_id, keys.OWNER)) == b"entry:alice"


def test_the_unnamed_key_is_one_identity_and_the_python_client_is_another(
    worker: WorkerProcess, r: redis.Redis
) -> None:
    """A bare key is the single unnamed manager: its run refuses alice, and refuses the Python
    client's path (`fleet`) too, before anything is sent."""
    from workers import runtime
    from workers.client import CritiqueClient

    run_id = new_run_id("unnamed")
    assert _entry(r, UNNAMED, hand_built(run_id, "w1"))["status"] == "SUCCESS"
    assert refusal(_entry(r, ALICE, hand_built(run_id, "w2")))[0] == "RunOwnedError"
    with pytest.raises(SubmissionError, match=f"run {run_id} belongs to another manager"):
        CritiqueClient(ENABLED).submit(honest_submission(run_id, worker_id="w5"))
    assert set(runtime.stores().runs.submitted(run_id)) == {"1:w1"}
