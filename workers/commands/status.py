"""``critique status RUN``: what a run submitted, what finished, and how each submission ended.

One row per submission: iteration, worker, status (or ``pending``), stop reason, score before →
after, repairs. A pending submission whose chain failed in Celery shows as ``error``.

Exit codes: 0 every finished submission was accepted or repaired (pending ones are shown, they
are not an error); 1 some result is ``failed`` or ``escalated``, or a chain errored (needs a
human); 2 bad usage or an unknown run (nothing submitted, no result); 3 Redis unreachable.
``--json`` prints one object: ``{run_id, iteration, ok, submitted, finished, pending, errors,
counts, mean_original_score, mean_best_score, submissions: [...]}``.

The helpers here (:func:`load_snapshot`, :func:`service_guard`) are shared by ``watch`` and
``report``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.models import CritiqueResult

HELP = "show what a run submitted and finished, per worker (exit 1 if any failed/escalated)"

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
BAD_STATUSES = ("failed", "escalated")


class UnknownRunError(LookupError):
    """Redis holds nothing for the run: never submitted, mistyped, or its keys expired."""


def key_of(iteration: int, worker_id: str) -> str:
    """``"<iteration>:<worker_id>"``, the form the run registry keys submissions by."""
    return f"{iteration}:{worker_id}"


def split_key(key: str) -> tuple[int, str]:
    it, _, worker = key.partition(":")
    return (int(it) if it.isdigit() else 0), worker


@dataclass
class RunSnapshot:
    """What Redis holds about a run right now."""

    run_id: str
    submitted: dict[str, dict[str, Any]]
    results: list[CritiqueResult]
    errors: dict[str, str] = field(default_factory=dict)
    """Pending submissions whose Celery chain failed: key -> error text."""

    @property
    def finished(self) -> set[str]:
        return {key_of(r.iteration, r.worker_id) for r in self.results}

    @property
    def pending(self) -> list[str]:
        done = self.finished
        return sorted((k for k in self.submitted if k not in done), key=split_key)

    @property
    def ok(self) -> bool:
        return not self.errors and not any(r.status in BAD_STATUSES for r in self.results)


def check_run_id(run_id: str) -> str:
    """``run_id`` if it is a valid identifier; raises ValueError with the rule otherwise."""
    from pipeline.models import check_identifier

    return check_identifier(run_id, "run_id")


def load_snapshot(
    run_id: str, iteration: int | None = None, *, chain_errors: bool = True
) -> RunSnapshot:
    """Submissions and results of ``run_id`` (one iteration when given) from Redis.

    Raises :class:`UnknownRunError` when Redis has neither; with ``chain_errors`` a pending
    submission's Celery result is checked, so a chain that died shows as an error, not pending.
    """
    from workers import runtime

    check_run_id(run_id)
    stores = runtime.stores()
    submitted = stores.runs.submitted(run_id)
    results = stores.runs.results(run_id, iteration)
    if iteration is not None:
        submitted = {k: v for k, v in submitted.items() if split_key(k)[0] == iteration}
    if not submitted and not results:
        where = "" if iteration is None else f" in iteration {iteration}"
        raise UnknownRunError(
            f"no submission of run {run_id!r}{where} in the store at {runtime.redis_url()} "
            "(a mistyped run id, another REDIS_URL, or the run's keys expired)"
        )
    snap = RunSnapshot(run_id, submitted, results)
    if chain_errors and snap.pending:
        snap.errors = _chain_errors({k: submitted[k] for k in snap.pending})
    return snap


def _chain_errors(pending: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Pending submissions whose chain's Celery result says FAILURE."""
    from celery.result import AsyncResult

    from workers.app import app

    out: dict[str, str] = {}
    for key, doc in pending.items():
        task_id = doc.get("task_id")
        if not task_id:
            continue
        try:
            ar = AsyncResult(str(task_id), app=app)
            if ar.state == "FAILURE":
                out[key] = printable(repr(ar.result))
        except Exception:  # a result backend other than the store may be down: stay pending
            continue
    return out


def printable(text: str, limit: int = 300) -> str:
    """One terminal-safe line: control characters escaped (worker text is untrusted), cut."""
    cleaned = "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text
    )
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 1] + "…"


def service_guard(command: str, body: Callable[[], int]) -> int:
    """Run a command body, mapping an unreachable Redis to exit 3 and an unknown run to 2."""
    import redis

    from pipeline.errors import CritiqueError, StoreUnavailableError
    from workers import runtime

    try:
        return body()
    except UnknownRunError as exc:
        print(f"critique {command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except StoreUnavailableError as exc:  # its message names the URL and REDIS_URL
        print(f"critique {command}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        url = runtime.redis_url()
        print(
            f"critique {command}: cannot reach Redis at {url}: {exc} "
            f"(hint: is Redis running at {url}? set REDIS_URL)",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    except (CritiqueError, ValueError) as exc:
        print(f"critique {command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _mean(values: Sequence[float]) -> float | None:
    return round(math.fsum(values) / len(values), 6) if values else None


def _score(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def snapshot_doc(snap: RunSnapshot, iteration: int | None) -> dict[str, Any]:
    """The JSON document of ``--json``."""
    rows: list[dict[str, Any]] = [
        {
            "iteration": r.iteration,
            "worker_id": r.worker_id,
            "status": r.status,
            "stop_reason": r.stop_reason,
            "original_score": r.original_score,
            "best_score": r.best_score,
            "repairs": len(r.attempts),
        }
        for r in snap.results
    ]
    for key in snap.pending:
        it, worker = split_key(key)
        row: dict[str, Any] = {
            "iteration": it,
            "worker_id": worker,
            "status": "error" if key in snap.errors else "pending",
            "stop_reason": None,
            "original_score": None,
            "best_score": None,
            "repairs": None,
        }
        if key in snap.errors:
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
        "pending": snap.pending,
        "errors": snap.errors,
        "counts": dict(sorted(counts.items())),
        "mean_original_score": _mean([r.original_score for r in snap.results]),
        "mean_best_score": _mean([r.best_score for r in snap.results]),
        "submissions": rows,
    }


def render_text(doc: dict[str, Any]) -> str:
    """The human-readable table."""
    scope = "" if doc["iteration"] is None else f", iteration {doc['iteration']}"
    lines = [
        f"run {doc['run_id']}{scope}: {doc['submitted']} submitted, {doc['finished']} finished, "
        f"{len(doc['pending'])} pending",
        "",
        f"{'iter':>4}  {'worker':<16} {'status':<22} {'stop reason':<24} {'score':<13} repairs",
    ]
    for r in doc["submissions"]:
        if r["original_score"] is None:
            score, repairs = "", ""
        else:
            score = f"{_score(r['original_score'])} → {_score(r['best_score'])}"
            repairs = str(r["repairs"])
        lines.append(
            f"{r['iteration']:>4}  {r['worker_id']:<16} {r['status']:<22} "
            f"{r['stop_reason'] or '':<24} {score:<13} {repairs}".rstrip()
        )
        if r.get("error"):
            lines.append(f"{'':>6}error: {r['error']}")
    lines.append("")
    counts = ", ".join(f"{k} {v}" for k, v in doc["counts"].items()) or "none yet"
    lines.append(f"statuses: {counts}")
    if doc["mean_best_score"] is not None:
        lines.append(
            f"mean score: {_score(doc['mean_original_score'])} → {_score(doc['mean_best_score'])}"
        )
    if doc["pending"]:
        lines.append(f"pending: {', '.join(doc['pending'])}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="RUN", help="the run id")
    parser.add_argument("--iteration", type=int, metavar="N", help="only this iteration")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")


def run(args: argparse.Namespace) -> int:
    if args.iteration is not None and args.iteration < 1:
        print("critique status: --iteration must be ≥ 1", file=sys.stderr)
        return EXIT_USAGE

    def body() -> int:
        snap = load_snapshot(args.run_id, args.iteration)
        doc = snapshot_doc(snap, args.iteration)
        if args.json:
            print(json.dumps(doc, ensure_ascii=False))
        else:
            print(render_text(doc))
        return EXIT_OK if snap.ok else EXIT_FAILED

    return service_guard("status", body)
