"""The scripted AWP world runs end to end with AWP's OWN in-process CritiqueEngine (issue 35).

No critique service is involved: this pins down what the AWP runtime does on its own (which
requests it makes, where it writes critiques, how it repairs) before issue 35 routes the
critique through our service.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("awp", reason="awp-agents (the AWP runtime) is not installed")

from tests.fakes.openai_server import FakeOpenAIServer, system_text
from tests.support.awp_world import (
    REPAIR_MODE,
    AwpScript,
    awp_env,
    run_awp,
    validate_workflow,
    write_workflow,
)

WORKERS = 5
ITERATIONS = 3


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_awp_own_critique_engine_repairs_defective_workers(
    tmp_path: Path, fake_llm: FakeOpenAIServer
) -> None:
    workflow = write_workflow(tmp_path, workers=WORKERS, iterations=ITERATIONS)
    validate_workflow(workflow)
    script = AwpScript(workers=WORKERS, iterations=ITERATIONS).install(fake_llm)

    started = time.monotonic()
    run_dir = run_awp(workflow, awp_env(fake_llm), timeout=60)
    assert time.monotonic() - started < 60

    # The run finished: the manager completed after the scripted iterations.
    completion = _json(run_dir / "run_completion.json")
    assert completion["status"] == "complete", completion
    assert not script.unknown_requests(), "AWP asked the model something unscripted"

    workers = [f"w{k}" for k in range(1, WORKERS + 1)]
    repairs_so_far = 0
    for i in range(1, ITERATIONS + 1):
        iteration_dir = run_dir / "iterations" / f"{i:03d}"
        # Five workers per iteration, each with its own critique file.
        delegated = _json(iteration_dir / "manager_decision.json")["delegations"]
        assert sorted(d["worker_id"] for d in delegated) == workers
        first_runs = script.worker_requests(i, repair=False)
        assert sorted(script.worker_id(r) for r in first_runs) == workers
        critiques = {w: _json(iteration_dir / "delegations" / w / "critique.json") for w in workers}
        defective = script.defective(i)
        assert len(defective) == 3
        for w, critique in critiques.items():
            if w in defective:
                # Critical defect found, then the worker re-ran in repair mode.
                assert critique["critical_count"] >= 1, (i, w, defective[w], critique)
                repairs = script.worker_requests(i, worker_id=w, repair=True)
                assert len(repairs) == 1, (i, w)
                assert REPAIR_MODE in system_text(repairs[0])
                assert script.worker_id(repairs[0]) == f"{w}_repair"
            else:
                assert critique["critical_count"] == 0, (i, w, critique)
                assert not script.worker_requests(i, worker_id=w, repair=True)
        # The engine's repair history is cumulative over the run: one attempt per defect so far,
        # this iteration's last, each fixing its defect.
        repairs_so_far += len(defective)
        history = _json(iteration_dir / "critique.json")["summary"]["repair_history"]
        assert len(history) == repairs_so_far
        assert {h["worker_id"] for h in history[-len(defective) :]} == set(defective)
        assert all(h["defects_remaining"] == 0 for h in history)
        # The repaired output replaced the defective one.
        for w in defective:
            result = _json(iteration_dir / "delegations" / w / "result.json")
            assert set(script.required_fields) <= set(result), (i, w, result)
            assert "TODO" not in json.dumps(result)

    # The manager was asked once per iteration plus once more, and that COMPLETE was accepted.
    assert len(script.requests("manager")) == ITERATIONS + 1
    assert completion["total_iterations"] == ITERATIONS + 1
    assert not (run_dir / "iterations" / f"{ITERATIONS + 1:03d}" / "delegations").exists()
    # The critic's learned pitfalls reach later workers, not the first ones.
    assert not any(script.saw_pitfalls(r) for r in script.worker_requests(1, repair=False))
    assert all(script.saw_pitfalls(r) for r in script.worker_requests(2, repair=False))
