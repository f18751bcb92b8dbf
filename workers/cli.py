"""The ``critique`` command line: a thin dispatcher over :mod:`workers.commands`.

One exit-code table for every sub-command (:data:`workers.exit_codes.EXIT_CODES`, printed in
every ``--help``). A command that cannot go on raises
:class:`workers.commands._common.CommandError` with one of its codes, and
:func:`workers.commands._common.service_guard` maps every other error to the table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence

from pipeline import __version__
from pipeline.errors import ConfigError
from pipeline.store.urls import check_urls, new_lookalike_warnings
from pipeline.text.escaping import one_line
from workers.commands._common import number_problem
from workers.exit_codes import EXIT_BROKEN_PIPE, EXIT_CODES, EXIT_INTERRUPTED, EXIT_USAGE

# name -> module under workers.commands; order is the order `--help` lists them in.
COMMANDS: dict[str, str] = {
    "demo": "demo",
    "worker": "worker",
    "submit": "submit",
    "l0": "l0",
    "loop": "loop",
    "status": "status",
    "watch": "watch",
    "report": "report",
    "archive": "archive",
    "resume": "resume",
    "cancel": "cancel",
    "ab": "ab",
    "exporter": "exporter",
    "awp": "awp",
    "mcp": "mcp",
}

OFFLINE_COMMANDS = frozenset({"l0", "loop"})
"""Commands that reach no Redis and no broker: the only ones that skip the URL check."""


def _prepare_environment() -> None:
    """Settings every command needs before any heavy import: never fetch litellm's cost map."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def url_problem() -> str | None:
    """The one-line message for the first bad URL setting (``REDIS_URL``, the broker, the
    result backend, the store, Sentinel's), or None: every command but :data:`OFFLINE_COMMANDS`
    checks them before it starts anything (:func:`pipeline.store.urls.check_urls`)."""
    try:
        check_urls()
    except ConfigError as exc:
        return one_line(exc)
    return None


def version() -> str:
    """The installed package's version (``critique --version``)."""
    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="critique",
        description="Critique and repair LLM worker outputs before the manager sees them.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"workers.commands.{module_name}")
        p = sub.add_parser(
            name,
            help=module.HELP,
            description=module.HELP,
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    _prepare_environment()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_USAGE
    if args.command not in OFFLINE_COMMANDS:
        problem = url_problem()
        if problem:
            print(f"critique {args.command}: {problem}", file=sys.stderr)
            return EXIT_USAGE
        for warning in new_lookalike_warnings():  # REDIS_ULR: a typo would go unnoticed
            print(f"critique {args.command}: warning: {warning}", file=sys.stderr)
    bad_number = number_problem(args)  # "--X must be ≥ N" from the shared numeric types
    if bad_number:
        print(f"critique {args.command}: {bad_number}", file=sys.stderr)
        return EXIT_USAGE
    try:
        code = int(args._run(args))
        sys.stdout.flush()  # a reader gone after the last write shows here, not at exit
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`critique status RUN --json | head`): stop quietly, as a
        # SIGPIPE-killed tool would, with no traceback and no message. What is still buffered
        # goes to /dev/null so flushing it at exit cannot fail again (CPython's advice).
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
