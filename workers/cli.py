"""The ``critique`` command line: a thin dispatcher over :mod:`workers.commands`.

Exit codes shared by every sub-command: 0 success, 1 the thing checked failed (a contract
violation, a rejected gate, a failed submission), 2 bad usage or unreadable input,
3 a service (Redis, a worker) could not be reached.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence

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
    "resume": "resume",
}

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


def _prepare_environment() -> None:
    """Settings every command needs before any heavy import: never fetch litellm's cost map."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="critique",
        description="Critique and repair LLM worker outputs before the manager sees them.",
        epilog="Exit codes: 0 ok, 1 check failed, 2 bad usage or input, 3 service unavailable.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"workers.commands.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
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
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`critique status RUN --json | head`): stop quietly, as a
        # SIGPIPE-killed tool would, instead of a traceback.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
