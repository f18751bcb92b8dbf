"""The A/B experiment's domain: inputs, generation, the defect counter, the verdict.

``critique ab`` (:mod:`workers.commands.ab`) runs each input × mode × repetition: mode **A**
asks the worker model for the output and stops; mode **B** asks the same way and then runs the
real critique pipeline on it. This module holds everything that needs no broker:

- :func:`parse_inputs` — the JSONL workload, one :class:`ABInput` per line; a bad line is one
  :class:`ABInputError` naming ``file:line``.
- :func:`generation_request` / :func:`output_from_reply` — the worker's prompt and how its
  reply becomes an output (JSON object, Markdown, or a Python module saved as ``solution.py``).
- :class:`DefectCounter` — **independent of the critic**: it never calls a critic or reads an
  envelope. Per output: every Layer-0 failure (:mod:`pipeline.contract`, errors and warnings),
  plus for ``json`` each required field absent, null or blank (a reply that is not a JSON object
  counts one, plus every required field), for ``markdown`` each required section without a
  heading of that title, and for ``python`` every ruff violation in ``solution.py`` (``ruff check
  --isolated --select E4,E7,E9,F``: ruff's classic defaults, pinned so counts do not drift with
  ruff's version) plus every failing or erroring test of the input's own test files (pytest,
  confined like the command critic: :mod:`pipeline.security.sandbox`); a pytest run that fails
  without a test report (nothing collected, a time-out) counts one.
- :class:`ABRow`, :data:`CSV_COLUMNS`, :func:`write_csv` — ``ab.csv`` with exactly
  ``run_id,mode,input_id,defects,latency_s,tokens_in,tokens_out,loops``.
- :func:`summarize` — the verdict: ``reduction = (mean A − mean B) / mean A``, pass when it is at
  least 0.8 (or when A has no defects at all: nothing to reduce; ``reduction`` is then None);
  ``tokens_per_defect_fixed = (Σ tokens B − Σ tokens A) / (Σ defects A − Σ defects B)``, None
  when B fixed nothing.
- :func:`escalation_markdown` — ``escalations/<run_id>.md``: a three-line summary and the
  choices (retry, accept best, manual).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from pipeline.contract import build_suite, output_text
from pipeline.contract.models import ContractInput
from pipeline.critics.llm_reply import EnvelopeParseError, json_object
from pipeline.errors import SubmissionError
from pipeline.llm.completion import ChatMessage, LLMRequest
from pipeline.models import (
    CritiqueResult,
    Defect,
    FileRef,
    Frozen,
    check_identifier,
)
from pipeline.security.sandbox import (
    Isolation,
    minimal_path,
    run_confined,
    scrubbed_env,
    temp_workspace,
    write_workspace,
)
from pipeline.text.escaping import md_text

Kind = Literal["json", "markdown", "python"]
Mode = Literal["A", "B"]

CSV_COLUMNS: tuple[str, ...] = (
    "run_id",
    "mode",
    "input_id",
    "defects",
    "latency_s",
    "tokens_in",
    "tokens_out",
    "loops",
)
"""``ab.csv``'s header, exactly (docs/llm.md, 'The A/B experiment')."""
PASS_REDUCTION = 0.8
"""The verdict passes when B has at least this much fewer defects than A (relative)."""
SOLUTION_FILE = "solution.py"
"""Where a python output is saved for its tests (they ``from solution import …``)."""
RUFF_SELECT = "E4,E7,E9,F"
"""The ruff rules the counter applies (ruff's classic defaults, pinned)."""
GENERATE_SYSTEM = (
    "You are the worker. Do the task below and reply with the result only: no preamble, "
    "no explanation."
)
"""The worker's system message (a fake server scripts it by this marker)."""
MAX_INPUT_ID = 64


class ABInputError(SubmissionError):
    """A line of the workload file is not a valid input; the message names ``file:line``."""


class InputFile(Frozen):
    """A file of an input: for python inputs, the tests to run."""

    path: str
    content: str

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        try:
            FileRef(path=v, size=0)
        except ValidationError as exc:
            msg = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
            raise ValueError(msg) from None
        return v


class ABInput(Frozen):
    """One workload line: ``{"input_id", "task", "kind", "required_fields"?, "files"?}``."""

    input_id: str
    task: str = Field(min_length=1)
    kind: Kind
    required_fields: tuple[str, ...] = ()
    files: tuple[InputFile, ...] = ()

    @field_validator("input_id")
    @classmethod
    def _ident(cls, v: str) -> str:
        check_identifier(v, "input_id")
        if len(v) > MAX_INPUT_ID:
            raise ValueError(f"input_id {v[:80]!r} is longer than {MAX_INPUT_ID} characters")
        return v

    def file_refs(self) -> tuple[FileRef, ...]:
        """The files as a submission carries them (inline, with size and sha256)."""
        import hashlib

        refs = []
        for f in self.files:
            data = f.content.encode("utf-8")
            refs.append(
                FileRef(
                    path=f.path,
                    size=len(data),
                    sha256=hashlib.sha256(data).hexdigest(),
                    content=f.content,
                )
            )
        return tuple(refs)


def _problem(exc: ValidationError) -> str:
    first = exc.errors(include_input=False, include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"]) or "line"
    return f"field '{where}': {first['msg']}"


def parse_inputs(text: str, source: str = "INPUTS.jsonl") -> list[ABInput]:
    """Every input of a JSONL workload (blank lines and ``#`` comments skipped).

    Raises :class:`ABInputError` for the first bad line: ``source:N: what is wrong``; also for
    an ``input_id`` used twice, a python input without test files, and an empty workload.
    """
    inputs: list[ABInput] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            data = json.loads(stripped)
        except ValueError as exc:
            raise ABInputError(f"{source}:{n}: not valid JSON ({exc})") from None
        except RecursionError:
            raise ABInputError(f"{source}:{n}: JSON nested too deeply to parse") from None
        if not isinstance(data, dict):
            raise ABInputError(f"{source}:{n}: expected a JSON object, got {type(data).__name__}")
        try:
            item = ABInput.model_validate(data)
        except ValidationError as exc:
            raise ABInputError(f"{source}:{n}: {_problem(exc)}") from None
        if item.kind == "python" and not item.files:
            raise ABInputError(
                f"{source}:{n}: a python input needs 'files' with the tests to run "
                f"(they import from {SOLUTION_FILE})"
            )
        if any(f.path == SOLUTION_FILE for f in item.files):
            raise ABInputError(
                f"{source}:{n}: file {SOLUTION_FILE!r} is where the output goes; rename it"
            )
        if item.input_id in seen:
            raise ABInputError(
                f"{source}:{n}: input_id {item.input_id!r} is used twice "
                f"(first on line {seen[item.input_id]})"
            )
        seen[item.input_id] = n
        inputs.append(item)
    if not inputs:
        raise ABInputError(f"{source}: no inputs (one JSON object per line)")
    return inputs


# -- generation -------------------------------------------------------------------------------

_FENCE = re.compile(r"\s*```[\w+.-]*[ \t]*\r?\n(.*?)\r?\n?```\s*", re.DOTALL)


def generation_request(item: ABInput, model: str, max_tokens: int) -> LLMRequest:
    """The worker model's request for ``item`` (the same in both modes)."""
    rules = {
        "python": f"Reply with the complete Python module only (it is saved as {SOLUTION_FILE} "
        "and tested), without Markdown fences.",
        "json": "Reply with one JSON object only.",
        "markdown": "Reply with the Markdown document only.",
    }[item.kind]
    if item.required_fields:
        noun = "fields" if item.kind == "json" else "sections (as headings)"
        rules += f" It must have these {noun}: {', '.join(item.required_fields)}."
    return LLMRequest(
        model=model,
        messages=(
            ChatMessage(role="system", content=f"{GENERATE_SYSTEM} {rules}"),
            ChatMessage(role="user", content=item.task),
        ),
        json_mode=item.kind == "json",
        max_tokens=max_tokens,
        purpose="generate",
    )


def output_from_reply(item: ABInput, text: str) -> str | dict[str, Any]:
    """The worker's output from its reply: a JSON object for ``json`` (the reply as text when it
    is not one — the contract then counts it), the text for ``markdown``, the module (a reply
    wrapped whole in a code fence unwrapped) for ``python``."""
    if item.kind == "json":
        try:
            return json_object(text)
        except EnvelopeParseError:
            return text
    if item.kind == "python":
        m = _FENCE.fullmatch(text)
        body = m.group(1) if m else text
        return body if body.endswith("\n") else body + "\n"
    return text


# -- the independent defect counter -----------------------------------------------------------

_HEADING = re.compile(r"^[ \t]{0,3}#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)


def _title(text: str) -> str:
    t = re.sub(r"^\d+(?:\.\d+)*\.?\s+", "", text.strip())
    t = re.sub(r"[\s_-]+", " ", t).casefold()
    return t.strip(" :.")


class DefectCount(Frozen):
    """What the counter found in one output, by kind of check, with one line per defect."""

    l0: int = 0
    contract: int = 0
    ruff: int = 0
    tests: int = 0
    details: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.l0 + self.contract + self.ruff + self.tests


class DefectCounter:
    """Counts defects in an output without any critic (module docstring). ``python`` and
    ``ruff`` are the programs run for python inputs (default: this Python, the ``ruff`` on the
    sandbox's PATH); ``isolation`` is the sandbox's network isolation (default: probed)."""

    def __init__(
        self,
        *,
        timeout_s: float = 60.0,
        python: str | None = None,
        ruff: str | None = None,
        isolation: Isolation | None = None,
    ) -> None:
        self.suite = build_suite()
        self.timeout_s = timeout_s
        self.python = python or sys.executable
        self.ruff = ruff if ruff is not None else shutil.which("ruff", path=minimal_path())
        self.isolation = isolation

    def count(self, item: ABInput, output: str | dict[str, Any]) -> DefectCount:
        """The defects in ``output``, an answer to ``item``."""
        claimed = "json" if isinstance(output, dict) else item.kind
        report = self.suite.run([ContractInput(text=output_text(output), claimed_format=claimed)])
        details = [f"L0 {f.check}: {f.reason}" for f in report.failures]
        count = DefectCount(l0=len(report.failures))
        if item.kind == "json":
            missing = self._json_fields(item, output)
            details += missing
            count = count.model_copy(update={"contract": len(missing)})
        elif item.kind == "markdown":
            missing = self._headings(item, output)
            details += missing
            count = count.model_copy(update={"contract": len(missing)})
        else:
            ruff, tests, found = self._python(item, output)
            details += found
            count = count.model_copy(update={"ruff": ruff, "tests": tests})
        return count.model_copy(update={"details": tuple(details)})

    @staticmethod
    def _json_fields(item: ABInput, output: str | dict[str, Any]) -> list[str]:
        if not isinstance(output, dict):
            return ["the output is not a JSON object"] + [
                f"required field {f!r} is missing" for f in item.required_fields
            ]
        return [
            f"required field {f!r} is missing or empty"
            for f in item.required_fields
            if output.get(f) is None or (isinstance(output[f], str) and not output[f].strip())
        ]

    @staticmethod
    def _headings(item: ABInput, output: str | dict[str, Any]) -> list[str]:
        text = output if isinstance(output, str) else json.dumps(output)
        present = {_title(m.group(1)) for m in _HEADING.finditer(text)}
        return [
            f"required section {f!r} has no heading"
            for f in item.required_fields
            if _title(f) not in present
        ]

    def _python(self, item: ABInput, output: str | dict[str, Any]) -> tuple[int, int, list[str]]:
        code = output if isinstance(output, str) else json.dumps(output)
        files = [(f.path, f.content.encode("utf-8")) for f in item.files]
        files.append((SOLUTION_FILE, code.encode("utf-8", "surrogatepass")))
        details: list[str] = []
        with temp_workspace("critique-ab-") as root:
            work = os.path.join(root, "work")
            os.mkdir(work)
            write_workspace(work, files)
            env = scrubbed_env(work)
            ruff = 0
            if self.ruff is not None:
                run = run_confined(
                    [
                        self.ruff,
                        "check",
                        "--isolated",
                        "--no-cache",
                        "--select",
                        RUFF_SELECT,
                        "--output-format",
                        "json",
                        SOLUTION_FILE,
                    ],
                    work,
                    timeout_s=self.timeout_s,
                    env=env,
                    isolation=self.isolation,
                )
                ruff, lines = _ruff_count(run.output, run.exit_code)
                details += lines
            junit = os.path.join(root, "junit.xml")
            run = run_confined(
                [
                    self.python,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--junitxml={junit}",
                ],
                work,
                timeout_s=self.timeout_s,
                env=env,
                isolation=self.isolation,
            )
            tests, lines = _junit_count(junit, run.exit_code, run.timed_out)
            details += lines
        return ruff, tests, details


def _ruff_count(output: str, exit_code: int) -> tuple[int, list[str]]:
    start, end = output.find("["), output.rfind("]")
    try:
        data = json.loads(output[start : end + 1]) if 0 <= start < end else None
    except ValueError:
        data = None
    if not isinstance(data, list):
        return (1, [f"ruff failed (exit {exit_code}) without a report"]) if exit_code else (0, [])
    lines = [
        f"ruff {d.get('code') or 'error'} at line {(d.get('location') or {}).get('row')}: "
        f"{d.get('message')}"
        for d in data
        if isinstance(d, dict)
    ]
    return len(lines), lines


def _junit_count(path: str, exit_code: int, timed_out: bool) -> tuple[int, list[str]]:
    if timed_out:
        return 1, ["pytest timed out"]
    try:
        doc = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return (1, [f"pytest failed (exit {exit_code}) without a report"]) if exit_code else (0, [])
    lines = []
    for case in doc.iter("testcase"):
        for tag in ("failure", "error"):
            for el in case.findall(tag):
                msg = " ".join((el.get("message") or "").split())[:160]
                lines.append(f"test {case.get('name')} {tag}: {msg}")
    if not lines and exit_code != 0:
        return 1, [f"pytest exited {exit_code} without a failing test (nothing collected?)"]
    return len(lines), lines


# -- rows, CSV and the verdict ----------------------------------------------------------------


class ABRow(Frozen):
    """One line of ``ab.csv``."""

    run_id: str
    mode: Mode
    input_id: str
    defects: int = Field(ge=0)
    latency_s: float = Field(ge=0.0)
    tokens_in: int = Field(0, ge=0)
    tokens_out: int = Field(0, ge=0)
    loops: int = Field(0, ge=0)

    def csv_values(self) -> list[str]:
        """The row's cells, in :data:`CSV_COLUMNS` order."""
        return [
            self.run_id,
            self.mode,
            self.input_id,
            str(self.defects),
            f"{self.latency_s:.3f}",
            str(self.tokens_in),
            str(self.tokens_out),
            str(self.loops),
        ]


def write_csv(rows: Sequence[ABRow], path: str | Path) -> None:
    """``ab.csv``: the header :data:`CSV_COLUMNS`, then one line per row."""
    with open(path, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            writer.writerow(row.csv_values())


class ABSummary(Frozen):
    """The experiment's verdict (``--json`` prints it with the rows)."""

    mean_a: float
    mean_b: float
    reduction: float | None
    verdict: Literal["pass", "fail"]
    tokens_per_defect_fixed: float | None


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(rows: Sequence[ABRow]) -> ABSummary:
    """Means per mode, the relative reduction, the verdict, tokens per defect fixed."""
    a = [r for r in rows if r.mode == "A"]
    b = [r for r in rows if r.mode == "B"]
    mean_a = _mean([r.defects for r in a])
    mean_b = _mean([r.defects for r in b])
    reduction = (mean_a - mean_b) / mean_a if mean_a > 0 else None
    passed = reduction is None or round(reduction, 9) >= PASS_REDUCTION
    fixed = sum(r.defects for r in a) - sum(r.defects for r in b)
    spent = sum(r.tokens_in + r.tokens_out for r in b) - sum(r.tokens_in + r.tokens_out for r in a)
    per_fixed = round(spent / fixed, 1) if fixed > 0 else None
    return ABSummary(
        mean_a=round(mean_a, 4),
        mean_b=round(mean_b, 4),
        reduction=round(reduction, 4) if reduction is not None else None,
        verdict="pass" if passed else "fail",
        tokens_per_defect_fixed=per_fixed,
    )


def verdict_line(summary: ABSummary) -> str:
    """``verdict: pass — defects per output 2.00 (A) → 0.00 (B): 100.0% fewer (…)``."""
    if summary.reduction is None:
        change = "A has no defects: nothing to reduce"
    else:
        change = f"{summary.reduction * 100:.1f}% fewer"
    tokens = (
        f"; {summary.tokens_per_defect_fixed:,.1f} tokens per defect fixed"
        if summary.tokens_per_defect_fixed is not None
        else "; no defect fixed"
    )
    return (
        f"verdict: {summary.verdict} — defects per output {summary.mean_a:.2f} (A) → "
        f"{summary.mean_b:.2f} (B): {change} (pass at ≥ {PASS_REDUCTION * 100:.0f}%){tokens}"
    )


# -- escalations ------------------------------------------------------------------------------


def _fence_for(text: str) -> str:
    longest = max((len(m.group()) for m in re.finditer(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def _defect_md(d: Defect) -> str:
    """``category at location: description``, worker-made text shown literally in Markdown."""
    where = f" at {md_text(d.location)}" if d.location else ""
    return f"{md_text(d.category)}{where}: {md_text(d.description)}"


def escalation_markdown(
    row: ABRow,
    result: CritiqueResult,
    counted: DefectCount,
    *,
    retry_command: str,
) -> str:
    """``escalations/<run_id>.md`` for a B row whose pipeline did not accept the output:
    three summary lines, the three choices, the remaining defects and the best output."""
    remaining = result.envelope.actionable
    first = remaining[0] if remaining else None
    first_line = (
        f"First remaining: [{first.severity}] {_defect_md(first)}"
        if first
        else f"No defect listed by the critic; `critique status {row.run_id}` shows the trace."
    )
    text = result.output if isinstance(result.output, str) else json.dumps(result.output, indent=2)
    fence = _fence_for(text)
    lines = [
        f"# Escalation: {row.input_id} ({row.run_id})",
        "",
        f"{row.input_id} ended `{result.status}` ({result.stop_reason}) after "
        f"{len(result.attempts)} repair(s): score {result.score_text()}.  ",
        f"{len(remaining)} defect(s) remain by the critic; the independent counter finds "
        f"{counted.total} in the best output.  ",
        first_line,
        "",
        "## Choices",
        "",
        f"- **retry** — run it again, e.g. with a stronger model or more "
        f"`max_repair_attempts` on the workers: `{retry_command}`",
        f"- **accept best** — take the best output below as it is (score "
        f"{'no score' if result.best_score is None else f'{result.best_score:.2f}'}); the "
        "remaining defects ship with it.",
        "- **manual** — fix the remaining defects by hand: they are listed below with where "
        "they are.",
        "",
        "## Remaining defects",
        "",
    ]
    lines += [f"- [{d.severity}] {_defect_md(d)}" for d in remaining] or [
        "- (none listed by the critic)"
    ]
    if counted.details:
        lines += ["", "## Counted by the independent counter", ""]
        lines += [f"- {md_text(d)}" for d in counted.details]
    if result.notes:
        lines += ["", "## Notes", ""] + [f"- {md_text(n)}" for n in result.notes]
    lines += ["", "## Best output", "", fence, text.rstrip("\n"), fence, ""]
    return "\n".join(lines)
