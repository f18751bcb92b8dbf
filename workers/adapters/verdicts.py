"""The verdict → framework mapping, written once for every adapter.

A framework hook needs the same few things from a :class:`~pipeline.models.CritiqueResult`:
whether the output may pass, the defects as plain records, the feedback to send a worker back
with, the score to report (never a made-up one), and which of the outputs a repair chain saw is
the one the service kept.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pipeline.models import CritiqueResult, Defect, defect_line

PASSING = frozenset({"accepted", "accepted_with_warnings", "repaired"})
"""Statuses whose output a manager may use as it is."""


def passes(result: CritiqueResult) -> bool:
    """True when the manager may use the result's output (accepted, with warnings, repaired)."""
    return result.status in PASSING


def severity(defect: Defect) -> str:
    """A defect's severity as a framework reads it: a false positive grounding found is
    ``info`` (nothing to fix), whatever the critic said."""
    return "info" if defect.false_positive else defect.severity


def defect_records(result: CritiqueResult) -> list[dict[str, str]]:
    """Every defect of the verdict's envelope: category, location, description, severity."""
    return [
        {
            "category": d.category,
            "location": d.location or "",
            "description": d.description,
            "severity": severity(d),
        }
        for d in result.envelope.defects
    ]


def feedback(result: CritiqueResult) -> str:
    """What to tell the worker sent back: the verdict line's reasons (the deciding defects
    and the next step), then the critic's prescriptions; "" for a passing output."""
    if passes(result):
        return ""
    lines = list(result.why()) or [defect_line(d) for d in result.envelope.actionable]
    lines += [f"fix: {p}" for p in result.envelope.prescriptions]
    return "\n".join(lines)


def comparable(output: Any) -> str:
    """An output as the service compares it: JSON with sorted keys (text as it is)."""
    if isinstance(output, str):
        return output
    return json.dumps(output, sort_keys=True, ensure_ascii=False, default=str)


def kept_index(result: CritiqueResult, candidates: Sequence[Any]) -> int:
    """Which of ``candidates`` (the outputs a repair chain submitted, oldest first) is the one
    the service kept (``result.output``, keep-best); the newest when none matches exactly."""
    kept = comparable(result.output)
    for i in range(len(candidates) - 1, -1, -1):
        if comparable(candidates[i]) == kept:
            return i
    return len(candidates) - 1
