"""A run as Redis (or, once Redis holds none of it, its archive) holds it, for ``status``,
``watch``, ``report``, ``resume`` and ``archive``: the snapshot of its submissions and results,
why each failed chain failed, and the short lines the commands print under a result.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import did_you_mean
from pipeline.models import UNCHECKED_LINE, CritiqueResult, PassRef, check_identifier
from pipeline.records.archive_file import RunRecord, archive_dir, iso
from pipeline.text.escaping import escape_controls
from workers.commands._common import UnknownRunError
from workers.commands._text import printable

if TYPE_CHECKING:
    from pipeline.store.runs import Failure

REASON_LIMIT = 300
"""Longest failure reason shown (characters)."""


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
        return {PassRef.field_of(r.iteration, r.worker_id) for r in self.results}

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
    # lazy: workers.runtime loads celery; `critique --help` imports this module
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
            + close_run(run_id)
        )
    snap = RunSnapshot(run_id, submitted, results)
    if chain_errors and snap.unfinished:
        snap.errors = chain_failures({k: submitted[k] for k in snap.unfinished}, run_id)
    return snap


def close_run(run_id: str) -> str:
    """``"; did you mean 'q3-sales'?"`` for the run of this store whose id is closest to a
    mistyped ``run_id`` (the archive index names every run whose keys live), else ``""``."""
    # lazy: workers.archiving loads celery; `critique --help` imports this module
    from workers.archiving import default_index

    known = [r for r in default_index().known() if r != run_id]
    hint = did_you_mean(run_id, {r: repr(r) for r in known}).strip()
    return f"; {hint}" if hint else ""


def _archived_snapshot(run_id: str, iteration: int | None) -> RunSnapshot:
    """The run as its archive holds it (Redis holds no submission and no result of it)."""
    # lazy: pipeline.store.runs loads redis; `critique --help` imports this module
    from pipeline.store.runs import Failure

    # lazy: workers.archiving loads celery; `critique --help` imports this module
    from workers import archiving, runtime

    got = archiving.read_archived(run_id)
    if got is None:
        where = "" if iteration is None else f" in iteration {iteration}"
        path = archive_dir() / f"{run_id}.jsonl"
        raise UnknownRunError(
            f"no submission of run {run_id!r}{where} in the store at {runtime.store_url()} "
            f"and no archive at {path} (a mistyped run id, another {runtime.store_setting()} or "
            "CRITIQUE_ARCHIVE_DIR, or the run's keys expired before it was archived)"
            + close_run(run_id)
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
    # lazy: workers.runtime loads celery; `critique --help` imports this module
    from workers import runtime

    recorded = runtime.stores().runs.failures(run_id) if unfinished else {}
    return failure_lines(unfinished, recorded)


def failure_lines(
    unfinished: Mapping[str, Mapping[str, Any]], recorded: Mapping[str, Failure]
) -> dict[str, str]:
    """The one-line reason of each unfinished submission (key -> registry record) whose
    latest pass has a failure among ``recorded`` (pass member -> failure)."""
    out: dict[str, str] = {}
    for key, doc in unfinished.items():
        got = recorded.get(PassRef.member_of(key, str(doc.get("sid") or "")))
        if got is not None:
            text = f"{got.error}: {got.reason}"
            if got.refused:
                text = f"refused by the worker: {got.reason}"
            out[key] = printable(" ".join(text.split()), REASON_LIMIT)
    return out


def fallbacks(result: CritiqueResult) -> list[str]:
    """The result's notes that say a critic or reviser fell back: a fallback is never silent,
    so the CLI's line for that output shows it too."""
    return [n for n in result.notes if n.startswith("critic fallback:") or " reviser used" in n]


WHY_LIMIT = 300
"""Longest line of a result's explanation shown (characters)."""


def unscored_note(result: CritiqueResult) -> str | None:
    """What an ``unchecked`` or ``cancelled`` result says instead of a verdict (nothing was
    checked; who cancelled it); None for a checked one."""
    if result.checked:
        return None
    if result.status == "unchecked":
        return UNCHECKED_LINE
    return next((n for n in result.notes if n.startswith("cancelled")), result.envelope.summary)


def why_lines(result: CritiqueResult, indent: str = "      ") -> list[str]:
    """An escalated or failed result's deciding defects and next step, or an unchecked or
    cancelled one's :func:`unscored_note`, one indented, terminal-safe line each (the stored
    text is worker-made); [] for other verdicts."""
    note = unscored_note(result)
    lines = result.why() if note is None else (note,)
    return [escape_controls(f"{indent}{printable(line, WHY_LIMIT)}") for line in lines]


def tally(results: Sequence[CritiqueResult], failed: int, pending: int) -> str:
    """``"3 finished (accepted 2, escalated 1), 1 failed, 0 pending"``: the final tally."""
    counts = Counter(r.status for r in results)
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    finished = f"{len(results)} finished" + (f" ({verdicts})" if verdicts else "")
    return f"{finished}, {failed} failed, {pending} pending"


def archive_line(archive: Mapping[str, Any]) -> str:
    """``(from the archive: <path>, archived <time>)``: Redis no longer held the run."""
    return f"(from the archive: {archive['path']}, archived {archive['archived_at']})"
