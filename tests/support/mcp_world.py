"""What the ``critique mcp`` tests share: the task, the fleet's policy (an LLM critic on the fake
server), the defect its fake critic flags, the repaired output, and how to start the server as
a subprocess from this checkout."""

from __future__ import annotations

from typing import Any

from tests.fakes.openai_server import critic_verdict, reply, user_text

CRITIC_MODEL = "openai/critic-model"
WORKER_MODEL = "openai/worker-model"
TASK = "Summarise the Q3 sales report as JSON with a summary and the key findings."
MARK = "grew 40% in every region"
"""The defective output's unsupported claim: the fake critic flags an output holding it."""
FIXED = {"summary": "Sales rose 4% in Q3 overall.", "findings": "The north grew fastest."}
"""What the fleet's fake repairer answers."""
DEFECT = "the 40% growth in every region is not in the report"
POLICY = {"critic": "llm", "model": CRITIC_MODEL, "budget": {"total_tokens": 100_000}}
STDIO = "import sys; from workers.commands import mcp; sys.exit(mcp.main(sys.argv[1:]))"
"""``python -c`` source of ``critique mcp`` from this checkout."""
CRITIC_TOKENS = (100, 10)
"""Usage the fake critic reports for every reply (prompt, completion)."""


class Critic:
    """The fake critic: flags an output holding :data:`MARK`, accepts the rest; the first
    flagged one answers after ``delay_s`` (so a poll right after submit sees it pending)."""

    def __init__(self) -> None:
        self.delay_s = 0.0

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        prompt, completion = CRITIC_TOKENS
        if MARK in user_text(request):
            delay, self.delay_s = self.delay_s, 0.0
            return reply(
                critic_verdict(0.3, DEFECT),
                prompt_tokens=prompt,
                completion_tokens=completion,
                delay_s=delay or None,
            )
        return reply(critic_verdict(0.95), prompt_tokens=prompt, completion_tokens=completion)
