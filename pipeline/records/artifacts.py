"""Artifacts and the manager summary.

Per iteration the manager gets a JSON-safe summary (per-worker scores and defect counts, top
prescriptions, known patterns, repair history); the same facts land on disk under
``<root>/runs/<run-id>/iterations/NNN/`` as ``critique.json``, ``CRITIQUE.md`` and
``delegations/<worker-id>/{critique,repairs}.json``. Writes are atomic, never follow a symlink
under the artifacts root, and the JSON is deterministic (sorted keys, indent 2, trailing
newline) so reruns produce identical bytes. Every worker-made string in ``CRITIQUE.md`` is
escaped for Markdown (:mod:`pipeline.text.escaping`): raw HTML in an output shows as text.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import secrets
import stat
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import PathEscapeError, SubmissionError
from pipeline.models import (
    SCHEMA_VERSION,
    UNCHECKED_LINE,
    CritiqueResult,
    Pattern,
    check_identifier,
)
from pipeline.records.run_scores import mean_best_score, not_counted
from pipeline.text.escaping import md_cell

TOP_PRESCRIPTIONS = 10
_CELL_MAX = 200


def _sorted_results(results: Sequence[CritiqueResult]) -> list[CritiqueResult]:
    """Results by worker id; a worker listed twice is an error (its files would collide)."""
    seen: set[str] = set()
    for r in results:
        if r.worker_id in seen:
            raise SubmissionError(
                f"worker {r.worker_id!r} appears twice in one iteration's results",
                hint="pass one CritiqueResult per worker",
            )
        seen.add(r.worker_id)
    return sorted(results, key=lambda r: r.worker_id)


def _severity_counts(result: CritiqueResult) -> dict[str, int]:
    counts = {"critical": 0, "warning": 0, "info": 0}
    for d in result.envelope.defects:
        counts[d.severity] += d.folded or 1  # a summary defect counts what it folds
    return counts


def _normal(text: str) -> str:
    return " ".join(text.split())


def manager_summary(
    run_id: str,
    iteration: int,
    results: Sequence[CritiqueResult],
    patterns: Sequence[Pattern],
) -> dict[str, Any]:
    """The manager's per-iteration view of the critiques, JSON-safe and deterministic."""
    ordered = _sorted_results(results)
    workers: list[dict[str, Any]] = []
    totals = {"critical": 0, "warning": 0, "info": 0}
    for r in ordered:
        counts = _severity_counts(r)
        for k, v in counts.items():
            totals[k] += v
        workers.append(
            {
                "worker_id": r.worker_id,
                "status": r.status,
                "stop_reason": r.stop_reason,
                "original_score": r.original_score,
                "best_score": r.best_score,
                "band": r.envelope.band,
                "defects": counts,
                "false_positives": sum(1 for d in r.envelope.defects if d.false_positive),
                "repair_attempts": len(r.attempts),
                "critic": r.envelope.critic,
            }
        )

    counter: Counter[str] = Counter()
    for r in ordered:
        for p in r.envelope.prescriptions:
            key = _normal(p)
            if key:
                counter[key] += 1
    top = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_PRESCRIPTIONS]

    known = sorted(patterns, key=lambda p: -p.frequency)
    history = [a.model_dump(mode="json", exclude_none=True) for r in ordered for a in r.attempts]
    mean = mean_best_score(ordered)
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "iteration": iteration,
        "mean_score": None if mean is None else round(mean, 6),
        "workers": workers,
        "totals": {
            "workers": len(ordered),
            "defects": totals,
            "repaired": sum(1 for r in ordered if r.status == "repaired"),
            "escalated": sum(1 for r in ordered if r.status == "escalated"),
            "failed": sum(1 for r in ordered if r.status == "failed"),
            "unchecked": sum(1 for r in ordered if r.status == "unchecked"),
            "cancelled": sum(1 for r in ordered if r.status == "cancelled"),
            "tokens_in": sum(r.usage.tokens_in for r in ordered),
            "tokens_out": sum(r.usage.tokens_out for r in ordered),
            "cost": round(sum(r.usage.cost for r in ordered), 6),
        },
        "top_prescriptions": [{"prescription": k, "count": n} for k, n in top],
        "known_patterns": [p.model_dump(mode="json") for p in known],
        "repair_history": history,
    }


def _cell(value: object) -> str:
    """One Markdown table cell or list text: one line, shown literally (HTML, pipes, links and
    controls escaped: the text is worker-made), long text cut."""
    return md_cell(value, _CELL_MAX)


def _score(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "—"


def _band(result: CritiqueResult, band: str) -> str:
    """The score band, except where the verdict was not the score's: an escalated or failed
    output says what decided it instead (``accept_with_warnings`` there read as a contradiction)."""
    if result.status in ("escalated", "failed"):
        return f"— (not decided by the score: stop {result.stop_reason})"
    if not result.checked:
        return f"— (not checked: {result.status})"
    return band


def _why_rows(result: CritiqueResult) -> list[tuple[str, str]]:
    """``why`` (the deciding defects) and ``next`` rows for an escalated or failed output; a
    ``checked`` row saying nothing was for an unchecked or cancelled one."""
    if result.status == "unchecked":
        return [("checked", f"no: {UNCHECKED_LINE}")]
    if not result.checked:
        return [("checked", f"no: {result.envelope.summary}")]
    lines = result.why()
    if not lines:
        return []
    *defects, step = lines
    return [("why", "; ".join(defects)), ("next", step.removeprefix("next: "))]


def render_critique_md(summary: dict[str, Any], results: Sequence[CritiqueResult]) -> str:
    """CRITIQUE.md: a table per worker, prescriptions, known pitfalls, repair history."""
    ordered = _sorted_results(results)
    totals = summary["totals"]
    lines = [
        f"# Critique — run `{summary['run_id']}`, iteration {summary['iteration']:03d}",
        "",
        f"Mean score **{_score(summary['mean_score'])}** over "
        f"{totals['workers'] - totals['unchecked'] - totals['cancelled']} checked worker(s)"
        f"{not_counted(ordered)}; "
        f"{totals['repaired']} repaired, {totals['escalated']} escalated, "
        f"{totals['failed']} failed. Defects: {totals['defects']['critical']} critical, "
        f"{totals['defects']['warning']} warning, {totals['defects']['info']} info.",
        "",
    ]
    by_id = {w["worker_id"]: w for w in summary["workers"]}
    for r in ordered:
        w = by_id.get(r.worker_id)
        if w is None:
            continue
        d = w["defects"]
        lines += [
            f"## Worker `{r.worker_id}` — {r.status} (stop: {r.stop_reason})",
            "",
            "| metric | value |",
            "|---|---|",
            f"| original score | {_score(w['original_score'])} |",
            f"| best score | {_score(w['best_score'])} |",
            f"| band | {_cell(_band(r, w['band']))} |",
            f"| defects | {d['critical']} critical, {d['warning']} warning, {d['info']} info |",
            f"| repair attempts | {w['repair_attempts']} |",
            f"| critic | {_cell(w['critic'])} |",
            *(f"| {k} | {_cell(v)} |" for k, v in _why_rows(r)),
            "",
        ]
        if r.envelope.defects:
            lines += ["| severity | category | location | description |", "|---|---|---|---|"]
            for defect in r.envelope.defects:
                flag = " (false positive)" if defect.false_positive else ""
                lines.append(
                    f"| {defect.severity}{flag} | {_cell(defect.category)} | "
                    f"{_cell(defect.location or '—')} | {_cell(defect.description)} |"
                )
            lines.append("")
        if r.envelope.summary:
            lines += [f"> {_cell(r.envelope.summary)}", ""]

    lines += ["## Top prescriptions", ""]
    if summary["top_prescriptions"]:
        for i, p in enumerate(summary["top_prescriptions"], 1):
            lines.append(f"{i}. [×{p['count']}] {_cell(p['prescription'])}")
    else:
        lines.append("None.")
    lines += ["", "## Known pitfalls", ""]
    if summary["known_patterns"]:
        for p in summary["known_patterns"]:
            rule = _cell(p["prevention_rule"] or p["description"])
            lines.append(f"- [seen {p['frequency']}x] {_cell(p['category'])}: {rule}")
    else:
        lines.append("None recorded.")
    lines += ["", "## Repair history", ""]
    if summary["repair_history"]:
        lines += [
            "| worker | attempt | original | repaired | fixed | remaining | stop |",
            "|---|---|---|---|---|---|---|",
        ]
        for a in summary["repair_history"]:
            lines.append(
                f"| `{a['worker_id']}` | {a['attempt']} | {_score(a['original_score'])} | "
                f"{_score(a['repaired_score'])} | {a['defects_fixed']} | "
                f"{a['defects_remaining']} | {_cell(a.get('stop_reason') or '—')} |"
            )
    else:
        lines.append("No repairs.")
    return "\n".join(lines) + "\n"


def dumps(data: Any) -> str:
    """Deterministic JSON: sorted keys, indent 2, UTF-8 kept, trailing newline."""
    return json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def atomic_write(path: Path, text: str, *, root: Path | None = None) -> None:
    """Write one file atomically and durably: see :func:`atomic_write_many`."""
    atomic_write_many([(path, text)], root=root)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _through_symlink(root: Path, target: Path, link: Path) -> PathEscapeError:
    """The one-line refusal of a write whose way under ``root`` meets a symlink."""
    return PathEscapeError(
        f"refusing to write {str(target)!r}: {str(link)!r} under the artifacts root "
        f"{str(root)!r} is a symlink",
        hint="artifacts are never written through a symlink; remove it or choose another root",
    )


class _Folders:
    """The folders under one artifacts root, each created and opened relative to its parent's
    descriptor without following a symlink (``O_NOFOLLOW``), so a symlink planted anywhere
    under the root (or swapped in while we write) can never send a write outside it. The root
    itself is the operator's choice and may be a symlink."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.fds: dict[tuple[str, ...], int] = {(): os.open(root, os.O_RDONLY | _DIRECTORY)}

    def parts(self, path: Path) -> tuple[str, ...]:
        """``path`` relative to the root, as names; PathEscapeError when it is not under it."""
        try:
            parts = path.relative_to(self.root).parts
        except ValueError:
            parts = ()
        if not parts or any(p in ("", ".", "..") for p in parts):
            raise PathEscapeError(f"artifact path {str(path)!r} is not under {str(self.root)!r}")
        return parts

    def folder(self, parts: tuple[str, ...], target: Path) -> int:
        """The descriptor of the folder ``parts`` under the root, created when missing."""
        for depth in range(1, len(parts) + 1):
            key = parts[:depth]
            if key in self.fds:
                continue
            parent, name = self.fds[key[:-1]], key[-1]
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=parent)
            try:
                self.fds[key] = os.open(
                    name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=parent
                )
            except OSError:
                if _is_symlink(name, parent):
                    raise _through_symlink(self.root, target, self.root.joinpath(*key)) from None
                raise
        return self.fds[parts]

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def _is_symlink(name: str, folder: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=folder).st_mode)
    except OSError:
        return False


def atomic_write_many(
    files: Sequence[tuple[Path, str]],
    *,
    root: Path | None = None,
    remove: Sequence[Path] = (),
) -> None:
    """Write each ``(path, text)`` atomically (UTF-8, ``\\n`` newlines), the batch durably;
    then delete the files in ``remove`` (absent ones are fine).

    Confinement: with ``root`` (the artifacts root) every path must lie under it, and no
    symlink under it is followed: each folder from the root down is created and opened
    relative to its parent without following a symlink, each temp file is created new
    (``O_EXCL | O_NOFOLLOW``) in its folder, and a target that is itself a symlink is
    refused. A symlink met anywhere raises PathEscapeError naming it before anything is
    written. Without ``root`` each file's own folder is its root (created as given).

    Each text goes to a temp file in its target's folder, which is then renamed over the
    target: a reader sees the old file or the new one, never half of one. Durable means the
    data is on disk before any rename, and the renames are on disk before this returns. For
    one file that is an fsync of the file and of its folder. For a batch (``critique report``
    writes dozens of files into as many folders) an fsync per file and per folder costs a
    journal commit each, so on Linux the batch syncs each filesystem it wrote to once before
    the renames and once after them (``syncfs``) instead. On an error the temp files are
    removed and the targets not yet renamed are unchanged.
    """
    syncfs = _syncfs() if len(files) > 1 else None
    trees: dict[Path, _Folders] = {}
    pending: list[tuple[int, str, str]] = []
    try:
        planned: list[tuple[int, str, str]] = []
        for path, text in files:
            folder, name = _place(trees, root, path)
            if _is_symlink(name, folder):
                raise _through_symlink(path.parent if root is None else root, path, path)
            planned.append((folder, name, text))
        doomed = [_place(trees, root, path) for path in remove]
        for folder, name, text in planned:
            tmp = f".{name}.{secrets.token_hex(6)}.tmp"
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC,
                0o600,
                dir_fd=folder,
            )
            pending.append((folder, tmp, name))
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
                fh.write(text)
                fh.flush()
                if syncfs is None:
                    os.fsync(fh.fileno())
        folders = list(dict.fromkeys(folder for folder, _, _ in planned))
        if syncfs is not None:
            syncfs(folders)
        while pending:
            folder, tmp, name = pending[0]
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            pending.pop(0)
        for folder, name in doomed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=folder)
        if syncfs is not None:
            syncfs(folders)
        else:
            for folder in folders:
                with contextlib.suppress(OSError):  # some filesystems refuse fsync on a folder
                    os.fsync(folder)
    except BaseException:
        for folder, tmp, _ in pending:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=folder)
        raise
    finally:
        for tree in trees.values():
            tree.close()


def _place(trees: dict[Path, _Folders], root: Path | None, path: Path) -> tuple[int, str]:
    """``(folder descriptor, file name)`` of ``path``, its folders opened under its root."""
    base = root if root is not None else path.parent
    tree = trees.get(base)
    if tree is None:
        tree = trees[base] = _Folders(base)
    parts = tree.parts(path)
    return tree.folder(parts[:-1], path), parts[-1]


@functools.cache
def _syncfs() -> Callable[[Sequence[int]], None] | None:
    """Linux ``syncfs(2)`` over the filesystems holding some open folders, or None where the C
    library has no such call (then every file and folder is fsynced on its own)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return None

    def sync(folders: Sequence[int]) -> None:
        devices: set[int] = set()
        for fd in folders:
            device = os.fstat(fd).st_dev
            if device not in devices:
                devices.add(device)
                if call(fd) != 0:
                    os.sync()  # refused (seccomp, old kernel): flush everything instead

    return sync


def _ident(value: str, what: str) -> str:
    try:
        return check_identifier(value, what)
    except ValueError as exc:
        raise SubmissionError(str(exc)) from None


def iteration_dir(root: Path, run_id: str, iteration: int) -> Path:
    """``<root>/runs/<run-id>/iterations/NNN`` for a safe run id and iteration ≥ 1."""
    _ident(run_id, "run_id")
    if iteration < 1:
        raise SubmissionError(f"iteration must be ≥ 1, got {iteration}")
    return root / "runs" / run_id / "iterations" / f"{iteration:03d}"


def write_delegation_artifacts(
    root: Path, run_id: str, iteration: int, result: CritiqueResult
) -> list[Path]:
    """Write one worker's ``critique.json`` (and ``repairs.json`` when it was repaired).

    Workers on a shared volume can call this for their own output; a stale ``repairs.json``
    from an earlier write of the same worker is removed when there were no repairs. Nothing
    under ``root`` is followed through a symlink (:func:`atomic_write_many`).
    """
    files, stale = _delegation_files(root, run_id, iteration, result)
    atomic_write_many(files, root=root, remove=[stale] if stale else ())
    return [path for path, _ in files]


def _delegation_files(
    root: Path, run_id: str, iteration: int, result: CritiqueResult
) -> tuple[list[tuple[Path, str]], Path | None]:
    """One worker's files to write, and its ``repairs.json`` to remove when it had no repairs."""
    worker = _ident(result.worker_id, "worker_id")
    folder = iteration_dir(root, run_id, iteration) / "delegations" / worker
    files = [(folder / "critique.json", dumps(result.model_dump(mode="json")))]
    repairs = folder / "repairs.json"
    if not result.attempts:
        return files, repairs
    attempts = [a.model_dump(mode="json", exclude_none=True) for a in result.attempts]
    files.append((repairs, dumps(attempts)))
    return files, None


def artifact_files(
    root: Path,
    run_id: str,
    iteration: int,
    results: Sequence[CritiqueResult],
    patterns: Sequence[Pattern],
) -> tuple[list[tuple[Path, str]], list[Path]]:
    """The iteration's artifact tree under ``root`` as ``(path, text)`` pairs, in order, and
    the stale ``repairs.json`` files to remove: what :func:`write_artifacts` writes, for a
    caller that writes it in one batch with more files (``critique report``)."""
    folder = iteration_dir(root, run_id, iteration)
    ordered = _sorted_results(results)
    for r in ordered:
        _ident(r.worker_id, "worker_id")
        if r.run_id != run_id:
            raise SubmissionError(
                f"result for worker {r.worker_id!r} belongs to run {r.run_id!r}, not {run_id!r}"
            )
    summary = manager_summary(run_id, iteration, ordered, patterns)
    document = {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "iteration": iteration,
        "summary": summary,
        "critiques": [r.model_dump(mode="json") for r in ordered],
    }
    files = [
        (folder / "critique.json", dumps(document)),
        (folder / "CRITIQUE.md", render_critique_md(summary, ordered)),
    ]
    stale: list[Path] = []
    for r in ordered:
        worker_files, worker_stale = _delegation_files(root, run_id, iteration, r)
        files += worker_files
        if worker_stale is not None:
            stale.append(worker_stale)
    return files, stale


def write_artifacts(
    root: Path,
    run_id: str,
    iteration: int,
    results: Sequence[CritiqueResult],
    patterns: Sequence[Pattern],
) -> list[Path]:
    """Write the iteration's artifact tree under ``root``; returns the files written, in order.

    One batch (:func:`atomic_write_many`): each file atomic, the tree durable once written,
    nothing under ``root`` followed through a symlink.
    """
    files, stale = artifact_files(root, run_id, iteration, results, patterns)
    atomic_write_many(files, root=root, remove=stale)
    return [path for path, _ in files]
