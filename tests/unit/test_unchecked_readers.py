"""An output nobody checked reads as ``unchecked`` (and a cancelled pass as ``cancelled``) in
every reader: no score, never ``accepted``, never 1.00, and out of every mean (issue 34)."""

from __future__ import annotations

import typing

from pipeline.models import (
    UNCHECKED_LINE,
    CritiqueEnvelope,
    CritiqueResult,
    Status,
    cancelled_result,
)
from pipeline.store import metrics
from workers.commands._runs import RunSnapshot
from workers.commands.status import render_text, snapshot_doc
from workers.commands.submit import _result_lines
from workers.commands.watch import format_event

TODO = "# Q3 report\n\nTODO: fill in the numbers."


def _unchecked(worker: str = "analyst_02") -> CritiqueResult:
    return CritiqueResult(
        run_id="q3",
        worker_id=worker,
        status="unchecked",
        stop_reason="disabled",
        output=TODO,
        original_score=None,
        best_score=None,
        envelope=CritiqueEnvelope(worker_id=worker, score=0.0, critic="disabled"),
    )


def _accepted(worker: str, score: float) -> CritiqueResult:
    return CritiqueResult(
        run_id="q3",
        worker_id=worker,
        status="accepted",
        stop_reason="accepted",
        output="Revenue rose 12% in Q3.",
        original_score=score,
        best_score=score,
        envelope=CritiqueEnvelope(worker_id=worker, score=score),
    )


def _cancelled(worker: str) -> CritiqueResult:
    return cancelled_result(run_id="q3", iteration=1, worker_id=worker, pass_id="p1", by="ops")


def _status(*results: CritiqueResult) -> tuple[dict[str, typing.Any], str]:
    snap = RunSnapshot("q3", {f"1:{r.worker_id}": {"task_id": "t"} for r in results}, [*results])
    doc = snapshot_doc(snap, None)
    return doc, render_text(doc)


def test_status_row_of_an_unchecked_output_says_no_score_and_nothing_was_checked() -> None:
    """The row shows ``unchecked  disabled  no score`` and the unchecked line under it."""
    _, text = _status(_unchecked())
    rows = text.split("\n")
    at = next(i for i, line in enumerate(rows) if "analyst_02" in line)
    assert rows[at].split() == ["1", "analyst_02", "unchecked", "disabled", "no", "score", "0"]
    assert rows[at + 1] == f"      {UNCHECKED_LINE}"
    assert "1.00" not in text and "accepted" not in text
    assert "verdicts: unchecked 1" in text
    assert "mean score: no score (1 unchecked, not counted)" in text


def test_status_json_and_means_leave_unchecked_and_cancelled_out() -> None:
    """--json rows carry ``checked: false`` and the note; means are over checked rows only."""
    doc, text = _status(_accepted("w1", 0.8), _unchecked("w2"), _cancelled("w3"))
    rows = {r["worker_id"]: r for r in doc["submissions"]}
    assert (rows["w2"]["status"], rows["w2"]["best_score"], rows["w2"]["checked"]) == (
        "unchecked",
        None,
        False,
    )
    assert rows["w2"]["note"] == UNCHECKED_LINE and rows["w1"]["note"] is None
    assert rows["w3"]["note"].startswith("cancelled by ops")
    assert doc["counts"] == {"accepted": 1, "cancelled": 1, "unchecked": 1}
    assert (doc["mean_original_score"], doc["mean_best_score"]) == (0.8, 0.8)
    assert "mean score: 0.80 → 0.80 (1 cancelled, 1 unchecked, not counted)" in text


def test_watch_result_event_of_an_unchecked_pass_says_no_score() -> None:
    """format_event prints ``RESULT  unchecked (disabled) no score: …``, never ``?`` or 1.00."""
    event = _unchecked().trace_event(round=0, stage="gate")
    line = format_event(event)
    assert f"RESULT  unchecked (disabled) no score: {UNCHECKED_LINE}" in line
    assert "?" not in line and "1.00" not in line
    gone = format_event(_cancelled("w3").trace_event(round=0, stage="gate"))
    assert gone.endswith("RESULT  cancelled (cancelled) no score")
    scored = format_event(_accepted("w1", 0.9).trace_event(round=1, stage="gate"))
    assert scored.endswith("RESULT  accepted (accepted) 0.90 → 0.90, 0 repair(s)")


def test_submit_wait_line_of_an_unchecked_output() -> None:
    """``submit --wait`` prints ``no score  unchecked (disabled, …)`` and the unchecked line."""
    first, second = _result_lines(_unchecked()).split("\n")
    assert first == "q3  1  analyst_02  no score  unchecked (disabled, 0 repairs)"
    assert second == f"      {UNCHECKED_LINE}"
    assert str(_unchecked()).endswith(f"no score: {UNCHECKED_LINE}")


def test_metric_status_labels_come_from_the_model() -> None:
    """The exporter's status labels are Status itself: unchecked and cancelled included."""
    assert typing.get_args(Status) == metrics.STATUSES
    assert {"unchecked", "cancelled"} <= set(metrics.STATUSES)


def test_watch_names_who_cancelled_a_pass() -> None:
    """A ``cancelled`` trace event reads ``CANCEL  by <who>``, not an unknown ``?`` line."""
    line = format_event({"type": "cancelled", "iteration": 1, "worker_id": "w1", "by": "alice"})
    assert line.endswith("CANCEL  by alice")
