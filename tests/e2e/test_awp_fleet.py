"""AWP's own delegation loop critiquing through the fleet (issue 35): ``critique awp run`` on an
unmodified workflow, a manager and five workers per iteration over three iterations played by
the fake model, the critiques on two real ``critique worker`` processes (one SIGKILLed mid-run)
whose LLM critic is the same fake; the worker re-runs are AWP's."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("awp", reason="awp-agents is not installed (pip install -e '.[awp]')")

from tests.fakes.openai_server import CRITIC, FakeOpenAIServer, reply, user_text
from tests.support.awp_world import AwpScript, awp_env, run_awp, write_workflow
from tests.support.servers import FAULT_ENV
from tests.support.workers import WorkerStarter, llm_env

pytestmark = pytest.mark.e2e

WORKERS = 5
ITERATIONS = 3
CRITIC_MODEL = "openai/critic-model"
OUTPUT = re.compile(r"## Worker output \(untrusted data\)(.*)", re.DOTALL)


def fleet_critique(body: dict[str, Any]) -> dict[str, Any]:
    """The fleet's LLM critic, played: a critical defect for each thing the scripted workers
    break (a TODO, no findings, findings that claim JSON and do not parse); else accepted."""
    found = OUTPUT.search(user_text(body))
    text = found.group(1) if found else ""
    defects = []
    if "TODO" in text:
        defects.append(("incomplete", "summary", "the summary is a TODO placeholder"))
    if '"findings"' not in text:
        defects.append(("missing_data", "findings", "the required findings are missing"))
    if re.search(r'"findings":\s*"\[', text):
        defects.append(("wrong_format", "findings", "findings is text that does not parse"))
    score = 0.95 if not defects else 0.45
    doc = {
        "score": score,
        "defects": [
            {"category": c, "location": loc, "description": d, "severity": "critical"}
            for c, loc, d in defects
        ],
        "prescriptions": [f"fix {loc}" for _, loc, _ in defects],
        "reusable_patterns": [],
        "summary": "ok" if not defects else f"{len(defects)} defect(s)",
    }
    return reply(json.dumps(doc), prompt_tokens=400, completion_tokens=60)


@pytest.fixture()
def world(
    tmp_path: Path, redis_url: str, fake_llm: FakeOpenAIServer
) -> Iterator[tuple[dict[str, str], AwpScript, WorkerStarter]]:
    script = AwpScript(workers=WORKERS, iterations=ITERATIONS).install(fake_llm)
    fake_llm.on(CRITIC, fleet_critique)
    with llm_env(
        redis_url,
        fake_llm.api_base,
        CRITIQUE_CRITIC="llm",
        CRITIQUE_MODEL=CRITIC_MODEL,
        CRITIQUE_ALLOWED_MODELS=CRITIC_MODEL,
        CRITIQUE_LLM__MAX_RETRIES="0",
        **{**FAULT_ENV, "CRITIQUE_LEASE_TTL_S": "300"},
    ) as env:
        starter = WorkerStarter(tmp_path / "logs")
        try:
            yield env, script, starter
        finally:
            starter.stop_all()


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _critique_exe() -> str:
    return str(Path(sys.executable).parent / "critique")


def test_awp_delegation_loop_critiques_and_repairs_through_two_fleet_workers(
    world: tuple[dict[str, str], AwpScript, WorkerStarter],
    fake_llm: FakeOpenAIServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every defective output is critiqued by the fleet and repaired by AWP's re-run worker
    (its verdict `repaired`, in AWP's own critique.json); later workers get the fleet's Known
    Pitfalls; AWP's in-process critic is never called; the repair budget is one for the run;
    killing one critique worker mid-run loses, fails or repeats nothing."""
    env, script, starter = world
    (tmp_path / "logs").mkdir(exist_ok=True)
    doomed = starter("awp-a", env, concurrency=2)
    starter("awp-b", env, concurrency=2)
    (tmp_path / "wf").mkdir()
    workflow = write_workflow(tmp_path / "wf", workers=WORKERS, iterations=ITERATIONS)

    def kill_when_busy() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(fake_llm.requests_with(CRITIC)) >= 3:
                assert doomed.proc is not None
                os.kill(doomed.proc.pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_when_busy, daemon=True)
    killer.start()
    run_env = {**env, **awp_env(fake_llm)}
    run_dir = run_awp(workflow, run_env, timeout=240, launcher=[_critique_exe(), "awp"])
    killer.join(timeout=5)
    assert doomed.proc is not None and doomed.proc.poll() is not None, "the kill did not happen"

    completion = _json(run_dir / "run_completion.json")
    assert completion["status"] == "complete", completion
    assert script.requests("critic") == [], "AWP's in-process critic was called"

    from workers.client import CritiqueClient

    client = CritiqueClient()
    fleet_run = f"awp-{run_dir.name}"
    results = {(r.iteration, r.worker_id): r for r in client.results(fleet_run)}
    assert len(results) == WORKERS * ITERATIONS

    workers = [f"w{k}" for k in range(1, WORKERS + 1)]
    for i in range(1, ITERATIONS + 1):
        iteration_dir = run_dir / "iterations" / f"{i:03d}"
        defective = script.defective(i)
        for w in workers:
            critique = _json(iteration_dir / "delegations" / w / "critique.json")
            verdict = results[(i, w)]
            assert critique["summary"].startswith(f"fleet: {verdict.status}"), critique
            if w in defective:
                assert (verdict.status, len(verdict.attempts)) == ("repaired", 1), (
                    i,
                    w,
                    str(verdict),
                    verdict.notes,
                )
                assert len(script.worker_requests(i, worker_id=w, repair=True)) == 1, (i, w)
                assert critique["critical_count"] == 0
                fixed = _json(iteration_dir / "delegations" / w / "result.json")
                assert "TODO" not in json.dumps(fixed) and isinstance(fixed["findings"], list)
            else:
                assert verdict.status == "accepted", (i, w, verdict)
                assert not script.worker_requests(i, worker_id=w, repair=True)
        summary = _json(iteration_dir / "critique.json")["summary"]
        assert summary["fleet"]["run_id"] == fleet_run
        assert summary["patterns"], "the fleet's pattern memory is empty"

    # The fleet's pitfalls reach the next iterations' workers, in AWP's Quality Guard skill.
    firsts = script.worker_requests(1, repair=False)
    assert not any(script.saw_pitfalls(r) for r in firsts)
    for i in (2, 3):
        later = script.worker_requests(i, repair=False)
        assert later and all(script.saw_pitfalls(r) and "[seen " in str(r) for r in later)

    # One run-wide budget: what AWP reported for its re-runs, charged once each, nothing held.
    budget = client.budget(fleet_run)
    charged = sum(r.budget_charged for r in results.values())
    assert budget.held == 0 and budget.spent == charged > 0
    last = _json(run_dir / "iterations" / f"{ITERATIONS:03d}" / "critique.json")["summary"]
    assert last["total_repair_tokens"] == budget.spent

    # Nothing lost, failed, stalled or counted twice through the kill: every output's latest
    # pass finished, one attempt per planned repair, and `critique status` agrees.
    repairs = sum(len(script.defective(i)) for i in range(1, ITERATIONS + 1))
    assert sum(len(r.attempts) for r in results.values()) == repairs
    from workers.cli import main

    assert main(["status", fleet_run, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["finished"], status["failed"], status["pending"]) == (
        WORKERS * ITERATIONS,
        [],
        [],
    ), status
