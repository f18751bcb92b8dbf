"""Submission builders shared by the worker, fault and hostile suites: outputs of known kinds,
the run configuration they are sent with, and the broker-free reference results."""

from __future__ import annotations

from typing import Any

from pipeline.config import load_config
from pipeline.loop.stages import run_submission
from pipeline.models import CritiqueEnvelope, CritiqueResult, Submission
from pipeline.store.memory import MemoryPatternStore
from pipeline.wiring import make_context

REQUIRED = ("summary", "findings")


LOOP = (
    "Sales rose four percent in the third quarter, led by the northern region, where two new "
    "stores opened and the online shop doubled its monthly orders compared with last year."
)
"""A paragraph of 20+ words: repeated verbatim, Layer-0 no_text_loop flags it."""


TEXT_KINDS: dict[str, str] = {
    # repaired by the token-free reviser: the verbatim copy is deleted, the first kept
    "looping": f"# Q3 sales\n\n## Summary\n\nSales rose 4%.\n\n## Findings\n\n{LOOP}\n\n{LOOP}\n",
    # repaired: the second heading becomes "Findings (2)"
    "dup_heading": "# Q3 sales\n\n## Summary\n\nSales rose 4%.\n\n## Findings\n\nNorth grew."
    "\n\n## Findings\n\nSouth shrank.\n",
    # needs_model: the placeholder stands in a sentence, which stays untouched
    "todo_sentence": "# Q3 sales\n\n## Summary\n\nSales rose overall. TODO: add numbers.\n\n"
    "## Findings\n\nNorth grew.\n",
    # one honest repair (the copy goes), then needs_model: the Findings section is missing
    "looping_no_findings": f"# Q3 sales\n\n## Summary\n\n{LOOP}\n\n{LOOP}\n",
}


def make_sub(run_id: str, worker_id: str, iteration: int, kind: str) -> Submission:
    """A worker output of a given kind: clean, missing, broken or garbage (JSON results), or
    one of :data:`TEXT_KINDS` (Markdown reports)."""
    output: str | dict[str, Any]
    if kind in TEXT_KINDS:
        output = TEXT_KINDS[kind]
    elif kind == "clean":
        output = {"summary": "Sales rose 4%.", "findings": "Two regions grew.", "confidence": 0.9}
    elif kind == "missing":
        output = {"summary": "Sales rose 4%.", "confidence": 0.8}
    elif kind == "broken":
        output = {"summary": "Sales rose.", "findings": "x", "error": "tool timed out"}
    else:  # nothing usable: in the escalate band
        output = {"error": "worker crashed"}
    return Submission(
        run_id=run_id,
        iteration=iteration,
        worker_id=worker_id,
        subtask_signature=f"sig-{worker_id}",
        task="Summarise the quarterly sales report with findings.",
        output=output,
        claimed_format="markdown" if isinstance(output, str) else None,
        required_fields=REQUIRED,
    )


KINDS = ("clean", "looping", "missing", "broken", "garbage")


CONFIG = {"enabled": True, "budget": {"total_tokens": 2_000_000}}


def reference(
    subs: list[Submission], config: dict[str, Any]
) -> tuple[dict[str, CritiqueResult], MemoryPatternStore]:
    """The same submissions through the broker-free runner, for comparison."""
    patterns = MemoryPatternStore()
    ctx = make_context(load_config(env={}, overrides=config), patterns=patterns)
    out = {f"{s.iteration}:{s.worker_id}": run_submission(s, ctx) for s in subs}
    return out, patterns


EVIL = "<script>alert('owned')</script>"


def operator_sub(run_id: str, worker_id: str, kind: str, iteration: int = 1) -> Submission:
    output: str | dict[str, Any]
    fmt = None
    if kind == "clean":
        output = {"summary": "Sales rose 4%.", "findings": "Two regions grew.", "confidence": 0.9}
    elif kind == "looping":  # the token-free reviser deletes the verbatim copy: repaired
        output = f"# Q3 sales\n\n## Summary\n\nSales rose 4%.\n\n## Findings\n\n{LOOP}\n\n{LOOP}\n"
        fmt = "markdown"
    elif kind == "evil":
        output = f"# Summary\n\nSales rose.\n\n{EVIL}\n"
        fmt = "markdown"
    else:  # no confidence, no required field, an error: score 0 → escalated
        output = {"error": "tool crashed"}
    return Submission(
        run_id=run_id,
        iteration=iteration,
        worker_id=worker_id,
        subtask_signature=f"sig-{worker_id}",
        task="Summarise the quarterly sales report with findings.",
        output=output,
        claimed_format=fmt,
        required_fields=() if kind == "evil" else ("summary", "findings"),
    )


def accepted_result(
    run_id: str, worker_id: str = "w1", *, output: Any = "ok", **more: Any
) -> CritiqueResult:
    """A result that accepted ``output`` (score 1.0), for tests of what stores and reads
    results; ``more`` sets any other field (``pass_id``, ``iteration``...)."""
    return CritiqueResult(
        run_id=run_id,
        worker_id=worker_id,
        status="accepted",
        stop_reason="accepted",
        output=output,
        original_score=1.0,
        best_score=1.0,
        envelope=CritiqueEnvelope(worker_id=worker_id, score=1.0),
        **more,
    )
