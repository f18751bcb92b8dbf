"""``critic: command`` and ``critique ab`` through a real worker process and a real Redis.

The worker's operator gives it the command in its environment (``CRITIQUE_COMMAND='python -m
pytest -q'`` without the venv's plugins, a 10 s ``command_timeout_s``), an API key of the
product's and one of a provider's (that no command may see), and the LLM transport pointed at
the fake OpenAI server (worker-only settings). ``critique ab`` runs in this process against the
same Redis and worker, its worker model scripted on the fake (:mod:`tests.fakes.ab_models`).
"""

from __future__ import annotations

import csv
import json
import re
import shlex
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import RefusedOverrideError
from pipeline.models import CritiqueResult, FileRef, Submission
from pipeline.store import keys
from tests.fakes import ab_models
from tests.fakes.openai_server import REPAIR, FakeOpenAIServer, user_text
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url

pytestmark = pytest.mark.integration

TIMEOUT_S = 10
"""The command's limit: a hanging test waits it out, and `critique ab`'s own defect counter runs
its pytest (with every plugin this venv installs: ~4 s to start on a 2-CPU VM) under it too."""
PROVIDER_KEY = "sk-provider-must-not-leak"
PRODUCT_KEY = "sk-product-must-not-leak"
LEAN = ("-p", "no:cacheprovider", "-p", "no:langsmith_plugin", "-p", "no:hypothesispytest")
"""pytest without the plugins this venv's extras install (langsmith's comes with the langgraph
extra, hypothesis' with dev): loading them took ~3.5 s of each run on a 2-CPU VM, close to the
4 s limit; the tests here use none of them."""
COMMAND = shlex.join([sys.executable, "-m", "pytest", "-q", *LEAN])
CONFIG = {"enabled": True, "critic": "command"}
ADD_TEST = ab_models.ADD_TEST


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def env(redis_url: str, fake: FakeOpenAIServer) -> Iterator[dict[str, str]]:
    """This process and the worker on the worker database; the operator's settings in the
    environment of both (the command, its limit, the keys, the fake LLM's address)."""
    with client_on(
        worker_db_url(redis_url),
        CRITIQUE_COMMAND=COMMAND,
        CRITIQUE_COMMAND_TIMEOUT_S=str(TIMEOUT_S),
        CRITIQUE_LLM_API_KEY=PRODUCT_KEY,
        OPENAI_API_KEY=PROVIDER_KEY,
        CRITIQUE_ALLOWED_MODELS="openai/weak",  # the worker model `critique ab` names
        CRITIQUE_LLM__API_BASE=fake.api_base,
        CRITIQUE_LLM__TIMEOUT_S="5",
        CRITIQUE_LLM__MAX_RETRIES="1",
        CRITIQUE_LLM__BACKOFF_S="0.01",
        CRITIQUE_LLM__BACKOFF_MAX_S="0.05",
    ) as e:
        from workers import runtime

        runtime._configs.clear()  # this process's own configuration now has the command
        runtime._contexts.clear()
        yield e
        runtime._configs.clear()
        runtime._contexts.clear()


WORKER = WorkerSpec("cmd")


def python_sub(code: str, *files: tuple[str, str], model: str | None = None) -> Submission:
    return Submission(
        run_id=f"cmd-{uuid.uuid4().hex[:8]}",
        worker_id="w1",
        task="Write add(a, b) returning the sum of two numbers.",
        output=code,
        claimed_format="python",
        files=tuple(FileRef(path=p, size=len(c), content=c) for p, c in files),
        model=model,
    )


def critique(sub: Submission, timeout: float = 60) -> CritiqueResult:
    from workers.client import CritiqueClient

    client = CritiqueClient(CONFIG)
    return client.wait(client.submit(sub), timeout=timeout)


def test_a_failing_test_becomes_a_defect_at_its_line(worker: WorkerProcess) -> None:
    """A failing pytest assertion is a critical ``command`` defect at ``test_solution.py:5``
    carrying the assertion and expected/actual; without a model the deterministic reviser
    cannot fix it: escalated, needs_model."""
    result = critique(
        python_sub("def add(a, b):\n    return a - b\n", ("test_solution.py", ADD_TEST))
    )
    assert (result.status, result.stop_reason) == ("escalated", "needs_model")
    assert result.envelope.critic == "command"
    by_location = {d.location: d for d in result.envelope.defects}
    first = by_location["test_solution.py:5"]
    assert (first.source, first.severity, first.category) == ("command", "critical", "incomplete")
    assert "`assert add(2, 3) == 5`" in first.description
    assert "expected 5, got -1" in first.description
    assert "test_solution.py:9" in by_location
    assert result.best_score == pytest.approx(0.53)
    assert "network: none" in result.envelope.summary or "not isolated" in result.envelope.summary


def test_passing_tests_are_accepted_with_files_by_reference(worker: WorkerProcess) -> None:
    """A module whose tests pass is accepted with score 1.0 and no defect; the test file is
    held by blob reference and the worker's reader puts it in the sandbox like an inline one."""
    from workers import runtime

    data = ADD_TEST.encode()
    ref = runtime.stores().blobs.put(data)
    sub = python_sub("def add(a, b):\n    return a + b\n").model_copy(
        update={"files": (FileRef(path="test_solution.py", size=len(data), blob=ref),)}
    )
    result = critique(sub)
    assert (result.status, result.best_score, result.envelope.defects) == ("accepted", 1.0, ())
    assert "passed" in result.envelope.summary


HANGING_TEST = """import time

from solution import add


def test_hangs():
    time.sleep(3600)
    assert add(1, 1) == 2
"""


def test_a_hanging_test_is_cut_at_the_limit_and_the_worker_survives(worker: WorkerProcess) -> None:
    """A test that sleeps for an hour is killed at command_timeout_s (a time-out defect; the
    result arrives within the client's 60 s wait only because it was cut); the worker process
    is the same one afterwards and serves the next submission."""
    assert worker.proc is not None
    pid = worker.proc.pid
    result = critique(
        python_sub("def add(a, b):\n    return a + b\n", ("test_hangs.py", HANGING_TEST))
    )
    [defect] = [d for d in result.envelope.defects if d.source == "command"]
    assert f"did not finish within {TIMEOUT_S} s" in defect.description
    assert "process group was killed" in defect.description
    assert worker.proc.poll() is None and worker.proc.pid == pid
    after = critique(
        python_sub("def add(a, b):\n    return a + b\n", ("test_solution.py", ADD_TEST))
    )
    assert after.status == "accepted"


def test_the_command_does_not_see_the_workers_keys(worker: WorkerProcess, tmp_path: Path) -> None:
    """The command's environment is scrubbed: a test that asserts the worker's API keys are
    absent passes, and what it saw (written outside the sandbox) has no CRITIQUE_ setting,
    no provider key, and HOME in its own temp dir."""
    seen = tmp_path / "seen.json"
    spy = f"""import json
import os


def test_no_keys():
    with open({str(seen)!r}, "w") as fh:
        json.dump(dict(os.environ), fh)
    assert "CRITIQUE_LLM_API_KEY" not in os.environ
    assert "OPENAI_API_KEY" not in os.environ
"""
    result = critique(python_sub("X = 1\n", ("test_env.py", spy)))
    assert result.status == "accepted", result.envelope.defects
    environ = json.loads(seen.read_text())
    assert not [k for k in environ if k.startswith("CRITIQUE_") or k.endswith("_API_KEY")]
    assert PROVIDER_KEY not in json.dumps(environ) and PRODUCT_KEY not in json.dumps(environ)
    assert "REDIS_URL" not in environ
    assert environ["HOME"].startswith(environ["TMPDIR"]) and "critique-cmd-" in environ["HOME"]


def test_a_submission_cannot_set_the_argv(worker: WorkerProcess, tmp_path: Path) -> None:
    """``command`` is worker-only: the client refuses it at submit, and a message built
    without the client is refused by the worker before anything runs (the argv never runs)."""
    from workers import runtime
    from workers.app import app
    from workers.client import CritiqueClient

    marker = tmp_path / "ran"
    argv = ["sh", "-c", f"touch {marker}"]
    with pytest.raises(RefusedOverrideError, match="'command'"):
        CritiqueClient({**CONFIG, "command": argv})
    from pipeline.loop.stages import start

    sub = python_sub("X = 1\n", ("test_x.py", "def test_x():\n    pass\n"))
    state = start(sub).model_copy(update={"next": "critic"})
    msg = runtime.encode(state, {**CONFIG, "command": argv})
    sent = app.send_task(keys.TASK_CRITIC, args=(msg,), queue=keys.QUEUE_CPU)
    with pytest.raises(RefusedOverrideError, match="'command'"):
        sent.get(timeout=30)
    assert not marker.exists()


# -- critique ab, end to end -----------------------------------------------------------------

RUN_ID = re.compile(r"ab-\d{8}-\d{6}-[0-9a-f]{4}-(?P<input>[a-z_]+)-(?P<mode>[ab])(?P<rep>\d)")


def run_ab(
    fake: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], *, fixes: bool
) -> tuple[int, dict[str, Any], list[dict[str, str]], Path]:
    """``critique ab --json`` on the three-input workload against the scripted model."""
    from workers.cli import main

    ab_models.script(fake, fixes=fixes)
    inputs = ab_models.write_inputs(tmp_path / "inputs.jsonl")
    out = tmp_path / "out"
    argv = ["ab", str(inputs), "--out", str(out), "--reps", "1", "--json", "--model", "openai/weak"]
    code = main(argv)
    printed = capsys.readouterr().out
    with open(out / "ab.csv", encoding="utf-8", newline="") as fh:
        header = fh.readline().strip()
        assert header == "run_id,mode,input_id,defects,latency_s,tokens_in,tokens_out,loops"
        fh.seek(0)
        rows = list(csv.DictReader(fh))
    return code, json.loads(printed), rows, out


def expected_rows(b_defects: int) -> list[tuple[str, str, str, str, str, str]]:
    """(mode, input_id, defects, tokens_in, tokens_out, loops) per row, in CSV order: the
    python input's B row spends one repair call (the command critic is token-free), the json
    and markdown B rows two critic calls and one repair."""
    rows = []
    for input_id, b_in, b_out in (
        ("add_numbers", 500, 130),
        ("sales_summary", 1100, 250),
        ("incident_report", 1100, 250),
    ):
        rows.append(("A", input_id, "2", "100", "50", "0"))
        rows.append(("B", input_id, str(b_defects), str(b_in), str(b_out), "1"))
    return rows


def check_csv(rows: list[dict[str, str]], b_defects: int) -> None:
    got = []
    for r in rows:
        m = RUN_ID.fullmatch(r["run_id"])
        assert m, r["run_id"]
        assert (m["input"], m["mode"].upper(), m["rep"]) == (r["input_id"], r["mode"], "1")
        assert float(r["latency_s"]) >= 0 and re.fullmatch(r"\d+\.\d{3}", r["latency_s"])
        got.append(
            (r["mode"], r["input_id"], r["defects"], r["tokens_in"], r["tokens_out"], r["loops"])
        )
    assert got == expected_rows(b_defects)


def test_ab_passes_when_the_repairer_fixes(
    worker: WorkerProcess,
    fake: FakeOpenAIServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Weak worker model, fixing repairer: A has 2 defects per output, B none; the verdict
    passes, the CSV is exact, no escalation is written, and the python repair's prompt carried
    the failing assertion."""
    code, doc, rows, out = run_ab(fake, tmp_path, capsys, fixes=True)
    assert code == 0
    check_csv(rows, b_defects=0)
    assert set(doc) == {
        "mean_a",
        "mean_b",
        "reduction",
        "verdict",
        "tokens_per_defect_fixed",
        "rows",
    }
    assert (doc["mean_a"], doc["mean_b"], doc["reduction"], doc["verdict"]) == (
        2.0,
        0.0,
        1.0,
        "pass",
    )
    assert doc["tokens_per_defect_fixed"] == 480.0  # (3330 − 450) tokens / 6 defects
    assert [r["run_id"] for r in doc["rows"]] == [r["run_id"] for r in rows]
    assert not (out / "escalations").exists()
    repairs = [user_text(body) for body in fake.requests_with(REPAIR)]
    assert any("`assert add(2, 3) == 5` — expected 5, got -1" in t for t in repairs)


def test_ab_fails_when_the_repairer_cannot_fix(
    worker: WorkerProcess,
    fake: FakeOpenAIServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A repairer that cannot fix: B keeps every defect, the verdict fails (exit 0: the
    experiment ran), and each escalated B row has its escalations/<run_id>.md with the
    three choices."""
    code, doc, rows, out = run_ab(fake, tmp_path, capsys, fixes=False)
    assert code == 0
    check_csv(rows, b_defects=2)
    assert (doc["mean_a"], doc["mean_b"], doc["reduction"], doc["verdict"]) == (
        2.0,
        2.0,
        0.0,
        "fail",
    )
    assert doc["tokens_per_defect_fixed"] is None
    b_runs = sorted(r["run_id"] for r in rows if r["mode"] == "B")
    files = sorted(p.stem for p in (out / "escalations").glob("*.md"))
    assert files == b_runs
    text = (out / "escalations" / f"{b_runs[0]}.md").read_text()
    for choice in ("**retry**", "**accept best**", "**manual**"):
        assert choice in text
