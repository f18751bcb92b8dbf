"""The LangGraph critique node with the real ``langgraph``, a real Redis and a real ``critique
worker`` (heuristic critic), the graph's worker nodes calling a fake OpenAI-compatible model on
127.0.0.1: a manager fans a task out to 5 workers with ``Send``, the critique node re-sends
only the defective output to its worker with the defects, charges the re-run's reported tokens,
stops at the budget with ``interrupt()`` and resumes, and fails closed when the fleet is down."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip(
    "langgraph", reason="langgraph is not installed (pip install langgraph==1.2.24)"
)

import openai
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from langgraph.types import Command, Send

from tests.fakes.openai_server import FakeOpenAIServer, system_text, user_text
from tests.support.docs import assert_examples_print_what_the_page_shows
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url
from workers.adapters.langgraph import CritiqueNode, CritiqueState, CritiqueUnavailable

pytestmark = pytest.mark.integration

WORKER = WorkerSpec("langgraph", concurrency=4)
WORKER_SYSTEM = "You are worker of the sales team. Answer with one JSON object."
TASK = "Summarise the Q3 sales report as JSON with summary and findings."
TEXT_TASK = "Summarise the Q4 sales report as JSON."
FIELDS = ["summary", "findings"]
WORKERS = [f"w{i}" for i in range(1, 6)]
DEFECTIVE = "w3"
FIX_MARKER = "Fix these defects:"
NO_NETWORK = {  # LangChain/LangSmith tracing off: nothing leaves the machine
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "LANGSMITH_API_KEY": "",
    "LANGCHAIN_API_KEY": "",
}


def complete(wid: str) -> dict[str, Any]:
    """A worker's complete answer."""
    return {
        "summary": f"Sales rose 4% ({wid}).",
        "findings": [f"Two new stores opened ({wid})."],
        "confidence": 0.8,
    }


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """The workers' model: w3's first answer lacks ``findings`` (under TEXT_TASK: gives its
    confidence as text); an answer to a prompt with the defects in it, and every other
    worker's, is complete."""
    prompt = user_text(request)
    wid = prompt.split(":", 1)[0].removeprefix("worker ").strip()
    out = complete(wid)
    if wid == DEFECTIVE and TEXT_TASK in prompt:  # what the fleet's own repair can fix
        out.update(confidence="0.72", sources="", notes="", caveats="")
    elif wid == DEFECTIVE and FIX_MARKER not in prompt:
        del out["findings"]
    return {"reply": json.dumps(out), "prompt_tokens": 40 + len(prompt) // 8}


@pytest.fixture(scope="module")
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as s:
        yield s


@pytest.fixture
def fake(server: FakeOpenAIServer) -> FakeOpenAIServer:
    """The fake model with a fresh request log for each test."""
    server.reset()
    server.on(WORKER_SYSTEM, answer)
    return server


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    with client_on(worker_db_url(redis_url), CRITIQUE_CRITIC="heuristic", **NO_NETWORK) as e:
        yield e


class State(CritiqueState, total=False):
    reported: list[str]


def build(
    node: CritiqueNode, fake: FakeOpenAIServer, *, asynchronous: bool = False, task: str = TASK
) -> Any:
    """manager → Send × 5 → worker (the fake model) → critique → report."""
    llm = openai.OpenAI(base_url=fake.api_base, api_key="sk-test", max_retries=0)

    def fan_out(state: State) -> list[Send]:
        return [Send("worker", {"worker_id": w, "task": task}) for w in WORKERS]

    def worker(arg: dict[str, Any]) -> dict[str, Any]:
        prompt = f"worker {arg['worker_id']}: {arg['task']}"
        if arg.get("feedback"):
            prompt += f"\n{FIX_MARKER}\n{arg['feedback']}"
        reply = llm.chat.completions.create(
            model="worker-model",
            messages=[
                {"role": "system", "content": WORKER_SYSTEM},
                {"role": "user", "content": prompt},
            ],
        )
        assert reply.usage is not None
        item = {
            "worker_id": arg["worker_id"],
            "task": arg["task"],
            "required_fields": FIELDS,
            "output": json.loads(reply.choices[0].message.content or "{}"),
            "tokens": reply.usage.total_tokens,
        }
        return {"outputs": [item]}

    def report(state: State) -> dict[str, Any]:
        return {"reported": sorted(r["worker_id"] for r in state.get("passed", []))}

    builder = StateGraph(State)
    builder.add_node("manager", lambda state: {})
    builder.add_node("worker", worker)
    builder.add_node("report", report)
    builder.add_edge(START, "manager")
    builder.add_conditional_edges("manager", fan_out, ["worker"])
    node.attach(builder, asynchronous=asynchronous)
    return builder.compile(checkpointer=InMemorySaver())


def worker_calls(fake: FakeOpenAIServer) -> list[dict[str, Any]]:
    """The worker nodes' model requests (with their reported usage), oldest first."""
    return [
        r
        for r in fake.requests
        if isinstance(r["body"], dict) and WORKER_SYSTEM in system_text(r["body"])
    ]


def by_worker(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["worker_id"]: r for r in records}


def thread() -> dict[str, Any]:
    return {"configurable": {"thread_id": uuid.uuid4().hex[:12]}}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_only_the_defective_worker_re_runs_once_with_its_defects_and_its_tokens_are_charged(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer, asynchronous: bool
) -> None:
    """Verdict mode (sync node under invoke, async node under ainvoke): w3 (no findings) is
    re-sent once with the defects in its prompt and ends repaired; the run's budget spent is
    the re-run's usage as the fake reported it; the other 4 pass with their first output, each
    model called once."""
    from workers.client import CritiqueClient

    node = CritiqueNode("worker", "report", config={"budget": {"total_tokens": 200_000}})
    graph = build(node, fake, asynchronous=asynchronous)
    cfg = thread()
    final = asyncio.run(graph.ainvoke({}, cfg)) if asynchronous else graph.invoke({}, cfg)

    passed = by_worker(final["passed"])
    assert sorted(passed) == WORKERS and final["rejected"] == []
    assert final["reported"] == WORKERS
    assert (passed[DEFECTIVE]["status"], passed[DEFECTIVE]["reruns"]) == ("repaired", 1)
    assert "findings" in passed[DEFECTIVE]["output"]

    calls = worker_calls(fake)
    reruns = [c for c in calls if FIX_MARKER in user_text(c["body"])]
    assert len(calls) == 6 and len(reruns) == 1
    prompt = user_text(reruns[0]["body"])
    assert prompt.startswith(f"worker {DEFECTIVE}:") and "findings" in prompt.split(FIX_MARKER)[1]

    for wid in WORKERS:
        if wid != DEFECTIVE:
            assert passed[wid]["output"] == complete(wid)
            assert (passed[wid]["status"], passed[wid]["reruns"]) == ("accepted", 0)

    run_id = final["critique"]["run_id"]
    spent = CritiqueClient().budget(run_id).spent
    assert spent == reruns[0]["usage"]["total_tokens"] > 0


def test_a_spent_budget_interrupts_with_the_escalation_and_resumes_with_the_reviewers_answer(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """A run whose repair budget cannot hold a re-run stops at interrupt() with w3's
    escalation (repair_budget_exhausted, its defects); Command(resume={"w3": "accept"}) on the
    same thread passes it on as escalated, with no re-run, and the graph goes on to report."""
    node = CritiqueNode("worker", "report", config={"budget": {"total_tokens": 10}})
    graph = build(node, fake)
    cfg = thread()
    first = graph.invoke({}, cfg)

    [pause] = first["__interrupt__"]
    [escalation] = pause.value["escalations"]
    assert escalation["worker_id"] == DEFECTIVE
    assert escalation["stop_reason"] == "repair_budget_exhausted"
    assert any("findings" in d["description"] for d in escalation["defects"])
    assert graph.get_state(cfg).next == (node.review_name,)
    assert sorted(r["worker_id"] for r in first["passed"]) == [w for w in WORKERS if w != "w3"]

    final = graph.invoke(Command(resume={DEFECTIVE: "accept"}), cfg)
    passed = by_worker(final["passed"])
    assert sorted(passed) == WORKERS and final["reported"] == WORKERS
    assert (passed[DEFECTIVE]["status"], passed[DEFECTIVE]["decision"]) == ("escalated", "accept")
    assert len(worker_calls(fake)) == 5  # nobody re-ran


def test_repair_mode_puts_the_fleets_repaired_output_into_the_state(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """Repair mode on the async node (ainvoke): the fleet repairs w3 itself (deterministic
    repairer: its confidence given as text), the repaired output is what ``passed`` holds, the
    other 4 pass as they came, and no worker is re-sent."""
    node = CritiqueNode("worker", "report", mode="repair", config={"repairer": "deterministic"})
    graph = build(node, fake, asynchronous=True, task=TEXT_TASK)
    final = asyncio.run(graph.ainvoke({}, thread()))
    passed = by_worker(final["passed"])
    assert sorted(passed) == WORKERS and final["rejected"] == []
    assert (passed[DEFECTIVE]["status"], passed[DEFECTIVE]["reruns"]) == ("repaired", 0)
    assert passed[DEFECTIVE]["output"]["confidence"] == 0.72
    for wid in WORKERS:
        if wid != DEFECTIVE:
            assert passed[wid]["output"] == complete(wid)
    assert len(worker_calls(fake)) == 5


def test_a_worker_that_will_not_re_run_is_rejected_and_its_budget_hold_released(
    env: dict[str, str], worker: WorkerProcess
) -> None:
    """A re-sent worker that returns ``output: None`` declines the re-run: its output lands in
    ``rejected`` saying so, and the verdict is released (nothing held in the run's budget)."""
    from workers.client import CritiqueClient

    def fan_out(state: State) -> list[Send]:
        return [Send("worker", {"worker_id": w, "task": TASK}) for w in ("w1", DEFECTIVE)]

    def worker(arg: dict[str, Any]) -> dict[str, Any]:
        output = None if arg.get("feedback") else complete(arg["worker_id"])
        if output is not None and arg["worker_id"] == DEFECTIVE:
            del output["findings"]
        return {"outputs": [{**arg, "output": output, "required_fields": FIELDS}]}

    builder = StateGraph(State)
    builder.add_node("worker", worker)
    builder.add_conditional_edges(START, fan_out, ["worker"])
    CritiqueNode("worker", config={"budget": {"total_tokens": 200_000}}).attach(builder)
    final = builder.compile().invoke({})
    assert [r["worker_id"] for r in final["passed"]] == ["w1"]
    [declined] = final["rejected"]
    assert declined["worker_id"] == DEFECTIVE and "did not re-run" in declined["why"][0]
    snap = CritiqueClient().budget(final["critique"]["run_id"])
    assert (snap.spent, snap.held) == (0, 0)


def test_a_stopped_fleet_passes_nothing_and_fail_open_marks_the_outputs_unchecked(
    env: dict[str, str], worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """With the fleet's worker stopped, no verdict comes within the node's timeout: the graph
    raises CritiqueUnavailable with the reason and its state holds no passed output; with
    fail_open=True the outputs go on, each marked unchecked. (Last: it stops the worker.)"""
    worker.stop()
    closed = build(CritiqueNode("worker", "report", timeout=1.0), fake)
    cfg = thread()
    with pytest.raises(CritiqueUnavailable, match="none is passed on: no result for"):
        closed.invoke({}, cfg)
    assert not closed.get_state(cfg).values.get("passed")

    opened = build(CritiqueNode("worker", "report", timeout=0.5, fail_open=True), fake)
    final = opened.invoke({}, thread())
    assert {r["status"] for r in final["passed"]} == {"unchecked"}
    assert sorted(r["worker_id"] for r in final["passed"]) == WORKERS


def test_an_unreachable_redis_raises_in_the_graph_with_the_reason(
    env: dict[str, str], fake: FakeOpenAIServer
) -> None:
    """The fleet's Redis cannot be reached: the critique node raises CritiqueUnavailable naming
    Redis and its address, and nothing is passed on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    graph = build(CritiqueNode("worker", "report", timeout=5.0), fake)
    cfg = thread()
    with (
        client_on(dead, flush=False),
        pytest.raises(CritiqueUnavailable, match="none is passed on: cannot reach Redis at"),
    ):
        graph.invoke({}, cfg)
    assert not graph.get_state(cfg).values.get("passed")


def test_the_examples_of_docs_langgraph_print_what_the_page_shows(
    env: dict[str, str], fake: FakeOpenAIServer, start_worker: Any
) -> None:
    """docs/langgraph.md's two Python examples (the second continues the first), run in one
    namespace against a real worker, print the text blocks under them."""
    start_worker("langgraph-docs", env, concurrency=1)
    assert_examples_print_what_the_page_shows("docs/langgraph.md", 2)
