"""``critique ab INPUTS.jsonl --out DIR [--reps 3] [--json]``: the A/B experiment: does
the critique loop reduce the defects of a worker model's outputs, and at what token cost?

Every input × mode × repetition is one row. Mode **A**: the worker model (``--model``, else
``model`` from the configuration) answers the task through the product's completer (litellm
with the ``llm.*`` transport settings: ``CRITIQUE_LLM__API_BASE``, ``CRITIQUE_LLM_API_KEY``) and
that is the output. Mode **B**: the same generation, then the real pipeline through
:class:`workers.client.CritiqueClient` — python inputs with ``critic: command`` (their tests run
in the worker's sandbox; repairs by the worker model), json and markdown inputs with the
workers' configured critic (default ``auto``: the LLM critic on the worker model). Each row is
its own run (``run_id``), so repetitions are independent. Defects are counted by
:class:`pipeline.loop.ab.DefectCounter`, never by the critic. Rows run ``--parallel`` at a time.

Where the pipeline runs: with ``REDIS_URL`` unset, an embedded Redis and an in-process worker
(as ``critique demo``); when no ``command`` is configured, that worker runs the tests with
``python -m pytest -q``. With ``REDIS_URL`` set, the running workers (they need
``CRITIQUE_COMMAND`` for python inputs). ``CRITIQUE_STORE_URL`` without ``REDIS_URL``: exit 2.

Writes ``DIR/ab.csv`` (``run_id,mode,input_id,defects,latency_s,tokens_in,tokens_out,loops``)
and ``DIR/escalations/<run_id>.md`` for each B row the pipeline escalated or failed. Prints a
table per input and the verdict line, or with ``--json`` exactly ``{mean_a, mean_b, reduction,
verdict, tokens_per_defect_fixed, rows}``; progress goes to stderr.

Exit codes: 0 the experiment ran (the verdict, pass or fail, is in the output); 2 bad usage, a
bad input line (named ``file:line``), a configuration error, a model the provider refuses or a
submission the workers refuse; 3 Redis, the workers or the model provider could not be reached.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.llm.completion import Completer
    from pipeline.loop.ab import ABInput, ABRow, DefectCount, DefectCounter
    from pipeline.models import CritiqueResult
    from workers.client import CritiqueClient

from pipeline.config import load_config
from pipeline.errors import CritiqueError, LLMPermanentError, LLMTransientError
from pipeline.models import Submission
from workers.commands._common import (
    CommandError,
    above,
    add_json_argument,
    at_least,
    service_guard,
    unreachable_redis,
)
from workers.commands._input import InputError, label_of, read_text
from workers.commands._pipeline import sigterm_as_exit, start_pipeline
from workers.exit_codes import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE

HELP = "A/B experiment: defects without (A) and with (B) the critique loop, over INPUTS.jsonl"

INPUT_LIMIT = 64 * 1024 * 1024
"""Largest workload file read."""
DEFAULT_TEST_COMMAND = ("-m", "pytest", "-q", "-p", "no:cacheprovider")
"""The embedded worker's command when none is configured (after this Python)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", metavar="INPUTS.jsonl", help="the workload, one JSON per line")
    parser.add_argument("--out", required=True, metavar="DIR", help="where ab.csv goes")
    parser.add_argument("--reps", type=at_least(1), default=3, metavar="N", help="repetitions (3)")
    add_json_argument(parser, "print the summary and rows as JSON")
    parser.add_argument(
        "--model", metavar="NAME", help="the worker model, a litellm name (default: model)"
    )
    parser.add_argument(
        "--parallel", type=at_least(1), default=4, metavar="N", help="rows run at a time (4)"
    )
    parser.add_argument(
        "--timeout",
        type=above(0),
        default=600.0,
        metavar="S",
        help="give up on a mode-B submission after S seconds (600)",
    )
    parser.add_argument(
        "--workers",
        type=at_least(1),
        default=4,
        metavar="N",
        help="threads of the in-process worker (embedded mode; 4)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


@dataclass(frozen=True)
class Job:
    """One row to produce."""

    item: ABInput
    mode: str
    rep: int
    run_id: str


@dataclass
class Done:
    """A produced row, with what the escalation file needs."""

    job: Job
    row: ABRow
    count: DefectCount
    result: CritiqueResult | None


def run(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    def body() -> int:
        with sigterm_as_exit(), contextlib.ExitStack() as stack:
            return _ab(args, stack, say)

    return service_guard("ab", body)


def _read_inputs(path: str) -> list[ABInput]:
    # lazy: pipeline.loop.ab is not loaded by `critique --help`, which imports this module and stays
    # fast
    from pipeline.loop.ab import ABInputError, parse_inputs

    try:
        return parse_inputs(read_text(path, INPUT_LIMIT, "the workload size limit"), label_of(path))
    except (InputError, ABInputError) as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None


def _ab(args: argparse.Namespace, stack: contextlib.ExitStack, say: Callable[[str], None]) -> int:
    inputs = _read_inputs(args.inputs)
    # lazy: pipeline.loop.ab is not loaded by `critique --help`, which imports this module and stays
    # fast
    from pipeline.loop.ab import DefectCounter

    try:
        config = load_config()
    except CritiqueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    model = args.model or config.model
    if not model:
        raise CommandError(
            "the worker model is not set: pass --model NAME (a litellm model name, e.g. "
            "openai/gpt-4o-mini) or set model in the configuration",
            EXIT_USAGE,
        )
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommandError(
            f"cannot create --out {out}: {exc.strerror or exc}", EXIT_USAGE
        ) from None
    python_inputs = any(i.kind == "python" for i in inputs)
    counter = DefectCounter(timeout_s=config.command_timeout_s)
    if python_inputs and counter.ruff is None:
        raise CommandError(
            "python inputs are counted with ruff, which is not installed here "
            "(pip install 'critique-pipeline[dev]' or pip install ruff)",
            EXIT_USAGE,
        )
    _start_pipeline(args, stack, say, configured_command=bool(config.command), python=python_inputs)

    # lazy: pipeline.llm.completion is not loaded by `critique --help`, which imports this module
    # and stays fast
    from pipeline.llm.completion import LiteLLMCompleter

    completer = LiteLLMCompleter(config.llm, key_models=(model,))  # the researcher's model
    completer.warm()  # litellm loads here, not inside the first row's latency
    prefix = f"ab-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    jobs = [
        Job(item, mode, rep, f"{prefix}-{item.input_id}-{mode.lower()}{rep}")
        for item in inputs
        for mode in ("A", "B")
        for rep in range(1, args.reps + 1)
    ]
    say(
        f"{len(inputs)} input(s) × 2 modes × {args.reps} rep(s) = {len(jobs)} rows; worker model "
        f"{model}; {args.parallel} at a time"
    )
    done = _run_jobs(jobs, args, model, completer, counter, say)
    return _report(done, args, model, out, say)


def _start_pipeline(
    args: argparse.Namespace,
    stack: contextlib.ExitStack,
    say: Callable[[str], None],
    *,
    configured_command: bool,
    python: bool,
) -> None:
    """The embedded Redis and an in-process worker when ``REDIS_URL`` is unset, else a check
    that the running workers answer (both as ``critique demo``; ``CRITIQUE_STORE_URL`` without
    ``REDIS_URL``: exit 2)."""

    def embedded_command() -> None:
        if python and not configured_command:
            command = shlex.join([sys.executable, *DEFAULT_TEST_COMMAND])
            os.environ["CRITIQUE_COMMAND"] = command
            stack.callback(os.environ.pop, "CRITIQUE_COMMAND", None)
            say(f"no command configured: the in-process worker runs the tests with `{command}`")

    embedded, _url = start_pipeline(
        stack, say, concurrency=args.workers, before_worker=embedded_command
    )
    if not embedded and python:
        say("python inputs use critic: command: the workers need CRITIQUE_COMMAND")


def _clients() -> dict[str, CritiqueClient]:
    """One client per kind: python inputs are critiqued by their tests (``critic: command``),
    the others by the workers' configured critic."""
    # lazy: workers.client loads celery; `critique --help` imports this module
    from workers.client import CritiqueClient

    return {
        "python": CritiqueClient({"enabled": True, "critic": "command"}),
        "json": CritiqueClient({"enabled": True}),
        "markdown": CritiqueClient({"enabled": True}),
    }


def _one(
    job: Job,
    model: str,
    completer: Completer,
    counter: DefectCounter,
    clients: dict[str, CritiqueClient],
    timeout: float,
) -> Done:
    """Generate (both modes), critique (B), count: one row."""
    # lazy: pipeline.loop.ab is not loaded by `critique --help`, which imports this module and stays
    # fast
    from pipeline.loop.ab import ABRow, generation_request, output_from_reply

    item = job.item
    began = time.monotonic()
    reply = completer(generation_request(item, model, 4096))
    output = output_from_reply(item, reply.text)
    usage = reply.usage
    result = None
    if job.mode == "B":
        client = clients[item.kind]
        sub = Submission(
            run_id=job.run_id,
            worker_id=item.input_id,
            subtask_signature=item.input_id,
            task=item.task,
            output=output,
            claimed_format=item.kind,
            files=item.file_refs(),
            required_fields=item.required_fields,
            model=model,
        )
        result = client.wait(client.submit(sub), timeout=timeout)
        output = result.output
        usage = usage + result.usage
    latency = time.monotonic() - began
    count = counter.count(item, output)
    row = ABRow(
        run_id=job.run_id,
        mode="A" if job.mode == "A" else "B",
        input_id=item.input_id,
        defects=count.total,
        latency_s=round(latency, 3),
        tokens_in=usage.tokens_in,
        tokens_out=usage.tokens_out,
        loops=len(result.attempts) if result is not None else 0,
    )
    return Done(job, row, count, result)


def _failure(exc: BaseException) -> CommandError:
    """A row's exception as the run's exit (module docstring's exit codes)."""
    # lazy: workers.client loads celery; `critique --help` imports this module
    from workers.client import CritiqueTimeout

    # lazy: workers.unreachable is not loaded by `critique --help`, which imports this module and
    # stays fast
    from workers.unreachable import is_unreachable

    if isinstance(exc, LLMPermanentError):
        return CommandError(f"the worker model's provider refused the call: {exc}", EXIT_USAGE)
    if isinstance(exc, LLMTransientError):
        return CommandError(f"the worker model could not be reached: {exc}", EXIT_UNAVAILABLE)
    if isinstance(exc, CritiqueTimeout):
        return CommandError(str(exc), EXIT_UNAVAILABLE)
    if is_unreachable(exc):
        # lazy: workers.runtime loads celery; `critique --help` imports this module
        from workers import runtime

        return unreachable_redis(runtime.store_url(), exc)
    if isinstance(exc, CritiqueError):
        return CommandError(str(exc), EXIT_USAGE)
    raise exc


def _run_jobs(
    jobs: list[Job],
    args: argparse.Namespace,
    model: str,
    completer: Completer,
    counter: DefectCounter,
    say: Callable[[str], None],
) -> list[Done]:
    try:
        clients = _clients()
    except CritiqueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    lock = threading.Lock()
    finished: list[Done] = []

    def task(job: Job) -> Done:
        done = _one(job, model, completer, counter, clients, args.timeout)
        with lock:
            finished.append(done)
            n = len(finished)
        r = done.row
        status = f", {done.result.status}" if done.result is not None else ""
        say(
            f"[{n}/{len(jobs)}] {r.input_id} {r.mode} rep {job.rep}: {r.defects} defect(s), "
            f"{r.loops} loop(s){status}, {r.latency_s:.2f} s"
        )
        return done

    pool = ThreadPoolExecutor(max_workers=args.parallel, thread_name_prefix="critique-ab")
    futures: list[Future[Done]] = [pool.submit(task, job) for job in jobs]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            error = f.exception() if f.done() else None
            if error is not None:
                raise _failure(error) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    order = {job.run_id: i for i, job in enumerate(jobs)}
    return sorted((f.result() for f in futures), key=lambda d: order[d.job.run_id])


def _escalations(done: list[Done], args: argparse.Namespace, model: str, out: Path) -> list[Path]:
    # lazy: pipeline.loop.ab is not loaded by `critique --help`, which imports this module and stays
    # fast
    from pipeline.loop.ab import escalation_markdown

    written = []
    folder = out / "escalations"
    retry = shlex.join(["critique", "ab", args.inputs, "--out", args.out, "--model", model])
    for d in done:
        if d.result is None or d.result.status not in ("escalated", "failed"):
            continue
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{d.row.run_id}.md"
        path.write_text(
            escalation_markdown(d.row, d.result, d.count, retry_command=retry), encoding="utf-8"
        )
        written.append(path)
    return written


def _table(done: list[Done]) -> str:
    kinds: dict[str, str] = {}
    per: dict[str, dict[str, list[ABRow]]] = {}
    for d in done:
        kinds[d.row.input_id] = d.job.item.kind
        per.setdefault(d.row.input_id, {"A": [], "B": []})[d.row.mode].append(d.row)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    header = ["input", "kind", "A defects", "B defects", "B loops", "B tokens", "B latency s"]
    body = []
    for input_id, modes in per.items():
        a, b = modes["A"], modes["B"]
        body.append(
            [
                input_id,
                kinds[input_id],
                f"{mean([r.defects for r in a]):.2f}",
                f"{mean([r.defects for r in b]):.2f}",
                f"{mean([r.loops for r in b]):.2f}",
                f"{mean([r.tokens_in + r.tokens_out for r in b]):,.0f}",
                f"{mean([r.latency_s for r in b]):.2f}",
            ]
        )
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    right = {2, 3, 4, 5, 6}

    def fmt(line: list[str]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, body)])


def _report(
    done: list[Done], args: argparse.Namespace, model: str, out: Path, say: Callable[[str], None]
) -> int:
    # lazy: pipeline.loop.ab is not loaded by `critique --help`, which imports this module and stays
    # fast
    from pipeline.loop.ab import summarize, verdict_line, write_csv

    rows = [d.row for d in done]
    csv_path = out / "ab.csv"
    try:
        write_csv(rows, csv_path)
        escalations = _escalations(done, args, model, out)
    except OSError as exc:
        raise CommandError(f"cannot write under {out}: {exc.strerror or exc}", EXIT_USAGE) from None
    summary = summarize(rows)
    say(f"wrote {csv_path} ({len(rows)} rows) and {len(escalations)} escalation file(s)")
    if args.json:
        doc: dict[str, Any] = {
            **summary.model_dump(mode="json"),
            "rows": [r.model_dump(mode="json") for r in rows],
        }
        print(json.dumps(doc, ensure_ascii=False, indent=2))
        return EXIT_OK
    print(_table(done))
    print()
    print(verdict_line(summary))
    print(f"rows: {csv_path}; escalations: {len(escalations)}")
    return EXIT_OK
