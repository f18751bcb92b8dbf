"""Pydantic AI's output validator on the fleet: a real ``pydantic-ai-slim`` agent whose model is
the fake OpenAI server (HTTP on 127.0.0.1), a real Redis and a real ``critique worker``
(heuristic critic). Verdict mode re-runs only the defective worker, once, with the defects in
its prompt and its re-run's reported tokens charged; repair mode hands the agent the fleet's
repaired output in its own type; a fleet that cannot be reached rejects the output."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip(
    "pydantic_ai", reason="pydantic-ai-slim is not installed (pip install pydantic-ai-slim==2.78.0)"
)

from pydantic_ai import Agent, PromptedOutput, RunContext, UnexpectedModelBehavior
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.fakes.openai_server import REPAIR, FakeOpenAIServer, reply, user_text
from tests.support.docs import assert_examples_print_what_the_page_shows
from tests.support.frameworks import (
    ANALYST,
    DEFECTIVE,
    REGIONS,
    REPAIR_MODEL,
    Report,
    about,
    fleet_env,
    prompt,
    report,
)
from tests.support.workers import WorkerProcess, WorkerSpec, client_on
from workers.adapters.pydantic_ai import CritiqueRejected, CritiqueValidator

pytestmark = pytest.mark.integration

WORKER = WorkerSpec("pydantic-ai", concurrency=4)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def env(redis_url: str, fake: FakeOpenAIServer) -> Iterator[dict[str, str]]:
    """This process and the worker on the worker database (tests/support/frameworks.py)."""
    with fleet_env(redis_url, fake.api_base) as e:
        yield e


@pytest.fixture()
def llm(fake: FakeOpenAIServer) -> FakeOpenAIServer:
    """The fake as the analysts' model: each region's report; the south one leaves its
    findings blank until the run's retry feedback is in the prompt."""
    fake.reset()

    def analyst(body: dict[str, Any]) -> dict[str, Any]:
        text = user_text(body)
        region = re.search(r"the (\w+) region", text)
        name = region.group(1) if region else "?"
        retried = _retried(body)
        out = report(name).model_dump()
        if name == DEFECTIVE and not retried:
            out["findings"] = ""
        return reply(json.dumps(out), prompt_tokens=130 if retried else 100, completion_tokens=25)

    return fake.on(ANALYST, analyst)


def _agent(fake: FakeOpenAIServer, retries: int = 2) -> Agent[str, Report]:
    model = OpenAIChatModel(
        "analyst-model", provider=OpenAIProvider(base_url=fake.api_base, api_key="sk-test")
    )
    return Agent(
        model,
        deps_type=str,
        output_type=PromptedOutput(Report),
        instructions=f"{ANALYST}. Answer with the JSON report.",
        retries={"output": retries},
    )


def _retried(body: dict[str, Any]) -> bool:
    """The request carries Pydantic AI's retry feedback (a re-run after ModelRetry)."""
    return "retry_feedback" in user_text(body)


def _worker(ctx: RunContext[str]) -> str:
    """The worker an agent run plays: its deps."""
    return ctx.deps


async def _fan_out(agent: Agent[str, Report], validator: CritiqueValidator) -> list[Any]:
    try:
        return list(
            await asyncio.gather(
                *(agent.run(prompt(r), deps=f"analyst-{r}") for r in REGIONS),
                return_exceptions=True,
            )
        )
    finally:
        await validator.aclose()


def test_verdict_mode_re_runs_only_the_defective_worker_once_with_its_defects(
    env: dict[str, str], worker: WorkerProcess, llm: FakeOpenAIServer
) -> None:
    """Five agent runs, one with a blank required field: only that one is re-run, once, its
    retry prompt carries the fleet's defects, the run's budget is charged exactly the re-run's
    reported usage, and the other four pass untouched."""
    from workers.client import CritiqueClient

    run_id = f"pai-{uuid.uuid4().hex[:8]}"
    agent = _agent(llm)
    validator = CritiqueValidator(
        run_id=run_id,
        worker_id=_worker,
        required_fields=("summary", "findings"),
        config={"budget": {"total_tokens": 100_000}},
        timeout=60,
    )
    agent.output_validator(validator)
    results = asyncio.run(_fan_out(agent, validator))

    assert not [r for r in results if isinstance(r, BaseException)], results
    by_region = dict(zip(REGIONS, results, strict=True))
    calls = {r: [b for b in llm.requests_with(ANALYST) if about(b, r)] for r in REGIONS}
    assert {r: len(c) for r, c in calls.items()} == {r: 2 if r == DEFECTIVE else 1 for r in REGIONS}
    retry_prompt = user_text(calls[DEFECTIVE][1])
    assert "required field 'findings' is empty" in retry_prompt
    assert not any(_retried(c[0]) for c in calls.values())

    [rerun] = [r for r in llm.requests if about(r["body"], DEFECTIVE) and _retried(r["body"])]
    assert CritiqueClient().budget(run_id).spent == rerun["usage"]["total_tokens"] == 155

    fixed = by_region[DEFECTIVE]
    assert fixed.output == report(DEFECTIVE)
    verdict = validator.verdicts[fixed.run_id]
    assert (verdict.status, verdict.checked) == ("repaired", True)
    for region in set(REGIONS) - {DEFECTIVE}:
        assert by_region[region].output == report(region)
        assert validator.verdicts[by_region[region].run_id].status == "accepted"


def test_the_services_attempt_cap_ends_the_retries_with_a_rejection(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """A worker that never fixes its output: the agent is re-run as often as the fleet's
    max_repair_attempts (1) allows, not as its own larger retry budget, then the run ends with
    CritiqueRejected (an UnexpectedModelBehavior) saying why."""
    fake.reset()
    blank = {"summary": "Q3 sales.", "findings": "", "confidence": 0.9}
    fake.on(ANALYST, json.dumps(blank))
    agent = _agent(fake, retries=5)
    validator = CritiqueValidator(
        run_id=f"pai-{uuid.uuid4().hex[:8]}",
        worker_id="analyst-stuck",
        required_fields=("summary", "findings"),
        config={"max_repair_attempts": 1},
        timeout=60,
    )
    agent.output_validator(validator)

    async def go() -> Any:
        try:
            return await agent.run(prompt("north"))
        finally:
            await validator.aclose()

    with pytest.raises(UnexpectedModelBehavior) as caught:
        asyncio.run(go())
    assert isinstance(caught.value, CritiqueRejected)
    assert caught.value.result is not None and caught.value.result.status == "escalated"
    assert "findings" in caught.value.reason
    assert len(fake.completions) == 2  # the first answer and one re-run: the fleet's cap


def test_when_the_agents_retries_run_out_first_the_request_is_released_and_rejected(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """The agent allows 1 output retry, the fleet 2 attempts: the re-run improves but still
    misses a field, so the fleet asks again; the validator releases that request (nothing
    held in the run's budget) and ends the run with CritiqueRejected naming the retries."""
    from workers.client import CritiqueClient

    fake.reset()
    first = {"summary": "", "findings": "", "confidence": 0.9}
    better = {**first, "summary": "Q3 sales."}
    fake.script(reply(json.dumps(first), match=ANALYST))
    fake.on(ANALYST, json.dumps(better))
    agent = _agent(fake, retries=1)
    run_id = f"pai-{uuid.uuid4().hex[:8]}"
    validator = CritiqueValidator(
        run_id=run_id,
        worker_id="analyst-slow",
        required_fields=("summary", "findings"),
        config={"budget": {"total_tokens": 100_000}},
        timeout=60,
    )
    agent.output_validator(validator)

    async def go() -> Any:
        try:
            return await agent.run(prompt("north"))
        finally:
            await validator.aclose()

    with pytest.raises(CritiqueRejected, match=r"output retries \(1\) ran out") as caught:
        asyncio.run(go())
    assert caught.value.result is not None
    assert caught.value.result.stop_reason == "worker_repair"
    assert len(fake.completions) == 2
    budget = CritiqueClient().budget(run_id)
    rerun = fake.requests[1]["usage"]["total_tokens"]
    assert (budget.held, budget.spent) == (0, rerun)  # released; the one re-run charged


def test_repair_mode_returns_the_fleets_repaired_output_in_the_agents_type(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """Repair mode: the fleet's own reviser (an LLM call to the fake) fills the blank field;
    the agent gets that output as a Report without being re-run."""
    fake.reset()
    blank = {"summary": "Q3 sales in the south.", "findings": "", "confidence": 0.9}
    fixed = {**blank, "findings": "South grew 4% (repaired)."}
    fake.on(ANALYST, json.dumps(blank))
    fake.on(REPAIR, json.dumps(fixed))
    agent = _agent(fake)
    validator = CritiqueValidator(
        run_id=f"pai-{uuid.uuid4().hex[:8]}",
        worker_id="analyst-south",
        required_fields=("summary", "findings"),
        mode="repair",
        config={"repairer": "llm", "model": REPAIR_MODEL, "budget": {"total_tokens": 100_000}},
        timeout=60,
    )
    agent.output_validator(validator)

    async def go() -> Any:
        try:
            return await agent.run(prompt("south"))
        finally:
            await validator.aclose()

    result = asyncio.run(go())
    assert result.output == Report(**fixed)
    assert validator.verdicts[result.run_id].status == "repaired"
    assert len(fake.requests_with(ANALYST)) == 1
    assert fake.requests_with(REPAIR)


def _unreachable_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


@pytest.mark.parametrize("fail_open", [False, True])
def test_with_the_fleet_unreachable_the_output_is_rejected_unless_fail_open(
    fake: FakeOpenAIServer, fail_open: bool
) -> None:
    """Redis (so the fleet) unreachable: the run ends with CritiqueRejected naming Redis and
    the model is not re-run; with fail_open=True the output passes, marked unchecked."""
    fake.reset()
    good = {"summary": "Q3 sales.", "findings": "North grew.", "confidence": 0.9}
    fake.on(ANALYST, json.dumps(good))
    with client_on(_unreachable_url(), flush=False, OTEL_SDK_DISABLED="true"):
        agent = _agent(fake)
        validator = CritiqueValidator(
            run_id="pai-down", worker_id="analyst-north", timeout=5, fail_open=fail_open
        )
        agent.output_validator(validator)

        async def go() -> Any:
            try:
                return await agent.run(prompt("north"))
            finally:
                await validator.aclose()

        if fail_open:
            result = asyncio.run(go())
            assert result.output == Report(**good)
            verdict = validator.verdicts[result.run_id]
            assert (verdict.status, verdict.checked) == ("unchecked", False)
        else:
            with pytest.raises(CritiqueRejected, match=r"did not check the output: .*Redis"):
                asyncio.run(go())
    assert len(fake.completions) == 1


def test_the_example_of_docs_pydantic_ai_prints_what_the_page_shows(
    env: dict[str, str], worker: WorkerProcess
) -> None:
    """docs/pydantic-ai.md's example (a FunctionModel worker told its missing findings), run
    against a real worker, prints the text block under it: the told defects, the repaired
    report, its verdict and exactly the re-run's 340 tokens charged."""
    assert_examples_print_what_the_page_shows("docs/pydantic-ai.md", 1)
