"""The HTML report: self-contained, escaped, deterministic, one trajectory chart per result."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from pipeline.models import (
    CritiqueEnvelope,
    CritiqueResult,
    Defect,
    Pattern,
    RepairAttempt,
    RoundTrace,
    Usage,
    cancelled_result,
)
from workers.commands._report_html import render_report_html, trajectory_svg

EVIL = '<script>alert("x")</script>'


def _result(
    worker: str,
    *,
    iteration: int = 1,
    output: object = None,
    rubric: bool = False,
    description: str = "the 'findings' field is missing",
) -> CritiqueResult:
    scores = {"clarity": 6.0, "evidence": 5.0} if rubric else {}
    scores2 = {"clarity": 8.5, "evidence": 8.0} if rubric else {}
    return CritiqueResult(
        run_id="run-1",
        iteration=iteration,
        worker_id=worker,
        status="repaired",
        stop_reason="accepted",
        output=output if output is not None else {"summary": "ok", "confidence": 0.9},
        original_score=0.4,
        best_score=0.9,
        envelope=CritiqueEnvelope(
            worker_id=worker,
            score=0.9,
            defects=(
                Defect(
                    category="missing_data",
                    severity="warning",
                    location="findings",
                    description=description,
                    source="heuristic",
                ),
            ),
            prescriptions=("Include the 'findings' field",),
            summary="Fixed after one repair.",
        ),
        attempts=(
            RepairAttempt(
                worker_id=worker,
                attempt=1,
                original_score=0.4,
                repaired_score=0.9,
                defects_fixed=1,
                defects_remaining=0,
                stop_reason="accepted",
            ),
        ),
        trace=(
            RoundTrace(
                round=1,
                score=0.4,
                scores=scores,
                mean=5.5 if rubric else 0.4,
                defects=2,
                verdict="continue",
            ),
            RoundTrace(
                round=2,
                score=0.9,
                scores=scores2,
                mean=8.25 if rubric else 0.9,
                defects=1,
                verdict="accepted",
            ),
        ),
        usage=Usage(tokens_in=100, tokens_out=50),
        repair_usage=Usage(tokens_in=60, tokens_out=20),
    )


PATTERN = Pattern(
    category="missing_data",
    frequency=3,
    description="findings missing",
    prevention_rule="Always include the 'findings' field",
    first_seen_iteration=1,
    last_seen_iteration=2,
)


class _Collector(HTMLParser):
    """Collects tags and attributes of a document (the parser is lenient: we check structure)."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def _parse(page: str) -> _Collector:
    c = _Collector()
    c.feed(page)
    return c


def test_untrusted_output_and_critic_text_are_escaped() -> None:
    """A <script> in a worker's output, a critic's defect or a gate reason appears only escaped."""
    r = _result("w1", output=f"# Report\n\n{EVIL}", description=f"says {EVIL}")
    events = [{"type": "gate", "stage": "l0", "verdict": "reject", "reason": EVIL}]
    page = render_report_html("run-1", {1: [r]}, [PATTERN], events)
    assert "<script" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert not any(tag == "script" for tag, _ in _parse(page).tags)


def test_self_contained_no_external_assets_or_scripts() -> None:
    """No <script>, <link>, <img>, @import, url(...) or http(s) reference outside the SVG xmlns."""
    page = render_report_html("run-1", {1: [_result("w1")]}, [PATTERN], [])
    tags = _parse(page).tags
    assert {t for t, _ in tags}.isdisjoint({"script", "link", "img", "iframe", "object"})
    assert "@import" not in page and "url(" not in page
    refs = set(re.findall(r"https?://[^\s\"'<>]+", page))
    assert refs == {"http://www.w3.org/2000/svg"}
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</html>\n")


def test_one_svg_per_result_with_a_marker_and_verdict_per_round() -> None:
    """Each result gets one <svg>; each round a marker whose <title> names its verdict."""
    results = {1: [_result("w1"), _result("w2")], 2: [_result("w1", iteration=2)]}
    page = render_report_html("run-1", results, [PATTERN])
    assert page.count("<svg ") == 3
    svg = trajectory_svg(_result("w1"))
    assert svg.count("<circle") == 2
    assert "<title>round 1: score 0.40, 2 defect(s), verdict continue</title>" in svg
    assert "verdict accepted</title>" in svg
    assert "<rect" not in svg and 'class="mean"' not in svg


def test_rubric_rounds_add_the_scaled_mean_line() -> None:
    """Rubric results also plot the 0–10 mean divided by 10, with its own markers."""
    svg = trajectory_svg(_result("paper", rubric=True))
    assert 'class="mean"' in svg and svg.count("<rect") == 2
    assert "rubric mean 8.25/10" in svg


def test_chart_points_stay_on_the_zero_to_one_axis() -> None:
    """A score of 1.0 sits on the top grid line and 0.0 on the x axis."""
    r = _result("w1")
    top = r.trace[1].model_copy(update={"score": 1.0})
    bottom = r.trace[0].model_copy(update={"score": 0.0})
    svg = trajectory_svg(r.model_copy(update={"trace": (bottom, top)}))
    ys = [float(v) for v in re.findall(r'<circle class="pt-score" cx="[\d.]+" cy="([\d.]+)"', svg)]
    grid = [float(v) for v in re.findall(r'<line class="grid" x1="\d+" y1="([\d.]+)"', svg)]
    assert ys == [max(grid), min(grid)]


def test_totals_tables_pitfalls_and_repairs_are_reported() -> None:
    """Totals, per-iteration rows, Known Pitfalls with frequency and the repair history appear."""
    page = render_report_html(
        "run-1", {1: [_result("w1"), _result("w2")]}, [PATTERN], pending=["1:w3"]
    )
    assert "<dt>submissions</dt><dd>3</dd>" in page
    assert "<dt>pending</dt><dd>1</dd>" in page
    assert "<dt>mean original score</dt><dd>0.40</dd>" in page
    assert "<dt>mean best score</dt><dd>0.90</dd>" in page
    assert "<dt>repair tokens (reported)</dt><dd>160</dd>" in page
    assert 'id="iteration-001"' in page
    assert "3x</td><td>missing_data</td><td>Always include the &#x27;findings&#x27; field" in page
    assert page.count("<td>accepted</td></tr>") == 2  # one repair row per worker
    assert "<code>1:w3</code>" in page
    assert "[×2] Include the &#x27;findings&#x27; field" in page


def test_output_is_deterministic() -> None:
    """The same inputs give the same bytes, whatever order the results arrive in."""
    a, b = _result("w1"), _result("w2")
    first = render_report_html("run-1", {1: [a, b]}, [PATTERN], [])
    again = render_report_html("run-1", {1: [b, a]}, [PATTERN], [])
    assert first == again
    assert "generated" not in first
    assert "generated 2024-01-01" in render_report_html(
        "run-1", {1: [a]}, [], generated_at="2024-01-01"
    )


def test_empty_run_renders() -> None:
    """A run without results still renders a page that says so."""
    page = render_report_html("run-1", {}, [], [])
    assert "No results yet." in page and "None recorded." in page


def test_unchecked_and_cancelled_show_no_score_their_own_badge_and_stay_out_of_means() -> None:
    """Unscored results get an s-unchecked / s-cancelled badge, a totals card, ``no score``,
    the unchecked line, and are left out of every mean."""
    unchecked = _result("w2").model_copy(
        update={
            "status": "unchecked",
            "stop_reason": "disabled",
            "original_score": None,
            "best_score": None,
            "attempts": (),
            "trace": (),
        }
    )
    gone = cancelled_result(run_id="run-1", iteration=1, worker_id="w3", pass_id="p", by="cli")
    page = render_report_html("run-1", {1: [_result("w1"), unchecked, gone]}, [], [])
    assert ".s-unchecked {" in page and ".s-cancelled {" in page
    assert '<span class="badge s-unchecked">unchecked</span>' in page
    assert '<span class="badge s-cancelled">cancelled</span>' in page
    assert "<dt>unchecked</dt><dd>1</dd>" in page and "<dt>cancelled</dt><dd>1</dd>" in page
    assert "<dt>mean best score</dt><dd>0.90</dd>" in page
    assert "mean best score 0.90 (1 cancelled, 1 unchecked, not counted)" in page
    assert "unchecked</span> · no score</figcaption>" in page
    assert "critique is off (enabled: false): nothing was checked" in page
