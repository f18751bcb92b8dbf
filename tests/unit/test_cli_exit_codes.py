"""One exit-code table for every ``critique`` command: defined once (workers/exit_codes.py),
printed in every ``--help``, and escalated is an outcome, not an error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline import __version__
from workers.cli import COMMANDS, build_parser, main
from workers.exit_codes import EXIT_CODES

ROOT = Path(__file__).resolve().parents[2]


def test_every_help_prints_the_exit_code_table() -> None:
    """`critique --help` and each `critique COMMAND --help` end with the same table."""
    parser = build_parser()
    assert EXIT_CODES in parser.format_help()
    sub = next(a for a in parser._actions if a.dest == "command")
    choices = sub.choices
    assert set(choices) == set(COMMANDS)
    for name, command in choices.items():
        text = command.format_help()
        assert EXIT_CODES in text, name
    for code in ("0  ran", "1  a chain failed", "2  bad usage or configuration", "3  a service"):
        assert code in EXIT_CODES


def test_the_exit_code_table_tells_the_failed_verdict_from_a_failed_chain() -> None:
    """`failed` as a verdict is exit 0, a chain failure (a stage errored, no verdict) exit 1:
    the table names each so a reader can tell them apart."""
    rows = {
        m.group(1): " ".join(m.group(2).split())
        for m in re.finditer(r"^  (\d+)  (.*?)(?=^  \d|\Z)", EXIT_CODES, re.S | re.M)
    }
    assert "the verdict `failed`" in rows["0"] and "a chain" not in rows["0"]
    assert "a stage errored" in rows["1"] and "no verdict" in rows["1"]
    assert "verdict `failed`" not in rows["1"]


def test_exit_codes_are_defined_in_one_place() -> None:
    """No command module defines its own EXIT_* numbers: they import workers.exit_codes'."""
    defining = re.compile(r"^EXIT_[A-Z_]+\s*(?:,\s*EXIT_[A-Z_]+\s*)*=", re.MULTILINE)
    offenders = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "workers").rglob("*.py"))
        if p.name != "exit_codes.py" and defining.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`critique --version` prints the package version and exits 0."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"critique {__version__}"


def test_loop_exits_0_on_an_escalated_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`critique loop` on a hopeless result gives its verdict (escalated) and exits 0: an
    escalation is the manager's cue, not a failure of the command."""
    path = tmp_path / "hopeless.json"
    path.write_text(json.dumps({"error": "tool crashed"}), "utf-8")
    rc = main(["loop", str(path), "--critic", "heuristic", "--required", "summary", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "escalated"
    assert rc == 0
