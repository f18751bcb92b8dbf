"""A run's scores as its results add up: what the manager summary, the completion gates, the
report and the CLI say about the run as a whole.

Each worker counts once, by its latest result (:func:`latest_per_worker`); the run's score is
the mean of those results' ``best_score`` (:func:`mean_best_score`), and the results that have
no score (``unchecked``, ``cancelled``: :data:`~pipeline.models.UNSCORED`) are named beside it
as not counted (:func:`not_counted`, :func:`not_counted_text`), never averaged in.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

from pipeline.models import UNSCORED, CritiqueResult


def latest_per_worker(results: Sequence[CritiqueResult]) -> list[CritiqueResult]:
    """Each worker's latest result: its highest iteration, and of one iteration the last one
    given (a run store hands back only each submission's latest pass)."""
    latest: dict[str, CritiqueResult] = {}
    for r in results:
        seen = latest.get(r.worker_id)
        if seen is None or r.iteration >= seen.iteration:
            latest[r.worker_id] = r
    return list(latest.values())


def mean_best_score(results: Sequence[CritiqueResult]) -> float | None:
    """Mean ``best_score`` over the run's workers (each worker's latest result), or None.

    ``unchecked`` and ``cancelled`` results (:data:`~pipeline.models.UNSCORED`) have no score and
    are not counted: an output nobody checked never raises or lowers the mean."""
    scores = [r.best_score for r in latest_per_worker(results) if r.best_score is not None]
    return math.fsum(scores) / len(scores) if scores else None


def not_counted(results: Sequence[CritiqueResult]) -> str:
    """`` (1 cancelled, 2 unchecked, not counted)`` for the workers whose latest result has no
    score, or ``""`` when every one was checked."""
    return not_counted_text(Counter(r.status for r in latest_per_worker(results)))


def not_counted_text(counts: Mapping[str, int]) -> str:
    """`` (1 cancelled, 2 unchecked, not counted)`` from counts by status (only the unscored
    statuses are named), or ``""`` when there are none."""
    parts = ", ".join(f"{counts[s]} {s}" for s in sorted(UNSCORED) if counts.get(s))
    return f" ({parts}, not counted)" if parts else ""
