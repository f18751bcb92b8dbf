"""Test and lint output → failures (the command critic). Pure: text in, values out.

One :class:`ToolFailure` per failure, with the file and line inside the command's workspace,
the message, and — where the tool says them — the expected and actual values:

- **pytest**, from its JUnit XML report (:func:`parse_pytest_junit`: the command critic adds
  ``--junitxml`` when the command is pytest) or from its terminal output
  (:func:`parse_pytest_text`: the ``____ test_x ____`` sections with their ``path:line:`` lines,
  else the ``FAILED path::test - msg`` summary). The location is the failing line in the test's
  own file (``test_x.py:12``); an exception raised elsewhere adds "raised at solution.py:5".
  ``assert X == Y`` gives actual ``X`` and expected ``Y`` (swapped when pytest's
  ``where`` line shows ``Y`` is the computed value); the failing statement is quoted, so a
  repair prompt carries the assertion itself. A collection error (a syntax error in the code
  under test) points at the line Python named.
- **ruff** ``--output-format json`` (:func:`parse_ruff_json`): code, message, row and column.
- **mypy** (:func:`parse_mypy`): ``path:line[:col]: error: message  [code]``; notes are skipped;
  ``(got "X", expected "Y")`` and ``has incompatible type "X"; expected "Y"`` give actual and
  expected.
- **generic** ``path:line[:col]: message`` lines (:func:`parse_generic`), for anything else.

Paths are kept only when they lie inside the workspace (relative, or absolute under one of its
``roots``; never ``..``), and — when ``known`` is given — name a file that exists there, so a
traceback line from site-packages or a URL never becomes a defect location.
:func:`parse_failures` picks the parser for the tool the argv names (:func:`detect_tool`) and
falls back through the text parsers; an empty list means "nothing recognisable" (the critic then
reports the output's tail).
"""

from __future__ import annotations

import json
import posixpath
import re
import xml.etree.ElementTree as ET
from collections.abc import Collection, Sequence
from typing import Literal

from pipeline.models import Frozen

Tool = Literal["pytest", "ruff", "mypy", "generic"]

MAX_TEXT = 300
"""Longest message, statement, expected or actual value kept (longer ones end in …)."""

_LOCATION = re.compile(r"^(?P<path>[^\s:<>\[\]][^:\n]*?):(?P<line>\d+):(?: (?P<rest>.*))?$")
_FILE_LINE = re.compile(r'File "(?P<path>[^"\n]+)", line (?P<line>\d+)')
_E_LINE = re.compile(r"^E\s(?P<text>.*)$")
_STATEMENT = re.compile(r"^>\s+(?P<code>\S.*)$")
_ASSERT = re.compile(r"^(?:AssertionError: )?assert (?P<left>.+?) == (?P<right>.+)$")
_WHERE = re.compile(r"^\+\s+where (?P<value>.+?) = (?P<expr>.+)$")
_ERROR_NAME = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Failed|Interrupt)\b")
_SECTION = re.compile(r"^_{3,} (?P<title>.+?) _{3,}$")
_RULE = re.compile(r"^={5,}")
_SUMMARY = re.compile(
    r"^(?P<kind>FAILED|ERROR) (?P<path>[^\s:]+?)(?:::(?P<test>\S+))?(?: - (?P<msg>.*))?$"
)
_MYPY = re.compile(
    r"^(?P<path>[^\s:][^:\n]*?):(?P<line>\d+)(?::(?P<col>\d+))?: (?P<level>error|note|warning): "
    r"(?P<msg>.*?)(?:\s{2}\[(?P<code>[\w-]+)\])?$"
)
_MYPY_GOT = re.compile(r'\(got "(?P<actual>[^"]+)", expected "(?P<expected>[^"]+)"\)')
_MYPY_ARG = re.compile(r'incompatible type "(?P<actual>[^"]+)"; expected "(?P<expected>[^"]+)"')
_GENERIC = re.compile(
    r"^(?P<path>[^\s:<>\[\]][^:\n]*?):(?P<line>\d+)(?::(?P<col>\d+))?:\s*(?P<msg>\S.*)$"
)


def _cut(text: str | None, limit: int = MAX_TEXT) -> str | None:
    if text is None:
        return None
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ToolFailure(Frozen):
    """One failure a tool reported, located inside the workspace when it can be."""

    tool: Tool
    path: str | None = None
    line: int | None = None
    column: int | None = None
    test: str | None = None
    """pytest: the test's name (``test_add``, ``TestX.test_y[1-2]``)."""
    code: str | None = None
    """ruff / mypy: the rule or error code (``F821``, ``arg-type``)."""
    message: str = ""
    statement: str | None = None
    """pytest: the failing statement (the ``>`` line), e.g. ``assert add(2, 3) == 5``."""
    expected: str | None = None
    actual: str | None = None
    raised_at: str | None = None
    """pytest: where the exception was raised, when not at ``location`` (``solution.py:5``)."""
    collection: bool = False
    """pytest: the file could not even be collected (import or syntax error)."""

    @property
    def location(self) -> str | None:
        """``path:line`` (``path`` alone without a line; None without a path)."""
        if self.path is None:
            return None
        return self.path if self.line is None else f"{self.path}:{self.line}"

    def describe(self) -> str:
        """The defect description: what failed, the statement, expected/actual, the message."""
        if self.tool == "pytest":
            if self.collection:
                head = f"pytest could not collect {self.test or self.path or 'the tests'}"
            else:
                head = f"test {self.test or '?'} failed"
            if self.statement:
                head += f": `{self.statement}`"
            if self.expected is not None and self.actual is not None:
                head += f" — expected {self.expected}, got {self.actual}"
                if self.message and not _ASSERT.match(self.message):
                    head += f" ({self.message})"
            elif self.message:
                head += f" — {self.message}"
            if self.raised_at:
                head += f" (raised at {self.raised_at})"
            return head
        label = {"ruff": "ruff", "mypy": "mypy", "generic": "check"}[self.tool]
        code = f" {self.code}" if self.code else ""
        text = f"{label}{code}: {self.message}"
        if self.tool == "mypy" and self.expected is not None and self.actual is not None:
            text += f" — expected {self.expected}, got {self.actual}"
        return text


# -- paths ------------------------------------------------------------------------------------


def workspace_path(
    raw: str, roots: Sequence[str], known: Collection[str] | None = None
) -> str | None:
    """``raw`` as a normalised path relative to the workspace, or None when it is outside
    (``..``, absolute elsewhere, ``<frozen …>``), or not in ``known`` when that is given."""
    p = raw.strip().replace("\\", "/")
    if not p or p.startswith("<"):
        return None
    if p.startswith("/"):
        for root in roots:
            base = root.rstrip("/").replace("\\", "/")
            if base and p.startswith(base + "/"):
                p = p[len(base) + 1 :]
                break
        else:
            return None
    p = posixpath.normpath(p)
    if p in (".", "..") or p.startswith("../") or p.startswith("/"):
        return None
    if known is not None and p not in known:
        return None
    return p


# -- pytest -----------------------------------------------------------------------------------


def _e_lines(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        m = _E_LINE.match(line)
        if m:
            stripped = m.group("text").strip()
            if stripped:
                out.append(stripped)
    return out


def _locations(
    text: str, roots: Sequence[str], known: Collection[str] | None
) -> list[tuple[str, int, str]]:
    """``(path, line, rest)`` of every traceback location inside the workspace, in order
    (``path:line:`` lines and ``File "path", line N`` mentions)."""
    found: list[tuple[int, str, int, str]] = []
    offset = 0
    for line in text.splitlines(keepends=True):
        m = _LOCATION.match(line.rstrip("\r\n"))
        if m:
            path = workspace_path(m.group("path"), roots, known)
            if path is not None:
                found.append((offset, path, int(m.group("line")), m.group("rest") or ""))
        for f in _FILE_LINE.finditer(line):
            path = workspace_path(f.group("path"), roots, known)
            if path is not None:
                found.append((offset + f.start(), path, int(f.group("line")), ""))
        offset += len(line)
    found.sort(key=lambda t: t[0])
    return [(p, n, rest) for _o, p, n, rest in found]


def _error_text(e_lines: Sequence[str], fallback: str) -> str:
    """The error a traceback ends with: the last ``SomethingError: …`` E line, else the first E
    line, else ``fallback`` (the junit message, or a ``--tb=line`` location's text)."""
    for line in reversed(e_lines):
        if _ERROR_NAME.match(line):
            return line
    if e_lines:
        return e_lines[0]
    return fallback.strip().splitlines()[0] if fallback.strip() else ""


def _expected_actual(
    error: str, e_lines: Sequence[str]
) -> tuple[str | None, str | None, str | None]:
    """``(expected, actual, where)`` from an ``assert X == Y`` failure, else Nones."""
    m = _ASSERT.match(error)
    if m is None:
        return None, None, None
    actual, expected = m.group("left").strip(), m.group("right").strip()
    where = None
    for line in e_lines:
        w = _WHERE.match(line)
        if w:
            where = f"where {w.group('value')} = {w.group('expr')}"
            value = w.group("value").strip()
            if value == expected and value != actual:
                actual, expected = expected, actual
            break
    return expected, actual, where


def pytest_failure(
    test: str | None,
    longrepr: str,
    message: str,
    roots: Sequence[str],
    known: Collection[str] | None = None,
    *,
    collection: bool = False,
) -> ToolFailure:
    """One pytest failure from its traceback text (``longrepr``) and short message."""
    e_lines = _e_lines(longrepr)
    locations = _locations(longrepr, roots, known)
    loc_text = next((rest for _p, _n, rest in reversed(locations) if rest.strip()), "")
    error = _error_text(e_lines, message or loc_text)
    statement = None
    for line in longrepr.splitlines():
        s = _STATEMENT.match(line)
        if s:
            statement = s.group("code").strip()
            break
    expected, actual, where = _expected_actual(error, e_lines)
    path = line_no = None
    raised_at = None
    if locations:
        if collection:
            path, line_no, _ = locations[-1]
        else:
            own = locations[0][0]
            path, line_no, _ = next(loc for loc in reversed(locations) if loc[0] == own)
            last = f"{locations[-1][0]}:{locations[-1][1]}"
            if last != f"{path}:{line_no}":
                raised_at = last
    msg = error
    if expected is not None and where:
        msg = where
    return ToolFailure(
        tool="pytest",
        path=path,
        line=line_no,
        test=test,
        message=_cut(msg) or "",
        statement=_cut(statement),
        expected=_cut(expected),
        actual=_cut(actual),
        raised_at=raised_at,
        collection=collection,
    )


def parse_pytest_junit(
    xml_text: str, roots: Sequence[str], known: Collection[str] | None = None
) -> list[ToolFailure]:
    """Every ``<failure>`` and ``<error>`` of a pytest JUnit XML report."""
    try:
        doc = ET.fromstring(xml_text)
    except ET.ParseError:
        return []
    failures: list[ToolFailure] = []
    for case in doc.iter("testcase"):
        name = case.get("name") or None
        classname = case.get("classname") or ""
        for tag in ("failure", "error"):
            for el in case.findall(tag):
                message = el.get("message") or ""
                collection = tag == "error" and (not classname or message == "collection failure")
                test = name
                if collection and name and not name.endswith(".py"):
                    test = name.replace(".", "/") + ".py"  # the module pytest could not import
                found = pytest_failure(
                    test, el.text or "", message, roots, known, collection=collection
                )
                if collection and found.path is None and test:
                    found = found.model_copy(update={"path": workspace_path(test, roots, known)})
                failures.append(found)
    return failures


def parse_pytest_text(
    text: str, roots: Sequence[str], known: Collection[str] | None = None
) -> list[ToolFailure]:
    """pytest's terminal output: one failure per ``____ name ____`` section of its FAILURES /
    ERRORS blocks; without sections (``--tb=no``), one per ``FAILED``/``ERROR`` summary line."""
    summary: dict[str, tuple[str, str]] = {}
    ordered: list[tuple[str, str | None, str]] = []
    for line in text.splitlines():
        m = _SUMMARY.match(line.strip())
        if m:
            test = m.group("test")
            ordered.append((m.group("path"), test, m.group("msg") or ""))
            if test:
                summary[test.split("::")[-1]] = (m.group("path"), m.group("msg") or "")
    failures: list[ToolFailure] = []
    title: str | None = None
    body: list[str] = []

    def flush() -> None:
        if title is None:
            return
        collection = title.startswith("ERROR collecting ")
        if collection:
            test = title.removeprefix("ERROR collecting ")
            short = ""
        else:
            test = title.removeprefix("ERROR at setup of ").removeprefix("ERROR at teardown of ")
            short = summary.get(test.replace(".", "::").split("::")[-1], ("", ""))[1]
        found = pytest_failure(test, "\n".join(body), short, roots, known, collection=collection)
        if collection and found.path is None:
            found = found.model_copy(update={"path": workspace_path(test, roots, known)})
        failures.append(found)

    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            flush()
            title, body = m.group("title"), []
        elif title is not None and _RULE.match(line):
            flush()
            title, body = None, []
        elif title is not None:
            body.append(line)
    flush()
    if failures:
        return failures
    # --tb=line prints one "path:line: message" per failure, in the summary's order.
    lines = [loc for loc in _locations(text, roots, known) if loc[2]]
    paired = len(lines) == len(ordered)
    for i, (path, test, msg) in enumerate(ordered):
        where, line_no = workspace_path(path, roots, known), None
        if paired:
            where, line_no, _rest = lines[i]
        expected, actual, _where = _expected_actual(msg, ())
        failures.append(
            ToolFailure(
                tool="pytest",
                path=where,
                line=line_no,
                test=test.split("::")[-1] if test else path,
                message=_cut(msg) or "",
                expected=_cut(expected),
                actual=_cut(actual),
                collection=test is None,
            )
        )
    return failures


# -- ruff, mypy, generic ------------------------------------------------------------------------


def parse_ruff_json(
    text: str, roots: Sequence[str], known: Collection[str] | None = None
) -> list[ToolFailure]:
    """``ruff check --output-format json``: one failure per diagnostic."""
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        return []
    try:
        data = json.loads(text[start : end + 1])
    except ValueError:
        return []
    if not isinstance(data, list):
        return []
    failures = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("message"), str):
            continue
        raw_loc = item.get("location")
        loc: dict[str, object] = raw_loc if isinstance(raw_loc, dict) else {}
        row, col = loc.get("row"), loc.get("column")
        filename = item.get("filename")
        failures.append(
            ToolFailure(
                tool="ruff",
                path=workspace_path(filename, roots, known) if isinstance(filename, str) else None,
                line=row if isinstance(row, int) else None,
                column=col if isinstance(col, int) else None,
                code=item.get("code") if isinstance(item.get("code"), str) else None,
                message=_cut(item["message"]) or "",
            )
        )
    return failures


def parse_mypy(
    text: str, roots: Sequence[str], known: Collection[str] | None = None
) -> list[ToolFailure]:
    """mypy's ``path:line[:col]: error: message  [code]`` lines (notes skipped)."""
    failures = []
    for line in text.splitlines():
        m = _MYPY.match(line.rstrip())
        if m is None or m.group("level") != "error":
            continue
        path = workspace_path(m.group("path"), roots, known)
        if path is None:
            continue
        msg = m.group("msg").strip()
        pair = _MYPY_GOT.search(msg) or _MYPY_ARG.search(msg)
        failures.append(
            ToolFailure(
                tool="mypy",
                path=path,
                line=int(m.group("line")),
                column=int(m.group("col")) if m.group("col") else None,
                code=m.group("code"),
                message=_cut(msg) or "",
                expected=_cut(pair.group("expected")) if pair else None,
                actual=_cut(pair.group("actual")) if pair else None,
            )
        )
    return failures


def parse_generic(
    text: str, roots: Sequence[str], known: Collection[str] | None = None
) -> list[ToolFailure]:
    """Any ``path:line[:col]: message`` line whose path is in the workspace."""
    failures = []
    for line in text.splitlines():
        m = _GENERIC.match(line.rstrip())
        if m is None:
            continue
        path = workspace_path(m.group("path"), roots, known)
        if path is None:
            continue
        failures.append(
            ToolFailure(
                tool="generic",
                path=path,
                line=int(m.group("line")),
                column=int(m.group("col")) if m.group("col") else None,
                message=_cut(m.group("msg")) or "",
            )
        )
    return failures


# -- which tool, and its argv -----------------------------------------------------------------

_TOOL_NAMES: dict[str, Tool] = {
    "pytest": "pytest",
    "py.test": "pytest",
    "ruff": "ruff",
    "mypy": "mypy",
    "dmypy": "mypy",
}


def detect_tool(argv: Sequence[str]) -> Tool | None:
    """The tool ``argv`` runs: its program (``pytest``, ``ruff``, ``mypy``), or the module of
    ``python -m X``; None for anything else (``sh -c …``, ``make test``)."""
    if not argv:
        return None
    program = posixpath.basename(argv[0].replace("\\", "/"))
    if program in _TOOL_NAMES:
        return _TOOL_NAMES[program]
    if program.startswith("python"):
        for i, arg in enumerate(argv[1:-1], 1):
            if arg == "-m":
                return _TOOL_NAMES.get(argv[i + 1])
    return None


def prepare_argv(argv: Sequence[str], tool: Tool | None, junit_path: str) -> list[str]:
    """``argv`` with what makes its output parseable: ``--junitxml=junit_path`` for pytest;
    ``--output-format json`` for ``ruff check`` unless it names a format itself."""
    out = list(argv)
    if tool == "pytest":
        at = out.index("--") if "--" in out else len(out)  # options go before a `--`
        out.insert(at, f"--junitxml={junit_path}")
    elif (
        tool == "ruff"
        and "check" in out
        and not any(a.startswith(("--output-format", "--format")) for a in out)
    ):
        i = out.index("check") + 1
        out[i:i] = ["--output-format", "json"]
    return out


def parse_failures(
    tool: Tool | None,
    output: str,
    junit_xml: str | None,
    roots: Sequence[str],
    known: Collection[str] | None = None,
) -> list[ToolFailure]:
    """The failures in a command's output: the tool's own parser first (pytest's JUnit report,
    ruff's JSON, mypy's lines), then the text parsers in turn (pytest text, mypy, generic)."""
    if tool == "pytest" and junit_xml:
        found = parse_pytest_junit(junit_xml, roots, known)
        if found:
            return found
    if tool == "ruff":
        found = parse_ruff_json(output, roots, known)
        if found:
            return found
    for parser in (parse_pytest_text, parse_mypy, parse_generic):
        found = parser(output, roots, known)
        if found:
            return found
    return []
