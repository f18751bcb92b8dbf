"""``critique mcp`` as an ``openai-agents`` agent uses it: a real ``Agent`` whose MCP server is
the real ``critique mcp`` process (the SDK's ``MCPServerStdio`` spawns it; its
``MCPServerStreamableHttp`` reaches ``critique mcp --transport http`` on a free loopback port),
whose model is scripted at HTTP level (the fake OpenAI server, Chat Completions API): it calls
``submit`` with a real submission, then ``wait`` on the handle it read in the submit's tool result,
then answers. A real Redis and a real ``critique worker`` critique the output (its critic and
repairer LLM calls go to the same fake): the verdict the model reads is the fleet's, as the sync
client reads it back, and every tool result it reads is the server's structured output. A submit
whose ``config`` sets a worker-only field comes back to the model as a tool error naming it, and
nothing is enqueued."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "agents", reason="openai-agents is not installed (pip install openai-agents==0.24.0)"
)
pytest.importorskip("mcp", reason="mcp is not installed (pip install mcp==2.3.0)")

import redis
from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.mcp import MCPServer, MCPServerStdio, MCPServerStreamableHttp
from agents.mcp.util import MCPToolCustomDataContext
from openai import AsyncOpenAI

from tests.fakes.openai_server import (
    CRITIC,
    REPAIR,
    FakeOpenAIServer,
    tool_calls,
    user_text,
)
from tests.support import stop_process, wait_until
from tests.support.mcp_world import (
    CRITIC_MODEL,
    DEFECT,
    FIXED,
    MARK,
    POLICY,
    STDIO,
    TASK,
    WORKER_MODEL,
    Critic,
)
from tests.support.workers import ROOT, WorkerProcess, WorkerSpec, llm_env
from workers.adapters.mcp_server import HandleRef, Submitted, Verdict, verdict_of
from workers.embedded import free_port

pytestmark = pytest.mark.integration

set_tracing_disabled(True)  # the SDK uploads traces to OpenAI unless told not to

SECRET = "7a" * 32
MANAGER = "You are the delegation manager"
"""The agent's instructions (its system message): the fake answers the agent's model by it."""
SUBMIT_THIS = "Submit this for critique:"
"""The agent's prompt: this, then the submit tool's arguments as JSON."""
REFUSED_FIELD = "llm.api_base"
WORKER = WorkerSpec("mcp-agents", concurrency=4)


# -- the fleet's LLM (critic, repairer) and the agent's scripted model, one fake server ---------
def _text(content: Any) -> str:
    """A chat message's content as text (a string, or content parts)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")


def manager(body: dict[str, Any]) -> str | dict[str, Any]:
    """The agent's model, a function of the request alone: call ``submit`` with the arguments
    its prompt gives; given the submit's handles, ``wait`` on the first; given the verdict,
    answer with it; given a refused submit, ask ``status`` about the run; then answer."""
    msgs = body["messages"]
    n = sum(1 for m in msgs if m.get("role") == "assistant")
    asked = json.loads(user_text(body).split(SUBMIT_THIS, 1)[1])
    last = msgs[-1]
    if last.get("role") != "tool":
        return tool_calls([("submit", asked)], n)
    names = {
        c["id"]: c["function"]["name"]
        for m in msgs
        if m.get("role") == "assistant"
        for c in m.get("tool_calls") or ()
    }
    tool, text = names[last["tool_call_id"]], _text(last.get("content"))
    if tool == "submit":
        try:
            handle = json.loads(text)["handles"][0]
        except (ValueError, KeyError, IndexError, TypeError):  # refused: does the run exist?
            return tool_calls([("status", {"run_id": asked["submissions"][0]["run_id"]})], n)
        return tool_calls([("wait", {"handle": handle, "timeout_s": 30})], n)
    if tool == "wait":
        verdict = json.loads(text)
        return f"{verdict['worker_id']} {verdict['status']}"
    return "not submitted"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        server.on(CRITIC, Critic())
        server.on(REPAIR, json.dumps(FIXED))
        server.on(MANAGER, manager)
        yield server


@pytest.fixture(scope="module")
def env(redis_url: str, fake: FakeOpenAIServer) -> Iterator[dict[str, str]]:
    """The worker, this process and the MCP server processes: one database, one secret, the
    workers' LLM transport (worker-only) at the fake, no telemetry."""
    with llm_env(
        redis_url,
        fake.api_base,
        CRITIQUE_SECRET=SECRET,
        CRITIQUE_ALLOWED_MODELS=f"{CRITIC_MODEL},{WORKER_MODEL}",
        CRITIQUE_LLM__MAX_RETRIES="0",
        OTEL_SDK_DISABLED="true",
        OTEL_TRACES_EXPORTER="none",
        OPENAI_AGENTS_DISABLE_TRACING="1",
        NO_PROXY="127.0.0.1,localhost",
    ) as e:
        yield e


# -- the agent and its MCP server ----------------------------------------------------------------
def server_command() -> list[str]:
    """``critique mcp``: the venv's ``critique`` entry point once the command is registered
    (workers/cli.py COMMANDS), else the same ``main`` through the interpreter."""
    from workers.cli import COMMANDS

    entry = Path(sys.executable).parent / "critique"
    if "mcp" in COMMANDS and entry.exists():
        return [str(entry), "mcp"]
    return [sys.executable, "-c", STDIO]


class Seen:
    """What the SDK got back from each MCP tool call (its custom-data hook): the tool, the
    result's ``isError`` and ``structuredContent``, and the output it made for the model."""

    def __init__(self) -> None:
        self.calls: list[MCPToolCustomDataContext] = []

    def __call__(self, ctx: MCPToolCustomDataContext) -> None:
        self.calls.append(ctx)

    def tools(self) -> list[str]:
        return [c.tool_name for c in self.calls]


def stdio_server(env: dict[str, str], seen: Seen) -> MCPServerStdio:
    command, *args = server_command()
    return MCPServerStdio(
        {"command": command, "args": [*args], "env": env, "cwd": str(ROOT)},
        name="critique",
        client_session_timeout_seconds=60,
        use_structured_content=True,
        custom_data_extractor=seen,
    )


def http_server(url: str, seen: Seen) -> MCPServerStreamableHttp:
    return MCPServerStreamableHttp(
        {"url": url, "timeout": 30},
        name="critique",
        client_session_timeout_seconds=60,
        use_structured_content=True,
        custom_data_extractor=seen,
    )


def agent_on(fake: FakeOpenAIServer, server: MCPServer) -> Agent[Any]:
    model = OpenAIChatCompletionsModel(
        model="manager-model",
        openai_client=AsyncOpenAI(base_url=fake.api_base, api_key="sk-test", max_retries=0),
    )
    return Agent(
        name="manager",
        instructions=f"{MANAGER}. Submit the worker's output for critique and wait for it.",
        model=model,
        mcp_servers=[server],
    )


def run_agent(fake: FakeOpenAIServer, server: MCPServer, arguments: dict[str, Any]) -> Any:
    """The agent run once (its MCP server connected for the run): the final output."""

    async def go() -> Any:
        async with server:
            result = await Runner.run(
                agent_on(fake, server), f"{SUBMIT_THIS} {json.dumps(arguments)}", max_turns=6
            )
        return result.final_output

    return asyncio.run(go())


def read_by_model(fake: FakeOpenAIServer, run_id: str) -> list[tuple[str, str]]:
    """The tool results the agent's model read at its last call for ``run_id``: (tool, text)."""
    [*_, last] = [b for b in fake.requests_with(MANAGER) if run_id in user_text(b)]
    names = {
        c["id"]: c["function"]["name"]
        for m in last["messages"]
        if m.get("role") == "assistant"
        for c in m.get("tool_calls") or ()
    }
    return [
        (names[m["tool_call_id"]], _text(m.get("content")))
        for m in last["messages"]
        if m.get("role") == "tool"
    ]


def run_keys(url: str, run_id: str) -> list[bytes]:
    """The fleet database's keys that name ``run_id``."""
    client = redis.Redis.from_url(url)
    try:
        return list(client.scan_iter(match=f"*{run_id}*", count=1000))
    finally:
        client.close()


def defective(run_id: str) -> dict[str, Any]:
    """A defective output (it holds :data:`MARK`), told apart by its run id."""
    return {"summary": f"Sales {MARK} (run {run_id}).", "findings": "The north grew fastest."}


def submission(run_id: str, worker_id: str) -> dict[str, Any]:
    """One worker's output, as the submit tool takes it."""
    return {
        "run_id": run_id,
        "worker_id": worker_id,
        "task": TASK,
        "output": defective(run_id),
        "required_fields": ["summary", "findings"],
        "model": WORKER_MODEL,
    }


# -- the tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_the_agents_model_submits_through_critique_mcp_and_reads_the_fleets_verdict(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer, transport: str
) -> None:
    """The scripted model calls submit (a defective output), then wait on the handle it read in
    the tool result: the fleet's critic (an LLM call of the worker) flags it and its repairer
    fixes it; the verdict the model reads next is the fleet's (its worker_id, `repaired`, the
    repaired output), equal to the stored result the sync client reads; each tool result the
    model read is the server's structured output, verbatim."""
    from workers.client import CritiqueClient

    run_id = f"mcpa-{uuid.uuid4().hex[:8]}"
    worker_id = f"writer-{transport}"
    arguments = {"submissions": [submission(run_id, worker_id)], "config": POLICY}
    seen = Seen()
    if transport == "stdio":
        final = run_agent(fake, stdio_server(env, seen), arguments)
    else:
        port = free_port()
        proc = subprocess.Popen(
            [*server_command(), "--transport", "http", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )

        def listening() -> bool:
            assert proc.poll() is None, "the MCP server exited"
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        try:
            wait_until(listening, 60, what="the MCP server's port")
            final = run_agent(fake, http_server(f"http://127.0.0.1:{port}/mcp", seen), arguments)
        finally:
            stop_process(proc, wait_s=15)

    assert final == f"{worker_id} repaired"
    assert seen.tools() == ["submit", "wait"]
    assert [c.is_error for c in seen.calls] == [False, False]
    read = read_by_model(fake, run_id)
    assert [tool for tool, _ in read] == ["submit", "wait"]
    for (_, text), call in zip(read, seen.calls, strict=True):
        assert call.structured_content is not None
        assert json.loads(text) == dict(call.structured_content)  # the server's, verbatim

    submitted = Submitted.model_validate_json(read[0][1])
    [handle] = submitted.handles
    assert (handle.run_id, handle.worker_id) == (run_id, worker_id)
    verdict = Verdict.model_validate_json(read[1][1])
    assert (verdict.run_id, verdict.worker_id, verdict.pass_id) == (
        run_id,
        worker_id,
        handle.pass_id,
    )
    assert (verdict.status, verdict.stop_reason, verdict.passes, verdict.checked) == (
        "repaired",
        "accepted",
        True,
        True,
    )
    assert verdict.output == FIXED and verdict.repairs == 1
    assert verdict.best_score is not None and verdict.original_score is not None
    assert verdict.best_score > verdict.original_score

    stored = CritiqueClient().result(HandleRef.model_validate(handle).handle())
    assert stored is not None and stored.worker_id == worker_id
    assert verdict_of(stored).model_dump(mode="json") == json.loads(read[1][1])
    # the fleet's own LLM calls: its critic read this output, its repairer fixed it
    assert any(run_id in user_text(b) for b in fake.requests_with(CRITIC))
    [repair] = [b for b in fake.requests_with(REPAIR) if run_id in user_text(b)]
    assert DEFECT in user_text(repair)
    assert run_keys(env["REDIS_URL"], run_id)  # the run is in the fleet's store


def test_a_worker_only_field_in_the_config_is_a_tool_error_and_nothing_is_enqueued(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """The scripted model's submit sets `llm.api_base` in its config: the model reads a tool
    error (the MCP result is isError, no structured verdict) naming the refused field, and the
    status it asks next says the run does not exist; the fleet's store holds nothing for the
    run and its critic never saw the output."""
    run_id = f"mcpa-{uuid.uuid4().hex[:8]}"
    config = {**POLICY, "llm": {"api_base": "http://evil.invalid/v1"}}
    arguments = {"submissions": [submission(run_id, "writer-evil")], "config": config}
    seen = Seen()
    final = run_agent(fake, stdio_server(env, seen), arguments)

    assert final == "not submitted"
    assert seen.tools() == ["submit", "status"]
    assert [c.is_error for c in seen.calls] == [True, True]
    assert not any(c.structured_content for c in seen.calls)
    read = dict(read_by_model(fake, run_id))
    refused = read["submit"]
    assert f"may not set '{REFUSED_FIELD}': worker-only" in refused, refused
    assert "\n" not in refused and "handles" not in refused
    assert f"no submission of run '{run_id}'" in read["status"], read["status"]
    time.sleep(0.5)  # a message enqueued would have reached the worker's critic by now
    assert run_keys(env["REDIS_URL"], run_id) == []
    assert not any(run_id in user_text(b) for b in fake.requests_with(CRITIC))
