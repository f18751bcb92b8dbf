"""`critique l0`: exit codes, human and JSON output, stdin, strictness and bad input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from workers.cli import main


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CRITIQUE_CONFIG", raising=False)


def test_clean_file_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file that passes every check exits 0 with an ok summary."""
    path = write(tmp_path, "ok.md", "# Title\n\nAll good (really).\n")
    assert main(["l0", path]) == 0
    assert "l0 ok: 0 error(s)" in capsys.readouterr().out


def test_failure_lines_and_exit_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A failing check exits 1 and prints path:line:col: severity check: reason (1-based line
    and column, as compilers print them, never a character offset where the line goes)."""
    path = write(tmp_path, "bad.md", "# A\n\nTODO\n\n# a\n")
    assert main(["l0", path]) == 1
    out = capsys.readouterr().out
    assert f"{path}:3:1: error no_placeholder: placeholder 'TODO'" in out
    assert f"{path}:5:1: error no_duplicate_headings:" in out
    assert "l0 FAILED: 2 error(s)" in out


def test_positions_are_line_and_column_in_a_code_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a two-line file the position is on line 2 at the placeholder's column (the offset
    20 that was printed as a line number before)."""
    path = write(tmp_path, "code.py", 'x = {"a": 1}\ny = 1  # TODO: fix\n')
    assert main(["l0", path]) == 1
    out = capsys.readouterr().out
    assert f"{path}:2:10: error no_placeholder:" in out
    assert main(["l0", "--json", path]) == 1
    [f] = json.loads(capsys.readouterr().out)["failures"]
    assert (f["offset"], f["line"], f["column"]) == (22, 2, 10)


def test_json_output_has_exactly_the_documented_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json prints {ok, elapsed_ms, failures[{check, severity, reason, path, offset, line,
    column}]}."""
    path = write(tmp_path, "x.json", '{"a": [1,}')
    assert main(["l0", "--json", path]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"ok", "elapsed_ms", "failures"}
    assert doc["ok"] is False and isinstance(doc["elapsed_ms"], float)
    assert {tuple(sorted(f)) for f in doc["failures"]} == {
        ("check", "column", "line", "offset", "path", "reason", "severity")
    }
    assert {f["check"] for f in doc["failures"]} == {"balanced_delimiters", "json_valid_if_claimed"}


def test_stdin_with_format(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """PATH '-' reads stdin; --format json makes it parse as JSON."""
    monkeypatch.setattr("sys.stdin", io.StringIO("{broken"))
    assert main(["l0", "--format", "json", "--json", "-"]) == 1
    [f] = [
        f
        for f in json.loads(capsys.readouterr().out)["failures"]
        if f["check"] == "json_valid_if_claimed"
    ]
    assert f["path"] == "<stdin>" and f["offset"] == 1


def test_warnings_pass_unless_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A prose delimiter warning exits 0, and 1 with --strict."""
    path = write(tmp_path, "w.md", "Unclosed (paren in prose.\n")
    assert main(["l0", path]) == 0
    assert "warning balanced_delimiters" in capsys.readouterr().out
    assert main(["l0", "--strict", "--json", path]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_previous_size(tmp_path: Path) -> None:
    """--previous-size enables the 2.5× growth check."""
    path = write(tmp_path, "big.txt", "x" * 3000)
    assert main(["l0", path]) == 0
    assert main(["l0", "--previous-size", "1000", path]) == 1
    assert main(["l0", "--previous-size", "2000", path]) == 0


def test_unreadable_input_exits_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing or non-UTF-8 file exits 2 with a message naming it on stderr."""
    missing = str(tmp_path / "missing.md")
    assert main(["l0", missing]) == 2
    assert missing in capsys.readouterr().err
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert main(["l0", str(binary)]) == 2
    assert "b.txt: not UTF-8 text" in capsys.readouterr().err


def test_bad_usage_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown --format is a usage error (argparse exits 2)."""
    with pytest.raises(SystemExit) as exc:
        main(["l0", "--format", "yaml", "x"])
    assert exc.value.code == 2


def test_config_selects_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--config reads observability.output_contract; an unknown check exits 2."""
    path = write(tmp_path, "t.md", "TODO\n")
    good = write(
        tmp_path,
        "good.yaml",
        "observability:\n  output_contract:\n    checks: [balanced_delimiters]\n",
    )
    assert main(["l0", "--config", good, path]) == 0
    bad = write(tmp_path, "bad.yaml", "observability:\n  output_contract:\n    checks: [nope]\n")
    assert main(["l0", "--config", bad, path]) == 2
    assert "nope" in capsys.readouterr().err
