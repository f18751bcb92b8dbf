"""``critique awp ARGS…``: AWP's own command line (``awp ARGS…``), its delegation loops
critiquing through the fleet.

The same workflow directory, the same ``awp`` arguments (``critique awp run WORKFLOW_DIR``):
the only change is that ``orchestration.delegation_loop.critique`` is served by the critique
workers at ``REDIS_URL`` (:class:`workers.adapters.awp.FleetCritiqueEngine`) instead of AWP's
in-process engine. A workflow whose critique block is not ``enabled: true`` builds no engine,
so nothing is critiqued, as with ``awp`` itself. docs/awp.md walks through it.

Exit codes: AWP's own for the run (0 when it finished); 2 when ``awp-agents`` is not installed
(``pip install 'critique-pipeline[awp]'``) or the fleet would refuse this process (no, or
another, ``CRITIQUE_SECRET``); 3 when Redis cannot be reached.
"""

from __future__ import annotations

import argparse
import sys

from workers.commands._common import service_guard
from workers.exit_codes import EXIT_USAGE

HELP = "run AWP's command line (`critique awp run WORKFLOW_DIR`) with critique on the fleet"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "awp_args",
        nargs=argparse.REMAINDER,
        metavar="AWP_ARGS",
        help="what `awp` takes, e.g. `run WORKFLOW_DIR --model gpt-4o-mini` (see `awp --help`)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        # lazy: the awp extra may not be installed; ImportError says which to install
        from awp.cli import main as awp_main

        from workers.adapters.awp import install
    except ImportError as exc:
        print(
            f"critique awp: awp-agents is not installed ({exc}); install it with "
            "pip install 'critique-pipeline[awp]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not args.awp_args:
        print(
            "critique awp: give awp's arguments, e.g. critique awp run WORKFLOW_DIR",
            file=sys.stderr,
        )
        return EXIT_USAGE

    def body() -> int:
        # lazy: workers.client loads celery; `critique --help` imports this module
        from workers.client import CritiqueClient

        CritiqueClient().check_fleet()  # no or another CRITIQUE_SECRET: exit 2 before AWP starts
        install()
        return int(awp_main(list(args.awp_args)) or 0)

    return service_guard("awp", body)
