"""Entry messages against a real signed worker (issue 33: task-id reuse, item 5, entry
decoding): a task id another run's entry claimed is refused with nothing written under it, a
stream of distinct configurations leaves the worker's caches bounded, and over-deep, boolean or
unbounded numbers in an entry are refused with a one-line failure under the task id. The
manager here builds entries by hand and LPUSHes them (tests.support.rawcelery), signing with the
deploy secret (a one-secret fleet: entry messages verify with CRITIQUE_SECRET)."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest
import redis

from pipeline.models import MAX_ITERATION
from pipeline.store import keys
from tests.support import wait_until
from tests.support.entry import hand_built, refusal
from tests.support.hostile import HOSTILE_WORKER, SECRET, log_of, new_run_id
from tests.support.rawcelery import QUEUE, entry_body, protocol2, push, sign, task_meta
from tests.support.submissions import CONFIG
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.integration

WORKER = HOSTILE_WORKER


def _send(r: redis.Redis, sub: dict[str, Any], config: dict[str, Any] | None = None) -> str:
    """Push one signed entry message under a fresh task id; returns the id."""
    task_id = str(uuid.uuid4())
    push(r, keys.TASK_SUBMIT, task_id, entry_body(sub, task_id, config or CONFIG, SECRET))
    return task_id


def _refused_in_log(worker: WorkerProcess, task_id: str, reason: str) -> bool:
    """The worker logged its refusal of task ``task_id`` for ``reason``."""
    return any(task_id in line and reason in line for line in log_of(worker).splitlines())


# --- item 1: an entry task id is claimed fleet-wide ---------------------------------------------


def test_another_runs_entry_id_is_refused_and_the_verdict_under_it_is_kept(
    worker: WorkerProcess, r: redis.Redis
) -> None:
    """An entry of run B sent under run A's finished entry id is refused: A's verdict record is
    left byte for byte, B starts no pass, and the id's claim still names A."""
    from workers import runtime

    victim, attacker = new_run_id("victim"), new_run_id("attacker")
    task_id = _send(r, hand_built(victim))
    assert task_meta(r, task_id)["result"]["run_id"] == victim
    before = r.get(f"celery-task-meta-{task_id}")
    push(r, keys.TASK_SUBMIT, task_id, entry_body(hand_built(attacker), task_id, CONFIG, SECRET))
    wait_until(
        lambda: _refused_in_log(worker, task_id, "another run's entry"),
        60,
        what="the worker to refuse the reused entry id",
    )
    assert r.get(f"celery-task-meta-{task_id}") == before
    runs = runtime.stores().runs
    assert runs.submitted(attacker) == {} and runs.pass_results(attacker) == []
    assert (runs.entry_claim(task_id) or {}).get("run_id") == victim


def test_a_claimed_entry_id_gets_no_failure_from_another_run_or_from_garbage(
    worker: WorkerProcess, r: redis.Redis
) -> None:
    """While the id's own pass is in flight (its claim made, no verdict yet), neither another
    run's signed entry nor unsigned garbage sent under the id writes anything there: its
    manager never reads someone else's FAILURE (or verdict) under its own id."""
    from workers import runtime

    task_id = str(uuid.uuid4())
    runtime.stores().runs.claim_entry(new_run_id("inflight"), 1, "w1", task_id, "p" + "0" * 15)
    push(
        r,
        keys.TASK_SUBMIT,
        task_id,
        entry_body(hand_built(new_run_id("b")), task_id, CONFIG, SECRET),
    )
    push(r, keys.TASK_SUBMIT, task_id, {"v": 1, "garbage": True})
    wait_until(
        lambda: (
            _refused_in_log(worker, task_id, "another run's entry")
            and _refused_in_log(worker, task_id, "unsigned message")
        ),
        60,
        what="both messages under the claimed id to be refused",
    )
    assert r.get(f"celery-task-meta-{task_id}") is None


def test_an_unclaimed_id_still_gets_its_one_line_refusal(
    worker: WorkerProcess, r: redis.Redis
) -> None:
    """The claim rule costs honest senders nothing: a refused entry under its own fresh id still
    gets its one-line FAILURE there."""
    task_id = _send(r, {**hand_built(new_run_id("own")), "iteration": 0})
    exc_type, reason = refusal(task_meta(r, task_id))
    assert exc_type == "SubmissionError" and "iteration" in reason, reason


# --- item 5: configuration caches are bounded ---------------------------------------------------


def _stats(worker: WorkerProcess) -> dict[str, Any]:
    from workers.app import app

    got = app.control.inspect(destination=[worker.nodename], timeout=5.0).stats() or {}
    caches: dict[str, Any] = (got.get(worker.nodename) or {}).get("critique_caches") or {}
    return caches


def test_a_stream_of_distinct_configurations_leaves_the_caches_bounded(
    worker: WorkerProcess, r: redis.Redis
) -> None:
    """More valid entries than the cache holds, each with its own min_score_to_complete (the
    attack that grew a worker ~31 KB per configuration): every one gets its verdict, and the
    worker's configuration and context caches (as `inspect stats` reports them) stay within
    their bound, the oldest evicted."""
    from workers import runtime

    cap = runtime.CONFIG_CACHE_MAX
    extra = 24
    run_id = new_run_id("configs")
    ids = [
        _send(
            r,
            hand_built(run_id, worker_id=f"w{i}"),
            {**CONFIG, "min_score_to_complete": round(0.1 + i / (4 * cap), 6)},
        )
        for i in range(cap + extra)
    ]
    for task_id in ids:
        assert task_meta(r, task_id, timeout=300)["status"] == "SUCCESS"
    caches = _stats(worker)
    assert caches["max"] == cap
    assert caches["configs"] <= cap + 1 and caches["contexts"] <= cap + 1, caches
    assert caches["configs_evicted"] >= extra and caches["contexts_evicted"] >= extra, caches


# --- entry decoding: depth, booleans, bounds ------------------------------------------------------


def _raw_entry(r: redis.Redis, entry_json: str) -> str:
    """LPUSH an entry whose JSON text is given as is (deeper than json.dumps can write here)."""
    task_id = str(uuid.uuid4())
    message = json.loads(protocol2(keys.TASK_SUBMIT, task_id, [None]))
    payload = "[[" + entry_json + '],{},{"callbacks":null,"errbacks":null,"chain":null}]'
    message["body"] = base64.b64encode(payload.encode()).decode()
    r.lpush(QUEUE, json.dumps(message))
    return task_id


@pytest.mark.parametrize("depth", [150, 900])
def test_an_over_deep_entry_gets_a_one_line_failure(
    worker: WorkerProcess, r: redis.Redis, depth: int
) -> None:
    """An entry nested past the bound (signed or not; 900 is past what the signature's
    canonical JSON can encode on a worker, and is refused at the worker's door before the task
    runs) fails at once with one line under its id, instead of being dropped with its sender
    waiting."""
    nest = "[" * depth + "]" * depth
    entry = '{"v":1,"submission":{"run_id":"deep-1","output":{"x":' + nest + '}},"sig":"x"}'
    exc_type, reason = refusal(task_meta(r, _raw_entry(r, entry)))
    assert exc_type == "SubmissionError" and "nested more than" in reason, reason


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda body: body.update(v=True), "'v' must be the integer 1"),
        (lambda body: body["submission"].update(iteration=True), "iteration"),
        (lambda body: body["submission"].update(iteration=10**300), "iteration"),
        (lambda body: body["submission"].update(iteration=MAX_ITERATION + 1), "iteration"),
    ],
    ids=["v-true", "iteration-true", "iteration-10e300", "iteration-over-max"],
)
def test_booleans_and_unbounded_numbers_are_refused_in_one_line(
    worker: WorkerProcess, r: redis.Redis, change: Any, says: str
) -> None:
    """`v: true` and `iteration: true` no longer read as 1, and an iteration past the bound
    (10**300 made `critique report` exit 2) is refused: a signed entry fails with one line
    naming the field, and no pass starts."""
    from workers import runtime

    run_id = new_run_id("numbers")
    task_id = str(uuid.uuid4())
    body = {
        "v": 1,
        "submission": hand_built(run_id),
        "config": CONFIG,
        "task_name": keys.TASK_SUBMIT,
        "task_id": task_id,
    }
    change(body)
    push(r, keys.TASK_SUBMIT, task_id, sign(body, SECRET))
    exc_type, reason = refusal(task_meta(r, task_id))
    assert exc_type == "SubmissionError" and says in reason, reason
    assert runtime.stores().runs.submitted(run_id) == {}
