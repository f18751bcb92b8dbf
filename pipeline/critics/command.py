"""The command critic: the worker's own test or lint command judges a code output.

``critic: command`` runs the argv of the worker's ``command`` setting (worker-only, see
docs/security.md, 'Who may set what': a submission may choose the critic, never the argv) with
``command_timeout_s``, confined by :mod:`pipeline.security.sandbox`: a fresh temp dir, a scrubbed
environment, resource limits, the process group killed at the limit, no network where
``unshare -rn`` works.

**The workspace.** Every file of the submission (inline, or by reference through the injected
reader, :mod:`pipeline.records.files`) at its relative path, plus the output being critiqued written
as a file: ``solution.py`` for ``claimed_format: python`` (so tests ``from solution import …``),
``output.json`` for JSON (and any dict output), ``output.md``, ``output.tex``, else
``output.txt``. A submission file with that same name is left out (the output — the thing
being repaired — takes its place; a note says so). Metadata-only files have nothing to write.

**The verdict.** Exit 0 → no defects, score 1.0. Otherwise each failure the tool reports
(:mod:`pipeline.critics.toolparse`: pytest — the critic adds ``--junitxml`` —, ruff JSON, mypy,
generic ``path:line:``) is one critical defect, source ``command``, located ``file:line``, its
description carrying the failing statement and expected/actual values (the LLM repairer's prompt
quotes descriptions, so the repair sees the assertion). Categories: a failing test, a time-out
or an unexplained exit → ``incomplete``; a lint or type error → ``wrong_format`` (the first
configured category when those are not configured). A non-zero exit that parses to nothing is
one defect with the output's tail; the time limit is one time-out defect. At most
:data:`MAX_DEFECTS` are listed. Score with ``n`` failures: ``max(0.3, 0.55 − 0.02·(n−1))`` —
in the repair band (never the escalate band: failing tests are what repair is for), and higher
with fewer failures, so a repair that fixes some of them is an improvement.

**Composition.** The command critic wraps a *companion* critic and merges: the command's
defects first, then the companion's; the score is the lower of the two; usage, patterns and any
fallback reason are the companion's. :func:`pipeline.wiring.pick_critic` gives it the heuristic
(token-free, so ``critic: command`` spends no tokens and runs on ``critique.cpu``); code may
pass any critic (an :class:`~pipeline.critics.llm.LLMCritic` for "tests, then the LLM's
judgement"). Repairs pair with the LLM reviser when the submission's model resolves, else the
deterministic reviser, which cannot fix a failing test: the submission then ends ``escalated``
with ``needs_model``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.config import CritiqueConfig
from pipeline.critics.base import Critic, clamp_score
from pipeline.critics.heuristic import HeuristicCritic
from pipeline.critics.toolparse import (
    Tool,
    ToolFailure,
    detect_tool,
    parse_failures,
    prepare_argv,
)
from pipeline.errors import ConfigError
from pipeline.models import (
    CritiqueEnvelope,
    Defect,
    ReusablePattern,
    Submission,
)
from pipeline.records.files import FileReader, inline_bytes
from pipeline.records.files import read_file as read_file_bytes
from pipeline.security.sandbox import (
    Isolation,
    Limits,
    RunResult,
    run_confined,
    scrubbed_env,
    temp_workspace,
    write_workspace,
)

OUTPUT_FILES: dict[str, str] = {
    "python": "solution.py",
    "json": "output.json",
    "markdown": "output.md",
    "latex": "output.tex",
    "text": "output.txt",
}
"""The file the output is written to, by claimed format (a dict output is always JSON)."""
DEFAULT_OUTPUT_FILE = "output.txt"
MAX_DEFECTS = 50
"""Failures listed per critique; the rest are counted in one more defect."""
FAILED_SCORE = 0.55
"""Score with one failure; each further failure takes :data:`PER_FAILURE` off, down to
:data:`FLOOR` (the bottom of the repair band)."""
PER_FAILURE = 0.02
FLOOR = 0.3
TEST_CATEGORY = "incomplete"
"""A failing test, a time-out, an unexplained non-zero exit: the code does not yet do the task."""
LINT_CATEGORY = "wrong_format"
"""A lint or type error."""
TAIL_CHARS = 1200
MAX_KNOWN_FILES = 10_000


def output_filename(submission: Submission, output: str | dict[str, Any]) -> str:
    """Where the output is written in the command's workspace (see the module docstring)."""
    if isinstance(output, dict):
        return OUTPUT_FILES["json"]
    return OUTPUT_FILES.get(submission.claimed_format or "", DEFAULT_OUTPUT_FILE)


def command_score(failures: int) -> float:
    """1.0 for none; ``max(0.3, 0.55 − 0.02·(failures − 1))`` otherwise."""
    if failures <= 0:
        return 1.0
    return clamp_score(max(FLOOR, FAILED_SCORE - PER_FAILURE * (failures - 1)))


def category_for(tool: Tool | None, categories: Sequence[str]) -> str:
    """The defect category for a failure of ``tool`` (None: a time-out or a bare exit)."""
    wanted = LINT_CATEGORY if tool in ("ruff", "mypy", "generic") else TEST_CATEGORY
    return wanted if wanted in categories else categories[0]


def _exit_text(run: RunResult) -> str:
    if run.exit_code >= 0:
        return f"exited {run.exit_code}"
    try:
        name = signal.Signals(-run.exit_code).name
    except ValueError:
        name = f"signal {-run.exit_code}"
    why = {"SIGXCPU": " (CPU limit)", "SIGXFSZ": " (file size limit)", "SIGKILL": ""}
    return f"was killed by {name}{why.get(name, '')}"


class CommandOutcome:
    """One command run over one output: what ran, how it ended, the failures it reported."""

    def __init__(
        self,
        argv: Sequence[str],
        run: RunResult,
        tool: Tool | None,
        failures: Sequence[ToolFailure],
        notes: Sequence[str],
    ) -> None:
        self.argv = tuple(argv)
        self.run = run
        self.tool = tool
        self.failures = tuple(failures)
        self.notes = tuple(notes)


class CommandCritic:
    """``critic: command``: the worker's command on the submission's files, merged with a
    companion critic's envelope (module docstring)."""

    name = "command"

    def __init__(
        self,
        config: CritiqueConfig,
        *,
        companion: Critic | None = None,
        read_file: FileReader | None = None,
        isolation: Isolation | None = None,
        limits: Limits | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if not config.command:
            raise ConfigError(
                "critic 'command' needs the worker's 'command' (the test/lint argv to run)",
                key="command",
                hint="set it in the worker's workflow file (command: [python, -m, pytest, -q]) "
                "or environment (CRITIQUE_COMMAND='python -m pytest -q'); a submission may "
                "not set it",
            )
        self.config = config
        self.argv: tuple[str, ...] = tuple(config.command)
        self.timeout_s = config.command_timeout_s
        self.companion: Critic = companion if companion is not None else HeuristicCritic()
        self.read_file: FileReader = read_file if read_file is not None else inline_bytes
        self.isolation = isolation
        self.limits = limits if limits is not None else Limits.for_timeout(self.timeout_s)
        self.environ = environ
        self.tool = detect_tool(self.argv)
        self.token_free: bool = self.companion.token_free
        self.reads_pitfalls: bool = self.companion.reads_pitfalls

    # -- running ----------------------------------------------------------------------------------
    def run(self, submission: Submission, output: str | dict[str, Any]) -> CommandOutcome:
        """Write the workspace, run the command in it, parse what it reported."""
        notes: list[str] = []
        out_name = output_filename(submission, output)
        files: list[tuple[str, bytes]] = []
        for f in submission.files:
            if f.path == out_name:
                notes.append(f"file {f.path} left out: the output is written there")
                continue
            data = read_file_bytes(f, self.read_file)
            if data is None:
                notes.append(f"file {f.path} has no content (metadata only): not written")
                continue
            files.append((f.path, data))
        text = (
            json.dumps(output, ensure_ascii=False, indent=2) + "\n"
            if isinstance(output, dict)
            else output
        )
        files.append((out_name, text.encode("utf-8", "surrogatepass")))
        with temp_workspace() as root:
            work = os.path.join(root, "work")
            os.mkdir(work)
            write_workspace(work, files)
            junit = os.path.join(root, "junit.xml")
            argv = prepare_argv(self.argv, self.tool, junit)
            run = run_confined(
                argv,
                work,
                timeout_s=self.timeout_s,
                env=scrubbed_env(work, self.environ),
                limits=self.limits,
                isolation=self.isolation,
            )
            failures: list[ToolFailure] = []
            if not run.passed and not run.timed_out:
                junit_xml = _read_text(junit) if self.tool == "pytest" else None
                roots = list(dict.fromkeys([work, os.path.realpath(work)]))
                failures = parse_failures(self.tool, run.output, junit_xml, roots, _known(work))
        return CommandOutcome(self.argv, run, self.tool, failures, notes)

    # -- the critic -------------------------------------------------------------------------------
    def defects(self, outcome: CommandOutcome) -> list[Defect]:
        """The outcome as defects (source ``command``, critical): one per failure (at most
        :data:`MAX_DEFECTS`, then one counting the rest), a time-out defect, or one defect
        with the output's tail for a failing exit that names no failure."""
        run = outcome.run
        shown = shlex.join(outcome.argv)
        categories = self.config.defect_categories
        if run.timed_out:
            tail = run.tail(TAIL_CHARS // 2)
            return [
                _defect(
                    category_for(None, categories),
                    None,
                    f"command `{shown}` did not finish within {self.timeout_s:g} s: its "
                    f"process group was killed (time-out)"
                    + (f". Last output: {tail}" if tail else ""),
                )
            ]
        if run.passed:
            return []
        if not outcome.failures:
            tail = run.tail(TAIL_CHARS)
            return [
                _defect(
                    category_for(None, categories),
                    None,
                    f"command `{shown}` {_exit_text(run)} and its output names no failure"
                    + (f": {tail}" if tail else " (no output)"),
                )
            ]
        defects: dict[str, Defect] = {}
        for failure in outcome.failures:
            d = _defect(
                category_for(failure.tool, categories), failure.location, failure.describe()
            )
            defects.setdefault(d.id, d)
        listed = list(defects.values())
        if len(listed) > MAX_DEFECTS:
            rest = len(listed) - MAX_DEFECTS
            listed = listed[:MAX_DEFECTS]
            listed.append(
                _defect(
                    category_for(outcome.tool, categories),
                    None,
                    f"command `{shown}` reported {rest} more failure(s), not listed",
                )
            )
        return listed

    def critique(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        pitfalls: str = "",
        round: int = 1,
    ) -> CritiqueEnvelope:
        """Run the command, then the companion; merge (module docstring)."""
        outcome = self.run(submission, output)
        found = self.defects(outcome)
        base = self.companion.critique(submission, output, pitfalls=pitfalls, round=round)
        own = command_score(len(found))
        score = clamp_score(min(own, base.score))
        defects = (*found, *base.defects)
        run = outcome.run
        status = (
            "timed out"
            if run.timed_out
            else "passed"
            if run.passed
            else f"{_exit_text(run)}, {len(found)} failure(s)"
        )
        summary = (
            f"command `{shlex.join(outcome.argv)}` {status} in {run.elapsed_s:.2f} s "
            f"({run.isolation}; limits: {run.limits})."
        )
        if outcome.notes:
            summary += " " + "; ".join(outcome.notes) + "."
        if base.summary:
            summary += f" {base.summary}"
        prescriptions = tuple(
            f"Change the output so this check passes: {d.description}" for d in found[:10]
        )
        patterns: tuple[ReusablePattern, ...] = ()
        if found:
            patterns = (
                ReusablePattern(
                    category=found[0].category,
                    description=f"the output failed the worker's check `{outcome.argv[0]}`",
                    prevention_rule="Run the given tests and linters on your code and make "
                    "them pass before returning it",
                ),
            )
        return base.model_copy(
            update={
                "score": score,
                "defects": defects,
                "prescriptions": (*prescriptions, *base.prescriptions),
                "reusable_patterns": (*patterns, *base.reusable_patterns),
                "summary": summary,
                "critic": self.name,
            }
        )


def _defect(category: str, location: str | None, description: str) -> Defect:
    return Defect(
        category=category,
        severity="critical",
        location=location,
        description=description,
        source="command",
    )


def _read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(16 << 20).decode("utf-8", "replace")
    except OSError:
        return None


def _known(work: str) -> frozenset[str]:
    """Relative paths of the files in the workspace after the run (at most 10,000)."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(work):
        dirnames[:] = [d for d in dirnames if not d.startswith((".git", "__pycache__"))]
        rel = os.path.relpath(dirpath, work)
        for name in filenames:
            found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
            if len(found) >= MAX_KNOWN_FILES:
                return frozenset(found)
    return frozenset(found)
