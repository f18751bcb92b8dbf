"""The chain on a real Redis and real Celery worker processes (no eager mode, no mocks)."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.loop.stages import start
from pipeline.models import PassRef, Submission
from pipeline.store import keys
from tests.support import wait_until
from tests.support.submissions import CONFIG, KINDS, LOOP, make_sub, reference
from tests.support.workers import WorkerProcess, WorkerSpec, WorkerStarter, client_on, worker_db_url

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dist_url(redis_url: str) -> str:
    """A database of its own for the distributed tests."""
    return worker_db_url(redis_url)


@pytest.fixture(scope="module")
def env(dist_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Point this process's client at the test Redis, as the workers are (fast redelivery)."""
    from workers.app import app

    with client_on(
        dist_url,
        CRITIQUE_VISIBILITY_TIMEOUT_S="4",
        CRITIQUE_RESTORE_INTERVAL_S="1",
        CRITIQUE_RESTORE_MUTEX_S="3",
        CRITIQUE_LEASE_TTL_S="2",
        RECORD_PITFALLS_TO=str(tmp_path_factory.mktemp("rec") / "pitfalls.txt"),
        SLOW_REVISE_S="0.4",
        CRITIQUE_STALL_S="15",  # the sweeper's backstop; a lost message is proved lost sooner
    ) as e:
        saved = app.conf.broker_transport_options
        app.conf.broker_transport_options = {"visibility_timeout": 4}
        yield e
        app.conf.broker_transport_options = saved


# A callable repairer is worker-only configuration: the worker's environment names it. It is
# the heuristic reviser that first records the Known Pitfalls it was given.
WORKER = WorkerSpec(
    "main", more_env={"CRITIQUE_REPAIRER": "tests.support.revisers:recording_revise"}
)
"""One worker process (threads pool, 4 threads) for the module."""


def test_200_submissions_from_20_workers(worker: WorkerProcess) -> None:
    """200 mixed submissions end with the right status, exact pattern counts, spend ≤ cap."""
    from workers import runtime
    from workers.client import CritiqueClient

    run_id = f"run-{uuid.uuid4().hex[:8]}"
    subs = [
        make_sub(run_id, f"w{w:02d}", it, KINDS[(w + it) % len(KINDS)])
        for w in range(20)
        for it in range(1, 11)
    ]
    client = CritiqueClient(CONFIG)
    handles = client.submit_many(subs)
    results = {f"{r.iteration}:{r.worker_id}": r for r in client.wait_many(handles, timeout=240)}

    ref, ref_patterns = reference(subs, CONFIG)
    for key, want in ref.items():
        got = results[key]
        assert (got.status, got.stop_reason) == (want.status, want.stop_reason), key
        assert got.best_score == pytest.approx(want.best_score)
    statuses = Counter(r.status for r in results.values())
    assert set(statuses) == {"accepted", "repaired", "escalated"}

    got_freq = {(p.category, p.prevention_rule): p.frequency for p in client_patterns(run_id)}
    want_freq = {
        (p.category, p.prevention_rule): p.frequency for p in ref_patterns.top(run_id, 1000)
    }
    assert got_freq == want_freq

    cfg = runtime.config_for(CONFIG)
    spent = runtime.stores().budget.spent(run_id)
    assert cfg.repair_token_cap is not None and spent <= cfg.repair_token_cap
    assert spent == sum(r.repair_usage.tokens for r in results.values())


def client_patterns(run_id: str) -> list[Any]:
    from workers import runtime

    return runtime.stores().patterns.top(run_id, 1000)


def test_tiny_budget_ends_repairs_and_keeps_the_best(worker: WorkerProcess) -> None:
    """With a tiny repair budget, repairs stop with repair_budget_exhausted; the original stays."""
    from workers.client import CritiqueClient

    run_id = f"tiny-{uuid.uuid4().hex[:8]}"
    config = {"enabled": True, "budget": {"total_tokens": 10}}
    client = CritiqueClient(config)
    subs = [make_sub(run_id, f"w{i}", 1, "looping") for i in range(5)]
    results = client.wait_many(client.submit_many(subs), timeout=60)
    for sub, res in zip(subs, results, strict=True):
        assert res.stop_reason == "repair_budget_exhausted"
        assert res.output == sub.output
        assert res.attempts == ()


def test_redelivered_task_bodies_change_no_count_or_charge(
    worker: WorkerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Running each stage body twice with the same message counts patterns and charges once."""
    from tests.support.revisers import estimating_revise
    from workers import runtime, tasks

    # A reviser that spends (estimated) tokens, so the repair round reserves and charges.
    monkeypatch.setattr(runtime.context_for(CONFIG), "reviser", estimating_revise)
    run_id = f"redo-{uuid.uuid4().hex[:8]}"
    sub = make_sub(run_id, "w1", 1, "looping")
    msg = runtime.encode(start(sub, runtime.new_pass_id()), CONFIG)
    s = runtime.stores()
    m = msg
    # Each stage's body alone (a task runs the stages after it too, and replaces itself with
    # the repair round).
    for task, stage in ((tasks.l0, "l0"), (tasks.critic, "critic")):
        first = tasks._stage(task, m, stage)[0]
        before = (s.patterns.top(run_id, 100), s.budget.spent(run_id))
        again = tasks._stage(task, m, stage)[0]
        assert (s.patterns.top(run_id, 100), s.budget.spent(run_id)) == before
        assert again == first
        m = first
    assert s.patterns.top(run_id, 100)[0].frequency == 1
    critiqued = m
    m, next_stage = tasks._stage(tasks.decide, critiqued, "decide")
    assert tasks._stage(tasks.decide, critiqued, "decide") == (m, "repair")
    assert next_stage == runtime.decode(m)[0].next == "repair"

    def recheck(repaired: dict[str, object]) -> dict[str, object]:
        return tasks._stage(tasks.critic, tasks._stage(tasks.l0, repaired, "l0")[0], "critic")[0]

    repaired = tasks._stage(tasks.repair, m, "repair")[0]
    critic_msg = recheck(repaired)
    spent_once = s.budget.spent(run_id)
    patterns_once = s.patterns.top(run_id, 100)
    # Redeliver the repair and its re-critique: the same lease, so no second charge.
    assert tasks._stage(tasks.repair, m, "repair")[0] == repaired
    recheck(repaired)
    assert s.budget.spent(run_id) == spent_once > 0
    assert s.budget.holds(run_id) == {}
    assert s.patterns.top(run_id, 100) == patterns_once
    assert runtime.decode(critic_msg)[0].next == "decide"


def test_killed_worker_loses_nothing(
    env: dict[str, str], worker: WorkerProcess, start_worker: WorkerStarter
) -> None:
    """SIGKILL a worker mid-run: all submissions finish, counts stay exact, the lease returns."""
    from workers import runtime
    from workers.client import CritiqueClient

    worker.stop()  # only the killable worker consumes during this test
    run_id = f"kill-{uuid.uuid4().hex[:8]}"
    config = {"enabled": True, "budget": {"total_tokens": 2_000_000}}
    slow = {**env, "CRITIQUE_REPAIRER": "tests.support.revisers:slow_revise"}
    subs = [make_sub(run_id, f"w{i:02d}", 1, KINDS[i % len(KINDS)]) for i in range(16)]
    victim = start_worker("victim", slow, started=False)
    rescuer = start_worker("rescuer", slow, started=False)
    try:  # whatever fails, no worker process of this test outlives it
        victim.start()
        client = CritiqueClient(config)
        handles = client.submit_many(subs)
        s = runtime.stores()
        wait_until(lambda: s.budget.holds(run_id), 30, what="a repair in flight to kill")
        victim.kill()
        assert s.budget.holds(run_id)
        # The dead worker's lease comes back once its TTL (CRITIQUE_LEASE_TTL_S=2) passes.
        wait_until(lambda: s.budget.holds(run_id) == {}, 30, what="the dead lease to expire")
        rescuer.start()
        results = client.wait_many(handles, timeout=120)
    finally:
        victim.kill()
        rescuer.stop()
        worker.start()
    ref, ref_patterns = reference(subs, config)
    for r in results:
        want = ref[f"{r.iteration}:{r.worker_id}"]
        assert (r.status, r.stop_reason) == (want.status, want.stop_reason)
    got = {(p.category, p.prevention_rule): p.frequency for p in s.patterns.top(run_id, 1000)}
    want_f = {(p.category, p.prevention_rule): p.frequency for p in ref_patterns.top(run_id, 1000)}
    assert got == want_f


def test_large_output_travels_by_reference(worker: WorkerProcess, dist_url: str) -> None:
    """A 5 MB output is carried as a blob reference: every broker message stays under 64 KiB."""
    from workers.client import CritiqueClient

    sizes: list[int] = []
    stop = threading.Event()
    monitoring = threading.Event()
    mon_client = redis.Redis.from_url(dist_url)

    def watch() -> None:
        with mon_client.monitor() as m:  # MONITOR is on once the server has said OK
            monitoring.set()
            for cmd in m.listen():
                if stop.is_set():
                    return
                c = cmd.get("command", "")
                if c.upper().startswith("LPUSH") and "critique." in c:
                    sizes.append(len(c))

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    assert monitoring.wait(30), "MONITOR did not start"
    run_id = f"big-{uuid.uuid4().hex[:8]}"
    para = " ".join(f"word{i} measured value {i * 7} grows" for i in range(60))
    body = "\n\n".join(f"## Section {i}\n\n{para} section {i} tail." for i in range(5000))
    big = "# Report\n\n" + body
    assert len(big.encode()) > 5_000_000
    sub = Submission(
        run_id=run_id,
        worker_id="big",
        task="Write the report.",
        output=big,
        claimed_format="markdown",
    )
    client = CritiqueClient({"enabled": True})
    res = client.wait(client.submit(sub), timeout=120)
    stop.set()
    redis.Redis.from_url(dist_url).ping()  # wake the monitor loop
    t.join(timeout=5)
    assert res.output == big
    assert sizes, "no broker message was observed"
    assert max(sizes) < 64 * 1024


def test_trace_holds_every_stage_and_pitfalls_reach_later_repairs(
    worker: WorkerProcess, env: dict[str, str]
) -> None:
    """Every stage and gate event is in the stream in order; later repairs see Known Pitfalls."""
    from workers.client import CritiqueClient

    run_id = f"trace-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient({"enabled": True})  # the worker's repairer records the pitfalls
    early = [make_sub(run_id, f"early{i}", 1, "looping") for i in range(3)]
    client.wait_many(client.submit_many(early), timeout=60)
    late = make_sub(run_id, "late", 2, "looping")
    res = client.wait(client.submit(late), timeout=60)
    assert res.status == "repaired", (res.stop_reason, res.notes, res.trace)

    events = [e for e in client.trace(run_id) if e.get("worker_id") == "late"]
    stages = [e["stage"] for e in events if e["type"] in ("stage", "result")]
    assert stages[0] == "l0" and stages[-1] == "gate"
    assert stages.index("critic") < stages.index("decide") < stages.index("repair")
    assert events[-1]["type"] == "result" and events[-1]["status"] == "repaired"

    recorded = Path(env["RECORD_PITFALLS_TO"]).read_text(encoding="utf-8")
    late_part = recorded.split("=== late\n", 1)[1]
    assert "## Known Pitfalls" in late_part
    # three earlier workers and the late worker's own first critique
    assert "[seen 4x] policy_violation: Say each thing once" in late_part


def test_complete_gate_counts_each_rejection_once_and_ends_partial(worker: WorkerProcess) -> None:
    """complete_gate on a worker: a placeholder result is rejected, a redelivered request is not
    counted again, the third rejection answers partial, and every gate is in the trace."""
    from workers import runtime
    from workers.app import app
    from workers.client import CritiqueClient

    run_id = f"gate-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(CONFIG)
    subs = [make_sub(run_id, "w1", 1, "garbage"), make_sub(run_id, "w2", 1, "clean")]
    client.wait_many(client.submit_many(subs), timeout=60)

    first = client.complete_gate(run_id, {"answer": "TODO: fill in the totals"}, timeout=30)
    assert first.verdict == "rejected" and first.rejected_count == 1
    assert any("placeholder" in r for r in first.reasons)

    # The same request delivered twice: replayed, not counted again.
    msg = {
        "v": 1,
        "request_id": "same-request",
        "run_id": run_id,
        "iteration": 1,
        "final_result": "TBD",
        "config": CONFIG,
    }
    a = app.send_task(keys.TASK_COMPLETE_GATE, args=(msg,)).get(timeout=30)
    b = app.send_task(keys.TASK_COMPLETE_GATE, args=(msg,)).get(timeout=30)
    assert a == b and a["rejected_count"] == 2
    assert runtime.stores().runs.rejections(run_id) == 2

    third = client.complete_gate(run_id, "Final totals: TBD", timeout=30)
    assert third.verdict == "partial" and third.rejected_count == 3

    gates = [e for e in client.trace(run_id) if e.get("stage") == "complete_gate"]
    assert {e["gate"] for e in gates if e["type"] == "gate"} >= {"l0", "critique_score"}
    assert [e["verdict"] for e in gates if e["type"] == "completion"] == [
        "rejected",
        "rejected",
        "partial",
    ]


def test_delegate_guard_refuses_a_redispatch_while_scores_are_low(worker: WorkerProcess) -> None:
    """The redundancy guard rejects re-delegating a dispatched subtask while the mean score is
    under min_score_to_complete, and passes a new subtask."""
    from workers.client import CritiqueClient

    run_id = f"guard-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient({**CONFIG, "max_repair_attempts": 0})  # the low score stays
    client.wait(client.submit(make_sub(run_id, "w1", 1, "garbage")), timeout=60)
    again = client.delegate_guard(run_id, "sig-w1")
    assert again.verdict == "reject" and "already dispatched" in again.reason
    assert client.delegate_guard(run_id, "sig-new").verdict == "pass"
    assert any(e.get("stage") == "delegate" for e in client.trace(run_id))


def _lose_l0_successor(worker: WorkerProcess, env: dict[str, str], sub: Submission) -> Any:
    """Submit ``sub`` with no worker running, run its l0 in-process (recording the step) and
    drop the queued message: the chain is stalled as if the broker had lost a message."""
    from workers import runtime, tasks
    from workers.client import CritiqueClient

    worker.stop()
    try:
        handle = CritiqueClient(CONFIG).submit(sub)
        redis.Redis.from_url(env["REDIS_URL"]).delete(keys.QUEUE_CPU)
        doc = runtime.stores().runs.submission(sub.run_id, sub.iteration, sub.worker_id)
        first = (doc or {})["message"]
        tasks._stage(tasks.l0, first, "l0")  # the stage alone: its task would go on
    finally:
        worker.start()
    return handle


def test_critique_resume_redrives_the_pending_submissions(
    env: dict[str, str], worker: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """`critique resume RUN` re-drives each pending submission from its last recorded step;
    afterwards nothing is pending and a second resume says so."""
    import json as _json

    from workers.cli import main
    from workers.client import CritiqueClient

    run_id = f"resume-{uuid.uuid4().hex[:8]}"
    handle = _lose_l0_successor(worker, env, make_sub(run_id, "w1", 1, "looping"))
    capsys.readouterr()
    assert main(["resume", run_id, "--json"]) == 0
    doc = _json.loads(capsys.readouterr().out)
    assert doc["resumed"] == [{"iteration": 1, "worker_id": "w1", "stage": "critic"}]
    result = CritiqueClient(CONFIG).wait(handle, timeout=60)
    assert result.status == "repaired"
    assert main(["resume", run_id]) == 0
    assert "nothing pending" in capsys.readouterr().out
    assert main(["resume", run_id, "--worker", "nobody"]) == 2


def test_critique_resume_leaves_a_failed_chain_alone_unless_asked(
    env: dict[str, str], worker: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """A submission whose chain a worker recorded as failed is not pending: `critique resume`
    lists it with its reason and re-drives nothing; `--failed` forgets the failure and re-drives
    it, and wait() gets its result."""
    import json as _json

    from workers import runtime
    from workers.cli import main
    from workers.client import CritiqueClient

    run_id = f"resume-failed-{uuid.uuid4().hex[:8]}"
    handle = _lose_l0_successor(worker, env, make_sub(run_id, "w1", 1, "looping"))
    runtime.stores().runs.put_failure(
        run_id,
        PassRef(run_id, 1, "w1", handle.pass_id).member,
        stage="critic",
        error="ConfigError",
        reason="the worker refused the message",
        refused=True,
    )
    capsys.readouterr()
    assert main(["resume", run_id, "--json"]) == 0
    doc = _json.loads(capsys.readouterr().out)
    assert doc["resumed"] == []
    assert [(f["worker_id"], "refused" in f["reason"]) for f in doc["failed"]] == [("w1", True)]
    assert main(["resume", run_id]) == 0
    out = capsys.readouterr().out
    assert "not resumed" in out and "--failed" in out and "nothing pending" in out
    assert main(["resume", run_id, "--failed", "--json"]) == 0
    doc = _json.loads(capsys.readouterr().out)
    assert doc["resumed"] == [{"iteration": 1, "worker_id": "w1", "stage": "critic"}]
    # The failure record is gone with the re-drive: wait() waits for the new outcome.
    assert (
        runtime.stores().runs.failure(run_id, PassRef(run_id, 1, "w1", handle.pass_id).member)
        is None
    )
    assert CritiqueClient(CONFIG).wait(handle, timeout=60).status == "repaired"


def test_a_lost_stage_message_is_resumed_from_the_last_recorded_step(
    env: dict[str, str], worker: WorkerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Redis broker can lose a message a killed worker had popped but not yet registered
    as unacked. Simulated: l0 ran and recorded its step, its successor message is gone. The
    worker's sweeper re-drives the pass from the recorded step (the critic) while the client
    only waits (its own stall rule, 1 s here, would have fired first); the result is the
    reference one, with one resume event in the trace, by the sweeper."""
    from workers.client import CritiqueClient

    run_id = f"lost-{uuid.uuid4().hex[:8]}"
    sub = make_sub(run_id, "w1", 1, "missing")
    client = CritiqueClient(CONFIG)
    handle = _lose_l0_successor(worker, env, sub)
    monkeypatch.setenv("CRITIQUE_STALL_S", "1")
    result = client.wait(handle, timeout=60)
    want = reference([sub], CONFIG)[0]["1:w1"]
    assert (result.status, result.stop_reason) == (want.status, want.stop_reason)
    resumes = [e for e in client.trace(run_id) if e["type"] == "resume"]
    assert [(e["stage"], e["after_step"].rsplit(":", 1)[1]) for e in resumes] == [("critic", "l0")]
    assert [e["by"] for e in resumes] == ["sweeper"]


HONEST: dict[str, tuple[str, str]] = {
    "missing": ("escalated", "needs_model"),
    "broken": ("escalated", "needs_model"),
    "todo_sentence": ("escalated", "needs_model"),
    "looping": ("repaired", "accepted"),
    "dup_heading": ("repaired", "accepted"),
    "looping_no_findings": ("escalated", "needs_model"),
}
"""Kind → (status, stop reason) with the quickstart's default configuration (no model)."""


def test_token_free_reviser_invents_nothing_through_a_worker(worker: WorkerProcess) -> None:
    """Through a real worker with the default configuration (no model): only vouchable edits
    are made (a copy deleted, a heading suffixed); a missing field, an error field, a
    placeholder in a sentence end escalated / needs_model untouched, listed in the notes, with
    no repair round spent; a partly fixable output keeps its honest fix, then needs_model."""
    from workers.client import CritiqueClient

    run_id = f"honest-{uuid.uuid4().hex[:8]}"
    subs = {kind: make_sub(run_id, kind, 1, kind) for kind in HONEST}
    client = CritiqueClient({"enabled": True})
    got = {
        r.worker_id: r
        for r in client.wait_many(client.submit_many(list(subs.values())), timeout=60)
    }
    for kind, want in HONEST.items():
        r = got[kind]
        assert (r.status, r.stop_reason) == want, (kind, r.notes)
        if r.stop_reason == "needs_model":
            critical = [d.description for d in r.envelope.critical]
            assert critical and all(any(c in n for n in r.notes) for c in critical)
    for kind in ("missing", "broken", "todo_sentence"):
        assert got[kind].output == subs[kind].output
        assert got[kind].attempts == () and got[kind].repair_usage.tokens == 0
    assert isinstance(got["broken"].output, dict)
    assert got["broken"].output["error"] == "tool timed out"
    assert str(got["looping"].output).count(LOOP) == 1
    assert "## Findings (2)\n\nSouth shrank." in str(got["dup_heading"].output)
    partial = got["looping_no_findings"]
    assert str(partial.output).count(LOOP) == 1 and len(partial.attempts) == 1
    assert any("required section 'findings' is missing" in n for n in partial.notes)
