"""``critique cancel`` and ``CritiqueClient.cancel`` against a real Redis, a real worker
process and the fake OpenAI-compatible server (the only faked part): cancelled passes end
``cancelled``, hold no budget lease, get no later result and make no later model call."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pipeline.models import Submission
from pipeline.store import keys
from tests.fakes.openai_server import (
    CRITIC,
    REPAIR,
    FakeOpenAIServer,
    reply,
    system_text,
    user_text,
)
from tests.integration.test_llm_e2e import critique, defect
from tests.support import wait_until
from tests.support.workers import ROOT, WorkerProcess, WorkerSpec, llm_env
from workers.cli import main

pytestmark = pytest.mark.integration

CRITIC_MODEL = "openai/critic-model"
WORKER_MODEL = "openai/worker-model"
CONFIG = {
    "enabled": True,
    "critic": "llm",
    "model": CRITIC_MODEL,
    "budget": {"total_tokens": 10_000_000},
}
LLM_DELAY_S = 0.5
"""How long the fake LLM takes to answer each call: passes stay in flight."""
WORKER_ID = re.compile(r"cx-\d{3}")
"""The worker ids of the big run, as they appear in every prompt about their output."""


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def env(redis_url: str, fake: FakeOpenAIServer) -> Iterator[dict[str, str]]:
    """This process and the worker share the worker database; the worker's LLM calls go to
    the fake (worker-only settings, through the environment)."""
    with llm_env(
        redis_url,
        fake.api_base,
        CRITIQUE_ALLOWED_MODELS=f"{CRITIC_MODEL},{WORKER_MODEL}",
        CRITIQUE_LLM__MAX_RETRIES="0",
    ) as e:
        yield e


WORKER = WorkerSpec("cancel", concurrency=4)
"""One worker process, four threads, on critique.cpu and critique.llm."""


@pytest.fixture()
def llm(fake: FakeOpenAIServer) -> FakeOpenAIServer:
    """The fake, answering slowly: the critic finds a critical defect in an output until it
    was repaired (the repair adds ``FIXED``), so each pass reserves a repair lease."""
    fake.reset()

    def critic(body: dict[str, Any]) -> dict[str, Any]:
        fixed = "FIXED" in user_text(body)
        defects = [] if fixed else [defect("missing_data", "the findings name no region")]
        return reply(critique(0.95 if fixed else 0.4, *defects), delay_s=LLM_DELAY_S)

    def repair(body: dict[str, Any]) -> dict[str, Any]:
        worker = WORKER_ID.search(user_text(body))
        text = json.dumps(_output(worker.group() if worker else "cx-000", "FIXED"))
        return reply(text, delay_s=LLM_DELAY_S)

    return fake.on(CRITIC, critic).on(REPAIR, repair)


def _output(worker: str, extra: str = "") -> dict[str, Any]:
    return {
        "summary": f"Sales rose 4% in Q3 (report {worker}). {extra}".strip(),
        "findings": "The north grew fastest.",
        "confidence": 0.9,
    }


def _sub(run_id: str, worker: str) -> Submission:
    return Submission(
        run_id=run_id,
        worker_id=worker,
        task="Summarise the quarterly sales report: give a summary and the key findings.",
        output=_output(worker),
        required_fields=("summary", "findings"),
        model=WORKER_MODEL,
    )


def _store() -> redis.Redis:
    from workers import runtime

    client: redis.Redis = runtime.client()
    return client


def _run_key(run_id: str, suffix: str) -> str:
    return keys.run_key(run_id, suffix)


def _idle(env: dict[str, str]) -> bool:
    """The broker holds no message for the worker: its queues are empty and nothing is
    unacknowledged (taken by a worker and not yet done)."""
    broker = redis.Redis.from_url(env["REDIS_URL"])
    try:
        queued = sum(int(broker.llen(q)) for q in keys.QUEUES)
        return queued == 0 and int(broker.hlen("unacked")) == 0
    finally:
        broker.close()


def _settled(env: dict[str, str]) -> bool:
    """Idle, and still idle a moment later (a task that just finished may send nothing more)."""
    if not _idle(env):
        return False
    time.sleep(0.5)
    return _idle(env)


# --- without a worker: the command's answers --------------------------------------------------


@pytest.fixture()
def no_worker_queues(env: dict[str, str]) -> Iterator[None]:
    """The messages a test enqueues with no worker running are dropped when it ends."""
    yield
    broker = redis.Redis.from_url(env["REDIS_URL"])
    broker.delete(*keys.QUEUES)
    broker.close()


def test_cancel_of_an_unknown_run_or_worker_exits_2_saying_so(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], no_worker_queues: None
) -> None:
    """An unknown run: exit 2, one line naming it; a worker with no submission in a known
    run: exit 2 naming the worker; nothing is cancelled either time."""
    from workers.client import CritiqueClient

    assert main(["cancel", "no-such-run"]) == 2
    err = capsys.readouterr().err
    assert "no submission of run 'no-such-run'" in err and err.count("\n") == 1

    run_id = f"cx-{uuid.uuid4().hex[:8]}"
    [handle] = CritiqueClient({"enabled": True}).submit_many(
        [_sub(run_id, "cx-001").model_copy(update={"model": None})]
    )
    assert main(["cancel", run_id, "--worker", "nobody"]) == 2
    assert "has no submission from ['nobody']" in capsys.readouterr().err
    assert CritiqueClient().result(handle) is None


def test_a_queued_pass_is_cancelled_by_the_cli_and_the_trace_says_by_whom(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], no_worker_queues: None
) -> None:
    """No worker runs: `critique cancel RUN --by ops` ends the queued pass `cancelled` (no
    score), `wait` returns it, the trace has a `cancelled` event by ops and one result event;
    a second cancel finds nothing left (exit 0, already finished 1)."""
    from workers.client import CritiqueClient

    run_id = f"cx-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient({"enabled": True})
    [handle] = client.submit_many([_sub(run_id, "cx-001").model_copy(update={"model": None})])
    assert main(["cancel", run_id, "--by", "ops", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (
        doc["cancelled"] == [{"iteration": 1, "worker_id": "cx-001", "pass_id": handle.pass_id}]
        and doc["by"] == "ops"
    )
    result = client.wait(handle, timeout=5)
    assert (result.status, result.stop_reason, result.best_score) == (
        "cancelled",
        "cancelled",
        None,
    )
    events = [e for e in client.trace(run_id) if e.get("pass_id") == handle.pass_id]
    assert [(e["type"], e.get("by")) for e in events if e["type"] == "cancelled"] == [
        ("cancelled", "ops")
    ]
    assert [e["status"] for e in events if e["type"] == "result"] == ["cancelled"]
    assert _store().zcard(_run_key(run_id, keys.PENDING)) == 0  # nothing re-drives it

    assert main(["cancel", run_id]) == 0
    assert "nothing left to cancel" in capsys.readouterr().out


def test_a_signed_run_is_not_cancelled_without_the_workers_secret(
    env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    no_worker_queues: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Passes signed with CRITIQUE_SECRET: a cancel with no secret, or another one, exits 2
    naming CRITIQUE_SECRET and writes nothing (its results would not verify); with the
    workers' secret it cancels."""
    from workers.client import CritiqueClient

    monkeypatch.setenv("CRITIQUE_SECRET", "the-fleet-secret-0123456789abcdef")
    run_id = f"cx-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient({"enabled": True})
    [handle] = client.submit_many([_sub(run_id, "cx-001").model_copy(update={"model": None})])
    for secret in (None, "another-secret-0123456789abcdefgh"):
        if secret is None:
            monkeypatch.delenv("CRITIQUE_SECRET")
        else:
            monkeypatch.setenv("CRITIQUE_SECRET", secret)
        assert main(["cancel", run_id]) == 2
        assert "CRITIQUE_SECRET" in capsys.readouterr().err
        assert not _store().hexists(
            _run_key(run_id, keys.PASS_RESULTS), f"1:cx-001:{handle.pass_id}"
        )
    monkeypatch.setenv("CRITIQUE_SECRET", "the-fleet-secret-0123456789abcdef")
    assert main(["cancel", run_id]) == 0
    assert client.wait(handle, timeout=5).status == "cancelled"


def test_a_worker_stage_asks_its_own_pass_before_the_model_call(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A critic stage run as a worker runs it (steps.run_stage, this process, the real
    store): once its pass was cancelled the stage raises PassCancelled before its LLM critic
    is called; another pass of the same submission, not cancelled, is critiqued."""
    from pipeline.loop.stages import PassCancelled, start
    from pipeline.wiring import make_context
    from tests.unit.test_runner import SpendingCritic
    from workers import cancelling, runtime, tasks
    from workers.steps import Step, run_stage

    critic = SpendingCritic()
    ctx = make_context(runtime.config_for({"enabled": True}), critic=critic)
    monkeypatch.setattr(runtime._contexts, "get", lambda key: ctx)  # the worker's, ours
    run_id = f"cx-{uuid.uuid4().hex[:8]}"
    sub = _sub(run_id, "cx-001").model_copy(update={"model": None})

    def before(pass_id: str) -> Step:
        state = start(sub, pass_id).model_copy(update={"next": "critic"})
        return Step({}, state, {"enabled": True})

    cancelling.cancel_pass(run_id, 1, "cx-001", "p-cancelled", by="test")
    with pytest.raises(PassCancelled):
        run_stage(tasks.critic, "critic", before("p-cancelled"))
    assert critic.rounds == []
    run_stage(tasks.critic, "critic", before("p-live"))
    assert critic.rounds == [1]


# --- with a worker: passes in flight and queued ------------------------------------------------


def test_client_cancel_of_one_handle_stops_its_pass_in_flight_only(
    worker: WorkerProcess, llm: FakeOpenAIServer
) -> None:
    """Two passes; the first one's repair call is in flight when its handle is cancelled: it
    ends `cancelled` (wait returns it, its task id's Celery result says so), makes no model
    call after the cancel (no re-critique), holds no lease, and the budget is charged what its
    repair spent; the other pass of the run ends with its own verdict."""
    from workers import runtime
    from workers.app import app
    from workers.client import CritiqueClient

    run_id = f"cx-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(CONFIG)
    first, second = client.submit_many([_sub(run_id, "cx-001"), _sub(run_id, "cx-002")])
    wait_until(lambda: _calls_for(llm, {"cx-001"}, 0.0, REPAIR), 30, what="cx-001's repair")
    report = client.cancel(first)
    cancelled_at = time.monotonic()
    assert report.cancelled == (f"1:cx-001:{first.pass_id}",) and report.by == "client"
    assert client.wait(first, timeout=5).status == "cancelled"
    assert app.AsyncResult(first.task_id).get(timeout=5)["status"] == "cancelled"
    other = client.wait(second, timeout=60)
    assert other.status == "repaired"
    wait_until(lambda: _settled(worker.env), 30, what="the worker to go idle")
    assert _calls_for(llm, {"cx-001"}, cancelled_at + 1.0) == []
    budget = runtime.stores().budget
    assert budget.holds(run_id) == {}
    [repair] = [r for r in llm.requests if _about(r, {"cx-001"}, REPAIR)]
    assert budget.spent(run_id) == other.budget_charged + repair["usage"]["total_tokens"]


def _about(record: dict[str, Any], workers: set[str], marker: str = "") -> bool:
    """A recorded model call about one of ``workers``' outputs (whose system message holds
    ``marker``)."""
    body = record["body"]
    if record["path"] != "/chat/completions" or marker not in system_text(body):
        return False
    found = WORKER_ID.search(user_text(body))
    return found is not None and found.group() in workers


def _calls_for(
    llm: FakeOpenAIServer, workers: set[str], after: float, marker: str = ""
) -> list[dict[str, Any]]:
    """The model calls about ``workers``' outputs (with ``marker`` in their system message)
    that arrived after ``after`` (``time.monotonic()``)."""
    return [r for r in llm.requests if r["at"] > after and _about(r, workers, marker)]


FIRST = 4
"""Submissions of the big run that finish before the rest is submitted and cancelled."""


def test_cancel_of_200_passes_in_flight_and_queued(
    worker: WorkerProcess, llm: FakeOpenAIServer
) -> None:
    """200 submissions with a slow LLM critic; `critique cancel RUN` (a process) while some
    are in flight, some hold repair leases and most are queued. Once the worker is idle: every
    one has a result, `cancelled` for each pass the command reported (the rest finished before
    it: the two counts make 200); no budget lease is live or waiting; each cancelled pass has
    exactly one result event, the cancel's; and the fake LLM got no call about a cancelled
    pass after the cancel (but for the moment a call already past its check needs)."""
    from workers import runtime
    from workers.client import CritiqueClient

    run_id = f"cx-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(CONFIG)
    handles = client.submit_many([_sub(run_id, f"cx-{i:03d}") for i in range(FIRST)])
    client.wait_many(handles, timeout=60)  # these finish before the cancel
    handles += client.submit_many([_sub(run_id, f"cx-{i:03d}") for i in range(FIRST, 200)])
    budget = runtime.stores().budget
    wait_until(lambda: budget.snapshot(run_id).holders >= 2, 30, what="repairs holding leases")

    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", "cancel", run_id, "--by", "ops-test", "--json"],
        cwd=ROOT,
        env={**os.environ, **worker.env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    cancelled_at = time.monotonic()
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    cancelled = {p["worker_id"] for p in report["cancelled"]}
    finished = {p["worker_id"] for p in report["already_finished"]}
    assert len(cancelled) + len(finished) == 200 and not cancelled & finished
    assert len(finished) >= FIRST and len(cancelled) > 150  # most were still queued

    wait_until(lambda: _settled(worker.env), 45, what="the worker to go idle")
    results = {h.worker_id: client.result(h) for h in handles}
    assert all(r is not None for r in results.values())
    assert {w for w, r in results.items() if r and r.status == "cancelled"} == cancelled
    assert budget.holds(run_id) == {}
    assert _store().zcard(_run_key(run_id, keys.BUDGET_WAITING)) == 0
    assert _store().zcard(_run_key(run_id, keys.PENDING)) == 0

    by_pass: dict[str, list[dict[str, Any]]] = {}
    for e in client.trace(run_id):
        if e.get("type") in ("result", "cancelled"):
            by_pass.setdefault(str(e.get("worker_id")), []).append(e)
    for w in cancelled:
        got = [(e["type"], e.get("status"), e.get("by")) for e in by_pass[w]]
        assert got == [("cancelled", None, "ops-test"), ("result", "cancelled", None)], w
    for w in finished:
        assert [e["type"] for e in by_pass[w]] == ["result"] and results[w].status == "repaired"
    assert _calls_for(llm, cancelled, cancelled_at + 1.0) == []
