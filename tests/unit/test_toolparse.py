"""The command critic's parsers (pure): pytest (JUnit XML and terminal output), ruff JSON,
mypy and generic ``path:line:`` lines, on output captured from the real tools."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.critics.toolparse import (
    ToolFailure,
    detect_tool,
    parse_failures,
    parse_generic,
    parse_mypy,
    parse_pytest_junit,
    parse_pytest_text,
    parse_ruff_json,
    prepare_argv,
    workspace_path,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "command"
ROOTS = ["/tmp/critique-cmd-x/work"]
"""The workspace the fixtures were captured in (absolute paths in them point there)."""


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def summary(failures: list[ToolFailure]) -> list[tuple[str | None, str]]:
    return [(f.location, f.describe()) for f in failures]


EXPECTED_PYTEST = [
    (
        "test_solution.py:5",
        "test test_add failed: `assert add(2, 3) == 5` — expected 5, got -1 (where -1 = add(2, 3))",
    ),
    (
        "test_solution.py:9",
        "test test_div failed: `assert div(1, 0) == 0` — ZeroDivisionError: division by zero "
        "(raised at solution.py:6)",
    ),
    (
        "test_solution.py:17",
        "test test_reversed failed: `assert 5 == add(2, 3)` — expected 5, got -1 "
        "(where -1 = add(2, 3))",
    ),
]


def test_pytest_junit_gives_the_test_line_statement_and_expected_actual() -> None:
    """Each JUnit failure is at the failing line of the test's own file, quotes the statement,
    and says expected/actual (swapped by pytest's ``where`` line for ``assert 5 == f()``); an
    exception raised in the code under test adds where it was raised."""
    failures = parse_pytest_junit(fixture("pytest_junit.xml"), ROOTS)
    assert summary(failures) == EXPECTED_PYTEST
    assert (failures[0].expected, failures[0].actual, failures[0].test) == ("5", "-1", "test_add")


def test_pytest_text_sections_parse_like_the_junit_report() -> None:
    """Without a report, the FAILURES sections of pytest's output give the same failures."""
    assert summary(parse_pytest_text(fixture("pytest.txt"), ROOTS)) == EXPECTED_PYTEST


def test_a_collection_error_points_at_the_line_python_named() -> None:
    """A syntax error in the code under test: pytest cannot collect the test file; the defect
    is at solution.py:1 with the SyntaxError (report and terminal output alike)."""
    want = [
        ("solution.py:1", "pytest could not collect test_solution.py — SyntaxError: expected ':'")
    ]
    assert summary(parse_pytest_junit(fixture("pytest_junit_collection.xml"), ROOTS)) == want
    assert summary(parse_pytest_text(fixture("pytest_collection.txt"), ROOTS)) == want


def test_pytest_summary_lines_alone_still_give_one_failure_per_test() -> None:
    """``--tb=no``: only the ``FAILED path::test - msg`` lines; the file, the test and the
    assertion's values are kept. ``--tb=line`` adds each failure's ``path:line``."""
    no_tb = parse_pytest_text(fixture("pytest_tb_no.txt"), ROOTS)
    assert [(f.location, f.test, f.expected, f.actual) for f in no_tb] == [
        ("test_solution.py", "test_add", "5", "-1"),
        ("test_solution.py", "test_div", None, None),
        ("test_solution.py", "test_reversed", "-1", "5"),
    ]
    assert "ZeroDivisionError" in no_tb[1].describe()
    line_tb = parse_pytest_text(fixture("pytest_tb_line.txt"), ROOTS)
    assert [f.location for f in line_tb] == [
        "test_solution.py:5",
        "solution.py:6",
        "test_solution.py:17",
    ]


def test_ruff_json_diagnostics_become_failures_with_code_and_position() -> None:
    """ruff's JSON: one failure per diagnostic, the absolute filename made relative; noise
    around the JSON (a warning on stderr) is ignored."""
    text = "warning: something on stderr\n" + fixture("ruff.json") + "\n"
    failures = parse_ruff_json(text, ROOTS)
    assert [(f.location, f.column, f.code, f.message) for f in failures] == [
        ("solution.py:1", 8, "F401", "`os` imported but unused"),
        ("solution.py:5", 16, "F821", "Undefined name `c`"),
    ]
    assert failures[1].describe() == "ruff F821: Undefined name `c`"
    assert parse_ruff_json("not json at all", ROOTS) == []
    assert parse_ruff_json(fixture("ruff.json"), ["/elsewhere"])[0].path is None


def test_mypy_errors_with_codes_and_expected_actual_notes_skipped() -> None:
    """mypy: errors only (the reveal_type note is skipped), with column, code, and the
    got/expected types as actual/expected."""
    failures = parse_mypy(fixture("mypy.txt"), ROOTS)
    assert [(f.location, f.column, f.code, f.expected, f.actual) for f in failures] == [
        ("solution.py:2", 12, "return-value", "int", "str"),
        ("solution.py:5", 17, "arg-type", "int", "str"),
    ]
    assert failures[0].describe().startswith("mypy return-value: Incompatible return value")


def test_generic_lines_inside_the_workspace_only() -> None:
    """``path:line[:col]: message`` lines count when the path is in the workspace (and, with
    ``known``, names a file there); site-packages, ``<frozen>`` and URLs do not."""
    text = "\n".join(
        [
            "solution.py:3:1: E999 bad thing",
            "pkg/mod.py:10: warning: unused",
            "/usr/lib/python3/site.py:1: in <module>",
            "<frozen importlib._bootstrap>:1204: in _gcd_import",
            "see http://example.com:80: for help",
            "/tmp/critique-cmd-x/work/solution.py:7: absolute inside",
            "Found 3 errors.",
        ]
    )
    failures = parse_generic(text, ROOTS)
    assert [(f.location, f.column, f.message) for f in failures] == [
        ("solution.py:3", 1, "E999 bad thing"),
        ("pkg/mod.py:10", None, "warning: unused"),
        ("solution.py:7", None, "absolute inside"),
    ]
    known = frozenset({"solution.py"})
    assert [f.location for f in parse_generic(text, ROOTS, known)] == [
        "solution.py:3",
        "solution.py:7",
    ]


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("solution.py", "solution.py"),
        ("./a/../b.py", "b.py"),
        ("../outside.py", None),
        ("a/../../outside.py", None),
        ("/etc/passwd", None),
        ("/tmp/critique-cmd-x/work/x/y.py", "x/y.py"),
        ("/tmp/critique-cmd-x/workother/y.py", None),
        ("<string>", None),
        ("", None),
    ],
)
def test_workspace_paths_never_leave_the_workspace(raw: str, want: str | None) -> None:
    """A location is relative to the workspace or dropped."""
    assert workspace_path(raw, ROOTS) == want


def test_the_tool_is_detected_from_the_argv_and_made_parseable() -> None:
    """pytest gets ``--junitxml``; ``ruff check`` gets ``--output-format json`` unless it
    names a format; ``python -m X`` is X; anything else is generic."""
    assert detect_tool(["pytest", "-q"]) == "pytest"
    assert detect_tool(["/venv/bin/python3", "-m", "pytest"]) == "pytest"
    assert detect_tool(["python", "-m", "mypy", "."]) == "mypy"
    assert detect_tool(["/usr/bin/ruff", "check", "."]) == "ruff"
    assert detect_tool(["sh", "-c", "pytest"]) is None
    assert detect_tool([]) is None
    assert prepare_argv(["pytest", "-q"], "pytest", "/r/j.xml") == [
        "pytest",
        "-q",
        "--junitxml=/r/j.xml",
    ]
    assert prepare_argv(["ruff", "check", "."], "ruff", "x") == [
        "ruff",
        "check",
        "--output-format",
        "json",
        ".",
    ]
    assert prepare_argv(["pytest", "--", "-odd-name.py"], "pytest", "j") == [
        "pytest",
        "--junitxml=j",
        "--",
        "-odd-name.py",
    ]
    kept = ["ruff", "check", "--output-format=concise", "."]
    assert prepare_argv(kept, "ruff", "x") == kept
    assert prepare_argv(["mypy", "."], "mypy", "x") == ["mypy", "."]


def test_parse_failures_prefers_the_tools_own_format_then_falls_back() -> None:
    """The report first; a pytest run whose report is missing falls back to its text; an
    unknown tool's output goes through pytest, mypy and generic text parsers in turn."""
    junit, text = fixture("pytest_junit.xml"), fixture("pytest.txt")
    assert summary(parse_failures("pytest", "", junit, ROOTS)) == EXPECTED_PYTEST
    assert summary(parse_failures("pytest", text, None, ROOTS)) == EXPECTED_PYTEST
    assert [f.tool for f in parse_failures(None, fixture("mypy.txt"), None, ROOTS)] == [
        "mypy",
        "mypy",
    ]
    assert parse_failures("ruff", fixture("ruff.json"), None, ROOTS)[0].code == "F401"
    assert parse_failures(None, "Segmentation fault\n", None, ROOTS) == []
