"""``critique loop FILE``: run the critique loop on one file, broker-free, and show every round.

With ``--critic rubric`` (the default) FILE is a paper draft — JSON (``{title, abstract,
originality_tag, sections}``) or Markdown (``# Title``, the abstract, ``## Section`` headings:
:mod:`pipeline.text.paper_markdown`) — and the deterministic rubric critic/reviser pair revises it
until the target, a plateau or the round cap; with ``--critic heuristic`` FILE is a worker
result (a JSON object, or text) checked against ``--required`` fields and repaired by the
deterministic reviser.

Exit codes (the table of ``critique --help``): 0 the loop ran and gave its verdict (accepted,
repaired, escalated or failed: read it from the output or ``--json``); 2 unreadable or invalid
input or configuration.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from pipeline.config import load_config
from pipeline.errors import CritiqueError
from pipeline.models import Submission
from workers.commands._common import CommandError, add_json_argument, service_guard
from workers.commands._input import InputError, check_config_file, loads, read_text, terminal_line
from workers.exit_codes import EXIT_OK

HELP = "run the critique loop on one file (deterministic rubric or heuristic pair)"

_FORMATS = {".json": "json", ".md": "markdown", ".tex": "latex", ".py": "python"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file", metavar="FILE", help="paper draft, JSON or Markdown (rubric), or worker result"
    )
    parser.add_argument(
        "--critic",
        choices=("rubric", "heuristic"),
        default="rubric",
        help="rubric: paper drafts (default); heuristic: worker results with --required",
    )
    parser.add_argument("--target", type=float, help="rubric target score per dimension (8.0)")
    parser.add_argument("--epsilon", type=float, help="plateau epsilon on the mean (0.1)")
    parser.add_argument("--window", type=int, help="plateau window in rounds (2)")
    parser.add_argument("--max-rounds", type=int, help="rubric round cap (5)")
    parser.add_argument(
        "--required",
        nargs="+",
        action="extend",
        default=[],
        metavar="FIELD",
        help="required output fields (heuristic critic); read as headings for text outputs",
    )
    parser.add_argument("--max-attempts", type=int, help="max repair attempts (heuristic: 2)")
    parser.add_argument("--task", help="the original task text (repairs derive content from it)")
    parser.add_argument("--config", help="workflow.awp.yaml to read settings from")
    add_json_argument(parser, "print the CritiqueResult as JSON")


def _worker_id(path: Path) -> str:
    ident = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-.")
    return (ident or "worker")[:128]


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    rubric = {
        key: value
        for key, value in (
            ("target_score", args.target),
            ("plateau_epsilon", args.epsilon),
            ("plateau_window", args.window),
            ("max_rounds", args.max_rounds),
        )
        if value is not None
    }
    overrides: dict[str, Any] = {"enabled": True, "critic": args.critic}
    if rubric:
        overrides["rubric"] = rubric
    if args.max_attempts is not None:
        overrides["max_repair_attempts"] = args.max_attempts
    return overrides


def _read_output(
    args: argparse.Namespace, path: Path, limit: int
) -> tuple[str | dict[str, Any], str | None]:
    """The output and its claimed format (FILE read up to ``limit`` bytes); raises
    ValueError or ``InputError`` with a message on bad input."""
    text = read_text(str(path), limit)
    if args.critic == "rubric":
        markdown = path.suffix.lower() in (".md", ".markdown")
        if not markdown:
            try:
                data = loads(text, str(path))
            except ValueError as exc:
                if text.lstrip().startswith(("{", "[")):
                    raise ValueError(f"{path} is not a paper: not valid JSON ({exc})") from None
                markdown = True  # not JSON at all: read it as a Markdown paper
        if markdown:
            # lazy: the Markdown reader loads only for a Markdown paper
            from pipeline.text.paper_markdown import MarkdownPaperError, paper_from_markdown

            try:
                return paper_from_markdown(text), "json"
            except MarkdownPaperError as exc:
                raise ValueError(f"{path} is not a Markdown paper: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a paper: expected a JSON object")
        return data, "json"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return text, _FORMATS.get(path.suffix.lower(), "text")
    if isinstance(data, dict):
        return data, "json"
    return text, "json"


def _table(result: Any, dimensions: tuple[str, ...], rubric: bool) -> str:
    if rubric:
        header = ["round", *dimensions, "mean", "applied", "verdict"]
        rows = [
            [
                str(t.round),
                *(f"{t.scores[d]:.2f}" if d in t.scores else "-" for d in dimensions),
                f"{t.mean:.2f}",
                str(t.suggestions_applied),
                t.verdict,
            ]
            for t in result.trace
        ]
    else:
        header = ["round", "score", "defects", "applied", "verdict"]
        rows = [
            [str(t.round), f"{t.score:.2f}", str(t.defects), str(t.suggestions_applied), t.verdict]
            for t in result.trace
        ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    head = "  ".join(c.rjust(w) for c, w in zip(header, widths, strict=True))
    return "\n".join([head, *lines])


def run(args: argparse.Namespace) -> int:
    return service_guard("loop", lambda: _loop(args))


def _loop(args: argparse.Namespace) -> int:
    # lazy: pipeline.loop.convergence is not loaded by `critique --help`, which imports this module
    # and stays fast
    # lazy: pipeline.critics.rubric is not loaded by `critique --help`, which imports this module
    # and stays fast
    from pipeline.critics.rubric import parse_paper
    from pipeline.loop.convergence import STOP_TEXT

    # lazy: pipeline.loop.stages is not loaded by `critique --help`, which imports this module and
    # stays fast
    from pipeline.loop.stages import run_submission

    # lazy: pipeline.wiring is not loaded by `critique --help`, which imports this module and stays
    # fast
    from pipeline.wiring import make_context

    path = Path(args.file)
    try:
        if args.config:
            check_config_file(args.config)
        limit = load_config(args.config, overrides=_overrides(args)).max_output_bytes
        output, claimed = _read_output(args, path, limit)
        if args.critic == "rubric":
            parse_paper(output)
    except RecursionError:
        raise CommandError(f"--config {args.config}: nested too deeply to parse") from None
    except (ValueError, CritiqueError, InputError) as exc:
        raise CommandError(terminal_line(exc)) from None
    try:
        config = load_config(args.config, overrides=_overrides(args))
        task = args.task or (
            f"Write the paper '{output.get('title', path.stem)}'."
            if args.critic == "rubric" and isinstance(output, dict)
            else f"Produce the result in {path.name}."
        )
        submission = Submission(
            run_id="cli",
            worker_id=_worker_id(path),
            task=task,
            output=output,
            claimed_format=claimed,
            required_fields=tuple(args.required),
        )
        result = run_submission(submission, make_context(config))
    except (CritiqueError, ValueError) as exc:
        raise CommandError(terminal_line(exc)) from None
    if args.json:
        print(json.dumps(result.model_dump(mode="json"), ensure_ascii=False, indent=2))
    else:
        print(_table(result, config.rubric.dimensions, args.critic == "rubric"))
        print()
        print(f"status: {result.status}")
        print(f"stop reason: {result.stop_reason} ({STOP_TEXT[result.stop_reason]})")
        print(
            f"score: {result.score_text()} "
            f"after {len(result.attempts)} repair(s); tokens: {result.usage.tokens}"
        )
        for note in result.notes:
            print(f"note: {note}")
    return EXIT_OK
