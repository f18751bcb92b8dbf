"""The result says why where it is read: ``str(result)``, ``submit --wait``, ``status`` and
CRITIQUE.md name an escalated or failed output's deciding defects and what to do next; repair
rounds say what they did in words; no line contradicts itself; gate reasons read as text."""

from __future__ import annotations

from typing import Any

from pipeline.config import CritiqueConfig
from pipeline.critics.base import merge_l0
from pipeline.loop.gates import CompletionDecision, evaluate_completion
from pipeline.models import (
    CritiqueEnvelope,
    CritiqueResult,
    Defect,
    DefectRef,
    RoundTrace,
)
from pipeline.records.artifacts import manager_summary, render_critique_md

MISSING = Defect(
    category="missing_data",
    severity="critical",
    location="findings",
    description="required field 'findings' is missing",
    source="heuristic",
)


def _defect(n: int, severity: str = "warning", **kw: Any) -> Defect:
    return Defect(
        category="incomplete",
        severity=severity,  # type: ignore[arg-type]
        location=f"s{n}",
        description=f"section {n} is thin",
        source="heuristic",
        **kw,
    )


def _result(status: str = "escalated", stop: str = "needs_model", **kw: Any) -> CritiqueResult:
    defects = kw.pop("defects", (MISSING,))
    return CritiqueResult(
        run_id="q3",
        worker_id="analyst_02",
        status=status,  # type: ignore[arg-type]
        stop_reason=stop,  # type: ignore[arg-type]
        output={"summary": "x"},
        original_score=0.8,
        best_score=0.8,
        envelope=CritiqueEnvelope(worker_id="analyst_02", score=0.8, defects=defects),
        **kw,
    )


def test_str_of_an_escalated_result_names_its_defect_and_the_next_step() -> None:
    text = str(_result())
    assert text.startswith("analyst_02 escalated (needs_model, 0 repairs) 0.80 → 0.80: ")
    assert "missing_data at findings: required field 'findings' is missing" in text
    assert "; next: send it back to its worker" in text and "\n" not in text


def test_str_of_an_accepted_result_is_its_verdict_only() -> None:
    r = _result("accepted", "accepted", defects=())
    assert str(r) == "analyst_02 accepted (accepted, 0 repairs) 0.80 → 0.80"
    assert r.why() == () and r.next_step is None


def test_deciding_defects_put_critical_first_skip_false_positives_and_cap_the_line() -> None:
    defects = (
        *(_defect(i) for i in range(4)),
        _defect(9, "critical"),
        _defect(8, "info"),
        _defect(7, "critical", false_positive=True),
    )
    r = _result("failed", "repair_fixpoint_detected", defects=defects)
    assert [d.location for d in r.deciding_defects] == ["s9", "s0", "s1", "s2", "s3"]
    why = r.why()
    assert why[0] == "incomplete at s9: section 9 is thin"
    assert why[3] == "… and 2 more in the envelope"
    assert why[-1].startswith("next: repairs stopped changing it")


def test_every_escalating_stop_reason_has_its_own_next_step() -> None:
    seen = {
        _result(stop=stop).next_step
        for stop in ("needs_model", "escalate_band", "no_improvement", "repair_budget_exhausted")
    }
    assert len(seen) == 4 and None not in seen


def test_submit_wait_prints_why_under_an_escalated_line_terminal_safe() -> None:
    from workers.commands.submit import _result_lines

    bad = Defect(
        category="missing_data",
        severity="critical",
        location="f\x1b[2J",
        description="gone",
        source="heuristic",
    )
    lines = _result_lines(_result(defects=(bad,))).split("\n")
    assert lines[0].endswith("escalated (needs_model, 0 repairs)")
    assert lines[1] == "      missing_data at f\\x1b[2J: gone"
    assert lines[2].startswith("      next: ")
    assert _result_lines(_result("accepted", "accepted", defects=())).count("\n") == 0


def _status_text(result: CritiqueResult) -> str:
    from workers.commands._runs import RunSnapshot
    from workers.commands.status import render_text, snapshot_doc

    snap = RunSnapshot("q3", {"1:analyst_02": {"task_id": "t"}}, [result])
    return render_text(snapshot_doc(snap, None))


def test_status_names_the_deciding_defect_under_an_escalated_row() -> None:
    text = _status_text(_result())
    rows = text.split("\n")
    at = next(i for i, line in enumerate(rows) if "analyst_02" in line)
    assert "needs_model" in rows[at]
    assert rows[at + 1] == "      missing_data at findings: required field 'findings' is missing"
    assert rows[at + 2].startswith("      next: send it back to its worker")


def test_status_says_what_a_repair_did_in_words() -> None:
    """`deleted a repeated paragraph`, from the reviser's note, not `fixed policy_violation@…`."""
    trace = (
        RoundTrace(round=1, score=0.6, mean=0.6, defects=2, verdict="continue"),
        RoundTrace(
            round=2,
            score=0.8,
            mean=0.8,
            defects=1,
            verdict="escalated",
            fixed=(DefectRef(category="policy_violation", location="output:279"),),
            remaining=(DefectRef(category="missing_data", location="findings"),),
            new=(),
            regressed=(),
        ),
    )
    note = (
        "repair 1: fixed: deleted a repeated paragraph; 1 defect(s) left for a model "
        "(fixing them would invent)"
    )
    text = _status_text(_result(trace=trace, notes=(note,)))
    assert "      round 2 (0.80): deleted a repeated paragraph; remaining 1" in text
    assert "policy_violation@output:279" not in text
    unlabelled = _status_text(_result(trace=trace))
    assert "round 2 (0.80): fixed policy_violation@output:279; remaining 1" in unlabelled


def test_critique_md_shows_no_score_band_on_an_escalated_output_but_why_and_next() -> None:
    r = _result()
    md = render_critique_md(manager_summary("q3", 1, [r], []), [r])
    assert "accept_with_warnings" not in md
    assert "| band | — (not decided by the score: stop needs_model) |" in md
    assert "| why | missing_data at findings: required field 'findings' is missing |" in md
    assert "| next | send it back to its worker" in md
    ok = _result("accepted_with_warnings", "accepted", defects=())
    assert "| band | accept_with_warnings |" in render_critique_md(
        manager_summary("q3", 1, [ok], []), [ok]
    )


def test_a_layer0_envelope_summary_states_one_score() -> None:
    """Not "token-free score 0.60 … score 1.00" on one line."""
    base = CritiqueEnvelope(
        worker_id="w", score=1.0, summary="heuristic: 0 defect(s), 0 critical; score 1.00"
    )
    l0 = [
        Defect(
            category="wrong_format",
            severity="critical",
            location="output:0",
            description="unbalanced {}",
            source="l0",
            check="balanced_delimiters",
        )
    ] * 2
    summary = merge_l0(base, l0).summary
    assert "score 1.00" not in summary
    assert summary == (
        "layer-0 contract failed (2 error(s), 0 warning(s)): critic skipped, no tokens spent; "
        "score 0.60 = the token-free heuristic critic's 1.00 less 0.2 per Layer-0 error and "
        "0.1 per warning"
    )


def test_complete_gate_reasons_print_as_sentences_not_a_tuple() -> None:
    decision = evaluate_completion(
        run_id="q3",
        iteration=1,
        final_result={"answer": "North +4%, south -2%: TODO chart"},
        results=[],
        files=[],
        task="Summarise",
        deliverable_expected=False,
        config=CritiqueConfig(enabled=True),
    )
    text = str(decision)
    assert text.startswith("rejected: ") and "placeholder 'TODO'" in text
    assert "\\'" not in text and "('" not in text
    # The stub is said once (the placeholder gate's line), though both gates rejected on it.
    assert text.count("placeholder 'TODO'") == 1 and text.startswith("rejected: placeholder: ")
    assert {e.gate for e in decision.events if e.verdict == "reject"} == {"l0", "placeholder"}
    assert str(CompletionDecision(verdict="complete", events=())) == "complete"
