"""Passes (one critique of one submission) and effects written once, on a real Redis with a real
worker process: a resubmission is critiqued afresh and ``wait`` answers with its own pass; a
stage or gate delivered twice leaves no lease held, reserves once, charges once and writes one
result event."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.config import load_config
from pipeline.loop.stages import run_submission, start
from pipeline.models import Submission
from pipeline.store import keys
from pipeline.store.memory import MemoryPatternStore
from pipeline.wiring import make_context
from tests.support import wait_until
from tests.support.revisers import estimating_revise
from tests.support.submissions import make_sub
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url

pytestmark = pytest.mark.integration

CONFIG: dict[str, Any] = {"enabled": True, "budget": {"total_tokens": 2_000_000}}


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    """This process and the worker share the worker database of the test Redis."""
    with client_on(worker_db_url(redis_url), CRITIQUE_LEASE_TTL_S="30", CRITIQUE_STALL_S="60") as e:
        yield e


WORKER = WorkerSpec(
    "passes", more_env={"CRITIQUE_REPAIRER": "tests.support.revisers:estimating_revise"}
)
"""One worker (threads, 4) whose reviser spends (estimated) tokens, so repair rounds
reserve and charge budget (the default deterministic reviser is token-free)."""


def _run_id(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _leases(run_id: str) -> list[str]:
    from workers import runtime

    raw = runtime.client().hkeys(keys.run_key(run_id, keys.BUDGET_LEASES))
    return sorted(k.decode() for k in raw)


def _reference_patterns(passes: list[tuple[Submission, str]]) -> dict[tuple[str, str], int]:
    """Pattern frequencies of these passes through the broker-free runner."""
    patterns = MemoryPatternStore()
    ctx = make_context(
        load_config(env={}, overrides=CONFIG), patterns=patterns, reviser=estimating_revise
    )
    for sub, pass_id in passes:
        run_submission(sub, ctx, pass_id=pass_id)
    run_id = passes[0][0].run_id
    return {(p.category, p.prevention_rule): p.frequency for p in patterns.top(run_id, 1000)}


def test_a_resubmission_is_a_new_pass_and_wait_answers_with_its_own(
    worker: WorkerProcess,
) -> None:
    """Same (run, iteration, worker), a new output: with no worker running, ``wait`` on the new
    handle times out (never the old verdict) and the old result leaves ``results``; once a
    worker runs, the new pass gets its own verdict, its own lease and its own pattern counts,
    while the first handle still reads the first pass's result."""
    from workers import runtime
    from workers.client import CritiqueClient, CritiqueTimeout

    client = CritiqueClient(CONFIG)
    run_id = _run_id("resub")
    first_sub = make_sub(run_id, "w1", 1, "looping")
    h1 = client.submit(first_sub)
    r1 = client.wait(h1, timeout=60)
    assert r1.status == "repaired" and r1.pass_id == h1.pass_id
    worker.stop()
    try:
        second_sub = make_sub(run_id, "w1", 1, "dup_heading")
        h2 = client.submit(second_sub)
        assert h2.pass_id and h2.pass_id != h1.pass_id
        with pytest.raises(CritiqueTimeout):
            client.wait(h2, timeout=2)
        assert client.result(h2) is None
        assert client.results(run_id) == []  # the latest pass has no result yet
        assert client.result(h1) == r1  # the first pass's own result stays readable
    finally:
        worker.start()
    r2 = client.wait(h2, timeout=60)
    assert r2.pass_id == h2.pass_id
    assert r2.status == "repaired" and "Findings (2)" in str(r2.output)
    assert r2.output != r1.output
    assert client.results(run_id) == [r2]
    assert client.result(h1) == r1

    s = runtime.stores()
    assert r1.budget_charged > 0 and r2.budget_charged > 0
    assert s.budget.spent(run_id) == r1.budget_charged + r2.budget_charged
    assert s.budget.holds(run_id) == {}
    leases = _leases(run_id)
    assert leases == sorted(
        f"w1:1:{h.pass_id}:{a.attempt}" for h, r in ((h1, r1), (h2, r2)) for a in r.attempts
    )
    got = {(p.category, p.prevention_rule): p.frequency for p in s.patterns.top(run_id, 1000)}
    assert got == _reference_patterns([(first_sub, h1.pass_id), (second_sub, h2.pass_id)])
    events = list(client.trace(run_id))
    assert Counter(e.get("pass_id") for e in events if e["type"] == "result") == {
        h1.pass_id: 1,
        h2.pass_id: 1,
    }
    assert all(e.get("pass_id") in (h1.pass_id, h2.pass_id) for e in events)


def _decide_message(run_id: str) -> dict[str, Any]:
    """The message a decide stage gets for a repairable submission (its l0 and critic stages
    run here, through the task bodies)."""
    from workers import runtime, tasks

    sub = make_sub(run_id, "w1", 1, "looping")
    msg = runtime.encode(start(sub, runtime.new_pass_id()), CONFIG)
    msg = tasks._stage(tasks.l0, msg, "l0")[0]
    msg = tasks._stage(tasks.critic, msg, "critic")[0]  # the stage alone (its task decides too)
    assert runtime.decode(msg)[0].next == "decide"
    return msg


def _settled(run_id: str, pass_id: str, sent: list[Any], timeout: float = 30) -> None:
    """Wait until the pass's result is stored and every message ``sent`` has left the broker
    (a task that replaced one keeps its id: so the duplicate chains have run out)."""
    from workers import runtime

    runs = runtime.stores().runs
    wait_until(
        lambda: (
            runs.pass_result(run_id, 1, "w1", pass_id) is not None
            and all(_left_the_broker(res.id) for res in sent)
        ),
        timeout,
        what=f"pass {pass_id} of run {run_id} to finish and its messages to be acknowledged",
    )


def _left_the_broker(task_id: str) -> bool:
    """The message of ``task_id`` is neither waiting on a queue nor delivered and still
    unacknowledged: a worker took it and (acks_late) acknowledged it after the task ran."""
    from workers import runtime

    r = runtime.client()
    tid = task_id.encode()
    queued = any(tid in m for q in keys.QUEUES for m in r.lrange(q, 0, -1))
    return not queued and not any(tid in m for m in r.hvals("unacked"))


def test_a_decide_delivered_twice_reserves_once_and_leaves_no_lease(
    worker: WorkerProcess,
) -> None:
    """The same signed decide message sent twice (both run, maybe at once, each replacing
    itself with the repair loop): one lease per attempt, charged once, none left held."""
    from workers import runtime
    from workers.app import app

    run_id = _run_id("twice")
    msg = _decide_message(run_id)
    pass_id = runtime.decode(msg)[0].pass_id
    sent = [app.send_task(keys.TASK_DECIDE, args=[msg]) for _ in range(2)]
    _settled(run_id, pass_id, sent)  # each decide repairs, re-critiques and finishes the pass
    s = runtime.stores()
    assert _leases(run_id) == [f"w1:1:{pass_id}:1"]
    assert s.budget.holds(run_id) == {}
    once = s.budget.spent(run_id)
    assert once > 0
    # A third delivery, long after: the pass is over, so it ends at once, reserving nothing.
    third = app.send_task(keys.TASK_DECIDE, args=[msg])
    _settled(run_id, pass_id, [third])
    assert (s.budget.spent(run_id), _leases(run_id), s.budget.holds(run_id)) == (
        once,
        [f"w1:1:{pass_id}:1"],
        {},
    )


def test_a_critic_delivered_twice_decides_once_and_reserves_once(worker: WorkerProcess) -> None:
    """The critic task decides inline and replaces itself with the repair round. The same
    critic message sent twice (both run, maybe at once): each step (critic, decide) is traced
    once per round, one lease per attempt, charged once, none held, one result."""
    from workers import runtime, tasks
    from workers.app import app
    from workers.client import CritiqueClient

    run_id = _run_id("critic2")
    sub = make_sub(run_id, "w1", 1, "looping")
    msg = tasks._stage(tasks.l0, runtime.encode(start(sub, runtime.new_pass_id()), CONFIG), "l0")[0]
    pass_id = runtime.decode(msg)[0].pass_id
    sent = [app.send_task(keys.TASK_CRITIC, args=[msg]) for _ in range(2)]
    _settled(run_id, pass_id, sent)
    s = runtime.stores()
    assert _leases(run_id) == [f"w1:1:{pass_id}:1"]
    assert s.budget.holds(run_id) == {}
    assert s.budget.spent(run_id) > 0
    events = list(CritiqueClient(CONFIG).trace(run_id))
    decided = Counter(e["round"] for e in events if e.get("stage") == "decide")
    critiqued = Counter(e["round"] for e in events if e.get("stage") == "critic")
    assert list(decided.values()) == list(critiqued.values()) == [1, 1]  # two rounds, once each
    assert [e["type"] for e in events].count("result") == 1


def test_a_decide_that_lost_the_race_to_a_refusal_releases_its_lease(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two deliveries of one decide race: the first, refused the budget (a filler lease held
    it), recorded repair_budget_exhausted; the second checked the step record before that
    record existed (forced here: its check answers "nothing yet"), got the budget and
    reserved. Its reservation must not stay held: the recorded refusal wins, the lease goes."""
    from pipeline.store.runs import RedisRunStore
    from workers import runtime, tasks

    run_id = _run_id("race")
    # cap 30 000; no wait, so the filler lease refuses at once
    tight = {**CONFIG, "budget": {"total_tokens": 200_000, "wait_s": 0}}
    sub = make_sub(run_id, "w1", 1, "looping")
    msg = runtime.encode(start(sub, runtime.new_pass_id()), tight)
    msg = tasks._stage(tasks.l0, msg, "l0")[0]
    msg = tasks._stage(tasks.critic, msg, "critic")[0]  # the stage alone (its task decides too)
    s = runtime.stores()
    monkeypatch.setattr(runtime.context_for(tight), "reviser", estimating_revise)
    assert s.budget.reserve(run_id, "filler:1", 30_000, 30_000, 60)
    first, next_stage = tasks._stage(tasks.decide, msg, "decide")
    assert next_stage == "done"
    assert runtime.decode(first)[0].stop_reason == "repair_budget_exhausted"
    s.budget.refund(run_id, "filler:1")
    monkeypatch.setattr(RedisRunStore, "step_output", lambda self, run, step: None)
    again, next_again = tasks._stage(tasks.decide, msg, "decide")
    assert (again, next_again) == (first, "done")
    assert s.budget.holds(run_id) == {}
    assert s.budget.snapshot(run_id).spent == 0


def test_a_gate_delivered_twice_writes_one_result_and_one_event(worker: WorkerProcess) -> None:
    """The same finished state sent to critique.gate twice: one stored result, one ``result``
    trace event (both written in one atomic step, once per pass)."""
    from workers import runtime, tasks
    from workers.app import app
    from workers.client import CritiqueClient

    run_id = _run_id("gate")
    sub = make_sub(run_id, "w1", 1, "clean")
    msg = runtime.encode(start(sub, runtime.new_pass_id()), CONFIG)
    msg = tasks._stage(tasks.l0, msg, "l0")[0]
    msg = tasks._stage(tasks.critic, msg, "critic")[0]  # the stage alone (its task decides too)
    msg, next_stage = tasks._stage(tasks.decide, msg, "decide")
    assert next_stage == "done"
    got = [app.send_task(keys.TASK_GATE, args=[msg]) for _ in range(3)]
    answers = [res.get(timeout=30) for res in got]
    assert all(a["status"] == "accepted" for a in answers)
    events = [e for e in CritiqueClient(CONFIG).trace(run_id) if e["type"] == "result"]
    assert len(events) == 1
    assert events[0]["pass_id"] == runtime.decode(msg)[0].pass_id
    [stored] = CritiqueClient(CONFIG).results(run_id)
    assert stored.status == "accepted"


def test_a_step_a_failed_delivery_recorded_is_traced_once_by_the_delivery_that_finishes(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two deliveries of one l0 message, neither marked as a repeat (a Sentinel failover hands
    out again a message the old master had given a worker; a sweeper re-drives a pass whose
    message it proved lost): the first runs Layer-0, holding its step, and its critic fails
    (the store away mid-failover), so it writes the step it held before it raises; the second
    reads no step record (its message is no known repeat) and runs the whole pass, holding
    every step until the gate. Every step's trace events are written once, whichever delivery
    wrote them: the result writes a held step's events only if no delivery recorded it."""
    from pipeline.errors import StoreUnavailableError
    from pipeline.loop import stages
    from workers import runtime, steps, tasks
    from workers.client import CritiqueClient

    run_id = _run_id("held")
    sub = make_sub(run_id, "w1", 1, "clean")
    msg = runtime.encode(start(sub, runtime.new_pass_id()), CONFIG)
    pass_id = runtime.decode(msg)[0].pass_id

    def away(state: Any, ctx: Any) -> Any:
        raise StoreUnavailableError("the store is away (a failover)")

    with monkeypatch.context() as patched:
        patched.setitem(stages.STAGES, "critic", away)
        with pytest.raises(StoreUnavailableError):
            steps.drive(tasks.l0, msg, "l0")
    latest = runtime.stores().runs.latest_step(run_id, 1, "w1", pass_id)
    assert latest is not None and latest[0].endswith(":l0")  # written as the task failed
    assert steps.drive(tasks.l0, msg, "l0")["status"] == "accepted"
    events = [(e["type"], e.get("stage")) for e in CritiqueClient(CONFIG).trace(run_id)]
    assert events == [("stage", "l0"), ("stage", "critic"), ("round", "decide"), ("result", "gate")]


def test_store_keeps_the_latest_pass_in_results(env: dict[str, str]) -> None:
    """A pass resubmitted before the first finished: the first's late result is kept under its
    pass only; ``results`` shows the latest pass's; a repeated put writes nothing."""
    from pipeline.models import CritiqueEnvelope, CritiqueResult
    from workers import runtime

    runs = runtime.stores().runs
    run_id = _run_id("latest")

    def result(pass_id: str, score: float) -> CritiqueResult:
        return CritiqueResult(
            run_id=run_id,
            worker_id="w1",
            status="accepted",
            stop_reason="accepted",
            output="ok",
            original_score=score,
            best_score=score,
            envelope=CritiqueEnvelope(worker_id="w1", score=score),
            pass_id=pass_id,
        )

    runs.begin_pass(run_id, 1, "w1", "p1")
    runs.begin_pass(run_id, 1, "w1", "p2")
    assert runs.put_result(result("p1", 0.7), pass_id="p1", events=['{"type":"result"}']) is True
    assert runs.result(run_id, 1, "w1") is None
    assert runs.put_result(result("p2", 0.9), pass_id="p2", events=['{"type":"result"}']) is True
    assert runs.put_result(result("p2", 0.9), pass_id="p2", events=['{"type":"result"}']) is False
    latest = runs.result(run_id, 1, "w1")
    assert latest is not None and latest.pass_id == "p2"
    old = runs.pass_result(run_id, 1, "w1", "p1")
    assert old is not None and old.best_score == 0.7
    assert len(runtime.stores().trace.read(run_id)) == 2


def test_a_stage_message_at_another_stage_or_without_a_pass_is_refused(
    env: dict[str, str],
) -> None:
    """Every sender sends a state to the task of its next stage, under a pass id: a message
    at another stage (Layer-0's output sent to decide), or one with no pass id, is refused
    before any stage runs, and the refusal is traced in the run it names."""
    from pipeline.errors import SubmissionError
    from workers import runtime, tasks

    run_id = _run_id("refused")
    sub = make_sub(run_id, "w1", 1, "clean")
    at_critic = tasks._stage(tasks.l0, runtime.encode(start(sub, "p1"), CONFIG), "l0")[0]
    with pytest.raises(SubmissionError, match="a decide message carries a state at 'critic'"):
        tasks._stage(tasks.decide, at_critic, "decide")
    no_pass = runtime.sign({"v": 1, "config": CONFIG, "state": start(sub).model_dump_json()})
    with pytest.raises(SubmissionError, match="no pass id"):
        tasks._stage(tasks.l0, no_pass, "l0")
    refused = [e for e in runtime.stores().trace.read(run_id) if e["type"] == "refused"]
    assert [e["stage"] for e in refused] == ["decide", "l0"]
