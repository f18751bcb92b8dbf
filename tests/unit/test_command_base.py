"""The command base (workers/commands/_common.py): one guard mapping every error to the exit-code
table, the numeric option types and their "--X must be ≥ N" wording, and the one Redis check."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import redis

from workers.cli import main
from workers.commands._common import (
    REDIS_HINT,
    CommandError,
    UnknownRunError,
    above,
    at_least,
    between,
    check_numbers,
    check_redis,
    number_problem,
    service_guard,
)
from workers.exit_codes import EXIT_CODES, EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE

ROOT = Path(__file__).resolve().parents[2]
DEAD = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def _raises(exc: BaseException) -> int:
    raise exc


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (CommandError("no such queue", EXIT_USAGE), EXIT_USAGE, "critique x: no such queue"),
        (CommandError("chain failed", EXIT_FAILED), EXIT_FAILED, "critique x: chain failed"),
        (CommandError("gone", EXIT_UNAVAILABLE), EXIT_UNAVAILABLE, "critique x: gone"),
        (UnknownRunError("no submission of run 'r'"), EXIT_USAGE, "critique x: no submission"),
        (ValueError("run_id: bad"), EXIT_USAGE, "critique x: run_id: bad"),
    ],
)
def test_the_guard_maps_each_error_to_its_exit_code_with_one_stderr_line(
    capsys: pytest.CaptureFixture[str], error: BaseException, code: int, line: str
) -> None:
    """CommandError keeps its code; an unknown run or a bad value is 2; one prefixed line."""
    assert service_guard("x", lambda: _raises(error)) == code
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1


def test_the_guard_maps_an_unreachable_redis_to_3_with_the_one_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """redis-py's ConnectionError is exit 3: the store's URL, the error and REDIS_HINT, on the
    one line every error gets (`… (hint: …)`)."""
    refused = redis.exceptions.ConnectionError("Connection refused")
    assert service_guard("status", lambda: _raises(refused)) == EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert err.startswith("critique status: cannot reach Redis at ") and err.count("\n") == 1
    assert err.rstrip().endswith(f": Connection refused (hint: {REDIS_HINT})")


def test_the_guard_returns_the_body_code_and_lets_interrupts_and_broken_pipes_through() -> None:
    """The body's own code comes back; Ctrl-C and a closed stdout are the CLI entry's to end."""
    assert service_guard("x", lambda: EXIT_OK) == EXIT_OK
    assert service_guard("x", lambda: EXIT_FAILED) == EXIT_FAILED
    for exc in (KeyboardInterrupt(), BrokenPipeError(32, "Broken pipe"), SystemExit(143)):
        with pytest.raises(type(exc)):
            service_guard("x", lambda exc=exc: _raises(exc))  # type: ignore[misc]


def test_every_code_the_guard_returns_is_in_the_printed_table() -> None:
    """The codes are the ones `--help` prints (the one table)."""
    for code in (EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE):
        assert re.search(rf"^\s+{code}  ", EXIT_CODES, re.MULTILINE), code


def test_command_error_defaults_to_usage() -> None:
    """A CommandError without a code is bad usage (2); str() is its message."""
    exc = CommandError("bad")
    assert exc.code == EXIT_USAGE and str(exc) == "bad"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    parser.add_argument("--previous-size", type=at_least(0))
    parser.add_argument("--reps", type=at_least(1), default=3)
    parser.add_argument("--timeout", type=above(0), default=1.0)
    parser.add_argument("--port", type=between(1, 65535))
    return parser


def test_the_int_type_accepts_its_range_and_keeps_defaults() -> None:
    """In range: a plain int or float; the defaults are left as they are."""
    args = _parser().parse_args(["--previous-size", "0", "--timeout", "0.5", "--port", "65535"])
    assert (args.previous_size, args.reps, args.timeout, args.port) == (0, 3, 0.5, 65535)
    assert number_problem(args) is None
    check_numbers(args)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--previous-size", "-1"], "--previous-size must be ≥ 0"),
        (["--reps", "0"], "--reps must be ≥ 1"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--timeout", "nan"], "--timeout must be > 0"),
        (["--port", "70000"], "--port must be 1–65535"),
        (["--port", "0"], "--port must be 1–65535"),
    ],
)
def test_an_out_of_range_number_is_worded_as_before(argv: list[str], message: str) -> None:
    """`--X must be ≥ N` / `--X must be > N`, named by the option, exit 2."""
    args = _parser().parse_args(argv)
    assert number_problem(args) == message
    with pytest.raises(CommandError) as info:
        check_numbers(args)
    assert info.value.code == EXIT_USAGE and str(info.value) == message


def test_a_non_number_is_still_argparses_own_error() -> None:
    """`--reps x` is refused by argparse itself, naming the type as `int`."""
    with pytest.raises(argparse.ArgumentError, match="invalid int value: 'x'"):
        _parser().parse_args(["--reps", "x"])


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["status", "r", "--iteration", "0"], "critique status: --iteration must be ≥ 1"),
        (["resume", "r", "--iteration", "0"], "critique resume: --iteration must be ≥ 1"),
        (["watch", "r", "--timeout", "0"], "critique watch: --timeout must be > 0"),
        (["demo", "--workers", "0"], "critique demo: --workers must be ≥ 1"),
        (["demo", "--timeout", "-1"], "critique demo: --timeout must be > 0"),
        (["l0", "--previous-size", "-1", "x.md"], "critique l0: --previous-size must be ≥ 0"),
        (["submit", "--timeout", "0", "x.json"], "critique submit: --timeout must be > 0"),
    ],
)
def test_the_cli_reports_a_bad_number_before_the_command_runs(
    capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    """Exit 2 and exactly the line each command printed before (nothing started)."""
    assert main(argv) == EXIT_USAGE
    assert capsys.readouterr().err.strip() == line


def test_check_redis_names_the_url_and_gives_the_one_hint() -> None:
    """Nothing at the URL: exit 3, `cannot reach <what> at <url>: … (hint: REDIS_HINT)`, one
    line."""
    with pytest.raises(CommandError) as info:
        check_redis([(DEAD, "the broker")])
    assert info.value.code == EXIT_UNAVAILABLE
    text = str(info.value)
    assert text.startswith(f"cannot reach the broker at {DEAD}: ")
    assert text.endswith(f" (hint: {REDIS_HINT})") and "\n" not in text


def test_check_redis_skips_other_broker_transports() -> None:
    """An amqp:// broker is Celery's to report: no PING, no error."""
    check_redis([("amqp://guest@127.0.0.1:1//", "the broker")])


def test_check_redis_refuses_a_sentinel_url_without_its_master(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sentinel:// URL without CRITIQUE_REDIS_MASTER is a setting to fix (2), not an outage."""
    monkeypatch.delenv("CRITIQUE_REDIS_MASTER", raising=False)
    with pytest.raises(CommandError) as info:
        check_redis([("sentinel://127.0.0.1:1", "Redis")])
    assert info.value.code == EXIT_USAGE


def test_no_command_imports_a_private_name_of_another_command() -> None:
    """Shared helpers live in workers/commands/_*.py modules, never behind a sibling's `_name`."""
    sibling_private = re.compile(
        r"from workers\.commands\.([a-z][a-z0-9_]*) import \(?\s*(?:[\w, \n]*\b)?_[a-z]", re.M
    )
    offenders = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "workers").rglob("*.py"))
        if sibling_private.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == []
