"""What the lessons tests (issue 33) send through a real worker: an honest run that teaches one
pattern, a run that floods 200 distinct ones, and the run's ``lessons.md`` as
``critique report`` writes it."""

from __future__ import annotations

import uuid
from pathlib import Path

from pipeline.models import Submission
from tests.support.hostile import ENABLED

HONEST_RULE = "Always include the 'summary' field in your output"
"""The honest runs' one pattern (a missing required 'summary')."""
FLOOD_PATTERNS = 200
"""Distinct patterns the flooding run teaches: twenty per submission (one per missing field)."""


def new_run(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


def teach_honest(run_id: str) -> None:
    """One submission of ``run_id`` that misses 'summary': it teaches :data:`HONEST_RULE`."""
    _run_all(
        [
            Submission(
                run_id=run_id,
                worker_id="honest",
                task="Summarise the Q3 sales report.",
                output={"findings": "Sales rose 4% in Q3.", "confidence": 0.9},
                required_fields=("summary",),
            )
        ]
    )


def flood(run_id: str) -> None:
    """Ten submissions of ``run_id``, each missing twenty distinct required fields: 200
    distinct patterns, every one new to the fleet."""
    subs = [
        Submission(
            run_id=run_id,
            worker_id=f"flood{n}",
            task="t",
            output={"summary": "Sales rose.", "confidence": 0.9},
            required_fields=tuple(f"flood_{n}_{i}" for i in range(20)),
        )
        for n in range(FLOOD_PATTERNS // 20)
    ]
    _run_all(subs)


def lessons_md(run_id: str, root: Path) -> str:
    """The run's ``lessons.md`` as ``critique report RUN --out root`` writes it."""
    from workers.commands.report import write_report

    write_report(run_id, root)
    return (root / "runs" / run_id / "lessons.md").read_text(encoding="utf-8")


def _run_all(subs: list[Submission]) -> None:
    from workers.client import CritiqueClient

    client = CritiqueClient(ENABLED)
    client.wait_many(client.submit_many(subs), timeout=90)
