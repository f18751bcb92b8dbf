"""A scripted LLM provider and the broker-free context around it, for the budget and
round-decision unit tests (no process, no network: the completer is an in-process callable)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

from pipeline.config import CritiqueConfig
from pipeline.llm.completion import (
    LLMReply,
    LLMRequest,
)
from pipeline.loop.stages import L0Outcome
from pipeline.models import Submission, Usage
from pipeline.store.memory import MemoryBudgetLedger, MemoryPatternStore
from pipeline.wiring import make_context

MODEL = "openai/critic"


WORDS = ["north", "south", "region", "store", "online", "order", "growth", "margin", "price"]


def seeded_words(seed: int, n: int = 24) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def no_l0(sub: Submission, output: Any, previous_size: int | None) -> L0Outcome:
    return L0Outcome()


def never_similar(previous: str, current: str) -> bool:
    return False


class Provider:
    """A completer behaving like a provider: it answers the critic by the round in the prompt
    (a critical defect until round 3) and the repairer with a fresh output; usage is
    ⌊chars/4⌋ for the prompt and the reply, or ``max_tokens`` when ``fill`` (a provider that
    writes as long as it may), times ``over`` (a provider that reports more than it may)."""

    def __init__(self, *, fill: bool = False, over: float = 1.0) -> None:
        self.fill = fill
        self.over = over
        self.requests: list[LLMRequest] = []
        self.replies: list[LLMReply] = []
        self.repairs = 0

    def __call__(self, request: LLMRequest) -> LLMReply:
        self.requests.append(request)
        user = "\n".join(m.content for m in request.messages if m.role == "user")
        if request.purpose == "repair":
            self.repairs += 1
            text = json.dumps(
                {
                    "summary": seeded_words(self.repairs),
                    "findings": seeded_words(1000 + self.repairs),
                }
            )
        else:
            found = re.search(r"Critique round: (\d+)", user)
            round_no = int(found.group(1)) if found else 1
            score = {1: 0.4, 2: 0.5}.get(round_no, 0.95)
            defects = (
                [
                    {
                        "category": "incomplete",
                        "severity": "critical",
                        "location": "findings",
                        "description": f"findings too thin (round {round_no})",
                    }
                ]
                if score < 0.6
                else []
            )
            text = json.dumps({"score": score, "defects": defects, "summary": "ok"})
        prompt = sum(len(m.content) for m in request.messages) // 4
        completion = (request.max_tokens or 0) if self.fill else len(text) // 4
        reply = LLMReply(
            text=text,
            usage=Usage(
                tokens_in=int(prompt * self.over), tokens_out=int(completion * self.over), calls=1
            ),
        )
        self.replies.append(reply)
        return reply

    def spent_on_repairs(self) -> int:
        """What the provider billed for repair-phase calls: repairs and re-critiques."""
        first = re.compile(r"Critique round: 1\b")
        return sum(
            r.usage.tokens
            for q, r in zip(self.requests, self.replies, strict=True)
            if not first.search("\n".join(m.content for m in q.messages))
        )


def llm_context(
    provider: Provider,
    total_tokens: int | None,
    *,
    budget: MemoryBudgetLedger | None = None,
    patterns: MemoryPatternStore | None = None,
    max_tokens: int = 300,
    **extra: Any,
) -> Any:
    config = CritiqueConfig.model_validate(
        {
            "enabled": True,
            "critic": "llm",
            "model": MODEL,
            "max_repair_attempts": 3,
            "budget": {"total_tokens": total_tokens},
            "llm": {"max_tokens": max_tokens},
            **extra,
        }
    )
    return make_context(
        config,
        complete=provider,
        budget=budget or MemoryBudgetLedger(),
        patterns=patterns,
        l0=no_l0,
        fixpoint=never_similar,
    )


def budget_sub(worker: str = "w1", run_id: str = "run-1", **kw: Any) -> Submission:
    fields: dict[str, Any] = {
        "run_id": run_id,
        "worker_id": worker,
        "task": "Summarise the quarterly sales report: a summary and the findings.",
        "output": {"summary": seeded_words(7), "findings": "thin"},
        "required_fields": ("summary", "findings"),
    }
    return Submission.model_validate({**fields, **kw})
