"""The run's HTML report (``critique report``): one self-contained, deterministic file.

Inline CSS, inline SVG charts, no JavaScript, no external assets (fonts, CDNs, images), so it
opens from disk anywhere. Every string that comes from a worker's output or a critic's text is
untrusted and goes through :func:`html.escape`; nothing in the page is derived from it unescaped.
The same inputs always give the same bytes (no clock unless ``generated_at`` is passed in).
"""

from __future__ import annotations

import html
import math
import typing
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pipeline.llm.tokens import text_of
from pipeline.models import UNCHECKED_LINE, CritiqueResult, DefectRef, Pattern, RoundTrace, Status
from pipeline.records.run_scores import not_counted

TOP_DEFECTS = 15
TOP_PRESCRIPTIONS = 10
OUTPUT_PREVIEW_CHARS = 2000
GATE_EVENTS_SHOWN = 50

CHART_W, CHART_H = 320, 170
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 38, 12, 12, 30
RUBRIC_SCALE = 10.0
"""Rubric means are 0–10; the chart draws them divided by this, on the same 0–1 axis."""

STATUSES: tuple[str, ...] = typing.get_args(Status)
"""Every status a result may have, one totals card each (derived: never drifts from the model)."""

_CSS = """
:root { --fg:#1d2330; --muted:#5b6475; --line:#d9dde5; --bg:#f6f7f9; --card:#fff;
  --ok:#1f7a3d; --warn:#9a6700; --bad:#b42318; --blue:#1f5fbf; --violet:#7a3cc2; }
* { box-sizing: border-box; }
body { margin:0; padding:24px 32px 48px; font:14px/1.45 system-ui,-apple-system,"Segoe UI",
  Roboto,"Helvetica Neue",Arial,sans-serif; color:var(--fg); background:var(--bg); }
h1 { font-size:24px; margin:0 0 4px; } h2 { font-size:18px; margin:32px 0 10px; }
h3 { font-size:15px; margin:18px 0 8px; }
code, pre { font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace; font-size:12.5px; }
.muted { color:var(--muted); }
.cards { display:flex; flex-wrap:wrap; gap:12px; margin:0; }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px;
  padding:10px 14px; min-width:140px; }
.card dt { color:var(--muted); font-size:12px; } .card dd { margin:2px 0 0; font-size:20px;
  font-weight:600; }
table { border-collapse:collapse; background:var(--card); border:1px solid var(--line);
  width:100%; }
th, td { text-align:left; padding:5px 9px; border-bottom:1px solid var(--line);
  vertical-align:top; }
th { background:#eef0f4; font-weight:600; font-size:12.5px; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; }
.badge { display:inline-block; padding:1px 7px; border-radius:10px; font-size:12px;
  font-weight:600; background:#e8eaef; }
.s-accepted, .s-repaired { background:#dcf3e3; color:var(--ok); }
.s-accepted_with_warnings { background:#fdf1d6; color:var(--warn); }
.s-escalated, .s-failed, .s-pending-error { background:#fde2df; color:var(--bad); }
.s-pending { background:#e3ebf9; color:var(--blue); }
.s-unchecked { background:#fff; color:var(--bad); border:1px dashed var(--bad); }
.s-cancelled { background:#eceef2; color:var(--muted); text-decoration:line-through; }
.sev-critical { color:var(--bad); font-weight:600; } .sev-warning { color:var(--warn); }
.sev-info { color:var(--muted); }
.charts { display:grid; grid-template-columns:repeat(auto-fill,minmax(340px,1fr)); gap:14px; }
figure { margin:0; background:var(--card); border:1px solid var(--line); border-radius:8px;
  padding:10px; }
figcaption { font-size:13px; margin-bottom:4px; }
svg { display:block; }
svg .grid { stroke:#e6e8ee; stroke-width:1; }
svg .band { stroke:#c9ced8; stroke-width:1; stroke-dasharray:3 3; }
svg .axis { stroke:#8a93a5; stroke-width:1; }
svg text { font-size:10px; fill:var(--muted); font-family:inherit; }
svg .score { fill:none; stroke:var(--blue); stroke-width:2; }
svg .mean { fill:none; stroke:var(--violet); stroke-width:1.5; stroke-dasharray:5 3; }
svg .pt-score { fill:var(--blue); }
svg .pt-mean { fill:none; stroke:var(--violet); stroke-width:1.5; }
.legend { font-size:12px; color:var(--muted); }
.legend .k-score { color:var(--blue); } .legend .k-mean { color:var(--violet); }
details { margin-top:6px; } summary { cursor:pointer; color:var(--muted); font-size:12.5px; }
pre { white-space:pre-wrap; word-break:break-word; background:#f2f3f6; padding:8px;
  border-radius:6px; max-height:260px; overflow:auto; }
ul.defects, ul.diffs { margin:4px 0; padding-left:18px; font-size:12.5px; }
.diff-fixed { color:var(--ok); font-weight:600; } .diff-new { color:var(--warn); font-weight:600; }
.diff-regressed { color:var(--bad); font-weight:600; }
footer { margin-top:40px; color:var(--muted); font-size:12px; }
"""


def esc(value: object) -> str:
    """``html.escape`` (quotes too) of any value's ``str``: the only way text enters the page."""
    return html.escape(str(value), quote=True)


def _score(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.2f}"


def _mean(values: Iterable[float | None]) -> float | None:
    """The mean of the scores given, skipping None (unchecked and cancelled outputs)."""
    items = [v for v in values if v is not None]
    return math.fsum(items) / len(items) if items else None


def _badge(status: str) -> str:
    return f'<span class="badge s-{esc(status)}">{esc(status)}</span>'


def _severity_counts(result: CritiqueResult) -> dict[str, int]:
    counts = {"critical": 0, "warning": 0, "info": 0}
    for d in result.envelope.defects:
        counts[d.severity] += 1
    return counts


def _ordered(results_by_iteration: Mapping[int, Sequence[CritiqueResult]]) -> list[CritiqueResult]:
    return [
        r
        for it in sorted(results_by_iteration)
        for r in sorted(results_by_iteration[it], key=lambda r: r.worker_id)
    ]


def _table(head: Sequence[tuple[str, bool]], rows: Iterable[Sequence[str]]) -> str:
    """A table from pre-escaped cells; ``head`` is (title, numeric) pairs."""
    th = "".join(
        f'<th class="num">{esc(h)}</th>' if num else f"<th>{esc(h)}</th>" for h, num in head
    )
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="num">{c}</td>' if num else f"<td>{c}</td>"
            for c, (_, num) in zip(row, head, strict=True)
        )
        body.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>"


# --- sections ----------------------------------------------------------------------------------


def _totals(
    results: Sequence[CritiqueResult], pending: Sequence[str], failed: Mapping[str, str]
) -> str:
    statuses: Counter[str] = Counter(r.status for r in results)
    cards = [
        ("submissions", str(len(results) + len(failed) + len(pending))),
        ("finished", str(len(results))),
        ("failed chains", str(len(failed))),
        ("pending", str(len(pending))),
        ("mean original score", _score(_mean(r.original_score for r in results))),
        ("mean best score", _score(_mean(r.best_score for r in results))),
        ("repair attempts", str(sum(len(r.attempts) for r in results))),
        # What providers reported, never an estimate: token-free critics and
        # revisers report 0, so a run without a model shows 0 here as the budget line does.
        ("repair tokens (reported)", str(sum(r.repair_usage.tokens for r in results))),
        ("all tokens (reported)", str(sum(r.usage.tokens for r in results))),
    ]
    cards += [(s.replace("_", " "), str(statuses.get(s, 0))) for s in STATUSES]
    items = "".join(f'<div class="card"><dt>{esc(k)}</dt><dd>{esc(v)}</dd></div>' for k, v in cards)
    return f'<section id="totals"><h2>Totals</h2><dl class="cards">{items}</dl></section>'


def _iteration_tables(results_by_iteration: Mapping[int, Sequence[CritiqueResult]]) -> str:
    head = [
        ("worker", False),
        ("status", False),
        ("stop reason", False),
        ("score before", True),
        ("score after", True),
        ("repairs", True),
        ("critical", True),
        ("warning", True),
        ("info", True),
        ("critic", False),
    ]
    parts = ['<section id="iterations"><h2>Iterations</h2>']
    for it in sorted(results_by_iteration):
        rows = []
        ordered = sorted(results_by_iteration[it], key=lambda r: r.worker_id)
        for r in ordered:
            c = _severity_counts(r)
            rows.append(
                [
                    f"<code>{esc(r.worker_id)}</code>",
                    _badge(r.status),
                    esc(r.stop_reason),
                    _score(r.original_score),
                    _score(r.best_score),
                    str(len(r.attempts)),
                    str(c["critical"]),
                    str(c["warning"]),
                    str(c["info"]),
                    esc(r.envelope.critic),
                ]
            )
        mean = _mean(r.best_score for r in ordered)
        parts.append(
            f'<h3 id="iteration-{it:03d}">Iteration {it:03d} '
            f'<span class="muted">— {len(ordered)} worker(s), mean best score '
            f"{_score(mean)}{esc(not_counted(ordered))}</span></h3>"
        )
        parts.append(_table(head, rows))
    parts.append("</section>")
    return "".join(parts)


def _round_title(t: RoundTrace, rubric: bool) -> str:
    mean = f", rubric mean {t.mean:.2f}/10" if rubric else ""
    return f"round {t.round}: score {t.score:.2f}{mean}, {t.defects} defect(s), verdict {t.verdict}"


def trajectory_svg(result: CritiqueResult) -> str:
    """The result's score per round (and rubric mean ÷ 10) as an inline SVG line chart, 0–1."""
    rounds = list(result.trace)
    rubric = any(t.scores for t in rounds)
    inner_w = CHART_W - _PAD_L - _PAD_R
    inner_h = CHART_H - _PAD_T - _PAD_B
    n = len(rounds)

    def x(i: int) -> float:
        return _PAD_L + (inner_w / 2 if n <= 1 else inner_w * i / (n - 1))

    def y(v: float) -> float:
        return _PAD_T + inner_h * (1.0 - min(max(v, 0.0), 1.0))

    label = f"score trajectory of {result.worker_id}, iteration {result.iteration}"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_W}" height="{CHART_H}" '
        f'viewBox="0 0 {CHART_W} {CHART_H}" role="img" aria-label="{esc(label)}">'
    ]
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        ty = y(tick)
        out.append(
            f'<line class="grid" x1="{_PAD_L}" y1="{ty:.1f}" x2="{CHART_W - _PAD_R}" '
            f'y2="{ty:.1f}"/><text x="{_PAD_L - 6}" y="{ty + 3:.1f}" text-anchor="end">'
            f"{tick:.2f}</text>"
        )
    for band in (0.3, 0.6, 0.9):  # the score bands: escalate, repair, warnings, accept
        by = y(band)
        out.append(
            f'<line class="band" x1="{_PAD_L}" y1="{by:.1f}" x2="{CHART_W - _PAD_R}" '
            f'y2="{by:.1f}"><title>band threshold {band:.1f}</title></line>'
        )
    base = y(0.0)
    out.append(
        f'<line class="axis" x1="{_PAD_L}" y1="{_PAD_T}" x2="{_PAD_L}" y2="{base:.1f}"/>'
        f'<line class="axis" x1="{_PAD_L}" y1="{base:.1f}" x2="{CHART_W - _PAD_R}" '
        f'y2="{base:.1f}"/>'
    )
    for i, t in enumerate(rounds):
        out.append(
            f'<text x="{x(i):.1f}" y="{base + 13:.1f}" text-anchor="middle">{t.round}</text>'
        )
    out.append(
        f'<text x="{_PAD_L + inner_w / 2:.1f}" y="{CHART_H - 3}" text-anchor="middle">round</text>'
    )
    if rounds:
        pts = " ".join(f"{x(i):.1f},{y(t.score):.1f}" for i, t in enumerate(rounds))
        out.append(f'<polyline class="score" points="{pts}"/>')
    for i, t in enumerate(rounds):
        out.append(
            f'<circle class="pt-score" cx="{x(i):.1f}" cy="{y(t.score):.1f}" r="4">'
            f"<title>{esc(_round_title(t, rubric))}</title></circle>"
        )
    if rubric:
        pts = " ".join(f"{x(i):.1f},{y(t.mean / RUBRIC_SCALE):.1f}" for i, t in enumerate(rounds))
        out.append(f'<polyline class="mean" points="{pts}"/>')
        for i, t in enumerate(rounds):
            cx, cy = x(i), y(t.mean / RUBRIC_SCALE)
            out.append(
                f'<rect class="pt-mean" x="{cx - 5:.1f}" y="{cy - 5:.1f}" width="10" height="10">'
                f"<title>{esc(_round_title(t, rubric))}</title></rect>"
            )
    if not rounds:
        out.append(
            f'<text x="{_PAD_L + inner_w / 2:.1f}" y="{_PAD_T + inner_h / 2:.1f}" '
            'text-anchor="middle">no rounds recorded</text>'
        )
    out.append("</svg>")
    return "".join(out)


def _refs_html(refs: Sequence[DefectRef]) -> str:
    return ", ".join(
        f"<code>{esc(d.category)}{' @ ' + esc(d.location) if d.location else ''}</code>"
        for d in refs
    )


def _defect_diffs(r: CritiqueResult) -> str:
    """Per repair: the defects it fixed, introduced (new) or brought back (docs/pipeline.md,
    'Defect diff per round')."""
    items = []
    for t in r.trace:
        if t.fixed is None:
            continue
        parts = [
            f'<span class="{cls}">{label}</span> {_refs_html(refs)}'
            for label, cls, refs in (
                ("fixed", "diff-fixed", t.fixed),
                ("introduced", "diff-new", t.new or ()),
                ("regressed", "diff-regressed", t.regressed or ()),
            )
            if refs
        ]
        if t.remaining:
            parts.append(f"remaining {len(t.remaining)}")
        body = "; ".join(parts) or "no critical or warning defects before or after"
        items.append(f"<li>repair {t.round - 1} (round {t.round}, {_score(t.score)}): {body}</li>")
    if not items:
        return ""
    return (
        f"<details open><summary>defect diff per repair ({len(items)})</summary>"
        f'<ul class="diffs">{"".join(items)}</ul></details>'
    )


def _worker_figure(r: CritiqueResult) -> str:
    rubric = any(t.scores for t in r.trace)
    legend = '<span class="k-score">● score</span>'
    if rubric:
        legend += ' &nbsp; <span class="k-mean">□ rubric mean ÷ 10</span>'
    verdicts = " → ".join(esc(t.verdict) for t in r.trace) or "—"
    defects = "".join(
        f'<li><span class="sev-{esc(d.severity)}">{esc(d.severity)}</span> '
        f"{esc(d.category)}{' @ ' + esc(d.location) if d.location else ''}: "
        f"{esc(d.description)}{' (false positive)' if d.false_positive else ''}</li>"
        for d in r.envelope.defects
    )
    text = text_of(r.output)
    cut = len(text) > OUTPUT_PREVIEW_CHARS
    preview = esc(text[:OUTPUT_PREVIEW_CHARS]) + ("\n…" if cut else "")
    first = f" (first {OUTPUT_PREVIEW_CHARS} chars)" if cut else ""
    summary = f'<p class="muted">{esc(r.envelope.summary)}</p>' if r.envelope.summary else ""
    if r.status == "unchecked":
        summary = f'<p class="s-unchecked">{esc(UNCHECKED_LINE)}</p>'
    return (
        f'<figure id="w-{r.iteration:03d}-{esc(r.worker_id)}">'
        f"<figcaption><code>{esc(r.worker_id)}</code> · iteration {r.iteration:03d} · "
        f"{_badge(r.status)} · {esc(r.score_text())}</figcaption>"
        f"{trajectory_svg(r)}"
        f'<div class="legend">{legend} &nbsp; verdicts: {verdicts}</div>{summary}'
        f"{_defect_diffs(r)}"
        f"<details><summary>defects ({r.envelope.defect_count})</summary>"
        f'<ul class="defects">{defects or "<li>none</li>"}</ul></details>'
        f"<details><summary>best output{first}</summary><pre>{preview}</pre></details>"
        "</figure>"
    )


def _trajectories(results: Sequence[CritiqueResult]) -> str:
    figures = "".join(_worker_figure(r) for r in results)
    return (
        '<section id="trajectories"><h2>Score trajectories</h2>'
        '<p class="muted">Score per critique round on a 0–1 axis (dashed lines: the 0.3 / 0.6 / '
        "0.9 band thresholds). Hover a marker for the round's verdict.</p>"
        f'<div class="charts">{figures or "<p>No results yet.</p>"}</div></section>'
    )


def _top_defects(results: Sequence[CritiqueResult]) -> str:
    counter: Counter[tuple[str, str, str]] = Counter()
    for r in results:
        for d in r.envelope.defects:
            if not d.false_positive:
                counter[(d.severity, d.category, " ".join(d.description.split()))] += 1
    rank = {"critical": 0, "warning": 1, "info": 2}
    top = sorted(counter.items(), key=lambda kv: (-kv[1], rank[kv[0][0]], kv[0]))[:TOP_DEFECTS]
    rows = [
        [str(n), f'<span class="sev-{esc(sev)}">{esc(sev)}</span>', esc(cat), esc(desc)]
        for (sev, cat, desc), n in top
    ]
    presc: Counter[str] = Counter()
    for r in results:
        for p in r.envelope.prescriptions:
            key = " ".join(p.split())
            if key:
                presc[key] += 1
    top_p = sorted(presc.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_PRESCRIPTIONS]
    items = "".join(f"<li>[×{n}] {esc(p)}</li>" for p, n in top_p)
    table = (
        _table([("count", True), ("severity", False), ("category", False), ("defect", False)], rows)
        if rows
        else "<p>No defects in the final critiques.</p>"
    )
    return (
        '<section id="defects"><h2>Top defects</h2>'
        '<p class="muted">In each worker\'s final (best) critique.</p>'
        f"{table}<h3>Top prescriptions</h3>"
        f"{'<ol>' + items + '</ol>' if items else '<p>None.</p>'}</section>"
    )


def _pitfalls(patterns: Sequence[Pattern]) -> str:
    ordered = sorted(patterns, key=lambda p: -p.frequency)
    rows = [
        [
            f"{p.frequency}x",
            esc(p.category),
            esc(" ".join(p.prevention_rule.split()) or p.description),
            f"{p.first_seen_iteration}–{p.last_seen_iteration}"
            if p.first_seen_iteration != p.last_seen_iteration
            else str(p.first_seen_iteration),
        ]
        for p in ordered
    ]
    head = [("seen", True), ("category", False), ("prevention rule", False), ("iterations", False)]
    body = _table(head, rows) if rows else "<p>None recorded.</p>"
    return f'<section id="pitfalls"><h2>Known Pitfalls</h2>{body}</section>'


def _repairs(results: Sequence[CritiqueResult]) -> str:
    rows = [
        [
            f"<code>{esc(r.worker_id)}</code>",
            f"{r.iteration:03d}",
            str(a.attempt),
            _score(a.original_score),
            _score(a.repaired_score),
            str(a.defects_fixed),
            str(a.defects_remaining),
            esc(a.stop_reason or "—"),
        ]
        for r in results
        for a in r.attempts
    ]
    head = [
        ("worker", False),
        ("iteration", True),
        ("attempt", True),
        ("original", True),
        ("repaired", True),
        ("fixed", True),
        ("remaining", True),
        ("stop", False),
    ]
    body = _table(head, rows) if rows else "<p>No repairs.</p>"
    return f'<section id="repairs"><h2>Repair history</h2>{body}</section>'


def _pending(pending: Sequence[str]) -> str:
    if not pending:
        return ""
    items = "".join(f"<li><code>{esc(p)}</code></li>" for p in pending)
    return (
        '<section id="pending"><h2>Pending</h2><p class="muted">Submitted, no result yet '
        f"(iteration:worker).</p><ul>{items}</ul></section>"
    )


def _failed(failed: Mapping[str, str]) -> str:
    if not failed:
        return ""
    rows = [[f"<code>{esc(k)}</code>", esc(reason)] for k, reason in failed.items()]
    return (
        '<section id="failed"><h2>Failed chains</h2><p class="muted">Submitted, no verdict: '
        "the chain failed or a worker refused it (iteration:worker).</p>"
        f"{_table([('submission', False), ('reason', False)], rows)}</section>"
    )


def _trace(events: Sequence[Mapping[str, Any]]) -> str:
    counts: Counter[tuple[str, str]] = Counter(
        (str(e.get("type", "?")), str(e.get("stage", "?"))) for e in events
    )
    rows = [[esc(t), esc(s), str(n)] for (t, s), n in sorted(counts.items())]
    gates = [
        e for e in events if e.get("type") == "gate" and e.get("verdict") in ("reject", "bypass")
    ]
    gate_rows = [
        [
            f"{esc(e.get('iteration', '?'))}:<code>{esc(e.get('worker_id') or '—')}</code>",
            esc(e.get("gate", "?")),
            esc(e.get("verdict", "?")),
            esc(e.get("l0_check") or ""),
            esc(e.get("reason", "")),
        ]
        for e in gates[:GATE_EVENTS_SHOWN]
    ]
    more = len(gates) - len(gate_rows)
    gate_html = (
        _table(
            [
                ("submission", False),
                ("gate", False),
                ("verdict", False),
                ("check", False),
                ("reason", False),
            ],
            gate_rows,
        )
        if gate_rows
        else "<p>No gate rejected or bypassed anything.</p>"
    )
    if more > 0:
        gate_html += f'<p class="muted">… and {more} more.</p>'
    return (
        '<section id="trace"><h2>Trace</h2>'
        f'<p class="muted">{len(events)} event(s) in the run\'s stream.</p>'
        f"{_table([('type', False), ('stage', False), ('events', True)], rows)}"
        f"<h3>Gate rejections and bypasses</h3>{gate_html}</section>"
    )


def render_report_html(
    run_id: str,
    results_by_iteration: Mapping[int, Sequence[CritiqueResult]],
    patterns: Sequence[Pattern],
    trace_events: Sequence[Mapping[str, Any]] | None = None,
    *,
    pending: Sequence[str] = (),
    failed: Mapping[str, str] | None = None,
    generated_at: str | None = None,
) -> str:
    """The whole report as one HTML document (UTF-8 text, trailing newline).

    ``pending`` lists submissions without a result (``"<iteration>:<worker_id>"``), ``failed``
    maps those whose chain failed to the reason;
    ``generated_at`` is printed in the header when given (the page has no clock of its own).
    """
    results = _ordered(results_by_iteration)
    iterations = sorted(results_by_iteration)
    workers = sorted({r.worker_id for r in results})
    when = f" · generated {esc(generated_at)}" if generated_at else ""
    head = (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>Critique report — {esc(run_id)}</title><style>{_CSS}</style></head><body>"
    )
    header = (
        f"<header><h1>Critique report — run <code>{esc(run_id)}</code></h1>"
        f'<p class="muted">{len(iterations)} iteration(s) · {len(workers)} worker(s) · '
        f"{len(results)} result(s){when}</p></header>"
    )
    body = [
        head,
        header,
        _totals(results, pending, failed or {}),
        _iteration_tables(results_by_iteration),
        _trajectories(results),
        _top_defects(results),
        _pitfalls(patterns),
        _repairs(results),
        _failed(failed or {}),
        _pending(pending),
    ]
    if trace_events is not None:
        body.append(_trace(trace_events))
    body.append(
        "<footer>critique-pipeline · self-contained report: no scripts, no external assets."
        "</footer></body></html>\n"
    )
    return "".join(body)
