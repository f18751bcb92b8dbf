"""The per-round defect diff (docs/pipeline.md, "Defect diff per round"): fixed, remaining, new
and regressed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.config import CritiqueConfig
from pipeline.critics.base import RevisionResult
from pipeline.loop.defect_diff import defect_diff
from pipeline.loop.stages import L0Outcome, run_submission
from pipeline.models import CritiqueEnvelope, Defect, DefectRef, RepairAttempt, Submission
from pipeline.wiring import make_context

MISSING = ("missing_data", "summary")
FORMAT = ("format", "line 3")
INVENTED = ("hallucination", "line 7")

SCRIPT: dict[str, tuple[float, list[tuple[str, str, str]]]] = {
    # output -> (score, [(category, location, severity)])
    "v0": (0.40, [(*MISSING, "critical"), (*FORMAT, "warning")]),
    "v1": (0.45, [(*FORMAT, "warning"), (*INVENTED, "critical")]),
    "v2": (0.50, [(*MISSING, "critical"), (*FORMAT, "warning")]),
    "v3": (0.95, []),
}


class ScriptedCritic:
    """Says what SCRIPT says about each output."""

    name = "scripted"
    token_free = True
    reads_pitfalls = False

    def critique(
        self, submission: Submission, output: Any, *, pitfalls: str, round: int
    ) -> CritiqueEnvelope:
        score, defects = SCRIPT[output]
        return CritiqueEnvelope(
            worker_id=submission.worker_id,
            score=score,
            defects=tuple(
                Defect(
                    category=c,
                    location=loc,
                    severity=sev,  # type: ignore[arg-type]
                    description=f"{c} at {loc}",
                    source="heuristic",
                )
                for c, loc, sev in defects
            ),
            critic=self.name,
        )


class ScriptedReviser:
    """v0 -> v1 -> v2 -> v3, whatever the envelope says."""

    name = "scripted"
    reads_pitfalls = False
    token_free = False

    def revise(
        self,
        submission: Submission,
        output: Any,
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        return RevisionResult(output=f"v{int(output[1:]) + 1}", suggestions_applied=1)


def _no_l0(sub: Submission, output: Any, previous_size: int | None) -> L0Outcome:
    return L0Outcome()


def _never(previous: str, current: str) -> bool:
    return False


def _refs(*keys: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"category": c, "location": loc} for c, loc in sorted(keys)]


def _dump(refs: tuple[DefectRef, ...] | None) -> list[dict[str, Any]] | None:
    return None if refs is None else [r.model_dump() for r in refs]


def test_a_repair_that_fixes_one_defect_and_introduces_another() -> None:
    """Round 2: MISSING fixed, FORMAT remains, INVENTED new; round 3: MISSING regressed."""
    ctx = make_context(
        CritiqueConfig(enabled=True, max_repair_attempts=3),
        critic=ScriptedCritic(),
        reviser=ScriptedReviser(),
        l0=_no_l0,
        fixpoint=_never,
    )
    sub = Submission(run_id="run-d", worker_id="w1", task="t", output="v0")
    result = run_submission(sub, ctx)
    assert [t.round for t in result.trace] == [1, 2, 3, 4]
    first, second, third, fourth = result.trace
    assert (first.fixed, first.remaining, first.new, first.regressed) == (None, None, None, None)

    assert _dump(second.fixed) == _refs(MISSING)
    assert _dump(second.remaining) == _refs(FORMAT)
    assert _dump(second.new) == _refs(INVENTED)
    assert _dump(second.regressed) == []

    assert _dump(third.fixed) == _refs(INVENTED)
    assert _dump(third.remaining) == _refs(FORMAT)
    assert _dump(third.new) == []
    assert _dump(third.regressed) == _refs(MISSING)

    assert _dump(fourth.fixed) == _refs(MISSING, FORMAT)
    assert _dump(fourth.remaining) == _dump(fourth.new) == _dump(fourth.regressed) == []
    assert result.stop_reason == "accepted"

    # the round events in the run's stream carry the same diff; round 1's carries none
    rounds = [e for e in ctx.trace.read("run-d") if e["type"] == "round"]
    assert "fixed" not in rounds[0]
    assert rounds[1]["fixed"] == _refs(MISSING)
    assert rounds[1]["new"] == _refs(INVENTED)
    assert rounds[2]["regressed"] == _refs(MISSING)


def test_defect_diff_matches_by_category_and_location_only() -> None:
    """Two defects with the same (category, location) are one; None and '' locations match."""
    a = DefectRef(category="format", location=None)
    b = DefectRef(category="format", location="x")
    diff = defect_diff([a, b], [DefectRef(category="format", location=None)], ever_fixed=[b])
    assert diff["fixed"] == (b,)
    assert diff["remaining"] == (a,)
    assert diff["new"] == diff["regressed"] == ()
    again = defect_diff([a], [a, b], ever_fixed=[b])
    assert again["regressed"] == (b,) and again["new"] == ()


def test_status_shows_a_compact_line_per_repaired_round() -> None:
    """`critique status` prints each round's diff under the worker's row, and has it in --json."""
    from workers.commands._runs import RunSnapshot
    from workers.commands.status import render_text, snapshot_doc

    ctx = make_context(
        CritiqueConfig(enabled=True, max_repair_attempts=3),
        critic=ScriptedCritic(),
        reviser=ScriptedReviser(),
        l0=_no_l0,
        fixpoint=_never,
    )
    result = run_submission(Submission(run_id="r1", worker_id="w1", task="t", output="v0"), ctx)
    snap = RunSnapshot("r1", {"1:w1": {"task_id": "t"}}, [result])
    doc = snapshot_doc(snap, None)
    rounds = doc["submissions"][0]["rounds"]
    assert [d["round"] for d in rounds] == [2, 3, 4]
    assert rounds[0]["new"] == _refs(INVENTED)
    text = render_text(doc)
    assert (
        "      round 2 (0.45): fixed missing_data@summary; new hallucination@line 7; remaining 1"
        in text
    )
    assert "round 3 (0.50): fixed hallucination@line 7; regressed missing_data@summary;" in text


def test_html_report_shows_what_each_repair_fixed_or_introduced() -> None:
    """The worker's figure lists, per repair, the defects fixed, introduced and regressed."""
    from workers.commands._report_html import render_report_html

    ctx = make_context(
        CritiqueConfig(enabled=True, max_repair_attempts=3),
        critic=ScriptedCritic(),
        reviser=ScriptedReviser(),
        l0=_no_l0,
        fixpoint=_never,
    )
    result = run_submission(Submission(run_id="r1", worker_id="w1", task="t", output="v0"), ctx)
    page = render_report_html("r1", {1: [result]}, [])
    assert "defect diff per repair (3)" in page
    assert (
        '<li>repair 1 (round 2, 0.45): <span class="diff-fixed">fixed</span> '
        "<code>missing_data @ summary</code>; "
        '<span class="diff-new">introduced</span> <code>hallucination @ line 7</code>; '
        "remaining 1</li>"
    ) in page
    assert '<span class="diff-regressed">regressed</span> <code>missing_data @ summary</code>' in (
        page
    )
