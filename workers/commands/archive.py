"""``critique archive RUN [--dir DIR] [--json]``: write a run's full record outside Redis.

The record (:mod:`pipeline.records.archive_file`) is ``<dir>/<run-id>.jsonl``, JSON Lines: a header,
every result the store holds (the latest pass's and superseded ones) with its rounds, attempts and
notes, the failures, the completion-gate decisions, the trace, the pattern counts and the
shared lessons. ``<dir>`` is ``--dir``, else ``$CRITIQUE_ARCHIVE_DIR``, else
``<$CRITIQUE_WORKSPACE or ./workspace>/archive``. Archiving again rewrites the file whole. Only
records that verify are archived; with ``CRITIQUE_SECRET`` the file is signed.

Workers archive settled runs on their own (``CRITIQUE_ARCHIVE_AFTER_S``); this command is for
an operator who wants the record now. Prints the file, then a summary line; ``--json`` prints
``{"run_id", "path", "written", "archived_at", "counts", "pending", "signed_store"}``.

Exit codes (the table of ``critique --help``): 0 written (also for a run with passes still
pending: they are listed, and the record says so), or already archived and gone from Redis
(nothing rewritten; ``written`` false); 2 bad usage, an unknown run, an unwritable folder or a
symlinked archive file (nothing written); 3 Redis unreachable.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.errors import PathEscapeError
from pipeline.records.archive_file import RunRecord, archive_dir, iso
from pipeline.text.escaping import escape_controls
from workers.commands._common import (
    CommandError,
    UnknownRunError,
    add_json_argument,
    add_run_argument,
    service_guard,
)
from workers.commands._runs import check_run_id
from workers.commands._text import json_line
from workers.exit_codes import EXIT_OK

HELP = "write a run's full record (results, rounds, trace, patterns, lessons) as JSON Lines"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    parser.add_argument(
        "--dir",
        metavar="DIR",
        help="archive directory (default: $CRITIQUE_ARCHIVE_DIR, else "
        "<$CRITIQUE_WORKSPACE or ./workspace>/archive)",
    )
    add_json_argument(parser, "print what was written as JSON")


def run(args: argparse.Namespace) -> int:
    def body() -> int:
        # lazy: workers.archiving loads celery; `critique --help` imports this module
        from workers import archiving

        check_run_id(args.run_id)
        folder = Path(args.dir) if args.dir else archive_dir()
        try:
            done = archiving.archive_run(args.run_id, directory=folder)
        except archiving.NothingToArchiveError as exc:
            got = archiving.read_archived(args.run_id, folder)
            if got is None:
                raise UnknownRunError(f"{exc}; no archive at {folder} either") from None
            path, record = got
            return _report(args, path, record, written=False)
        except PathEscapeError as exc:  # a symlink on the way: nothing was written
            raise CommandError(escape_controls(str(exc))) from None
        except OSError as exc:
            raise CommandError(escape_controls(f"cannot write under {folder}: {exc}")) from None
        assert done.path is not None and done.record is not None
        return _report(args, done.path, done.record, written=True)

    return service_guard("archive", body)


def _report(args: argparse.Namespace, path: Path, record: RunRecord, *, written: bool) -> int:
    """Print what was archived (or found archived) and return the exit code."""
    counts = record.counts()
    if args.json:
        doc = {
            "run_id": record.run_id,
            "path": str(path),
            "written": written,
            "archived_at": iso(record.archived_at),
            "counts": counts,
            "pending": sorted(record.pending),
            "signed_store": record.signed_store,
        }
        print(json_line(doc))
        return EXIT_OK
    print(escape_controls(str(path)))
    held = (
        f"{counts['results']} result(s) ({counts['passes']} pass(es)), "
        f"{counts['failures']} failure(s), {counts['trace']} trace event(s), "
        f"{counts['patterns']} pattern(s), {counts['lessons']} lesson(s)"
    )
    if written:
        line = f"run {record.run_id} archived: {held}"
    else:
        line = (
            f"run {record.run_id}: Redis holds none of it; already archived "
            f"{iso(record.archived_at)} ({held}); nothing rewritten"
        )
    if record.pending:
        line += f"; {len(record.pending)} pass(es) still pending, without a result in the record"
    print(escape_controls(line))
    return EXIT_OK
