"""A client whose CRITIQUE_SECRET is not the workers' (another one, or none) is refused at the
door, on a real Redis and real workers: before it begins a pass or enqueues anything, from the
posture the workers publish (pipeline.security.posture), so the run's finished results stay finished
instead of turning into passes no worker will ever run; and a message the workers refuse never
turns a finished pass back into pending either."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pipeline.errors import ConfigError
from pipeline.loop.stages import start
from pipeline.models import Submission
from pipeline.store import keys
from tests.support import wait_until
from tests.support.rawcelery import entry_body, push
from tests.support.workers import ROOT, WorkerStarter, client_on, worker_db_url, worker_env

pytestmark = pytest.mark.integration

WORKERS_KEY = "w" * 64
MANAGERS_TYPO = "m" * 64


@pytest.fixture
def signed(redis_url: str) -> Iterator[str]:
    """This process's client on the workers' database with the workers' key (flushed for each
    test); the test starts the worker that holds the same key."""
    url = worker_db_url(redis_url)
    with client_on(url, CRITIQUE_SECRET=WORKERS_KEY) as env:
        yield env["REDIS_URL"]


def _subs() -> list[Submission]:
    return [
        Submission(
            run_id="mk",
            worker_id=f"w{i}",
            task="Summarise",
            output={"summary": "Sales rose 4%.", "findings": "Two stores."},
            required_fields=("summary", "findings"),
        )
        for i in range(3)
    ]


def _finished_run(client: Any) -> None:
    """Submit the three outputs of run ``mk`` and wait for their verdicts."""
    done = client.wait_many(client.submit_many(_subs()), timeout=60)
    assert [r.worker_id for r in done] == ["w0", "w1", "w2"] and all(r.checked for r in done)


def test_a_mis_keyed_resubmit_is_refused_and_the_finished_results_stay(
    signed: str, start_worker: WorkerStarter
) -> None:
    from workers.client import CritiqueClient
    from workers.commands._runs import load_snapshot

    start_worker("mismatch", worker_env(signed, CRITIQUE_SECRET=WORKERS_KEY))

    client = CritiqueClient()
    _finished_run(client)
    os.environ["CRITIQUE_SECRET"] = MANAGERS_TYPO
    try:
        with pytest.raises(ConfigError) as err:
            client.submit_many(_subs())
        text = str(err.value)
        assert "does not verify with this process's CRITIQUE_SECRET" in text
        assert "nothing was submitted" in text and "compare the manager's CRITIQUE_SECRET" in text
    finally:
        os.environ["CRITIQUE_SECRET"] = WORKERS_KEY
    snap = load_snapshot("mk")
    assert len(snap.results) == 3 and snap.pending == [] and snap.failed == []
    _finished_run(client)  # the right key: fine


def _posture_published(url: str) -> None:
    """Wait until a worker has published the fleet's posture (its sweeper's first tick)."""
    r = redis.Redis.from_url(url)
    try:
        wait_until(lambda: r.exists(keys.shared_key(keys.FLEET_POSTURE)), 30, what="the posture")
    finally:
        r.close()


def _queued(r: redis.Redis) -> dict[str, int]:
    """The length of every broker queue list (the product's queues and their priority lists)."""
    return {
        k.decode(): r.llen(k)
        for k in r.scan_iter(match="critique.*", _type="list")  # store keys are critique:…
    }


def _cli(
    env: dict[str, str], *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def _status(env: dict[str, str], run_id: str) -> dict[str, Any]:
    done = _cli(env, "status", run_id, "--json")
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def test_submit_wait_without_the_secret_exits_2_at_once_and_enqueues_nothing(
    signed: str, start_worker: WorkerStarter, tmp_path: Any
) -> None:
    """`critique submit FILE --wait` with no CRITIQUE_SECRET into a signed fleet: exit 2 within
    seconds (not at the 300 s timeout), one line naming CRITIQUE_SECRET, no queue grew, no run
    record written, and `critique status` of the earlier finished run is unchanged."""
    from workers.client import CritiqueClient

    start_worker("posture", worker_env(signed, CRITIQUE_SECRET=WORKERS_KEY))
    _finished_run(CritiqueClient())
    _posture_published(signed)
    operator = worker_env(signed, CRITIQUE_SECRET=WORKERS_KEY)
    before = _status(operator, "mk")
    assert (before["finished"], before["pending"]) == (3, [])
    fresh = f"fresh-{uuid.uuid4().hex[:8]}"
    lines = [s.model_dump(mode="json") for s in _subs()]
    lines.append({"run_id": fresh, "worker_id": "w1", "task": "t", "output": "ok"})
    path = tmp_path / "subs.jsonl"
    path.write_text("\n".join(json.dumps(doc) for doc in lines) + "\n")
    r = redis.Redis.from_url(signed)
    queued = _queued(r)
    no_secret = {k: v for k, v in operator.items() if k != "CRITIQUE_SECRET"}
    began = time.monotonic()
    done = _cli(no_secret, "submit", str(path), "--wait")
    took = time.monotonic() - began
    assert done.returncode == 2, done.stderr
    assert took < 60  # the default --timeout is 300 s
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("critique submit: the workers require signed messages")
    assert (
        "this process has no CRITIQUE_SECRET" in done.stderr
        and "hint: set CRITIQUE_SECRET" in done.stderr
    )
    assert _queued(r) == queued
    assert not list(r.scan_iter(match=keys.run_key_pattern(fresh)))
    assert _status(operator, "mk") == before
    r.close()


def test_a_client_without_the_secret_is_refused_before_any_pass_begins(
    signed: str, start_worker: WorkerStarter
) -> None:
    """In-process: with CRITIQUE_SECRET unset, submit_many, complete_gate and resume raise one
    ConfigError naming it before they send anything; the finished run stays finished."""
    from workers.client import CritiqueClient, Handle
    from workers.commands._runs import load_snapshot

    start_worker("posture", worker_env(signed, CRITIQUE_SECRET=WORKERS_KEY))
    client = CritiqueClient()
    _finished_run(client)
    _posture_published(signed)
    r = redis.Redis.from_url(signed)
    queued = _queued(r)
    submitted = load_snapshot("mk").submitted
    del os.environ["CRITIQUE_SECRET"]
    try:
        calls = [
            lambda: client.submit_many(_subs()),
            lambda: client.complete_gate("mk", "done"),
            lambda: client.resume(Handle("mk", 1, "w0", "")),
        ]
        for call in calls:
            with pytest.raises(ConfigError) as err:
                call()
            assert err.value.key == "CRITIQUE_SECRET"
            assert "this process has no CRITIQUE_SECRET" in str(err.value)
    finally:
        os.environ["CRITIQUE_SECRET"] = WORKERS_KEY
    assert _queued(r) == queued
    snap = load_snapshot("mk")
    assert snap.submitted == submitted and len(snap.results) == 3 and snap.pending == []
    r.close()


def test_a_fresh_run_with_another_secret_is_refused_at_the_door(
    signed: str, start_worker: WorkerStarter
) -> None:
    """A fresh run (no stored result to compare) submitted with another secret: exit 2 at
    once, "another secret", from the posture's key ids."""
    start_worker("mismatch", worker_env(signed, CRITIQUE_SECRET=WORKERS_KEY))
    _posture_published(signed)
    line = json.dumps({"run_id": "fresh-mk", "worker_id": "w1", "task": "t", "output": "ok"})
    done = _cli(
        worker_env(signed, CRITIQUE_SECRET=MANAGERS_TYPO), "submit", "-", "--wait", stdin=line
    )
    assert done.returncode == 2, done.stderr
    assert "this process's CRITIQUE_SECRET is another secret than the workers'" in done.stderr
    assert "compare the manager's CRITIQUE_SECRET with the workers'" in done.stderr


def test_an_older_fleet_without_a_posture_still_says_why_at_the_timeout(
    signed: str, start_worker: WorkerStarter
) -> None:
    """No posture record (workers that publish none): the submit proceeds as before, and
    --wait times out naming the workers' refusal and the secret to compare, not "is a worker
    consuming …?"."""
    # One sweeper tick an hour: the posture it published first is removed, as an older fleet.
    start_worker(
        "mismatch", worker_env(signed, CRITIQUE_SECRET=WORKERS_KEY, CRITIQUE_SWEEP_S="3600")
    )
    _posture_published(signed)
    redis.Redis.from_url(signed).delete(keys.shared_key(keys.FLEET_POSTURE))
    line = json.dumps({"run_id": "fresh-mk", "worker_id": "w1", "task": "t", "output": "ok"})
    done = _cli(
        worker_env(signed, CRITIQUE_SECRET=MANAGERS_TYPO),
        *("submit", "-", "--wait", "--timeout", "4"),
        stdin=line,
    )
    assert done.returncode == 1, done.stderr
    assert "a worker refused 1 message(s) claiming this run since the submit: " in done.stderr
    assert "bad signature" in done.stderr
    assert "compare the manager's CRITIQUE_SECRET with the workers'" in done.stderr
    assert "is a worker consuming" not in done.stderr


def test_refused_unsigned_messages_never_turn_a_finished_pass_back_into_pending(
    signed: str, start_worker: WorkerStarter
) -> None:
    """A finished run, then unsigned raw messages for the same (run, iteration, worker) pushed
    onto the broker (a stage message under its finished pass, one under a new pass, and an
    entry message): each is refused, and status still reports the submission finished."""
    from workers.client import CritiqueClient
    from workers.commands._runs import load_snapshot

    start_worker("refused", worker_env(signed, CRITIQUE_SECRET=WORKERS_KEY))
    client = CritiqueClient()
    _finished_run(client)
    before = load_snapshot("mk")
    sub = _subs()[0]
    finished_pass = str(before.submitted["1:w0"]["sid"])
    r = redis.Redis.from_url(signed)
    for pass_id in (finished_pass, uuid.uuid4().hex[:16]):
        task_id = str(uuid.uuid4())
        msg = {
            "v": 1,
            "sid": pass_id,
            "config": {},
            "state": start(sub, pass_id).model_dump_json(),
            "task_name": keys.TASK_L0,
            "task_id": task_id,
        }
        push(r, keys.TASK_L0, task_id, msg)
    task_id = str(uuid.uuid4())
    push(r, keys.TASK_SUBMIT, task_id, entry_body(sub.model_dump(mode="json"), task_id))

    def refused() -> list[dict[str, Any]]:
        got = [e for e in client.trace("mk") if e.get("type") == "refused"]
        return got if len(got) >= 3 else []

    events = wait_until(refused, 30, what="the workers' three refusals")
    assert {e["error"] for e in events} == {"ForgedMessageError"}
    snap = load_snapshot("mk")
    assert snap.submitted == before.submitted and snap.pending == [] and snap.failed == []
    assert [r.model_dump() for r in snap.results] == [r.model_dump() for r in before.results]
    r.close()
