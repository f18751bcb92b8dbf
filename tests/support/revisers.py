"""Configured callables used by the distributed tests (loaded by workers from configuration)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from pipeline.critics.base import RevisionResult
from pipeline.critics.heuristic import HeuristicReviser
from pipeline.llm.tokens import estimate_tokens, text_of
from pipeline.models import CritiqueEnvelope, RepairAttempt, Submission, Usage


class _HeuristicWith:
    """The heuristic reviser (its ``plan`` included, so the loop stops ``needs_model`` exactly as
    with the default) with something done first on every ``revise``: a Reviser object, loaded
    from the worker's ``repairer`` setting."""

    token_free = False
    """Declared token-spending, so the runner reserves for it; it reports the usage a model
    would (about a token per four characters read and written), which is charged."""
    reads_pitfalls = True
    """It is handed the Known Pitfalls text (the recording one writes it down)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._inner = HeuristicReviser()

    def before(self, submission: Submission, pitfalls: str) -> None:
        """What this test reviser does before revising."""

    def plan(
        self, submission: Submission, output: str | dict[str, Any], envelope: CritiqueEnvelope
    ) -> RevisionResult | None:
        return self._inner.plan(submission, output, envelope)

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        self.before(submission, pitfalls)
        result = self._inner.revise(
            submission, output, envelope, pitfalls=pitfalls, attempts=attempts
        )
        # The heuristic reviser is token-free (usage 0); this stand-in reports what a model
        # would have spent, within the estimate the runner reserved for it.
        usage = Usage(
            tokens_in=estimate_tokens(text_of(output)),
            tokens_out=estimate_tokens(text_of(result.output)),
            calls=1,
        )
        return result.model_copy(update={"usage": usage})


class _Slow(_HeuristicWith):
    def before(self, submission: Submission, pitfalls: str) -> None:
        """Pause, so a test can kill a worker mid-repair."""
        time.sleep(float(os.environ.get("SLOW_REVISE_S", "0.5")))


class _Recording(_HeuristicWith):
    def before(self, submission: Submission, pitfalls: str) -> None:
        """Append the pitfalls it was given to ``$RECORD_PITFALLS_TO``."""
        with open(os.environ["RECORD_PITFALLS_TO"], "a", encoding="utf-8") as fh:
            fh.write(f"=== {submission.worker_id}\n{pitfalls}\n")


estimating_revise = _HeuristicWith("estimating_revise")
"""The heuristic reviser, not declared token-free: a stand-in for a token-spending reviser (the
runner reserves the estimate of :mod:`pipeline.loop.repair`; it reports a model's usage,
charged)."""
slow_revise = _Slow("slow_revise")
"""The heuristic reviser after a pause (``SLOW_REVISE_S``)."""
recording_revise = _Recording("recording_revise")
"""The heuristic reviser that first records the Known Pitfalls it was given."""


def swap_revise(
    submission: Submission,
    output: str | dict[str, Any],
    envelope: CritiqueEnvelope,
    *,
    pitfalls: str,
    attempts: Sequence[RepairAttempt],
) -> Any:
    """A repair that fixes the missing ``findings`` field and introduces an ``error`` field:
    one defect fixed, one new (for the round's defect diff)."""
    fixed = dict(output) if isinstance(output, dict) else {}
    fixed["findings"] = "Sales rose 4% in Q3."
    fixed["error"] = "tool timed out"
    return fixed
