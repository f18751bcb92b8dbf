"""``critique mcp`` through the ``mcp`` package's own client, over stdio (the server a child
process) and streamable HTTP (on a free loopback port), against a real signed worker and Redis,
the LLM faked at HTTP level: five outputs, one defective; the service repairs it (repair mode)
or hands it back with its defects and checks the re-run (verdict mode); status and pitfalls;
a worker-only field and a missing secret refused; a stopped fleet is a tool error, never a pass."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp", reason="mcp is not installed (pip install mcp==2.3.0)")

from mcp import Client, StdioServerParameters
from mcp.types import CallToolResult

from tests.fakes.openai_server import (
    CRITIC,
    REPAIR,
    FakeOpenAIServer,
    user_text,
)
from tests.support import stop_process, wait_until
from tests.support.docs import example_pairs
from tests.support.mcp_world import (
    CRITIC_MODEL,
    CRITIC_TOKENS,
    DEFECT,
    FIXED,
    MARK,
    POLICY,
    STDIO,
    TASK,
    WORKER_MODEL,
    Critic,
)
from tests.support.workers import ROOT, WorkerProcess, WorkerSpec, client_on, llm_env
from workers.adapters.mcp_server import build_server
from workers.embedded import free_port

pytestmark = pytest.mark.integration

SECRET = "5e" * 32
GOOD = {"summary": "Sales rose 4% in Q3.", "findings": "The north grew fastest."}
BAD = {"summary": f"Sales {MARK}.", "findings": "The north grew fastest."}
WORKER = WorkerSpec("mcp", concurrency=4)


@pytest.fixture(scope="module")
def critic() -> Critic:
    return Critic()


@pytest.fixture(scope="module")
def fake(critic: Critic) -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        server.on(CRITIC, critic)
        server.on(REPAIR, json.dumps(FIXED))
        yield server


@pytest.fixture(scope="module")
def env(redis_url: str, fake: FakeOpenAIServer) -> Iterator[dict[str, str]]:
    """The workers, this process and the servers it starts: one database, one secret, the LLM
    transport (worker-only) at the fake, no telemetry."""
    with llm_env(
        redis_url,
        fake.api_base,
        CRITIQUE_SECRET=SECRET,
        CRITIQUE_ALLOWED_MODELS=f"{CRITIC_MODEL},{WORKER_MODEL}",
        CRITIQUE_LLM__MAX_RETRIES="0",
        OTEL_SDK_DISABLED="true",
        OTEL_TRACES_EXPORTER="none",
        NO_PROXY="127.0.0.1,localhost",
    ) as e:
        yield e


def submissions(run_id: str) -> list[dict[str, Any]]:
    """Five workers' outputs; w3's is the defective one."""
    return [
        {
            "run_id": run_id,
            "worker_id": f"w{i}",
            "task": TASK,
            "output": BAD if i == 3 else {**GOOD, "n": i},
            "required_fields": ["summary", "findings"],
            "model": WORKER_MODEL,
        }
        for i in range(1, 6)
    ]


def ok(result: CallToolResult) -> dict[str, Any]:
    """A tool's structured answer; fails the test with the tool's error text."""
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


def error_text(result: CallToolResult) -> str:
    """A tool error's text (and that it is one, with no structured verdict)."""
    assert result.is_error and not result.structured_content, result
    return " ".join(getattr(c, "text", "") for c in result.content)


async def submit_and_wait(
    client: Client, run_id: str, config: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Submit the five outputs in one call; the handles and each one's verdict, in order."""
    sent = ok(
        await client.call_tool("submit", {"submissions": submissions(run_id), "config": config})
    )
    handles = sent["handles"]
    assert [h["worker_id"] for h in handles] == ["w1", "w2", "w3", "w4", "w5"]
    results = [ok(await client.call_tool("wait", {"handle": h, "timeout_s": 60})) for h in handles]
    return handles, results


def check_untouched(results: list[dict[str, Any]]) -> None:
    """The four good outputs pass as they were sent."""
    for i in (0, 1, 3, 4):
        v = results[i]
        assert (v["status"], v["passes"], v["repairs"]) == ("accepted", True, 0), v
        assert v["output"] == {**GOOD, "n": i + 1} and v["feedback"] == ""


def test_stdio_repair_mode_repairs_the_defective_output_and_passes_the_rest(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """Over stdio (`critique mcp` a child process): 5 outputs, the defective one comes back
    repaired with the fleet's repaired output, the other 4 accepted untouched; poll, status
    (`critique status --json`'s document) and pitfalls answer for the run."""
    run_id = f"mcp-{uuid.uuid4().hex[:8]}"
    params = StdioServerParameters(command=sys.executable, args=["-c", STDIO], env=env, cwd=ROOT)

    async def scenario() -> None:
        async with Client(params) as client:
            names = {t.name for t in (await client.list_tools()).tools}
            assert names == {"submit", "wait", "poll", "status", "pitfalls"}
            handles, results = await submit_and_wait(client, run_id, POLICY)
            check_untouched(results)
            bad = results[2]
            assert (bad["status"], bad["stop_reason"], bad["passes"]) == (
                "repaired",
                "accepted",
                True,
            )
            assert bad["output"] == FIXED and bad["repairs"] == 1
            assert bad["best_score"] > bad["original_score"]

            polled = ok(await client.call_tool("poll", {"handle": handles[2]}))
            assert polled["state"] == "finished" and polled["verdict"]["output"] == FIXED

            doc = ok(await client.call_tool("status", {"run_id": run_id}))
            assert doc["run_id"] == run_id and doc["ok"] is True
            assert doc["counts"] == {"accepted": 4, "repaired": 1}
            pit = ok(await client.call_tool("pitfalls", {"run_id": run_id}))["result"]
            assert "[seen 1x] hallucinated" in pit, pit

    asyncio.run(scenario())
    [repair_call] = [b for b in fake.requests_with(REPAIR) if MARK in user_text(b)]
    assert DEFECT in user_text(repair_call)  # the service's repairer got the defect


def test_http_verdict_mode_hands_back_the_defects_and_checks_the_re_run(
    env: dict[str, str], worker: WorkerProcess, critic: Critic
) -> None:
    """Over streamable HTTP (`critique mcp --transport http` on a free loopback port), with
    `repairer: worker`: the defective output is pending at first, then escalated
    `worker_repair` with its defect as feedback and a repair request; the re-run's output
    (repair_of, its reported tokens) ends repaired, and the run's budget is charged the
    re-run's tokens plus the re-critique's usage as the fake reported it."""
    from workers.client import CritiqueClient

    run_id = f"mcp-{uuid.uuid4().hex[:8]}"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", STDIO, "--transport", "http", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )

    def listening() -> bool:
        assert proc.poll() is None, "the server exited"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    critic.delay_s = 2.0
    config = {**POLICY, "repairer": "worker"}

    async def scenario() -> None:
        async with Client(f"http://127.0.0.1:{port}/mcp") as client:
            sent = ok(
                await client.call_tool(
                    "submit", {"submissions": submissions(run_id), "config": config}
                )
            )
            handles = sent["handles"]
            first = ok(await client.call_tool("poll", {"handle": handles[2]}))
            assert first == {"state": "pending", "handle": handles[2], "verdict": None}
            results = [
                ok(await client.call_tool("wait", {"handle": h, "timeout_s": 60})) for h in handles
            ]
            check_untouched(results)
            bad = results[2]
            assert (bad["status"], bad["stop_reason"], bad["passes"]) == (
                "escalated",
                "worker_repair",
                False,
            )
            assert DEFECT in bad["feedback"] and bad["output"] == BAD
            assert bad["defects"][0]["description"] == DEFECT
            request = bad["repair_request"]
            assert request["attempt"] == 1 and request["of_pass"] == handles[2]["pass_id"]

            rerun = {**submissions(run_id)[2], "output": FIXED}
            rerun.update(repair_of=request["of_pass"], repair_tokens=321)
            again = ok(await client.call_tool("submit", {"submissions": [rerun], "config": config}))
            [h] = again["handles"]
            final = ok(await client.call_tool("wait", {"handle": h, "timeout_s": 60}))
            assert (final["status"], final["passes"], final["output"]) == ("repaired", True, FIXED)
            assert final["repairs"] == 1

    try:
        wait_until(listening, 60, what="the MCP server's port")
        asyncio.run(scenario())
    finally:
        critic.delay_s = 0.0
        stop_process(proc, wait_s=15)
    assert CritiqueClient().budget(run_id).spent == 321 + sum(CRITIC_TOKENS)


def test_a_worker_only_field_or_a_missing_secret_is_refused_before_anything_is_sent(
    env: dict[str, str], worker: WorkerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`llm.api_base` in a submit's config is a tool error with the client's one line; a server
    without the workers' CRITIQUE_SECRET is refused naming it; the run never exists."""
    run_id = f"mcp-{uuid.uuid4().hex[:8]}"
    args = {"submissions": submissions(run_id)[:1]}

    async def scenario() -> list[str]:
        async with Client(build_server()) as client:
            evil = {**POLICY, "llm": {"api_base": "http://127.0.0.1:9/v1"}}
            refused = error_text(await client.call_tool("submit", {**args, "config": evil}))
            monkeypatch.delenv("CRITIQUE_SECRET")
            unsigned = error_text(await client.call_tool("submit", args))
            monkeypatch.setenv("CRITIQUE_SECRET", SECRET)
            unknown = error_text(await client.call_tool("status", {"run_id": run_id}))
            return [refused, unsigned, unknown]

    refused, unsigned, unknown = asyncio.run(scenario())
    assert "may not set 'llm.api_base': worker-only" in refused and "\n" not in refused
    assert "CRITIQUE_SECRET" in unsigned
    assert run_id in unknown


def test_a_stopped_fleet_is_a_tool_error_never_a_passing_verdict(
    env: dict[str, str], redis_url: str
) -> None:
    """Redis down: submit and wait are tool errors saying the output was not critiqued and
    why; no worker consuming: wait times out with an error that says the output is not passed;
    with fail_open the same wait is an `unchecked` verdict that does not pass."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    handle = {"run_id": "mcp-dead", "iteration": 1, "worker_id": "w1", "pass_id": "p1"}

    async def down() -> list[str]:
        async with Client(build_server()) as client:
            sub = submissions("mcp-dead")[:1]
            return [
                error_text(await client.call_tool("submit", {"submissions": sub})),
                error_text(await client.call_tool("wait", {"handle": handle, "timeout_s": 5})),
            ]

    with client_on(dead, flush=False, CRITIQUE_SECRET=SECRET):
        for text in asyncio.run(down()):
            assert "not critiqued: cannot reach Redis at" in text, text

    async def no_worker() -> tuple[str, dict[str, Any]]:
        async with Client(build_server()) as closed, Client(build_server(fail_open=True)) as op:
            sent = ok(await closed.call_tool("submit", {"submissions": submissions("mcp-idle")}))
            h = sent["handles"][0]
            late = error_text(await closed.call_tool("wait", {"handle": h, "timeout_s": 0.3}))
            marked = ok(await op.call_tool("wait", {"handle": h, "timeout_s": 0.3}))
            return late, marked

    with client_on(redis_url, CRITIQUE_SECRET=SECRET):  # the tests' database: no worker there
        late, marked = asyncio.run(no_worker())
    assert "no verdict yet" in late and "not passed" in late
    assert (marked["status"], marked["passes"], marked["checked"]) == ("unchecked", False, False)
    assert marked["best_score"] is None and "not critiqued" in marked["why"][0]


def test_the_docs_example_prints_what_docs_mcp_md_shows(
    env: dict[str, str],
    worker: WorkerProcess,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/mcp.md's example (a manager on the `mcp` client, `critique mcp` over stdio, a
    missing field sent back in verdict mode) prints the text block under it."""
    [(code, shown)] = example_pairs("docs/mcp.md")
    bin_dir = str(Path(sys.executable).parent)  # the venv's `critique`
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    exec(compile(code, "docs/mcp.md", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.splitlines() == shown.splitlines()


def test_garbage_bytes_on_stdio_are_skipped_and_the_server_still_answers(
    env: dict[str, str],
) -> None:
    """NUL and invalid UTF-8 bytes, a line that is not JSON and a truncated array, then a
    well-formed session: `critique mcp` answers `initialize` and `tools/list` with the five
    tools, writes nothing but JSON-RPC on stdout, nothing on stderr, and exits 0 at EOF. (No
    Redis is needed: the fleet is reached only by a tool call.)"""
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "garbage-test", "version": "0"},
        },
    }
    lines = [
        b"\x00\xff{not json",
        b"[1,2",
        json.dumps(init).encode(),
        b'{"jsonrpc":"2.0","method":"notifications/initialized"}',
        b'{"jsonrpc":"2.0","id":2,"method":"tools/list"}',
    ]
    proc = subprocess.Popen(
        [sys.executable, "-c", STDIO],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env, "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"},
        cwd=ROOT,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"\n".join(lines) + b"\n")
    proc.stdin.flush()
    replies = [json.loads(proc.stdout.readline()) for _ in range(2)]  # stdin still open
    out, err = proc.communicate(timeout=60)  # closes stdin: EOF, the server ends
    assert proc.returncode == 0 and err == b"" and out == b"", (out[-300:], err[-500:])
    assert [r.get("id") for r in replies] == [1, 2]
    names = sorted(t["name"] for t in replies[1]["result"]["tools"])
    assert names == ["pitfalls", "poll", "status", "submit", "wait"]
