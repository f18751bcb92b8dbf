"""``critique status RUN``: what a run submitted, and how each submission stands.

Every submission is in one of three states:

- **finished**: it has a result — a verdict (``accepted``, ``accepted_with_warnings``,
  ``repaired``, ``escalated`` or ``failed``); escalated is a normal outcome, the manager's cue;
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

The helpers here (:func:`load_snapshot`, :func:`chain_failures`, :func:`failure_reason`,
:func:`service_guard`) are shared by ``watch`` and ``report``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.archive import RunRecord, iso
from pipeline.models import CritiqueResult
from workers.cli import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from workers.commands._text import escape_controls, json_line, printable

if TYPE_CHECKING:
    from pipeline.store.runs import Failure

HELP = "show a run's submissions: finished (with their verdict), failed, pending"

REASON_LIMIT = 300
"""Longest failure reason shown (characters)."""


class UnknownRunError(LookupError):
    """Redis holds nothing for the run: never submitted, mistyped, or its keys expired."""


def key_of(iteration: int, worker_id: str) -> str:
    """``"<iteration>:<worker_id>"``, the form the run registry keys submissions by."""
    return f"{iteration}:{worker_id}"


def split_key(key: str) -> tuple[int, str]:
    it, _, worker = key.partition(":")
    return (int(it) if it.isdigit() else 0), worker


def _by_key(keys: Sequence[str] | set[str]) -> list[str]:
    return sorted(keys, key=split_key)


@dataclass
class RunSnapshot:
    """What Redis holds about a run right now (or, once Redis holds none of it, its archive)."""

    run_id: str
    submitted: dict[str, dict[str, Any]]
    results: list[CritiqueResult]
    errors: dict[str, str] = field(default_factory=dict)
    """Submissions without a result whose Celery chain failed: key -> one-line reason."""
    archive: tuple[Path, RunRecord] | None = None
    """Where the run was read from when Redis no longer held it: its archive file and record."""

    @property
    def archive_info(self) -> dict[str, str] | None:
        """``{"path", "archived_at"}`` of the archive the run was read from, else None."""
        if self.archive is None:
            return None
        return {"path": str(self.archive[0]), "archived_at": iso(self.archive[1].archived_at)}

    @property
    def finished(self) -> set[str]:
        return {key_of(r.iteration, r.worker_id) for r in self.results}

    @property
    def failed(self) -> list[str]:
        done = self.finished
        return _by_key([k for k in self.errors if k not in done])

    @property
    def unfinished(self) -> list[str]:
        """Submitted, no result: failed or pending."""
        done = self.finished
        return _by_key([k for k in self.submitted if k not in done])

    @property
    def pending(self) -> list[str]:
        return [k for k in self.unfinished if k not in self.errors]

    @property
    def ok(self) -> bool:
        """True when no chain failed (verdicts, escalated and failed ones too, are outcomes)."""
        return not self.failed


def check_run_id(run_id: str) -> str:
    """``run_id`` if it is a valid identifier; raises ValueError with the rule otherwise."""
    from pipeline.models import check_identifier

    return check_identifier(run_id, "run_id")


def load_snapshot(
    run_id: str,
    iteration: int | None = None,
    *,
    chain_errors: bool = True,
    archive: bool = False,
) -> RunSnapshot:
    """Submissions and results of ``run_id`` (one iteration when given) from Redis.

    With ``archive``, a run of which Redis holds no submission and no result is read from its
    archive (:mod:`workers.archiving`; the snapshot's ``archive`` says so). Raises
    :class:`UnknownRunError` when neither has it; with ``chain_errors`` the failure record of
    every submission without a result is checked, so a chain that failed shows as failed (with
    its reason), not pending.
    """
    from workers import runtime

    check_run_id(run_id)
    stores = runtime.stores()
    submitted = stores.runs.submitted(run_id)
    results = stores.runs.results(run_id, iteration)
    if not submitted and not results and archive:
        return _archived_snapshot(run_id, iteration)
    if iteration is not None:
        submitted = {k: v for k, v in submitted.items() if split_key(k)[0] == iteration}
    if not submitted and not results:
        where = "" if iteration is None else f" in iteration {iteration}"
        raise UnknownRunError(
            f"no submission of run {run_id!r}{where} in the store at {runtime.store_url()} "
            f"(a mistyped run id, another {runtime.store_setting()}, or the run's keys expired)"
        )
    snap = RunSnapshot(run_id, submitted, results)
    if chain_errors and snap.unfinished:
        snap.errors = chain_failures({k: submitted[k] for k in snap.unfinished}, run_id)
    return snap


def _archived_snapshot(run_id: str, iteration: int | None) -> RunSnapshot:
    """The run as its archive holds it (Redis holds no submission and no result of it)."""
    from pipeline.archive import archive_dir
    from pipeline.store.runs import Failure
    from workers import archiving, runtime

    got = archiving.read_archived(run_id)
    if got is None:
        where = "" if iteration is None else f" in iteration {iteration}"
        path = archive_dir() / f"{run_id}.jsonl"
        raise UnknownRunError(
            f"no submission of run {run_id!r}{where} in the store at {runtime.store_url()} "
            f"and no archive at {path} (a mistyped run id, another {runtime.store_setting()} or "
            "CRITIQUE_ARCHIVE_DIR, or the run's keys expired before it was archived)"
        )
    path, record = got
    submitted = dict(record.submitted)
    results = record.results
    if iteration is not None:
        submitted = {k: v for k, v in submitted.items() if split_key(k)[0] == iteration}
        results = [r for r in results if r.iteration == iteration]
        if not submitted and not results:
            raise UnknownRunError(
                f"the archive {path} of run {run_id!r} holds no submission in iteration {iteration}"
            )
    snap = RunSnapshot(run_id, submitted, results, archive=(path, record))
    if snap.unfinished:
        failures = {
            m: Failure(
                stage=str(d.get("stage") or ""),
                error=str(d.get("error") or ""),
                reason=str(d.get("reason") or ""),
                refused=d.get("refused") is True,
            )
            for m, d in record.failures.items()
        }
        snap.errors = failure_lines({k: submitted[k] for k in snap.unfinished}, failures)
    return snap


def chain_failures(unfinished: Mapping[str, Mapping[str, Any]], run_id: str) -> dict[str, str]:
    """The submissions (key -> registry record) of ``run_id`` whose latest pass a worker
    recorded as failed, each with its one-line reason. Only such a record counts (signed with
    ``CRITIQUE_SECRET``), never Celery's FAILURE state for the task id: a broker writer can
    set that for any id."""
    from workers import runtime

    recorded = runtime.stores().runs.failures(run_id) if unfinished else {}
    return failure_lines(unfinished, recorded)


def failure_lines(
    unfinished: Mapping[str, Mapping[str, Any]], recorded: Mapping[str, Failure]
) -> dict[str, str]:
    """The one-line reason of each unfinished submission (key -> registry record) whose
    latest pass has a failure among ``recorded`` (pass member -> failure)."""
    from pipeline.store.runs import pass_member

    out: dict[str, str] = {}
    for key, doc in unfinished.items():
        iteration, worker_id = split_key(key)
        got = recorded.get(pass_member(iteration, worker_id, str(doc.get("sid") or "")))
        if got is not None:
            text = f"{got.error}: {got.reason}"
            if got.refused:
                text = f"refused by the worker: {got.reason}"
            out[key] = printable(" ".join(text.split()), REASON_LIMIT)
    return out


def failure_reason(error: object) -> str:
    """Why a chain failed, in one terminal-safe line without a Python repr: ``refused by the
    worker: <message>`` for a refused submission or configuration (a missing provider key, a
    worker-only field, a forged message), else ``<ExceptionType>: <message>``."""
    from pipeline.errors import ConfigError, CritiqueError, SubmissionError

    if isinstance(error, CritiqueError):
        text = error.message
    elif isinstance(error, BaseException):
        text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    else:
        text = str(error)
    if isinstance(error, SubmissionError | ConfigError):
        text = f"refused by the worker: {text}"
    return printable(" ".join(text.split()), REASON_LIMIT) or "failed (no reason recorded)"


def service_guard(command: str, body: Callable[[], int]) -> int:
    """Run a command body, mapping an unreachable Redis to exit 3 and an unknown run to 2.

    A ``BrokenPipeError`` is the reader of this command's output going away (``| head``), not
    Redis (redis-py wraps its own socket errors in its ``ConnectionError``): it is left to the
    CLI entry point, which ends quietly, instead of being reported as "cannot reach Redis".
    """
    from pipeline.errors import CritiqueError, StoreUnavailableError
    from workers import runtime
    from workers.unreachable import unreachable_errors

    try:
        return body()
    except BrokenPipeError:
        raise
    except UnknownRunError as exc:
        print(f"critique {command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except StoreUnavailableError as exc:  # its message names the URL and REDIS_URL
        print(f"critique {command}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except unreachable_errors() as exc:
        url = runtime.store_url()
        print(
            f"critique {command}: cannot reach Redis at {url}: {exc} "
            f"(hint: is Redis running at {url}? set {runtime.store_setting()})",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    except (CritiqueError, ValueError) as exc:
        print(f"critique {command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def fallbacks(result: CritiqueResult) -> list[str]:
    """The result's notes that say a critic or reviser fell back (SPEC §5.2: a fallback is
    always visible, on the CLI's line for that output too)."""
    return [n for n in result.notes if n.startswith("critic fallback:") or " reviser used" in n]


WHY_LIMIT = 300
"""Longest line of a result's explanation shown (characters)."""


def why_lines(result: CritiqueResult, indent: str = "      ") -> list[str]:
    """An escalated or failed result's deciding defects and next step, one indented,
    terminal-safe line each (the stored text is worker-made); [] for other verdicts."""
    return [escape_controls(f"{indent}{printable(line, WHY_LIMIT)}") for line in result.why()]


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


def _mean(values: Sequence[float]) -> float | None:
    return round(math.fsum(values) / len(values), 6) if values else None


def _score(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _ref(ref: dict[str, Any]) -> str:
    loc = ref.get("location")
    return f"{ref['category']}@{loc}" if loc else str(ref["category"])


def round_diffs(result: CritiqueResult) -> list[dict[str, Any]]:
    """The defect diff of each round after a repair (SPEC §5.4), JSON-ready; ``did``: what the
    repair before it did, in words, when its reviser said (else null)."""
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


def tally(results: Sequence[CritiqueResult], failed: int, pending: int) -> str:
    """``"3 finished (accepted 2, escalated 1), 1 failed, 0 pending"``: the final tally."""
    counts = Counter(r.status for r in results)
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    finished = f"{len(results)} finished" + (f" ({verdicts})" if verdicts else "")
    return f"{finished}, {failed} failed, {pending} pending"


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
        score = f"{_score(r['original_score'])} → {_score(r['best_score'])}"
        lines.append(
            f"{r['iteration']:>4}  {r['worker_id']:<16} {r['status']:<22} "
            f"{r['stop_reason'] or '':<24} {score:<13} {r['repairs']}".rstrip()
        )
        for note in r.get("fallbacks") or ():
            lines.append(f"{'':>6}FALLBACK {printable(note, 200)}")
        for diff in r.get("rounds") or ():
            lines.append(f"{'':>6}{printable(diff_line(diff), 300)}")
        for line in r.get("why") or ():
            lines.append(f"{'':>6}{printable(line, WHY_LIMIT)}")
    lines.append("")
    counts = ", ".join(f"{k} {v}" for k, v in doc["counts"].items()) or "none yet"
    lines.append(f"verdicts: {counts}")
    if doc["mean_best_score"] is not None:
        lines.append(
            f"mean score: {_score(doc['mean_original_score'])} → {_score(doc['mean_best_score'])}"
        )
    if doc["failed"]:
        lines.append(f"failed: {', '.join(doc['failed'])} (no verdict: see the reason per row)")
    if doc["pending"]:
        lines.append(f"pending: {', '.join(doc['pending'])}")
    return "\n".join(escape_controls(line) for line in lines)


def archive_line(archive: Mapping[str, Any]) -> str:
    """``(from the archive: <path>, archived <time>)``: Redis no longer held the run."""
    return f"(from the archive: {archive['path']}, archived {archive['archived_at']})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="RUN", help="the run id")
    parser.add_argument("--iteration", type=int, metavar="N", help="only this iteration")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")


def run(args: argparse.Namespace) -> int:
    if args.iteration is not None and args.iteration < 1:
        print("critique status: --iteration must be ≥ 1", file=sys.stderr)
        return EXIT_USAGE

    def body() -> int:
        snap = load_snapshot(args.run_id, args.iteration, archive=True)
        doc = snapshot_doc(snap, args.iteration)
        if args.json:
            print(json_line(doc))
        else:
            print(render_text(doc))
        return EXIT_OK if snap.ok else EXIT_FAILED

    return service_guard("status", body)
