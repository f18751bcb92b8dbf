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

Prints one handle per submission (run_id, iteration, worker_id, task_id). With ``--wait`` it
waits for the results and prints them; exit 0 when every one is accepted, accepted with
warnings or repaired, 1 when any failed or escalated (or ``--timeout`` passed). Exit 2 on bad
input or configuration, 3 when Redis cannot be reached.

Bad input is one line on stderr and exit 2, never a traceback: each input is read up to
``max_output_bytes`` (an endless or larger one — ``/dev/zero``, a pipe that never ends — is
refused there), and a directory, a missing file, bytes that are not UTF-8, JSON nested past
the parser's limit, invalid JSON (line and column), a lone surrogate (``"\\ud800"``) or an
identifier with a newline, and a ``--set`` value the configuration refuses are all named.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from workers.commands._input import (
    CONFIG_LIMIT,
    InputError,
    check_config_file,
    label_of,
    loads,
    one_line,
    read_text,
)

HELP = "enqueue JSON submissions for critique (files or - for stdin); --wait for results"

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
OK_STATUSES = ("accepted", "accepted_with_warnings", "repaired")
DEFAULT_LIMIT = 16 * 1024 * 1024
"""Input cap when none is given (``CritiqueConfig.max_output_bytes``'s default)."""

__all__ = ["InputError", "build_overrides", "parse_documents", "read_submissions", "run"]


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
    parser.add_argument("--wait", action="store_true", help="wait for the results")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="with --wait: give up after S seconds (default 300)",
    )
    parser.add_argument("--json", action="store_true", help="print handles and results as JSON")


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

    from pipeline.models import Submission

    if not isinstance(value, dict):
        raise InputError(
            f"{where}: expected a JSON object (a submission), got {type(value).__name__}"
        )
    try:
        return Submission.model_validate(value)
    except ValidationError as exc:
        problems = []
        errors = exc.errors(include_input=False, include_url=False)
        for e in errors[:3]:
            field = ".".join(str(p) for p in e["loc"]) or "submission"
            problems.append(f"field {field!r}: {one_line(e['msg'])[:300]}")
        more = len(errors) - len(problems)
        extra = f" (and {more} more)" if more > 0 else ""
        raise InputError(f"{where}: {'; '.join(problems)}{extra}") from None


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
    from pipeline.config import read_workflow
    from pipeline.models import check_json_value

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
def _result_line(result: Any) -> str:
    repairs = len(result.attempts)
    return (
        f"{result.run_id}  {result.iteration}  {result.worker_id}  "
        f"{result.original_score:.2f} → {result.best_score:.2f}  {result.status} "
        f"({result.stop_reason}, {repairs} repair{'s' if repairs != 1 else ''})"
    )


def run(args: argparse.Namespace) -> int:
    from pipeline.errors import CritiqueError, StoreUnavailableError

    if not args.timeout > 0:
        _say("--timeout must be > 0")
        return EXIT_USAGE
    try:
        overrides = build_overrides(args.config, args.settings)
        from workers import runtime
        from workers.client import CritiqueClient

        client = CritiqueClient(overrides)
        limit = runtime.config_for(overrides).max_output_bytes
        subs = read_submissions(args.paths, limit)
    except (InputError, CritiqueError) as exc:
        _say(exc)
        return EXIT_USAGE

    unavailable: tuple[type[BaseException], ...] = (
        StoreUnavailableError,
        OSError,
        *_redis_errors(),
    )
    try:
        runtime.client().ping()
        handles = client.submit_many(subs)
    except unavailable as exc:
        print(
            f"critique submit: cannot reach Redis at {runtime.redis_url()}: {exc}\n"
            "start Redis there or set REDIS_URL",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    except CritiqueError as exc:  # e.g. an output over max_output_bytes: nothing was enqueued
        _say(exc)
        return EXIT_USAGE
    submitted = [
        {
            "run_id": h.run_id,
            "iteration": h.iteration,
            "worker_id": h.worker_id,
            "task_id": h.task_id,
        }
        for h in handles
    ]
    if not args.json:
        for h in handles:
            print(f"submitted {h.run_id}  {h.iteration}  {h.worker_id}  task {h.task_id}")
    if not args.wait:
        if args.json:
            print(json.dumps({"submitted": submitted}, ensure_ascii=False, indent=2))
        return EXIT_OK
    return _wait(client, handles, submitted, args)


def _wait(client: Any, handles: list[Any], submitted: list[dict[str, Any]], args: Any) -> int:
    from pipeline.errors import StoreUnavailableError, SubmissionError
    from workers.client import CritiqueTimeout

    unavailable: tuple[type[BaseException], ...] = (StoreUnavailableError, *_redis_errors())
    try:
        results = client.wait_many(handles, timeout=args.timeout)
    except CritiqueTimeout:
        pending = [h.worker_id for h in handles if client.result(h) is None]
        print(
            f"critique submit: timed out after {args.timeout:g} s; still pending: "
            f"{', '.join(pending)} (is a worker consuming critique.cpu and critique.llm? "
            "start one with `critique worker`)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except SubmissionError as exc:
        print(f"critique submit: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except unavailable as exc:
        print(f"critique submit: lost Redis while waiting: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.json:
        doc = {
            "submitted": submitted,
            "results": [r.model_dump(mode="json") for r in results],
        }
        print(json.dumps(doc, ensure_ascii=False, indent=2))
    else:
        for r in results:
            print(_result_line(r))
    return EXIT_OK if all(r.status in OK_STATUSES for r in results) else EXIT_FAILED


def _say(message: object) -> None:
    """One line on stderr, prefixed with the command."""
    print(f"critique submit: {one_line(message)}", file=sys.stderr)


def _redis_errors() -> tuple[type[Exception], ...]:
    import redis

    return (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
