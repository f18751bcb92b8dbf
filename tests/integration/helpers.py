"""Configured callables used by the distributed tests (loaded by workers from configuration)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from pipeline.critics.heuristic import HeuristicReviser
from pipeline.models import CritiqueEnvelope, RepairAttempt, Submission


def slow_revise(
    submission: Submission,
    output: str | dict[str, Any],
    envelope: CritiqueEnvelope,
    *,
    pitfalls: str,
    attempts: Sequence[RepairAttempt],
) -> Any:
    """The heuristic reviser after a pause, so a test can kill a worker mid-repair."""
    time.sleep(float(os.environ.get("SLOW_REVISE_S", "0.5")))
    return HeuristicReviser().revise(
        submission, output, envelope, pitfalls=pitfalls, attempts=attempts
    )


def recording_revise(
    submission: Submission,
    output: str | dict[str, Any],
    envelope: CritiqueEnvelope,
    *,
    pitfalls: str,
    attempts: Sequence[RepairAttempt],
) -> Any:
    """The heuristic reviser that first appends the pitfalls it was given to a file."""
    path = os.environ["RECORD_PITFALLS_TO"]
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(f"=== {submission.worker_id}\n{pitfalls}\n")
    return HeuristicReviser().revise(
        submission, output, envelope, pitfalls=pitfalls, attempts=attempts
    )
