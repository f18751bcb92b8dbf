"""``critique submit FILE…|-``: enqueue worker outputs (JSON submissions) for critique.

Each input (a file, or ``-`` for stdin) holds one submission object, a JSON list of them, or
JSON Lines (one object per line); a submission is :class:`pipeline.models.Submission`'s JSON
(``run_id``, ``worker_id``, ``task``, ``output`` required). Every submission is validated
before any is enqueued: one malformed input exits 2 naming the file (and line or index) and
the field, and nothing is enqueued.

Configuration travels with the submissions as overrides of the workers' configuration:
``--config FILE`` (a JSON object of overrides, or a ``workflow.awp.yaml`` whose critique block
is used) and ``--set key=value`` (dotted keys; JSON values, else strings), later ones winning.
``enabled`` defaults to true here: submitting is asking for a critique.

Before anything is enqueued the configuration is validated here, where it enters: this
process's own (``CRITIQUE_CONFIG``, ``CRITIQUE_*`` variables — a typo is named) and the
overrides (an unknown key, a worker-only field). A submission that would call a model whose
provider key is missing is refused too (exit 2 naming the variable, e.g. ``OPENAI_API_KEY``;
litellm's environment check, ``CRITIQUE_LLM_API_KEY`` serves any provider). That check reads
*this* process's environment — the best information a client has, since the workers'
environment cannot be seen from here; when only the workers hold the keys, pass
``--no-key-check`` (a worker whose key is missing refuses the submission itself, and it shows
as failed with that reason).

Prints one handle per submission (run_id, iteration, worker_id, task_id) as soon as all are
enqueued. With ``--wait`` it prints each result the moment it is there (whatever the order),
each failed chain with a one-line reason, and a final tally; on a terminal a live counter runs
on stderr, elsewhere a progress line on stderr 10 s in and then every 10 s while the counts
change. When nothing has answered 2 s in and no worker answers a ping, it says so then
(``no worker has taken these yet — is `critique worker` running against <broker>?``), not at
the timeout. Ctrl-C stops the wait, not the critique: the pending submissions stay queued, and
it says how to follow them (``critique watch RUN``, ``critique status RUN``) or stop them
(``critique cancel RUN``); exit 130. A fallback (a critic or reviser that could not run and
was replaced) is named on the output's line. ``--json`` prints JSON Lines: ``{"type":
"submitted", …handle}`` per submission, then with ``--wait`` ``{"type": "result", "task_id",
…CritiqueResult}`` or ``{"type": "failed", …handle, "error"}`` per submission (``{"type":
"pending", …handle}`` for those still running at ``--timeout`` or Ctrl-C), then ``{"type":
"summary", "submitted", "finished", "failed", "pending", "counts", "elapsed_s"}`` — every
handle and every answer, whatever failed.

Exit codes (the table of ``critique --help``): 0 enqueued (with ``--wait``: every submission
has a verdict — escalated, and the verdict ``failed``, are verdicts); 1 with ``--wait``, a chain
failed (a stage errored or a worker refused it: no verdict) or ``--timeout`` passed; 2 bad
input or configuration (nothing enqueued); 3 Redis or the broker unreachable; 130 Ctrl-C in
``--wait`` (the submissions stay queued).

Bad input is one line on stderr and exit 2, never a traceback: each input is read up to
``max_output_bytes`` (an endless or larger one — ``/dev/zero``, a pipe that never ends — is
refused there), and a directory, a missing file, bytes that are not UTF-8, JSON nested past
the parser's limit, invalid JSON (line and column), a lone surrogate (``"\\ud800"``) or an
identifier with a newline, and a ``--set`` value the configuration refuses are all named.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import read_workflow
from pipeline.errors import CritiqueError, SubmissionError, validation_problems
from pipeline.models import Submission, check_json_value
from pipeline.store.urls import redact_url
from pipeline.text.escaping import escape_controls, one_line
from workers.commands._common import (
    CommandError,
    above,
    add_json_argument,
    check_redis,
    service_guard,
    unreachable_redis,
)
from workers.commands._input import (
    CONFIG_LIMIT,
    InputError,
    check_config_file,
    label_of,
    loads,
    read_text,
    terminal_line,
)
from workers.commands._progress import Progress
from workers.commands._runs import fallbacks, tally, why_lines
from workers.commands._text import json_line, printable
from workers.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNAVAILABLE

HELP = "enqueue JSON submissions for critique (files or - for stdin); --wait for results"

DEFAULT_LIMIT = 16 * 1024 * 1024
"""Input cap when none is given (``CritiqueConfig.max_output_bytes``'s default)."""

__all__ = ["build_overrides", "parse_documents", "read_submissions", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="FILE",
        help="JSON submission(s): an object, a list, or JSON Lines; - reads stdin",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="configuration overrides: a JSON object, or a workflow.awp.yaml",
    )
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one override, e.g. --set critic=rubric --set budget.total_tokens=200000",
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help="wait for the results; Ctrl-C stops the wait, not the critique (the submissions "
        "stay queued: follow them with `critique watch RUN`), exit 130",
    )
    parser.add_argument(
        "--timeout",
        type=above(0),
        default=300.0,
        metavar="S",
        help="with --wait: give up after S seconds (default 300)",
    )
    add_json_argument(parser, "print handles and results as JSON Lines")
    parser.add_argument(
        "--no-key-check",
        action="store_true",
        help="skip the provider-key check against this environment (when only the workers "
        "hold the keys)",
    )


# -- reading ------------------------------------------------------------------------------------
def parse_documents(text: str, label: str) -> list[tuple[str, Any]]:
    """The JSON values in ``text`` with where each came from: an object, a list, or JSON Lines."""
    if not text.strip():
        raise InputError(f"{label}: empty input (expected a JSON submission)")
    try:
        doc = loads(text, label)
    except ValueError as whole:
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if len(lines) < 2 or not _parses(lines[0][1]):
            err = whole if isinstance(whole, json.JSONDecodeError) else None
            where = f" at line {err.lineno} column {err.colno}" if err else ""
            msg = err.msg if err else str(whole)
            raise InputError(f"{label}: not valid JSON: {msg}{where}") from None
        items: list[tuple[str, Any]] = []
        for n, line in lines:
            try:
                items.append((f"{label}:{n}", loads(line, f"{label}:{n}")))
            except json.JSONDecodeError as exc:
                raise InputError(
                    f"{label}:{n}: not valid JSON Lines: {exc.msg} at column {exc.colno}"
                ) from None
        return items
    if isinstance(doc, list):
        if not doc:
            raise InputError(f"{label}: empty list (expected submissions)")
        return [(f"{label}[{i}]", item) for i, item in enumerate(doc)]
    return [(label, doc)]


def _parses(line: str) -> bool:
    try:
        loads(line, "")
    except (ValueError, InputError):
        return False
    return True


def validate(where: str, value: Any) -> Any:
    """The :class:`Submission` for one JSON value; :class:`InputError` names the field."""
    from pydantic import ValidationError

    if not isinstance(value, dict):
        raise InputError(
            f"{where}: expected a JSON object (a submission), got {type(value).__name__}"
        )
    try:
        return Submission.model_validate(value)
    except ValidationError as exc:
        raise InputError(f"{where}: {escape_controls(validation_problems(exc))}") from None


def read_submissions(paths: list[str], limit: int = DEFAULT_LIMIT) -> list[Any]:
    """Every submission of every input, validated; raises :class:`InputError` on the first bad
    one (so nothing is enqueued unless all are good). Each input is read up to ``limit``
    bytes (``max_output_bytes``) and refused past it."""
    subs: list[Any] = []
    seen: dict[tuple[str, int, str], str] = {}
    for path in paths:
        label = label_of(path)
        text = read_text(path, limit)
        for where, value in parse_documents(text, label):
            sub = validate(where, value)
            key = (sub.run_id, sub.iteration, sub.worker_id)
            if key in seen:
                raise InputError(
                    f"{where}: worker_id {sub.worker_id!r} of run {sub.run_id!r} iteration "
                    f"{sub.iteration} is also submitted at {seen[key]}"
                )
            seen[key] = where
            subs.append(sub)
    return subs


# -- configuration ------------------------------------------------------------------------------
def _set(overrides: dict[str, Any], assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    parts = [p.strip() for p in key.split(".")]
    if not sep or not all(parts):
        raise InputError(f"--set {assignment!r}: expected KEY=VALUE, e.g. critic=rubric")
    try:
        value: Any = loads(raw, f"--set {key}")
    except ValueError:
        value = raw
    node = overrides
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def build_overrides(config_path: str | None, settings: list[str]) -> dict[str, Any]:
    """The configuration overrides the submissions carry (``enabled`` defaults to true)."""
    overrides: dict[str, Any] = {"enabled": True}
    if config_path:
        check_config_file(config_path)
        path = Path(config_path)
        if path.suffix.lower() in (".yaml", ".yml"):
            try:
                overrides.update(read_workflow(path))
            except RecursionError:
                raise InputError(f"{path}: YAML nested too deeply to parse") from None
        else:
            try:
                text = read_text(config_path, CONFIG_LIMIT, "the configuration file limit")
                doc = loads(text, str(path))
            except ValueError as exc:
                raise InputError(f"{path}: not valid JSON ({exc})") from None
            if not isinstance(doc, dict):
                raise InputError(f"{path}: expected a JSON object of configuration overrides")
            overrides.update(doc)
    for assignment in settings:
        _set(overrides, assignment)
    try:
        check_json_value(overrides, "the configuration")
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return overrides


# -- output -------------------------------------------------------------------------------------
FALLBACK_LIMIT = 160
"""Longest fallback note shown on a result's line (characters)."""


def _result_line(result: Any) -> str:
    """One result's line, terminal-safe (the stored result's text is not trusted)."""
    repairs = len(result.attempts)
    line = (
        f"{result.run_id}  {result.iteration}  {result.worker_id}  "
        f"{result.score_text()}  {result.status} "
        f"({result.stop_reason}, {repairs} repair{'s' if repairs != 1 else ''})"
    )
    fell = fallbacks(result)
    if fell:
        more = f" (+{len(fell) - 1} more)" if len(fell) > 1 else ""
        line += f"  [FALLBACK {printable(fell[0], FALLBACK_LIMIT)}{more}]"
    return escape_controls(line)


def _result_lines(result: Any) -> str:
    """The result's line and, for an escalated or failed output, why (its deciding defects)
    and what to do next, indented under it (:meth:`CritiqueResult.why`)."""
    return "\n".join([_result_line(result), *why_lines(result)])


def _handle_doc(h: Any) -> dict[str, Any]:
    return {
        "run_id": h.run_id,
        "iteration": h.iteration,
        "worker_id": h.worker_id,
        "task_id": h.task_id,
    }


def _emit(doc: dict[str, Any]) -> None:
    print(json_line(doc), flush=True)


def check_keys_for(subs: list[Any], config: Any) -> None:
    """Raise ``ConfigError`` when a submission would call a model whose provider key is missing
    from this process's environment (litellm is imported only when there is a model)."""
    # lazy: pipeline.llm.providers is not loaded by `critique --help`, which imports this module and
    # stays fast
    from pipeline.llm.providers import check_keys, llm_models

    models = dict.fromkeys(m for sub in subs for m in llm_models(config, sub.model))
    if models:
        check_keys(models, api_base=config.llm.api_base, where="this client's environment")


def broker_url() -> str:
    """The broker's URL as :mod:`celeryconfig` reads it (``CELERY_BROKER_URL``, else
    ``REDIS_URL``)."""
    # lazy: workers.runtime loads celery; `critique --help` imports this module
    from workers import runtime

    return os.environ.get("CELERY_BROKER_URL") or runtime.redis_url()


def run(args: argparse.Namespace) -> int:
    return service_guard("submit", lambda: _submit(args))


def _submit(args: argparse.Namespace) -> int:
    # lazy: workers.unreachable is not loaded by `critique --help`, which imports this module and
    # stays fast
    from workers.unreachable import BrokerUnavailableError, unreachable_errors

    try:
        # lazy: configuration, store and client load only for a submit, not `critique --help`
        from pipeline.config import load_config

        load_config()  # this process's own configuration: CRITIQUE_CONFIG, CRITIQUE_* variables
        # lazy: as above
        from pipeline.store.redis_common import check_redis_urls

        check_redis_urls()  # a sentinel:// URL parses and has CRITIQUE_REDIS_MASTER
        overrides = build_overrides(args.config, args.settings)
        # lazy: as above
        from workers import runtime
        from workers.client import CritiqueClient

        client = CritiqueClient(overrides)  # this process's configuration + the overrides
        config = runtime.config_for(overrides)
        subs = read_submissions(args.paths, config.max_output_bytes)
    except RecursionError:
        raise CommandError("CRITIQUE_CONFIG: nested too deeply to parse") from None
    except (InputError, CritiqueError) as exc:
        raise CommandError(terminal_line(exc)) from None
    if not args.no_key_check:
        try:
            check_keys_for(subs, config)
        except CritiqueError as exc:
            raise CommandError(
                f"{terminal_line(exc)}\ncritique submit: checked against this process's "
                "environment, the best a client can see; if only the workers hold the key, "
                "pass --no-key-check"
            ) from None

    store, broker = runtime.store_url(), broker_url()
    check_redis([(store, "Redis"), *([(broker, "the broker")] if broker != store else [])])
    unavailable: tuple[type[BaseException], ...] = (OSError, *unreachable_errors())
    began = time.time()
    try:
        handles = client.submit_many(subs)
    except unavailable as exc:
        if isinstance(exc, BrokerUnavailableError) and broker != store:
            raise unreachable_redis(broker, exc, "the broker") from None
        raise unreachable_redis(store, exc) from None
    except CritiqueError as exc:  # e.g. an output over max_output_bytes: nothing was enqueued
        raise CommandError(terminal_line(exc)) from None
    try:
        for h in handles:
            if args.json:
                _emit({"type": "submitted", **_handle_doc(h)})
            else:
                print(f"submitted {h.run_id}  {h.iteration}  {h.worker_id}  task {h.task_id}")
        sys.stdout.flush()
    except KeyboardInterrupt:  # a reader that saw the first line and pressed Ctrl-C at once
        if not args.wait:
            raise
        return _wait(client, handles, args, since=began, interrupted=True)
    if not args.wait:
        return EXIT_OK
    return _wait(client, handles, args, since=began)


def refusals_since(run_ids: list[str], since: float) -> tuple[int, str]:
    """How many ``refused`` trace events the runs got since ``since`` (wall clock), and the
    first one's reason: what a worker said of messages it would not run. Their run id is the
    message's claim, unverified, so they only explain a wait (never a verdict). Read without
    checking the events' tags: a client holding another secret than the workers' (the very case
    this explains) cannot verify them."""
    # lazy: pipeline.store.redis loads redis; `critique --help` imports this module
    from pipeline.store.redis import RedisTraceSink

    # lazy: workers.runtime loads celery; `critique --help` imports this module
    from workers import runtime

    count, first = 0, ""
    sink = RedisTraceSink(runtime.client())
    for run_id in dict.fromkeys(run_ids):
        for _, event in sink.iterate(run_id, 1, f"{int(since * 1000)}-0", idle_limit=1):
            if event.get("type") == "refused":
                count += 1
                first = first or str(event.get("reason") or "")
    return count, first


def _wait(
    client: Any, handles: list[Any], args: Any, *, since: float = 0.0, interrupted: bool = False
) -> int:
    """Print every answer as it comes, then the tally; returns the exit code. ``interrupted``:
    Ctrl-C came before the wait began (the tally of what is pending, at once)."""
    # lazy: workers.client loads celery; `critique --help` imports this module
    from workers.client import CritiqueTimeout

    # lazy: workers.unreachable is not loaded by `critique --help`, which imports this module and
    # stays fast
    from workers.unreachable import unreachable_errors

    unavailable = unreachable_errors()
    progress = Progress("submit --wait")
    results: list[Any] = []
    failed: list[tuple[Any, str]] = []
    answered: set[int] = set()
    timed_out = False
    no_worker = _NoWorkerHint(progress)

    def count() -> None:
        progress.update(len(results), len(failed), len(handles) - len(answered))

    def poll() -> None:  # between polls, however quiet the wait: progress and the hint are due
        count()
        no_worker.check(bool(answered))

    count()
    try:
        for h, answer in (
            [] if interrupted else client.as_completed(handles, timeout=args.timeout, on_poll=poll)
        ):
            answered.add(id(h))
            if isinstance(answer, SubmissionError):
                reason = _reason(h, answer)
                failed.append((h, reason))
                if args.json:
                    progress.line(json_line({"type": "failed", **_handle_doc(h), "error": reason}))
                else:
                    progress.line(f"{h.run_id}  {h.iteration}  {h.worker_id}  FAILED  {reason}")
            else:
                results.append(answer)
                if args.json:
                    doc = {"type": "result", "task_id": h.task_id, **answer.model_dump(mode="json")}
                    progress.line(json_line(doc))
                else:
                    progress.line(_result_lines(answer))
            count()
    except CritiqueTimeout:
        timed_out = True
    except KeyboardInterrupt:  # Ctrl-C: what is queued stays queued; say so and how to follow
        interrupted = True
    except BrokenPipeError:  # our reader went away (`| head`), not Redis: the CLI ends quietly
        raise
    except unavailable as exc:
        progress.close()
        raise CommandError(f"lost Redis while waiting: {exc}", EXIT_UNAVAILABLE) from None
    finally:
        progress.close()
    pending = [h for h in handles if id(h) not in answered]
    elapsed = progress.clock() - progress.began
    if args.json:
        for h in pending:
            _emit({"type": "pending", **_handle_doc(h)})
        counts: dict[str, int] = {}
        for r in results:
            counts[r.status] = counts.get(r.status, 0) + 1
        _emit(
            {
                "type": "summary",
                "submitted": len(handles),
                "finished": len(results),
                "failed": len(failed),
                "pending": len(pending),
                "counts": dict(sorted(counts.items())),
                "elapsed_s": round(elapsed, 3),
            }
        )
    else:
        for h in pending:
            print(f"{h.run_id}  {h.iteration}  {h.worker_id}  pending")
        print(
            f"submit: {len(handles)} submission(s): {tally(results, len(failed), len(pending))} "
            f"in {elapsed:.1f} s"
        )
    if interrupted:
        print(interrupted_note(pending), file=sys.stderr)
        return EXIT_INTERRUPTED
    if timed_out:
        print(timed_out_note(pending, args.timeout, since), file=sys.stderr)
    return EXIT_FAILED if failed or pending else EXIT_OK


def timed_out_note(pending: list[Any], timeout: float, since: float) -> str:
    """The line ``--timeout`` ends on: what is still pending, and the likeliest why (messages a
    worker refused since the submit, else no worker consuming the queues)."""
    refused, reason = 0, ""
    with contextlib.suppress(Exception):  # only a better hint: never fail over it
        refused, reason = refusals_since([h.run_id for h in pending], since)
    hint = (
        f"a worker refused {refused} message(s) claiming this run since the submit: "
        f"{printable(reason, 300)}"
        if refused
        else "is a worker consuming critique.cpu and critique.llm? start one with `critique worker`"
    )
    return (
        f"critique submit: timed out after {timeout:g} s; still pending: "
        f"{', '.join(h.worker_id for h in pending)} ({hint})"
    )


NO_WORKER_AFTER_S = 2.0
"""With ``--wait`` and no answer yet this long after the submit, ask whether any worker runs."""


def workers_answering(timeout: float = 1.0) -> bool:
    """Whether any Celery worker answers a ping on the broker within ``timeout`` seconds (the
    first reply ends the wait)."""
    # lazy: workers.app loads celery; `critique --help` imports this module
    from workers.app import app

    return bool(app.control.ping(timeout=timeout, limit=1))


class _NoWorkerHint:
    """Once, :data:`NO_WORKER_AFTER_S` into a wait with no answer yet: when no worker answers a
    ping, say so then (on stderr), not at the timeout."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.done = False

    def check(self, answered: bool) -> None:
        if self.done or self.progress.clock() - self.progress.began < NO_WORKER_AFTER_S:
            return
        self.done = True
        if answered:
            return

        with contextlib.suppress(Exception):  # only a hint: never fail the wait over it
            if not workers_answering():
                self.progress.line(
                    "critique submit: no worker has taken these yet — is `critique worker` "
                    f"running against {redact_url(broker_url())}?",
                    stream=sys.stderr,
                )


def interrupted_note(pending: list[Any]) -> str:
    """What Ctrl-C in ``--wait`` left behind: the pending submissions stay queued and will be
    critiqued, and the commands that follow (or stop) them."""
    if not pending:
        return "critique submit: interrupted (every submission had its answer)"
    runs = list(dict.fromkeys(h.run_id for h in pending))
    run = printable(runs[0], 200) if len(runs) == 1 else "RUN"
    which = "" if len(runs) == 1 else f" (RUN: {printable(', '.join(runs), 300)})"
    return (
        f"critique submit: interrupted; the {len(pending)} pending submission(s) stay queued "
        f"and will be critiqued: follow them with `critique watch {run}` or `critique status "
        f"{run}`{which}; stop them with `critique cancel {run}`"
    )


def _reason(h: Any, error: Any) -> str:
    """The one-line reason of a failed chain, without the client's "submission … of run …"."""
    message = one_line(getattr(error, "message", error))
    prefix = f"submission {h.worker_id} of run {h.run_id} "
    if message.startswith(prefix):
        message = message[len(prefix) :]
    if message.startswith("was refused"):
        message = message[len("was ") :]
    elif message.startswith("failed: "):
        message = message[len("failed: ") :]
    return printable(message, 300)
