"""``critique l0 PATH…``: run the Layer-0 output contract on files (``-`` reads stdin).

Exit codes (the table of ``critique --help``): 0 every check passes (warnings are printed but
pass, unless ``--strict``), 1 one fails, 2 bad usage, unreadable input or a broken
configuration. Each failure prints as ``path:line:col: severity check: reason`` (line and
column 1-based, as compilers and linters print them; a failure without a position prints
``path: …``). ``--json`` prints exactly ``{"ok", "elapsed_ms", "failures": [{"check",
"severity", "reason", "path", "offset", "line", "column"}]}``: ``offset`` is the character
offset into the file's text, ``line``/``column`` the same position (null without one). Checks
come from ``--config`` (a ``workflow.awp.yaml``; default: ``$CRITIQUE_CONFIG`` and the
environment), else the six defaults.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pipeline.config import load_config
from pipeline.errors import CritiqueError
from pipeline.text.escaping import escape_controls
from workers.commands._common import CommandError, add_json_argument, at_least, service_guard
from workers.commands._input import InputError, check_config_file, read_text, terminal_line
from workers.commands._text import json_line
from workers.exit_codes import EXIT_FAILED, EXIT_OK

HELP = "run the Layer-0 output contract (deterministic checks) on files"

FORMATS = ("json", "markdown", "latex", "text", "python")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files to check; - reads stdin")
    parser.add_argument(
        "--previous-size",
        type=at_least(0),
        metavar="N",
        help="size in bytes of the previous attempt (enables the 2.5× growth check)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        help="claimed format of every PATH (default: from the file extension)",
    )
    parser.add_argument("--strict", action="store_true", help="warnings fail too")
    parser.add_argument("--config", help="workflow.awp.yaml whose output_contract to use")
    add_json_argument(parser, "print the report as JSON")


def position(text: str | None, offset: int | None) -> tuple[int | None, int | None]:
    """The 1-based ``(line, column)`` of a character ``offset`` into ``text``; ``(None, None)``
    without an offset (or the text it points into)."""
    if text is None or offset is None:
        return None, None
    offset = max(0, min(offset, len(text)))
    line_start = text.rfind("\n", 0, offset) + 1
    return text.count("\n", 0, offset) + 1, offset - line_start + 1


def run(args: argparse.Namespace) -> int:
    return service_guard("l0", lambda: _check(args))


def _check(args: argparse.Namespace) -> int:
    # lazy: pipeline.contract is not loaded by `critique --help`, which imports this module and
    # stays fast
    from pipeline.contract import build_suite

    # lazy: pipeline.contract.models is not loaded by `critique --help`, which imports this module
    # and stays fast
    from pipeline.contract.models import ContractInput

    items = []
    try:
        if args.config:
            check_config_file(args.config)
        config = load_config(args.config)
        suite = build_suite(config.output_contract)
        # Each input is read up to max_output_bytes: /dev/zero or an endless pipe is refused.
        texts = [(path, read_text(path, config.max_output_bytes)) for path in args.paths]
    except (CritiqueError, InputError, RecursionError) as exc:
        deep = f"--config {args.config}: nested too deeply to parse"
        why = deep if isinstance(exc, RecursionError) else exc
        raise CommandError(terminal_line(why)) from None
    for path, text in texts:
        label = "<stdin>" if path == "-" else path
        items.append(
            ContractInput(
                text=text,
                path=label,
                claimed_format=args.format,
                previous_size=args.previous_size,
            )
        )
    by_label = {item.path: item.text for item in items}
    t0 = time.perf_counter()
    report = suite.run(items)
    elapsed = 1000 * (time.perf_counter() - t0)
    errors, warnings = len(report.errors), len(report.warnings)
    ok = errors == 0 and not (args.strict and warnings)
    if args.json:
        doc: dict[str, Any] = {
            "ok": ok,
            "elapsed_ms": round(elapsed, 3),
            "failures": [
                {
                    "check": f.check,
                    "severity": f.severity,
                    "reason": f.reason,
                    "path": f.path,
                    "offset": f.offset,
                    **dict(
                        zip(
                            ("line", "column"),
                            position(by_label.get(f.path), f.offset),
                            strict=True,
                        )
                    ),
                }
                for f in report.failures
            ],
        }
        print(json_line(doc))
    else:
        for f in report.failures:
            where = f.path or "output"
            line, col = position(by_label.get(f.path), f.offset)
            at = "" if line is None else f":{line}:{col}"
            # File names and reasons are worker-made: a terminal must not run their escapes.
            print(escape_controls(f"{where}{at}: {f.severity} {f.check}: {f.reason}"))
        verdict = "ok" if ok else "FAILED"
        print(
            f"l0 {verdict}: {errors} error(s), {warnings} warning(s) in {len(items)} file(s), "
            f"{len(suite.checks)} check(s), {elapsed:.1f} ms"
        )
    return EXIT_OK if ok else EXIT_FAILED
