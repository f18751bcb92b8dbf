"""``critique cancel RUN [--worker W …] [--iteration N] [--by WHO] [--json]``: stop a run's
unfinished submissions.

Every unfinished pass of the run (or of the named workers and iteration) ends ``cancelled``
(:meth:`workers.client.CritiqueClient.cancel`): its result says so at once (``status``,
``wait`` and ``submit --wait`` read it), a stage in flight stops before its next model call,
its queued messages do nothing when they arrive, its budget leases are refunded, and the trace
says who cancelled it (``--by``, default the OS user). A pass that finished first keeps its
verdict and is counted. Celery's ``revoke`` (and Flower's button) cannot do this: see
docs/operations.md, "Cancelling a run".

Exit codes: 0 cancelled (or nothing was left to cancel), 2 bad usage, an unknown run, worker
or iteration, or a ``CRITIQUE_SECRET`` the workers do not sign with, 3 Redis unreachable.
"""

from __future__ import annotations

import argparse
import json

from workers.commands._common import (
    add_iteration_argument,
    add_json_argument,
    add_run_argument,
    add_worker_argument,
    service_guard,
)
from workers.commands._runs import load_snapshot
from workers.exit_codes import EXIT_OK

HELP = "cancel a run's unfinished submissions: each ends `cancelled`, its leases refunded"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    add_worker_argument(parser)
    add_iteration_argument(parser)
    parser.add_argument(
        "--by", metavar="WHO", help="who cancels, as the trace says (default: the OS user)"
    )
    add_json_argument(parser, "print what was cancelled as JSON")


def run(args: argparse.Namespace) -> int:
    def body() -> int:
        # lazy: workers.cancelling loads celery; `critique --help` imports this module
        from workers.cancelling import who

        # lazy: workers.client loads celery; `critique --help` imports this module
        from workers.client import CritiqueClient

        # An unknown run (or iteration) is named as `status` names it, with a did-you-mean.
        load_snapshot(args.run_id, args.iteration, chain_errors=False)
        report = CritiqueClient().cancel(
            args.run_id,
            workers=args.worker or None,
            iteration=args.iteration,
            by=who(args.by, _os_user()),
        )
        if args.json:
            print(json.dumps(report.as_json()))
        elif not report.cancelled:
            released = (
                f"; {len(report.released)} waiting worker repair(s) released"
                if report.released
                else ""
            )
            print(
                f"cancel: nothing left to cancel in run {args.run_id} "
                f"({len(report.finished)} already finished{released})"
            )
        else:
            print(report)
        return EXIT_OK

    return service_guard("cancel", body)


def _os_user() -> str:
    """The OS user running the command (``cli`` when it cannot be told)."""
    import getpass

    try:
        return getpass.getuser()
    except Exception:  # no USER/LOGNAME and no passwd entry (a bare container)
        return "cli"
