"""``critique demo``: a sample critique run end to end, on a bare machine.

With no ``REDIS_URL`` in the environment the demo starts a private Redis server
(:class:`workers.embedded.EmbeddedRedis`) and a real Celery worker inside this process
(:class:`workers.embedded.InProcessWorker`: a ``WorkController`` on the threads pool, in a
background thread, consuming ``critique.cpu`` and ``critique.llm`` from that Redis — not eager
mode). With ``REDIS_URL`` set it uses that server and the ``critique worker`` processes already
consuming it; ``CRITIQUE_STORE_URL`` without ``REDIS_URL`` is refused (exit 2).
:mod:`workers.commands._pipeline` starts either. The embedded run signs its stage messages as a
deployment does: with ``CRITIQUE_SECRET``, or a random one for this process.

It submits the sample run of :mod:`workers.commands._samples` (two dozen worker outputs over three
iterations, heuristic and rubric critics, deterministic revisers: no API key), one iteration
after the other so the Known Pitfalls of earlier iterations reach later repairs, prints one
progress line per finished submission, then a table per worker, the run's Known Pitfalls, the
repair budget and where the artifacts were written (``critique report``'s tree: ``CRITIQUE.md``
and ``critique.json`` per iteration, ``report.html``, ``lessons.md``).

Exit codes (the table of ``critique --help``): 0 the run completed (every output has a
verdict: escalated and failed ones are the product working), 1 it did not complete (a chain
failed in a worker, or ``--timeout`` passed), 2 bad usage or an invalid configuration
(``CRITIQUE_CONFIG``, a ``CRITIQUE_*`` variable: checked before anything starts), 3 Redis or a
worker could not be started or reached. The embedded Redis and the
in-process worker are stopped on every exit, including Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pipeline import settings
from pipeline.config import load_config
from pipeline.errors import ConfigError, CritiqueError, PathEscapeError, SubmissionError
from pipeline.models import score_text
from workers.commands._common import (
    CommandError,
    above,
    add_json_argument,
    at_least,
    service_guard,
    unreachable_redis,
)
from workers.commands._pipeline import sigterm_as_exit, start_pipeline
from workers.commands.report import write_report
from workers.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from pipeline.models import CritiqueResult
    from workers.client import CritiqueClient, Handle
    from workers.commands._samples import Sample

HELP = "run a sample critique run end to end (embedded Redis and worker when REDIS_URL is unset)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_argument(parser, "print only the results as JSON on stdout (progress goes to stderr)")
    parser.add_argument(
        "--workers",
        type=at_least(1),
        default=4,
        metavar="N",
        help="threads of the in-process worker (embedded mode; default 4)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="artifact root (default: $CRITIQUE_WORKSPACE or ./workspace)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--timeout",
        type=above(0),
        default=120.0,
        metavar="S",
        help="give up when an iteration takes longer than this (default 120 s)",
    )


# -- output -------------------------------------------------------------------------------------
def _row(sample: Sample, result: CritiqueResult) -> dict[str, Any]:
    return {
        "iteration": result.iteration,
        "worker_id": result.worker_id,
        "kind": sample.kind,
        "critic": sample.critic,
        "status": result.status,
        "stop_reason": result.stop_reason,
        "original_score": result.original_score,
        "best_score": result.best_score,
        "repairs": len(result.attempts),
    }


def _table(rows: Sequence[dict[str, Any]]) -> str:
    header = ["it", "worker", "sample", "score", "status", "stop reason", "repairs"]
    body = [
        [
            str(r["iteration"]),
            r["worker_id"],
            r["kind"],
            score_text(r["original_score"], r["best_score"]),
            r["status"],
            r["stop_reason"],
            str(r["repairs"]),
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [fmt(header), rule]
    previous = None
    for r, line in zip(rows, body, strict=True):
        if previous is not None and r["iteration"] != previous:
            out.append("")
        previous = r["iteration"]
        out.append(fmt(line))
    return "\n".join(out)


# -- the run ------------------------------------------------------------------------------------
def _wait_iteration(
    client: CritiqueClient,
    handles: Sequence[tuple[Sample, Handle]],
    timeout: float,
    progress: Callable[[str], None],
    done_before: int,
    total: int,
) -> list[tuple[Sample, CritiqueResult]]:
    """Results of one iteration, reporting each as it finishes; a failure a worker recorded
    for a submission's pass ends the demo (Celery's task state is not read: it is no evidence)."""
    finished: dict[str, CritiqueResult] = {}
    deadline = time.monotonic() + timeout
    next_state_check = time.monotonic() + 0.5
    while len(finished) < len(handles):
        for _sample, handle in handles:
            if handle.worker_id in finished:
                continue
            result = client.result(handle)
            if result is None:
                continue
            finished[handle.worker_id] = result
            repairs = len(result.attempts)
            progress(
                f"[{done_before + len(finished):>2}/{total}] iteration {result.iteration}  "
                f"{result.worker_id:<20} {result.score_text()}  {result.status} "
                f"({result.stop_reason}, "
                f"{repairs} repair{'s' if repairs != 1 else ''})"
            )
        if len(finished) == len(handles):
            break
        now = time.monotonic()
        if now >= next_state_check:
            next_state_check = now + 0.5
            for _sample, handle in handles:
                if handle.worker_id in finished:
                    continue
                got = client.outcome(handle)
                if isinstance(got, SubmissionError):
                    raise CommandError(f"{got.message} (task {handle.task_id})", EXIT_FAILED)
        if now >= deadline:
            pending = [h.worker_id for _s, h in handles if h.worker_id not in finished]
            raise CommandError(
                f"timed out after {timeout:g} s waiting for {', '.join(pending)} "
                "(is a worker consuming critique.cpu and critique.llm?)",
                EXIT_FAILED,
            )
        time.sleep(0.02)
    return [(sample, finished[handle.worker_id]) for sample, handle in handles]


def _run_samples(
    run_id: str, samples: Sequence[Sample], args: argparse.Namespace, say: Callable[[str], None]
) -> list[tuple[Sample, CritiqueResult]]:
    # lazy: workers.client loads celery; `critique --help` imports this module
    from workers.client import CritiqueClient

    # lazy: workers.commands._samples is not loaded by `critique --help`, which imports this
    # module and stays fast
    from workers.commands._samples import iterations, overrides_for

    clients = {
        critic: CritiqueClient(overrides_for(critic)) for critic in {s.critic for s in samples}
    }
    done: list[tuple[Sample, CritiqueResult]] = []
    for iteration in iterations(tuple(samples)):
        batch = [s for s in samples if s.iteration == iteration]
        handles = [(s, clients[s.critic].submit(s.submission(run_id))) for s in batch]
        say(f"iteration {iteration}: submitted {len(batch)} worker outputs")
        any_client = next(iter(clients.values()))
        done += _wait_iteration(any_client, handles, args.timeout, say, len(done), len(samples))
    return done


def run(args: argparse.Namespace) -> int:
    stream: IO[str] = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        if not args.quiet:
            print(line, file=stream, flush=True)

    def body() -> int:
        with sigterm_as_exit(), contextlib.ExitStack() as stack:
            return _demo(args, stack, say)

    return service_guard("demo", body)  # the embedded Redis and worker are stopped by then


def _check_config() -> None:
    """Refuse an invalid configuration before anything starts (exit 2 naming the key)."""
    try:
        load_config()
    except ConfigError as exc:
        raise CommandError(f"configuration: {exc}", EXIT_USAGE) from None
    except RecursionError:
        raise CommandError("configuration: CRITIQUE_CONFIG nested too deeply", EXIT_USAGE) from None


def _demo(args: argparse.Namespace, stack: contextlib.ExitStack, say: Callable[[str], None]) -> int:
    began = time.monotonic()
    _check_config()
    embedded, url = start_pipeline(stack, say, concurrency=args.workers)
    # lazy: pipeline.loop.pitfalls is not loaded by `critique --help`, which imports this module and
    # stays fast
    from pipeline.loop.pitfalls import render_pitfalls

    # lazy: workers.runtime loads celery; `critique --help` imports this module
    from workers import runtime

    # lazy: workers.commands._samples is not loaded by `critique --help`, which imports this
    # module and stays fast
    from workers.commands._samples import DEMO_TOTAL_TOKENS, demo_samples, iterations, overrides_for

    # lazy: workers.unreachable is not loaded by `critique --help`, which imports this module and
    # stays fast
    from workers.unreachable import unreachable_errors

    samples = demo_samples()
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    say(f"run {run_id}: {len(samples)} worker outputs over {len(iterations(samples))} iterations\n")
    try:
        done = _run_samples(run_id, samples, args, say)
        stores = runtime.stores()
        pitfalls = render_pitfalls(stores.patterns.top(run_id, 10))
        spent = stores.budget.spent(run_id)
    except BrokenPipeError:  # the reader of our output went away (`| head`), not Redis
        raise
    except unreachable_errors() as exc:
        raise unreachable_redis(url, exc) from None
    except (ConfigError, SubmissionError) as exc:  # refused here, before anything ran
        raise CommandError(str(exc), EXIT_USAGE) from None
    except CritiqueError as exc:
        raise CommandError(str(exc), EXIT_FAILED) from None
    cap = runtime.config_for(overrides_for("heuristic")).repair_token_cap or 0
    root = Path(args.out or settings.raw(settings.WORKSPACE) or "workspace")
    try:
        artifacts = write_report(run_id, root)
    except PathEscapeError as exc:  # a symlink under the root: nothing was written
        raise CommandError(str(exc), EXIT_FAILED) from None
    except OSError as exc:
        raise CommandError(f"cannot write the artifacts under {root}: {exc}", EXIT_FAILED) from None
    rows = [_row(s, r) for s, r in done]
    as_designed = sum(
        1 for s, r in done if (r.status, r.stop_reason) == (s.expected_status, s.expected_stop)
    )
    if args.json:
        doc = {
            "run_id": run_id,
            "results": rows,
            "pitfalls": pitfalls,
            "budget": {"total_tokens": DEMO_TOTAL_TOKENS, "repair_cap": cap, "repair_spent": spent},
            "artifacts": [str(p) for p in artifacts],
            "redis": {"embedded": embedded, "url": url},
            "elapsed_s": round(time.monotonic() - began, 2),
        }
        print(json.dumps(doc, ensure_ascii=False, indent=2))
        return EXIT_OK
    print()
    print(_table(rows))
    print()
    print(pitfalls.rstrip() or "## Known Pitfalls\n\n(none recorded)")
    print()
    why = "; deterministic repairs spend no tokens and are not charged" if spent == 0 else ""
    print(
        f"repair budget: {spent:,} of {cap:,} tokens spent "
        f"(repair_budget_fraction of budget.total_tokens {DEMO_TOTAL_TOKENS:,}{why})"
    )
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(
        "outcomes: "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        + f" ({as_designed}/{len(rows)} as designed)"
    )
    run_dir = root / "runs" / run_id
    print(f"artifacts: {run_dir} ({len(artifacts)} files: CRITIQUE.md per iteration, lessons.md)")
    print(f"report:    {run_dir / 'report.html'}")
    print(f"done in {time.monotonic() - began:.1f} s")
    return EXIT_OK
