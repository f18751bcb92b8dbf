"""``critique resume RUN [--worker W] [--iteration N] [--failed] [--json]``: re-drive pending
submissions.

Every pending submission of the run (or the named ones) is resumed from its last recorded step
(:meth:`workers.client.CritiqueClient.resume`): for a chain whose message the broker lost,
e.g. popped by a worker that was killed before it registered the message. Resuming a chain
that is only slow is harmless (stages replay their recorded output; effects are idempotent).
The client's ``wait`` (and ``critique submit --wait``) does this by itself after
``CRITIQUE_STALL_S``; this is the operator's way to do it now.

A submission whose chain a worker recorded as failed (an error, or a message it refused) is not
pending: it is listed with its reason and left alone, since re-driving it would most often fail
the same way; ``--failed`` re-drives it too (after the cause was fixed, e.g. a worker's key).

Exit codes: 0 resumed (or nothing pending), 2 bad usage, an unknown run or worker, 3 Redis
unreachable.
"""

from __future__ import annotations

import argparse
import json

from pipeline.models import PassRef
from workers.commands._common import (
    CommandError,
    add_iteration_argument,
    add_json_argument,
    add_run_argument,
    add_worker_argument,
    service_guard,
)
from workers.commands._runs import load_snapshot, split_key
from workers.exit_codes import EXIT_OK

HELP = "resume a run's pending submissions from their last recorded step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    add_worker_argument(parser)
    add_iteration_argument(parser)
    parser.add_argument(
        "--failed",
        action="store_true",
        help="also re-drive submissions whose chain failed (by default listed and left alone)",
    )
    add_json_argument(parser, "print what was resumed as JSON")


def run(args: argparse.Namespace) -> int:
    def body() -> int:
        # lazy: workers.runtime loads celery; `critique --help` imports this module
        from workers import runtime

        # lazy: workers.client loads celery; `critique --help` imports this module
        from workers.client import CritiqueClient, Handle

        # lazy: workers.recovery.redriving loads celery; `critique --help` imports this module
        from workers.recovery.redriving import FINISHED

        snap = load_snapshot(args.run_id, args.iteration)
        pending = [*snap.pending, *(snap.failed if args.failed else [])]
        skipped = [] if args.failed else snap.failed
        retried = set(snap.failed) if args.failed else set()
        if args.worker:
            unknown = sorted(set(args.worker) - {split_key(k)[1] for k in snap.submitted})
            if unknown:
                raise CommandError(f"run {args.run_id!r} has no submission from {unknown}")
            pending = [k for k in pending if split_key(k)[1] in args.worker]
            skipped = [k for k in skipped if split_key(k)[1] in args.worker]
        failed = [
            {"iteration": it, "worker_id": w, "reason": snap.errors[k]}
            for k in skipped
            for it, w in [split_key(k)]
        ]
        client = CritiqueClient()
        client.check_fleet()  # before a failure is cleared: a refused re-drive changes nothing
        runs = runtime.stores().runs
        resumed = []
        for key in pending:
            iteration, worker = split_key(key)
            task_id = str(snap.submitted[key].get("task_id", ""))
            if key in retried:  # asked for (--failed): pending again, until its new outcome
                pass_id = str(snap.submitted[key].get("sid") or "")
                runs.clear_failure(args.run_id, PassRef.member_of(key, pass_id))
            stage = client.resume(Handle(args.run_id, iteration, worker, task_id))
            resumed.append({"iteration": iteration, "worker_id": worker, "stage": stage})
        if args.json:
            print(json.dumps({"run_id": args.run_id, "resumed": resumed, "failed": failed}))
            return EXIT_OK
        for f in failed:
            print(
                f"not resumed {args.run_id}  {f['iteration']}  {f['worker_id']}  (its chain "
                f"failed: {f['reason']}; fix the cause and submit it again, or --failed)"
            )
        if not resumed:
            print(f"resume: nothing pending in run {args.run_id}")
        else:
            for r in resumed:
                where = f"{args.run_id}  {r['iteration']}  {r['worker_id']}"
                if r["stage"] == FINISHED:
                    print(f"finished {where}  (its result landed meanwhile: nothing to resume)")
                else:
                    print(f"resumed {where}  at {r['stage']}")
        return EXIT_OK

    return service_guard("resume", body)
