"""A scripted worker model for ``critique ab`` on the fake OpenAI server (tests and the README).

The model is *weak*: asked for an input's output it always answers the input's weak version.
As a repairer it either *fixes* (answers the fixed version) or *cannot fix* (answers the weak
version again). As the LLM critic (json and markdown inputs in mode B) it judges by content: the
fixed version is clean (0.95), anything else has the input's defects (0.5). Token counts are
fixed per call, so a run's CSV is exact:

    generation 100 in / 50 out · critic 300 / 60 · repair 400 / 80

Inputs are recognised by their task text, which every prompt carries. :data:`INPUTS` is a small
workload (one python, one json, one markdown input) with its weak and fixed outputs.

Run standalone (embedded Redis and worker, nothing else needed)::

    python -m tests.fakes.ab_models --out /tmp/ab [--cannot-fix] [--reps 1] [--json]

It writes the workload next to ``--out``, points ``critique ab`` at a fake server scripted as
above, and prints what ``critique ab`` prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.fakes.openai_server import (
    CRITIC,
    REPAIR,
    FakeOpenAIServer,
    ScriptItem,
    user_text,
)

GENERATE = "You are the worker"
"""The marker of the worker's generation prompt (``pipeline.loop.ab.GENERATE_SYSTEM``)."""
SCRIPTED_MODEL = "openai/scripted-weak"
"""The worker model ``main`` passes to ``critique ab`` (listed in the workers' allowed_models)."""
TOKENS = {"generate": (100, 50), "critic": (300, 60), "repair": (400, 80)}

ADD_TEST = """from solution import add


def test_add():
    assert add(2, 3) == 5


def test_negative():
    assert add(-1, -1) == -2
"""

INPUTS: list[dict[str, Any]] = [
    {
        "input_id": "add_numbers",
        "kind": "python",
        "task": "Write a Python function add(a, b) that returns the sum of two numbers.",
        "files": [{"path": "test_solution.py", "content": ADD_TEST}],
    },
    {
        "input_id": "sales_summary",
        "kind": "json",
        "task": "Summarise the Q3 sales report as JSON with a summary, the findings and your "
        "confidence.",
        "required_fields": ["summary", "findings", "confidence"],
    },
    {
        "input_id": "incident_report",
        "kind": "markdown",
        "task": "Write the incident report for the 2 June API outage with a summary, a "
        "timeline and the root cause.",
        "required_fields": ["Summary", "Timeline", "Root cause"],
    },
]

WEAK: dict[str, str] = {
    "add_numbers": "def add(a, b):\n    return a - b\n",
    "sales_summary": json.dumps({"summary": "Sales rose 4% in Q3."}),
    "incident_report": "# Incident 2 June\n\n## Summary\n\nThe API was down for two hours.\n",
}
FIXED: dict[str, str] = {
    "add_numbers": "def add(a, b):\n    return a + b\n",
    "sales_summary": json.dumps(
        {
            "summary": "Sales rose 4% in Q3.",
            "findings": "The north region grew 7% on two new stores.",
            "confidence": 0.9,
        }
    ),
    "incident_report": "# Incident 2 June\n\n## Summary\n\nThe API was down for two hours.\n\n"
    "## Timeline\n\n- 09:02 alerts fired\n- 11:05 service restored\n\n"
    "## Root cause\n\nAn expired TLS certificate on the load balancer.\n",
}
CRITIC_DEFECTS: dict[str, list[dict[str, Any]]] = {
    "sales_summary": [
        {"category": "missing_data", "severity": "critical", "location": "findings",
         "description": "required field 'findings' is missing"},
        {"category": "missing_data", "severity": "critical", "location": "confidence",
         "description": "required field 'confidence' is missing"},
    ],
    "incident_report": [
        {"category": "missing_data", "severity": "critical", "location": "Timeline",
         "description": "the Timeline section is missing"},
        {"category": "missing_data", "severity": "critical", "location": "Root cause",
         "description": "the Root cause section is missing"},
    ],
}  # fmt: skip
FIXED_MARK = {
    "sales_summary": "north region grew 7%",
    "incident_report": "expired TLS certificate",
}


def _input_of(request: dict[str, Any]) -> str:
    text = user_text(request)
    for item in INPUTS:
        if item["task"] in text:
            return str(item["input_id"])
    raise LookupError("the scripted model got a prompt for no known input")


def _answer(text: str, purpose: str) -> ScriptItem:
    tokens_in, tokens_out = TOKENS[purpose]
    return {"reply": text, "prompt_tokens": tokens_in, "completion_tokens": tokens_out}


def _critique(input_id: str, clean: bool) -> str:
    defects = [] if clean else CRITIC_DEFECTS[input_id]
    return json.dumps(
        {
            "score": 0.95 if clean else 0.5,
            "defects": defects,
            "prescriptions": [f"Fix: {d['description']}" for d in defects],
            "reusable_patterns": [],
            "summary": "clean" if clean else f"{len(defects)} defect(s)",
        }
    )


def script(fake: FakeOpenAIServer, *, fixes: bool) -> FakeOpenAIServer:
    """Script ``fake`` as the weak worker model with a repairer that fixes (or cannot)."""
    fake.reset()

    def generate(request: dict[str, Any]) -> ScriptItem:
        return _answer(WEAK[_input_of(request)], "generate")

    def critic(request: dict[str, Any]) -> ScriptItem:
        input_id = _input_of(request)
        clean = FIXED_MARK[input_id] in user_text(request)
        return _answer(_critique(input_id, clean), "critic")

    def repair(request: dict[str, Any]) -> ScriptItem:
        input_id = _input_of(request)
        return _answer((FIXED if fixes else WEAK)[input_id], "repair")

    fake.on(GENERATE, generate)
    fake.on(CRITIC, critic)
    fake.on(REPAIR, repair)
    return fake


def write_inputs(path: Path) -> Path:
    """The workload :data:`INPUTS` as a JSONL file."""
    path.write_text("".join(json.dumps(i) + "\n" for i in INPUTS), encoding="utf-8")
    return path


@contextmanager
def environment(fake: FakeOpenAIServer) -> Iterator[None]:
    """The LLM transport (worker-only configuration) pointed at ``fake``, fast retries."""
    saved = dict(os.environ)
    os.environ.update(
        {
            "CRITIQUE_LLM_API_KEY": "sk-scripted",
            "CRITIQUE_ALLOWED_MODELS": SCRIPTED_MODEL,  # a worker with a key lists its models
            "CRITIQUE_LLM__API_BASE": fake.api_base,
            "CRITIQUE_LLM__TIMEOUT_S": "10",
            "CRITIQUE_LLM__MAX_RETRIES": "1",
            "CRITIQUE_LLM__BACKOFF_S": "0.01",
        }
    )
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="critique ab against a scripted fake model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", default="1")
    parser.add_argument("--cannot-fix", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from workers.cli import main as critique

    inputs = write_inputs(Path(tempfile.mkdtemp(prefix="ab-inputs-")) / "inputs.jsonl")
    with FakeOpenAIServer() as fake, environment(fake):
        script(fake, fixes=not args.cannot_fix)
        os.environ.pop("REDIS_URL", None)
        extra = ["--json"] if args.json else []
        return critique(
            ["ab", str(inputs), "--out", args.out, "--reps", args.reps, "--model",
             SCRIPTED_MODEL, *extra]
        )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
