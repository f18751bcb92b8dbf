"""CrewAI's task guardrail on the fleet: a real ``crewai`` crew whose agents' LLM is the fake
OpenAI server (HTTP on 127.0.0.1), a real Redis and a real ``critique worker`` run by the main
environment's Python (``CREWAI_TESTS_FLEET_PYTHON``; heuristic critic).

A manager fans out five analysts (five asynchronous tasks, one agent each) and merges their
reports (a last task with the five as its context). Verdict mode re-runs only the defective
analyst, once, with the defects in its prompt and its re-run's reported tokens charged; the
fleet's attempt cap and CrewAI's own retries end a chain that does not pass; repair mode hands
the task the fleet's repaired output in its type; a fleet that cannot be reached, or is
stopped, rejects the output. No connection leaves the loopback: every other one is refused and
fails the module.

These run in CrewAI's own environment (tests/integration/test_adapter_crewai.py builds it from
constraints-crewai.txt and runs them); in the main environment they are skipped.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "crewai",
    reason="CrewAI runs in an environment of its own: tests/integration/test_adapter_crewai.py "
    "builds it (constraints-crewai.txt) and runs these tests there",
)

from crewai import LLM, Agent, Crew, Process, Task
from pydantic import BaseModel

from tests.crewai import OFFLINE
from tests.fakes.openai_server import REPAIR, FakeOpenAIServer, reply, user_text
from tests.support.workers import ROOT, WorkerProcess, WorkerStarter, client_on, llm_env
from workers.adapters.crewai import CritiqueGuardrail, CritiqueRejected

pytestmark = pytest.mark.integration

ANALYST = "sales analyst"
"""In every analyst's system message (CrewAI's "You are {role}. {backstory}…")."""
MANAGER = "sales manager"
REGIONS = ("north", "south", "east", "west", "central")
DEFECTIVE = "south"
RETRIED = "Previous attempt failed validation"
"""CrewAI's words before a guardrail's feedback in a re-run's prompt."""
REPAIR_MODEL = "openai/repair-model"
FLEET_PYTHON = os.environ.get("CREWAI_TESTS_FLEET_PYTHON") or sys.executable
"""The Python the fleet's worker runs under: the main environment's (set by the test that runs
this module), not CrewAI's."""


class Report(BaseModel):
    summary: str
    findings: str
    confidence: float


# -- no connection leaves the loopback -------------------------------------------------------
_LOOPBACK = ("127.", "::1", "localhost")


def _local(host: object) -> bool:
    return isinstance(host, str) and (host.startswith(_LOOPBACK) or host == "")


@pytest.fixture(scope="module", autouse=True)
def loopback_only() -> Iterator[list[str]]:
    """Refuse (and record) every connection and name lookup that is not for the loopback, in
    this process; the module fails if anything tried (telemetry, a model price list …)."""
    tried: list[str] = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def check(address: Any) -> None:
        if isinstance(address, tuple) and not _local(address[0]):
            tried.append(str(address))
            raise OSError(f"the test allows no connection off the loopback: {address}")

    def connect(self: socket.socket, address: Any) -> None:
        check(address)
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        check(address)
        return real_connect_ex(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name is not None and not _local(name):
            tried.append(f"lookup {name}")
            raise socket.gaierror(f"the test allows no name lookup off the loopback: {name}")
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]
    socket.getaddrinfo = getaddrinfo
    try:
        yield tried
    finally:
        socket.socket.connect, socket.socket.connect_ex = real_connect, real_connect_ex
        socket.getaddrinfo = real_getaddrinfo
    assert not tried, f"connections off the loopback were attempted: {tried}"


# -- the fleet -------------------------------------------------------------------------------
class FleetWorker(WorkerProcess):
    """A ``critique worker`` (``celery -A workers.app worker``) under the main environment's
    Python: the fleet is the service as deployed, with our own pins, not CrewAI's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.args[0] = FLEET_PYTHON


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def env(redis_url: str, fake: FakeOpenAIServer, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """This process and the worker on the worker database; the worker's critic is the heuristic
    (token-free) and its LLM reviser (repair mode) calls the fake; CrewAI keeps its files in a
    temporary folder."""
    storage = str(tmp_path_factory.mktemp("crewai-storage"))
    with llm_env(
        redis_url,
        fake.api_base,
        CRITIQUE_CRITIC="heuristic",
        CRITIQUE_ALLOWED_MODELS=REPAIR_MODEL,
        CREWAI_STORAGE_DIR=storage,
        **OFFLINE,
    ) as e:
        yield e


@pytest.fixture(scope="module")
def fleet(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The module's ``critique worker``, stopped after the module (or by the last test)."""
    starter = WorkerStarter(tmp_path_factory.mktemp("worker-crewai"))
    try:
        yield starter("crewai", env, concurrency=4, process=FleetWorker)
    finally:
        starter.stop_all()


# -- the crew --------------------------------------------------------------------------------
def _report(region: str) -> Report:
    """The report the fake's analyst writes for ``region`` (once fixed)."""
    return Report(
        summary=f"Q3 sales in the {region}.", findings=f"{region.title()} grew 4%.", confidence=0.9
    )


def _prompt(region: str) -> str:
    return f"Summarise the Q3 sales report for the {region} region."


def _about(body: dict[str, Any], region: str) -> bool:
    return f"the {region} region" in user_text(body)


def _retried(body: dict[str, Any]) -> bool:
    """The request is a re-run after the guardrail's ``(False, feedback)``."""
    return RETRIED in user_text(body)


def _reply_of(region: str) -> str:
    return json.dumps(_report(region).model_dump())


@pytest.fixture()
def llm(fake: FakeOpenAIServer) -> FakeOpenAIServer:
    """The fake as the analysts' model (each region's report; the south one leaves its findings
    blank until CrewAI re-runs it with the guardrail's feedback) and the manager's."""
    fake.reset()

    def analyst(body: dict[str, Any]) -> dict[str, Any]:
        region = re.search(r"the (\w+) region", user_text(body))
        name = region.group(1) if region else "?"
        retried = _retried(body)
        out = _report(name).model_dump()
        if name == DEFECTIVE and not retried:
            out["findings"] = ""
        return reply(json.dumps(out), prompt_tokens=130 if retried else 100, completion_tokens=25)

    fake.on(ANALYST, analyst)
    return fake.on(MANAGER, "Q3: every region grew 4%.")


def _model(fake: FakeOpenAIServer, name: str = "analyst-model") -> LLM:
    """An LLM of its own for one agent (its usage counters are that agent's alone)."""
    return LLM(model=f"openai/{name}", base_url=fake.api_base, api_key="sk-test")


def _analyst(fake: FakeOpenAIServer, region: str) -> Agent:
    return Agent(
        role=f"{region.title()} sales analyst",
        goal=f"Report on Q3 sales in the {region}",
        backstory="You are a sales analyst: you answer with the JSON report only.",
        llm=_model(fake),
        allow_delegation=False,
    )


def _task(agent: Agent, region: str, guardrail: CritiqueGuardrail, **extra: Any) -> Task:
    return Task(
        description=_prompt(region),
        expected_output="The JSON report: summary, findings, confidence.",
        agent=agent,
        guardrail=guardrail.check,
        **extra,
    )


def _manager_task(fake: FakeOpenAIServer, context: list[Task]) -> Task:
    manager = Agent(
        role="Regional sales manager",
        goal="Merge the regional reports",
        backstory="You are the sales manager.",
        llm=_model(fake, "manager-model"),
        allow_delegation=False,
    )
    return Task(
        description="Merge the five regional reports into one Q3 summary.",
        expected_output="One paragraph.",
        agent=manager,
        context=context,
    )


def _guardrail(run_id: str, agent: Agent, **kwargs: Any) -> CritiqueGuardrail:
    kwargs.setdefault("required_fields", ("summary", "findings"))
    kwargs.setdefault("timeout", 60)
    return CritiqueGuardrail(run_id=run_id, agent=agent, **kwargs)


def _run_id() -> str:
    return f"crew-{uuid.uuid4().hex[:8]}"


# -- verdict mode ----------------------------------------------------------------------------
def test_verdict_mode_re_runs_only_the_defective_worker_once_with_its_defects(
    fleet: WorkerProcess, llm: FakeOpenAIServer
) -> None:
    """A manager fans out five analysts, one of whom leaves a required field blank: only that
    one is re-run, once, its re-run's prompt carries the fleet's defects, the run's budget is
    charged exactly the re-run's reported usage, the other four pass untouched and the manager
    reads the five passing reports."""
    from workers.client import CritiqueClient

    run_id = _run_id()
    agents = {r: _analyst(llm, r) for r in REGIONS}
    guards = {
        r: _guardrail(run_id, agents[r], config={"budget": {"total_tokens": 100_000}})
        for r in REGIONS
    }
    tasks = {r: _task(agents[r], r, guards[r], async_execution=True) for r in REGIONS}
    merge = _manager_task(llm, list(tasks.values()))
    crew = Crew(
        agents=[*agents.values(), merge.agent],
        tasks=[*tasks.values(), merge],
        process=Process.sequential,
    )
    result = crew.kickoff()

    assert result.raw == "Q3: every region grew 4%."
    calls = {r: [b for b in llm.requests_with(ANALYST) if _about(b, r)] for r in REGIONS}
    assert {r: len(c) for r, c in calls.items()} == {r: 2 if r == DEFECTIVE else 1 for r in REGIONS}
    assert not any(_retried(c[0]) for c in calls.values())
    retry_prompt = user_text(calls[DEFECTIVE][1])
    assert RETRIED in retry_prompt
    assert "required field 'findings' is empty" in retry_prompt

    [rerun] = [r for r in llm.requests if _about(r["body"], DEFECTIVE) and _retried(r["body"])]
    assert CritiqueClient().budget(run_id).spent == rerun["usage"]["total_tokens"] == 155

    for region in REGIONS:
        output = tasks[region].output
        assert output is not None and output.raw == _reply_of(region)
        verdict = guards[region].verdicts[str(tasks[region].id)]
        expected = "repaired" if region == DEFECTIVE else "accepted"
        assert (verdict.status, verdict.checked) == (expected, True)
    [merged] = llm.requests_with(MANAGER)
    read = user_text(merged)
    assert all(f"{r.title()} grew 4%." in read for r in REGIONS)
    assert '"findings": ""' not in read


def test_the_fleets_attempt_cap_ends_the_re_runs_and_the_task_fails(
    fleet: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """An analyst that never fixes its output: CrewAI re-runs it as often as the fleet's
    max_repair_attempts (1) allows, not as its own larger guardrail_max_retries (3), then the
    guardrail raises CritiqueRejected and the task (so the crew) fails with the reason."""
    fake.reset()
    blank = {"summary": "Q3 sales.", "findings": "", "confidence": 0.9}
    fake.on(ANALYST, json.dumps(blank))
    agent = _analyst(fake, "north")
    guard = _guardrail(_run_id(), agent, config={"max_repair_attempts": 1})
    task = _task(agent, "north", guard, guardrail_max_retries=3)

    with pytest.raises(CritiqueRejected) as caught:
        Crew(agents=[agent], tasks=[task]).kickoff()
    assert caught.value.result is not None and caught.value.result.status == "escalated"
    assert "findings" in caught.value.reason
    assert len(fake.completions) == 2  # the first answer and one re-run: the fleet's cap


def test_when_crewais_retries_run_out_first_the_request_is_released_and_the_task_fails(
    fleet: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """The task allows 1 guardrail retry, the fleet 2 attempts: the re-run improves but still
    misses a field, so the fleet asks again; the guardrail releases that request (nothing held
    in the run's budget) and returns the reason, with which CrewAI fails the task."""
    from workers.client import CritiqueClient

    fake.reset()
    first = {"summary": "", "findings": "", "confidence": 0.9}
    better = {**first, "summary": "Q3 sales."}
    fake.script(reply(json.dumps(first), match=ANALYST))
    fake.on(ANALYST, json.dumps(better))
    run_id = _run_id()
    agent = _analyst(fake, "north")
    guard = _guardrail(run_id, agent, config={"budget": {"total_tokens": 100_000}})
    task = _task(agent, "north", guard, guardrail_max_retries=1)

    with pytest.raises(Exception, match=r"guardrail retries \(1\) ran out") as caught:
        Crew(agents=[agent], tasks=[task]).kickoff()
    assert "Task failed guardrail validation after 1 retries" in str(caught.value)
    assert guard.verdicts[str(task.id)].result.stop_reason == "worker_repair"  # type: ignore[union-attr]
    assert len(fake.completions) == 2
    budget = CritiqueClient().budget(run_id)
    rerun = fake.requests[1]["usage"]["total_tokens"]
    assert (budget.held, budget.spent) == (0, rerun)  # released; the one re-run charged


# -- repair mode -----------------------------------------------------------------------------
def test_repair_mode_hands_the_task_the_fleets_repaired_output_in_its_type(
    fleet: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """Repair mode: the fleet's own reviser (an LLM call to the fake) fills the blank field;
    the task gets that output, parsed into its output_pydantic, without a re-run."""
    fake.reset()
    blank = {"summary": "Q3 sales in the south.", "findings": "", "confidence": 0.9}
    fixed = {**blank, "findings": "South grew 4% (repaired)."}
    fake.on(ANALYST, json.dumps(blank))
    fake.on(REPAIR, json.dumps(fixed))
    agent = _analyst(fake, "south")
    guard = CritiqueGuardrail(
        run_id=_run_id(),
        worker_id="analyst-south",
        required_fields=("summary", "findings"),
        mode="repair",
        config={"repairer": "llm", "model": REPAIR_MODEL, "budget": {"total_tokens": 100_000}},
        timeout=60,
    )
    task = _task(agent, "south", guard, output_pydantic=Report)

    result = Crew(agents=[agent], tasks=[task]).kickoff()
    assert result.pydantic == Report(**fixed)
    assert guard.verdicts[str(task.id)].status == "repaired"
    assert len(fake.requests_with(ANALYST)) == 1
    assert fake.requests_with(REPAIR)


# -- the documentation's example -------------------------------------------------------------
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def test_the_example_of_docs_crewai_prints_what_the_page_shows(fleet: WorkerProcess) -> None:
    """docs/crewai.md's Python example, run against the real worker, prints the text block
    under it."""
    text = (ROOT / "docs" / "crewai.md").read_text(encoding="utf-8")
    found = [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]
    pairs = [
        (code, shown)
        for (lang, code), (next_lang, shown) in itertools.pairwise(found)
        if lang == "python" and next_lang == "text"
    ]
    assert len(pairs) == 1
    [(code, shown)] = pairs
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/crewai.md example", "exec"), {"__name__": "__main__"})
    assert out.getvalue().splitlines() == shown.splitlines()


# -- fail closed -----------------------------------------------------------------------------
def _unreachable_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


@pytest.mark.parametrize("fail_open", [False, True])
def test_with_the_fleet_unreachable_the_output_is_rejected_unless_fail_open(
    fake: FakeOpenAIServer, tmp_path: Path, fail_open: bool
) -> None:
    """Redis (so the fleet) unreachable: the guardrail returns (False, the reason), CrewAI
    re-runs the agent while it has retries (asking the fleet again) and then fails the task
    with that reason; the output never reaches the manager. With fail_open=True the output
    passes, marked unchecked, and the agent is not re-run."""
    fake.reset()
    good = {"summary": "Q3 sales.", "findings": "North grew.", "confidence": 0.9}
    fake.on(ANALYST, json.dumps(good))
    fake.on(MANAGER, "merged")
    with client_on(_unreachable_url(), flush=False, CREWAI_STORAGE_DIR=str(tmp_path), **OFFLINE):
        agent = _analyst(fake, "north")
        guard = _guardrail("crew-down", agent, timeout=5, fail_open=fail_open)
        task = _task(agent, "north", guard, guardrail_max_retries=1)
        merge = _manager_task(fake, [task])
        crew = Crew(agents=[agent, merge.agent], tasks=[task, merge])
        if fail_open:
            assert crew.kickoff().raw == "merged"
            assert task.output is not None and json.loads(task.output.raw) == good
            verdict = guard.verdicts[str(task.id)]
            assert (verdict.status, verdict.checked) == ("unchecked", False)
        else:
            with pytest.raises(Exception, match=r"did not check the output: .*Redis"):
                crew.kickoff()
    assert len(fake.requests_with(ANALYST)) == (1 if fail_open else 2)
    assert len(fake.requests_with(MANAGER)) == (1 if fail_open else 0)


def test_with_the_fleet_stopped_the_output_is_rejected_not_passed(
    env: dict[str, str], fleet: WorkerProcess, llm: FakeOpenAIServer
) -> None:
    """The fleet's worker stopped: no verdict comes within the guardrail's timeout, so the
    guardrail returns (False, the reason); CrewAI's one retry meets the same, and the task
    fails saying so: the output is rejected, the manager never sees it. (Last: it stops the
    module's worker.)"""
    fleet.stop()
    agent = _analyst(llm, "north")
    guard = _guardrail(_run_id(), agent, timeout=1.0)
    task = _task(agent, "north", guard, guardrail_max_retries=1)
    merge = _manager_task(llm, [task])
    crew = Crew(agents=[agent, merge.agent], tasks=[task, merge])
    with pytest.raises(Exception, match=r"did not check the output: no result for .* 1.0 s") as e:
        crew.kickoff()
    assert "Task failed guardrail validation after 1 retries" in str(e.value)
    verdict = guard.verdicts[str(task.id)]
    assert (verdict.status, verdict.checked, verdict.result) == ("unchecked", False, None)
    assert len(llm.requests_with(ANALYST)) == 2
    assert not llm.requests_with(MANAGER)
