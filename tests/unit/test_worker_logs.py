"""Worker logs: Celery's success line (it prints the whole stage state) only at DEBUG, one
compact line per stage at INFO with ids, status and timing; and a fallback is named on the
CLI's line for its output, not only in the --json notes."""

from __future__ import annotations

import json
import logging

import pytest
from celery.app import trace

from pipeline.models import CritiqueEnvelope, CritiqueResult
from workers.commands.submit import _result_line
from workers.logs import (
    QUIET_BELOW_DEBUG,
    PayloadsAtDebug,
    _quiet_celery_info,
    message_ids,
    stage_line,
)

STATE = json.dumps(
    {
        "submission": {
            "schema_version": 1,
            "run_id": "r1",
            "iteration": 2,
            "worker_id": "w-7",
            "task": "t",
            "output": "SECRET-PAYLOAD",
        },
        "output": "SECRET-PAYLOAD",
    },
    separators=(",", ":"),
)
MSG = {"v": 1, "sid": "0123456789abcdef", "config": {}, "state": STATE}


def _record(level: int) -> logging.LogRecord:
    return logging.LogRecord(
        "celery.app.trace", level, __file__, 1, trace.LOG_SUCCESS, ({"return_value": MSG},), None
    )


@pytest.mark.parametrize(("level", "kept"), [(logging.INFO, False), (logging.DEBUG, True)])
def test_celery_success_line_only_at_debug(level: int, kept: bool) -> None:
    """At INFO the success line (with the return value) is dropped; at DEBUG it is logged as
    DEBUG; other trace lines pass untouched."""
    logger = logging.getLogger("celery.app.trace")
    saved = logger.level
    logger.setLevel(level)
    try:
        record = _record(logging.INFO)
        assert PayloadsAtDebug().filter(record) is kept
        if kept:
            assert record.levelno == logging.DEBUG
        other = logging.LogRecord("celery.app.trace", logging.ERROR, __file__, 1, "x %s", (), None)
        assert PayloadsAtDebug().filter(other) is True
    finally:
        logger.setLevel(saved)


@pytest.mark.parametrize(
    ("loglevel", "quiet"), [(logging.INFO, True), ("WARNING", True), (logging.DEBUG, False)]
)
def test_celerys_per_task_info_lines_are_off_unless_the_worker_logs_at_debug(
    loglevel: int | str, quiet: bool
) -> None:
    """A worker at INFO (or above) holds Celery's ``received`` / ``succeeded`` loggers at
    WARNING, so those per-task records (and the result's repr) are never built, while their
    errors still show; at DEBUG they stay as they are."""
    loggers = [logging.getLogger(name) for name in QUIET_BELOW_DEBUG]
    saved = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.NOTSET)
        _quiet_celery_info(loglevel=loglevel)
        for lg in loggers:
            assert lg.isEnabledFor(logging.INFO) is not quiet or lg.level == logging.NOTSET
            assert (lg.level == logging.WARNING) is quiet
            if quiet:
                assert lg.isEnabledFor(logging.ERROR)
    finally:
        for lg, level in zip(loggers, saved, strict=True):
            lg.setLevel(level)


def test_the_stage_line_has_ids_status_timing_and_no_payload() -> None:
    """The compact line names task, run, iteration, worker, pass, state and time; the output
    never appears; a gate adds its verdict, a failure its one-line reason."""
    assert message_ids(MSG) == {"run": "r1", "it": 2, "worker": "w-7", "pass": "0123456789abcdef"}
    line = stage_line("critique.critic", "b4048db1-69ca", MSG, "SUCCESS", 6.14, MSG)
    assert line == (
        "critique.critic[b4048db1] run=r1 it=2 worker=w-7 pass=0123456789abcdef SUCCESS 6.1 ms"
    )
    gate = {"status": "escalated", "stop_reason": "needs_model", "best_score": 0.5}
    assert stage_line("critique.gate", "fd92", MSG, "SUCCESS", 1.0, gate).endswith(
        "SUCCESS 1.0 ms escalated/needs_model 0.50"
    )
    unchecked = {"status": "unchecked", "stop_reason": "disabled", "best_score": None}
    assert stage_line("critique.gate", "fd92", MSG, "SUCCESS", 1.0, unchecked).endswith(
        "SUCCESS 1.0 ms unchecked/disabled no score"
    )
    failed = stage_line("critique.critic", "x", MSG, "FAILURE", 2.0, ValueError("bad\nthing"))
    assert failed.endswith("FAILURE 2.0 ms ValueError: bad thing")
    assert "SECRET-PAYLOAD" not in line + failed
    assert message_ids("not a message") == {}


def _result(notes: tuple[str, ...]) -> CritiqueResult:
    envelope = CritiqueEnvelope(worker_id="w1", score=0.9)
    return CritiqueResult(
        run_id="r1",
        worker_id="w1",
        status="accepted",
        stop_reason="accepted",
        output="x",
        original_score=0.9,
        best_score=0.9,
        envelope=envelope,
        notes=notes,
    )


def test_a_fallback_is_named_on_the_outputs_line() -> None:
    """A critic or reviser fallback shows on the text line of `critique submit --wait`."""
    assert "FALLBACK" not in _result_line(_result(()))
    line = _result_line(
        _result(
            (
                "critic fallback: LLM critic unavailable after retries: timeout; heuristic used",
                "repair 1: LLM repair unavailable after retries: 503; deterministic reviser used",
            )
        )
    )
    assert "[FALLBACK critic fallback: LLM critic unavailable after retries" in line
    assert "(+1 more)]" in line


def test_a_fallback_is_named_on_the_status_row() -> None:
    """`critique status` shows the fallback under the output's row, and in --json."""
    from workers.commands._runs import RunSnapshot
    from workers.commands.status import render_text, snapshot_doc

    note = "critic fallback: LLM critic unavailable after retries: timeout; heuristic used"
    snap = RunSnapshot("r1", {"1:w1": {"task_id": "t"}}, [_result((note,))])
    doc = snapshot_doc(snap, None)
    assert doc["submissions"][0]["fallbacks"] == [note]
    assert f"      FALLBACK {note}" in render_text(doc)
