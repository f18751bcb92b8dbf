"""``critique report RUN [--out DIR]``: write a run's artifacts and its HTML report from Redis,
or from the run's archive (:mod:`workers.archiving`) once Redis holds no submission and no
result of it; then it prints ``(from the archive: <path>, archived <time>)`` first, and
``--json`` has ``"archive": {"path", "archived_at"}`` (null when read from Redis).

For every iteration with results, the artifact tree
``<root>/runs/<run-id>/iterations/NNN/{critique.json, CRITIQUE.md, delegations/<worker>/…}``
(:func:`pipeline.records.artifacts.write_artifacts`), plus ``<root>/runs/<run-id>/report.html`` (one
self-contained page with each worker's score trajectory as inline SVG) and
``<root>/runs/<run-id>/lessons.md`` (the patterns the run taught; with
``CRITIQUE_LESSONS_SCOPE=fleet``, those that recurred across the fleet's runs, counted, never
naming another run). ``<root>`` is ``--out``, else
``$CRITIQUE_WORKSPACE``, else ``./workspace``. Artifacts are written for finished submissions;
the report lists the failed chains (with their one-line reason) and the pending submissions
apart. Prints the files written, one per line, then a tally; ``--json`` prints ``{"run_id",
"root", "report", "files": [...], "finished", "failed": {key: reason}, "pending": [...]}``.

Every file is written in one batch under the root without following a symlink anywhere below
it (:func:`pipeline.records.artifacts.atomic_write_many`): a ``runs``, ``runs/<run-id>`` or
``report.html`` that is a symlink is refused with one line naming it, before anything is
written, also for a run with no finished result. Worker-made text is escaped in the Markdown
files and in what is printed.

Exit codes (the table of ``critique --help``): 0 written; 1 written, but a chain failed (it has
no verdict); 2 bad usage, an unknown run, an unwritable folder or a symlink under the root;
3 Redis unreachable.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from pipeline import settings
from pipeline.errors import PathEscapeError
from pipeline.models import CritiqueResult
from pipeline.store.keys import lessons_scope
from pipeline.text.escaping import escape_controls
from workers.commands._common import (
    CommandError,
    add_json_argument,
    add_run_argument,
    service_guard,
)
from workers.commands._runs import RunSnapshot, archive_line, load_snapshot, tally
from workers.commands._text import json_line
from workers.exit_codes import EXIT_FAILED, EXIT_OK

HELP = (
    "write a run's artifacts (critique.json, CRITIQUE.md) and report.html from Redis, "
    "or from its archive once Redis no longer holds it"
)

PATTERN_LIMIT = 1000


def default_root() -> Path:
    """``$CRITIQUE_WORKSPACE`` or ``./workspace``."""
    return Path(settings.raw(settings.WORKSPACE) or "workspace")


def write_report(
    run_id: str, out_dir: Path | str | None = None, *, snapshot: RunSnapshot | None = None
) -> list[Path]:
    """Write the run's artifact tree, ``report.html`` and ``lessons.md``; returns the files.

    ``snapshot`` is the run as already read (:func:`load_snapshot`), else it is read here.

    ``out_dir`` is the artifacts root (default :func:`default_root`). Every file is written in
    one confined batch: ``PathEscapeError`` (nothing written) when a symlink is met under the
    root. Raises :class:`~workers.commands._common.UnknownRunError` when Redis holds nothing for
    the run, ``StoreUnavailableError`` when Redis cannot be reached.
    """
    # lazy: pipeline.records.artifacts is not loaded by `critique --help`, which imports this module
    # and stays fast
    # lazy: pipeline.loop.pitfalls is not loaded by `critique --help`, which imports this module and
    # stays fast
    from pipeline.loop.pitfalls import render_lessons
    from pipeline.records.artifacts import artifact_files, atomic_write_many

    # lazy: workers.runtime loads celery; `critique --help` imports this module
    from workers import runtime

    # lazy: workers.commands._report_html is not loaded by `critique --help`, which imports this
    # module and stays fast
    from workers.commands._report_html import render_report_html

    root = Path(out_dir) if out_dir is not None else default_root()
    snap = snapshot if snapshot is not None else load_snapshot(run_id)
    if snap.archive is not None:  # Redis no longer holds the run: its archive does
        record = snap.archive[1]
        patterns = list(record.patterns[:PATTERN_LIMIT])
        events = list(record.trace)
        kept = [x for x in record.lessons if x.scope == "run" or x.runs >= 2]
        lessons = kept[:PATTERN_LIMIT]
        scope = lessons[0].scope if lessons else lessons_scope()
    else:
        stores = runtime.stores()
        patterns = stores.patterns.top(run_id, PATTERN_LIMIT)
        events = stores.trace.read(run_id)
        lessons = stores.patterns.lessons(PATTERN_LIMIT, run_id=run_id)
        scope = lessons_scope()
    by_iteration: dict[int, list[CritiqueResult]] = defaultdict(list)
    for r in snap.results:
        by_iteration[r.iteration].append(r)

    files: list[tuple[Path, str]] = []
    stale: list[Path] = []
    for iteration in sorted(by_iteration):
        tree, old = artifact_files(root, run_id, iteration, by_iteration[iteration], patterns)
        files += tree
        stale += old
    run_dir = root / "runs" / run_id  # a checked identifier (load_snapshot)
    failed = {k: snap.errors[k] for k in snap.failed}
    page = render_report_html(
        run_id, by_iteration, patterns, events, pending=snap.pending, failed=failed
    )
    report = run_dir / "report.html"
    files += [
        (report, page),
        (run_dir / "lessons.md", render_lessons(lessons, run_id=run_id, scope=scope)),
    ]
    atomic_write_many(files, root=root, remove=stale)
    return [path for path, _ in files]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="artifacts root (default: $CRITIQUE_WORKSPACE or ./workspace)",
    )
    add_json_argument(parser, "print the files written as JSON")


def run(args: argparse.Namespace) -> int:
    root = Path(args.out) if args.out else default_root()

    def body() -> int:
        snap = load_snapshot(args.run_id, archive=True)
        try:
            files = write_report(args.run_id, root, snapshot=snap)
        except PathEscapeError as exc:  # a symlink under the root: nothing was written
            raise CommandError(escape_controls(str(exc))) from None
        except OSError as exc:
            raise CommandError(escape_controls(f"cannot write under {root}: {exc}")) from None
        report = next(f for f in files if f.name == "report.html")
        if args.json:
            doc = {
                "run_id": args.run_id,
                "root": str(root),
                "report": str(report),
                "files": [str(f) for f in files],
                "finished": len(snap.results),
                "failed": {k: snap.errors[k] for k in snap.failed},
                "pending": snap.pending,
                "archive": snap.archive_info,
            }
            print(json_line(doc))
        else:
            if snap.archive_info is not None:
                print(escape_controls(archive_line(snap.archive_info)))
            for f in files:
                print(escape_controls(str(f)))
            print(escape_controls(f"report: {report} ({len(files)} file(s) written)"))
            print(f"run {args.run_id}: {tally(snap.results, len(snap.failed), len(snap.pending))}")
            for key in snap.failed:
                print(escape_controls(f"failed {key}: {snap.errors[key]}"))
        return EXIT_OK if snap.ok else EXIT_FAILED

    return service_guard("report", body)
