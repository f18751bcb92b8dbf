"""``critique status RUN``: what a run submitted, and how each submission stands.

Every submission is in one of three states:

- **finished**: it has a result — a verdict (``accepted``, ``accepted_with_warnings``,
  ``repaired``, ``escalated`` or ``failed``); escalated is a normal outcome, the manager's cue;
  or no verdict: ``unchecked`` (critique explicitly off, ``enabled: false``: nothing was
  checked, no score) or ``cancelled`` (``critique cancel``); these show ``no score``, a line
  saying so under the row (``note`` in ``--json``, ``checked: false``), and are not in the means;
- **failed**: its Celery chain failed — refused by a worker (a configuration error such as a
  missing provider key, a forged message), or a stage raised — so it will never have a result;
  shown with a one-line reason;
- **pending**: neither yet.

One row per submission: iteration, worker, status, stop reason, score before → after, repairs
(a failed chain: its reason). Exit codes (the table of ``critique --help``): 0 no chain failed
(pending ones are shown, they are not an error); 1 a chain failed; 2 bad usage or an unknown
run (nothing submitted, no result); 3 Redis unreachable. ``--json`` prints one object:
``{run_id, iteration, ok, submitted, finished, failed, pending, errors, counts,
mean_original_score, mean_best_score, submissions: [...]}`` where ``failed`` and ``pending``
list ``"<iteration>:<worker>"`` keys, ``errors`` maps each failed key to its reason and every
row has a ``state`` (``finished`` | ``failed`` | ``pending``). A finished row whose critic or
reviser fell back says so (``FALLBACK …`` under it; ``fallbacks`` in ``--json``); an escalated
or failed one says why under it: its deciding defects and ``next: …``, what the manager should
do (``why`` in ``--json``); a repaired round says what the repair did in words when its reviser
said (``did`` in each of ``rounds``).

Once Redis holds no submission and no result of the run (its keys expired), the run's archive
answers (:mod:`workers.archiving`): the table says ``(from the archive: <path>, archived
<time>)`` under its first line, and ``--json`` has ``"archive": {"path", "archived_at"}``
(null when read from Redis). A run in neither is unknown (exit 2).

The run snapshot itself, shared with ``watch``, ``report``, ``resume`` and ``archive``, is
:mod:`workers.commands._runs`; the guard that maps errors to exit codes is
:mod:`workers.commands._common`.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pipeline.models import CritiqueResult, score_text
from pipeline.records.run_scores import not_counted_text
from pipeline.text.escaping import escape_controls
from workers import riding
from workers.commands._common import (
    add_iteration_argument,
    add_json_argument,
    add_run_argument,
    service_guard,
)
from workers.commands._runs import (
    WHY_LIMIT,
    RunSnapshot,
    archive_line,
    fallbacks,
    load_snapshot,
    split_key,
    unscored_note,
)
from workers.commands._text import json_line, printable
from workers.exit_codes import EXIT_FAILED, EXIT_OK

__all__ = ["render_text", "run", "snapshot_doc"]

HELP = "show a run's submissions: finished (with their verdict), failed, pending"

_FIXED_NOTE = re.compile(r"^repair (\d+): fixed: (.*)$")
_LEFT = re.compile(r"^\d+ defect\(s\) left for ")


def repair_labels(result: CritiqueResult) -> dict[int, str]:
    """What each repair did, in words, from the reviser's notes (``repair 1: fixed: deleted a
    repeated paragraph; …``), keyed by the round it produced (repair N → round N + 1)."""
    out: dict[int, str] = {}
    for note in result.notes:
        m = _FIXED_NOTE.match(note)
        if m is None:
            continue
        did = [p for p in m.group(2).split("; ") if p and not _LEFT.match(p)]
        if did:
            out[int(m.group(1)) + 1] = "; ".join(did)
    return out


def _mean(values: Sequence[float | None]) -> float | None:
    """The mean of the scores given, skipping None (unchecked and cancelled results)."""
    scores = [v for v in values if v is not None]
    return round(math.fsum(scores) / len(scores), 6) if scores else None


def _score(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _ref(ref: dict[str, Any]) -> str:
    loc = ref.get("location")
    return f"{ref['category']}@{loc}" if loc else str(ref["category"])


def round_diffs(result: CritiqueResult) -> list[dict[str, Any]]:
    """The defect diff of each round after a repair (which defects it fixed, which remain,
    which are new, which came back), JSON-ready; ``did``: what the repair before it did, in
    words, when its reviser said (else null)."""
    labels = repair_labels(result)
    return [
        {
            "round": t.round,
            "score": t.score,
            "verdict": t.verdict,
            "did": labels.get(t.round),
            **{
                name: [r.model_dump(mode="json") for r in getattr(t, name) or ()]
                for name in ("fixed", "remaining", "new", "regressed")
            },
        }
        for t in result.trace
        if t.fixed is not None
    ]


def diff_line(diff: dict[str, Any]) -> str:
    """``round 2 (0.45): fixed missing_data@summary; new hallucination@line 7; remaining 1``;
    with what the repair did in words (``did``), that instead of the fixed defects' references:
    ``round 2 (0.80): deleted a repeated paragraph; remaining 1``."""
    did = diff.get("did")
    parts = [
        did if name == "fixed" and did else f"{name} {', '.join(_ref(r) for r in diff[name])}"
        for name in ("fixed", "new", "regressed")
        if diff[name] or (name == "fixed" and did)
    ]
    if diff["remaining"]:
        parts.append(f"remaining {len(diff['remaining'])}")
    body = "; ".join(parts) or "no actionable defects before or after"
    return f"round {diff['round']} ({_score(diff['score'])}): {body}"


def snapshot_doc(snap: RunSnapshot, iteration: int | None) -> dict[str, Any]:
    """The JSON document of ``--json``."""
    rows: list[dict[str, Any]] = [
        {
            "iteration": r.iteration,
            "worker_id": r.worker_id,
            "state": "finished",
            "status": r.status,
            "stop_reason": r.stop_reason,
            "original_score": r.original_score,
            "best_score": r.best_score,
            "repairs": len(r.attempts),
            "checked": r.checked,
            "note": unscored_note(r),
            "fallbacks": fallbacks(r),
            "rounds": round_diffs(r),
            "why": list(r.why()),
        }
        for r in snap.results
    ]
    failed = snap.failed
    for key in snap.unfinished:
        it, worker = split_key(key)
        row: dict[str, Any] = {
            "iteration": it,
            "worker_id": worker,
            "state": "failed" if key in failed else "pending",
            "status": None,
            "stop_reason": None,
            "original_score": None,
            "best_score": None,
            "repairs": None,
        }
        if key in failed:
            row["error"] = snap.errors[key]
        rows.append(row)
    rows.sort(key=lambda r: (r["iteration"], r["worker_id"]))
    counts = Counter(r.status for r in snap.results)
    return {
        "run_id": snap.run_id,
        "iteration": iteration,
        "ok": snap.ok,
        "submitted": len(snap.submitted.keys() | snap.finished),
        "finished": len(snap.results),
        "failed": failed,
        "pending": snap.pending,
        "errors": {k: snap.errors[k] for k in failed},
        "counts": dict(sorted(counts.items())),
        "mean_original_score": _mean([r.original_score for r in snap.results]),
        "mean_best_score": _mean([r.best_score for r in snap.results]),
        "submissions": rows,
        "archive": snap.archive_info,
    }


def render_text(doc: dict[str, Any]) -> str:
    """The human-readable table; every line terminal-safe (worker-made text escaped)."""
    scope = "" if doc["iteration"] is None else f", iteration {doc['iteration']}"
    lines = [
        f"run {doc['run_id']}{scope}: {doc['submitted']} submitted, {doc['finished']} finished, "
        f"{len(doc['failed'])} failed, {len(doc['pending'])} pending",
    ]
    if doc.get("archive"):
        lines.append(archive_line(doc["archive"]))
    lines += [
        "",
        f"{'iter':>4}  {'worker':<16} {'status':<22} {'stop reason':<24} {'score':<13} repairs",
    ]
    for r in doc["submissions"]:
        if r["state"] == "failed":
            lines.append(
                f"{r['iteration']:>4}  {r['worker_id']:<16} {'FAILED (chain)':<22} {r['error']}"
            )
            continue
        if r["state"] == "pending":
            lines.append(f"{r['iteration']:>4}  {r['worker_id']:<16} pending")
            continue
        score = score_text(r["original_score"], r["best_score"])
        lines.append(
            f"{r['iteration']:>4}  {r['worker_id']:<16} {r['status']:<22} "
            f"{r['stop_reason'] or '':<24} {score:<13} {r['repairs']}".rstrip()
        )
        if r.get("note"):
            lines.append(f"{'':>6}{printable(r['note'], WHY_LIMIT)}")
        for note in r.get("fallbacks") or ():
            lines.append(f"{'':>6}FALLBACK {printable(note, 200)}")
        for diff in r.get("rounds") or ():
            lines.append(f"{'':>6}{printable(diff_line(diff), 300)}")
        for line in r.get("why") or ():
            lines.append(f"{'':>6}{printable(line, WHY_LIMIT)}")
    lines.append("")
    counts = ", ".join(f"{k} {v}" for k, v in doc["counts"].items()) or "none yet"
    lines.append(f"verdicts: {counts}")
    unscored = not_counted_text(doc["counts"])
    if doc["mean_best_score"] is not None or unscored:
        mean = score_text(doc["mean_original_score"], doc["mean_best_score"])
        lines.append(f"mean score: {mean}{unscored}")
    if doc["failed"]:
        lines.append(f"failed: {', '.join(doc['failed'])} (no verdict: see the reason per row)")
    if doc["pending"]:
        lines.append(f"pending: {', '.join(doc['pending'])}")
    return "\n".join(escape_controls(line) for line in lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    add_iteration_argument(parser)
    add_json_argument(parser, "print the status as JSON")


def run(args: argparse.Namespace) -> int:
    def body() -> int:
        snap = riding.ride(
            lambda: load_snapshot(args.run_id, args.iteration, archive=True),
            notice=lambda line: print(
                f"critique status: warning: {line}", file=sys.stderr, flush=True
            ),
        )
        doc = snapshot_doc(snap, args.iteration)
        if args.json:
            print(json_line(doc))
        else:
            print(render_text(doc))
        return EXIT_OK if snap.ok else EXIT_FAILED

    return service_guard("status", body)
