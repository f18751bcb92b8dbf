"""The OpenAI Agents SDK's guardrails on the fleet: a real ``openai-agents`` manager whose model
and five analyst sub-agents (tools) are played by the fake OpenAI server over HTTP on 127.0.0.1
(the Chat Completions API), a real Redis and a real ``critique worker`` (heuristic critic).
Verdict mode re-runs only the defective analyst, once, with its defects in its prompt and its
re-run's reported tokens charged; an output guardrail trips and its agent's re-run is the
pass's repair; repair mode hands the model the fleet's repaired output; a fleet that cannot be
reached or does not answer rejects the outputs, never passes them."""

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
    "agents", reason="openai-agents is not installed (pip install openai-agents==0.24.0)"
)

from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OutputGuardrailTripwireTriggered,
    Runner,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tests.fakes.openai_server import REPAIR, FakeOpenAIServer, reply, tool_calls, user_text
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
from workers.adapters.openai_agents import CritiqueGuardrails, Verdict, critiqued_output

pytestmark = pytest.mark.integration

set_tracing_disabled(True)  # the SDK uploads traces to OpenAI unless told not to

MANAGER = "You are the sales manager"
"""The agents' instructions (their system messages): the fake answers by them."""
REJECTED = "REJECTED by the critique fleet"
WORKER = WorkerSpec("openai-agents", concurrency=4)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def env(redis_url: str, fake: FakeOpenAIServer) -> Iterator[dict[str, str]]:
    """This process and the worker on the worker database (tests/support/frameworks.py)."""
    with fleet_env(redis_url, fake.api_base, OPENAI_AGENTS_DISABLE_TRACING="1") as e:
        yield e


def _model(fake: FakeOpenAIServer, name: str) -> OpenAIChatCompletionsModel:
    return OpenAIChatCompletionsModel(
        model=name, openai_client=AsyncOpenAI(base_url=fake.api_base, api_key="sk-test")
    )


def _analyst(fake: FakeOpenAIServer, region: str, **kwargs: Any) -> Agent[Any]:
    return Agent(
        name=f"analyst_{region}",
        instructions=f"{ANALYST}. Answer with the JSON report.",
        model=_model(fake, "analyst-model"),
        output_type=Report,
        **kwargs,
    )


def _told(body: dict[str, Any]) -> bool:
    """The analyst's prompt carries the fleet's defects (a re-run)."""
    return "required field" in user_text(body)


def analysts(fake: FakeOpenAIServer) -> None:
    """The fake as the analysts' model: each region's report; the south one leaves its findings
    blank until its prompt carries the defects."""

    def analyst(body: dict[str, Any]) -> dict[str, Any]:
        region = re.search(r"the (\w+) region", user_text(body))
        name = region.group(1) if region else "?"
        told = _told(body)
        out = report(name).model_dump()
        if name == DEFECTIVE and not told:
            out["findings"] = ""
        return reply(json.dumps(out), prompt_tokens=130 if told else 100, completion_tokens=25)

    fake.on(ANALYST, analyst)


def _tool_calls(calls: list[tuple[str, str]], n: int) -> dict[str, Any]:
    """The manager's model calling agent tools: (tool name, its ``input``) each."""
    return tool_calls([(name, {"input": text}) for name, text in calls], n)


def manager_model(fake: FakeOpenAIServer) -> None:
    """The fake as the manager's model: call the five analysts' tools at once; call a tool
    again with its rejection (the defects) added to its input; then answer."""

    def manager(body: dict[str, Any]) -> str | dict[str, Any]:
        msgs = body["messages"]
        turns = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
        if not turns:
            return _tool_calls([(f"analyst_{r}", prompt(r)) for r in REGIONS], 0)
        asked = {
            c["id"]: (c["function"]["name"], json.loads(c["function"]["arguments"])["input"])
            for c in msgs[turns[-1]].get("tool_calls") or ()
        }
        again = [
            (asked[m["tool_call_id"]][0], f"{asked[m['tool_call_id']][1]}\n{m['content']}")
            for m in msgs[turns[-1] + 1 :]
            if m.get("role") == "tool" and str(m.get("content")).startswith(REJECTED)
        ]
        if again:
            return _tool_calls(again, len(turns))
        return "All five regional reports are in."

    fake.on(MANAGER, manager)


def _manager(fake: FakeOpenAIServer, critique: CritiqueGuardrails) -> Agent[Any]:
    tools = [
        critique.as_tool(
            _analyst(fake, r),
            f"analyst_{r}",
            f"The {r} region's analyst.",
            required_fields=("summary", "findings"),
        )
        for r in REGIONS
    ]
    return Agent(
        name="manager",
        instructions=f"{MANAGER}. Ask every regional analyst, then answer.",
        model=_model(fake, "manager-model"),
        tools=tools,
    )


def _tool_messages(fake: FakeOpenAIServer) -> list[str]:
    """The tool results the manager's model read at its last call."""
    last = fake.requests_with(MANAGER)[-1]
    return [str(m["content"]) for m in last["messages"] if m.get("role") == "tool"]


async def _run(critique: CritiqueGuardrails, agent: Agent[Any], prompt: str) -> Any:
    try:
        return await Runner.run(agent, prompt)
    finally:
        await critique.aclose()


def test_verdict_mode_re_runs_only_the_defective_analyst_once_with_its_defects(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """A manager calls five analyst sub-agents as tools, one output misses a required field:
    only that analyst is re-run, once, its prompt carrying the fleet's defects; the run's budget
    is charged exactly its re-run's reported usage; the other four pass untouched."""
    from workers.client import CritiqueClient

    fake.reset()
    analysts(fake)
    manager_model(fake)
    run_id = f"oai-{uuid.uuid4().hex[:8]}"
    critique = CritiqueGuardrails(
        run_id=run_id, config={"budget": {"total_tokens": 100_000}}, timeout=60
    )
    result = asyncio.run(_run(critique, _manager(fake, critique), "Collect the Q3 reports."))

    assert result.final_output == "All five regional reports are in."
    calls = {r: [b for b in fake.requests_with(ANALYST) if about(b, r)] for r in REGIONS}
    assert {r: len(c) for r, c in calls.items()} == {r: 2 if r == DEFECTIVE else 1 for r in REGIONS}
    assert "required field 'findings' is empty" in user_text(calls[DEFECTIVE][1])
    assert not any(_told(c[0]) for c in calls.values())

    [rerun] = [r for r in fake.requests if about(r["body"], DEFECTIVE) and _told(r["body"])]
    assert CritiqueClient().budget(run_id).spent == rerun["usage"]["total_tokens"] == 155

    infos = [g.output.output_info for g in result.tool_output_guardrail_results]
    assert all(isinstance(v, Verdict) for v in infos)
    by_worker: dict[str, list[str]] = {}
    for v in infos:
        by_worker.setdefault(v.worker_id, []).append(v.status)
    assert by_worker == {
        f"analyst_{r}": ["escalated", "repaired"] if r == DEFECTIVE else ["accepted"]
        for r in REGIONS
    }
    behaviors = [g.output.behavior["type"] for g in result.tool_output_guardrail_results]
    assert behaviors.count("reject_content") == 1 and behaviors.count("allow") == 5
    read = "\n".join(_tool_messages(fake))
    for region in REGIONS:
        assert report(region).findings in read


def test_an_output_guardrail_trips_and_the_agents_re_run_is_the_passes_repair(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """An agent's final output misses a field: the output guardrail trips with the verdict
    (escalated, worker_repair, the defects as feedback) as output_info; the agent run again
    with that feedback passes as the pass's repair (repaired), charged that run's usage."""
    from workers.client import CritiqueClient

    fake.reset()
    analysts(fake)
    run_id = f"oai-{uuid.uuid4().hex[:8]}"
    critique = CritiqueGuardrails(
        run_id=run_id, config={"budget": {"total_tokens": 100_000}}, timeout=60
    )
    agent = _analyst(
        fake,
        DEFECTIVE,
        output_guardrails=[critique.output_guardrail(required_fields=("summary", "findings"))],
    )

    async def go() -> tuple[Verdict, Any]:
        try:
            with pytest.raises(OutputGuardrailTripwireTriggered) as tripped:
                await Runner.run(agent, prompt(DEFECTIVE))
            verdict = tripped.value.guardrail_result.output.output_info
            again = await Runner.run(agent, f"{prompt(DEFECTIVE)}\n{verdict.feedback}")
            return verdict, again
        finally:
            await critique.aclose()

    verdict, again = asyncio.run(go())
    assert (verdict.status, verdict.stop_reason, verdict.retry) == (
        "escalated",
        "worker_repair",
        True,
    )
    assert "required field 'findings' is empty" in verdict.feedback
    assert [d["location"] for d in verdict.defects] == ["findings"]
    assert again.final_output == report(DEFECTIVE)
    [final] = [g.output.output_info for g in again.output_guardrail_results]
    assert (final.status, final.passed, final.checked) == ("repaired", True, True)
    assert critiqued_output(again) == report(DEFECTIVE)
    rerun = fake.requests[-1]["usage"]["total_tokens"]
    assert CritiqueClient().budget(run_id).spent == rerun == 155


def test_repair_mode_hands_the_model_the_fleets_repaired_output(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """Repair mode: the fleet's own reviser (an LLM call to the fake) fills the blank field; the
    manager's model reads the repaired report in place of the tool's output (the SDK's
    reject_content is a tool guardrail's only way to replace it) and no analyst is re-run."""
    fake.reset()
    analysts(fake)
    manager_model(fake)
    fixed = {**report(DEFECTIVE).model_dump(), "findings": "South grew 4% (repaired)."}
    fake.on(REPAIR, json.dumps(fixed))
    critique = CritiqueGuardrails(
        run_id=f"oai-{uuid.uuid4().hex[:8]}",
        mode="repair",
        config={"repairer": "llm", "model": REPAIR_MODEL, "budget": {"total_tokens": 100_000}},
        timeout=60,
    )
    result = asyncio.run(_run(critique, _manager(fake, critique), "Collect the Q3 reports."))

    assert len(fake.requests_with(ANALYST)) == 5
    assert fake.requests_with(REPAIR)
    [repaired] = [
        g.output.output_info
        for g in result.tool_output_guardrail_results
        if g.output.output_info.status == "repaired"
    ]
    assert repaired.output == Report(**fixed)
    assert json.dumps(fixed, ensure_ascii=False) in _tool_messages(fake)


def _unreachable_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


@pytest.mark.parametrize("fail_open", [False, True])
def test_with_the_fleet_unreachable_no_tool_output_reaches_the_model_unless_fail_open(
    fake: FakeOpenAIServer, fail_open: bool
) -> None:
    """Redis (so the fleet) unreachable: every analyst's output is rejected with the reason
    (Redis named) and the manager's model never reads a report; with fail_open=True the
    outputs go through, each verdict marked unchecked."""
    fake.reset()
    analysts(fake)
    fake.on(MANAGER, lambda body: "done" if _tool_messages_in(body) else _first_calls())
    with client_on(_unreachable_url(), flush=False, OTEL_SDK_DISABLED="true"):
        critique = CritiqueGuardrails(run_id="oai-down", timeout=5, fail_open=fail_open)
        result = asyncio.run(_run(critique, _manager(fake, critique), "Collect the Q3 reports."))
    infos = [g.output.output_info for g in result.tool_output_guardrail_results]
    assert len(infos) == 5 and {v.status for v in infos} == {"unchecked"}
    assert not any(v.checked for v in infos)
    read = _tool_messages(fake)
    if fail_open:
        assert {g.output.behavior["type"] for g in result.tool_output_guardrail_results} == {
            "allow"
        }
        assert all(m.startswith("summary='Q3 sales in the") for m in read)
        assert sum("grew 4%" in m for m in read) == 4  # south's blank findings went through too
    else:
        assert all(m.startswith(REJECTED) and "cannot reach Redis" in m for m in read)
        assert not any("grew 4%" in m for m in read)
    assert len(fake.requests_with(ANALYST)) == 5


def _tool_messages_in(body: dict[str, Any]) -> bool:
    return any(m.get("role") == "tool" for m in body["messages"])


def _first_calls() -> dict[str, Any]:
    return _tool_calls([(f"analyst_{r}", prompt(r)) for r in REGIONS], 0)


def test_the_examples_of_docs_openai_agents_print_what_the_page_shows(
    env: dict[str, str], worker: WorkerProcess
) -> None:
    """docs/openai-agents.md's Python examples (the second continues the first), run in one
    namespace against a real worker, print the text blocks under them."""
    assert_examples_print_what_the_page_shows("docs/openai-agents.md", 2)


def test_a_stopped_fleet_trips_the_output_guardrail_with_the_reason(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """With the fleet's worker stopped no verdict comes within the guardrail's timeout: the
    agent's output is not passed, the tripwire's verdict says why (unchecked, no result).
    (Last: it stops the module's worker.)"""
    worker.stop()
    fake.reset()
    analysts(fake)
    critique = CritiqueGuardrails(run_id=f"oai-{uuid.uuid4().hex[:8]}", timeout=1.0)
    agent = _analyst(fake, "north", output_guardrails=[critique.output_guardrail()])
    with pytest.raises(OutputGuardrailTripwireTriggered) as tripped:
        asyncio.run(_run(critique, agent, prompt("north")))
    verdict = tripped.value.guardrail_result.output.output_info
    assert (verdict.status, verdict.checked, verdict.output) == ("unchecked", False, None)
    assert verdict.reason.startswith("the critique fleet did not check the output: no result for")
