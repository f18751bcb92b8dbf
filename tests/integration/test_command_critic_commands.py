"""The command critic in the broker-free loop: real commands in the sandbox, no Redis.

What it pins: the workspace (output file, submission files inline and by reference), the
verdict (passing → 1.0, each failure a located ``command`` defect, a bare failing exit → the
tail, the time limit → a time-out defect), the merge with the heuristic, and the pairing with
revisers (deterministic → needs_model; the LLM reviser's prompt carries the assertion).
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
from typing import Any

import pytest

from pipeline.config import CritiqueConfig
from pipeline.critics.base import resolve_for
from pipeline.critics.command import (
    CommandCritic,
    category_for,
    command_score,
    output_filename,
)
from pipeline.critics.heuristic import HeuristicCritic, HeuristicReviser
from pipeline.critics.llm import LLMReviser
from pipeline.critics.llm_prompts import build_repair_prompt
from pipeline.errors import ConfigError
from pipeline.loop.stages import run_submission
from pipeline.models import FileRef, Submission
from pipeline.security.sandbox import NO_ISOLATION
from pipeline.wiring import make_context

PYTEST = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider")
TEST = "from solution import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
GOOD, BAD = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n"


def config(*argv: str, timeout: float = 20, **kw: Any) -> CritiqueConfig:
    return CritiqueConfig(
        enabled=True, critic="command", command=argv or PYTEST, command_timeout_s=timeout, **kw
    )


def sub(output: Any = BAD, *files: FileRef, fmt: str | None = "python", **kw: Any) -> Submission:
    files = files or (FileRef(path="test_solution.py", size=len(TEST), content=TEST),)
    return Submission(
        run_id="r1",
        worker_id="w1",
        task="Write add(a, b).",
        output=output,
        claimed_format=fmt,  # type: ignore[arg-type]
        files=files,
        **kw,
    )


def critic(cfg: CritiqueConfig, **kw: Any) -> CommandCritic:
    return CommandCritic(cfg, isolation=NO_ISOLATION, **kw)


def test_critic_command_needs_the_workers_command() -> None:
    """Without ``command`` the critic cannot be built: a ConfigError naming ``command``."""
    with pytest.raises(ConfigError, match="needs the worker's 'command'") as info:
        make_context(CritiqueConfig(critic="command"))
    assert info.value.key == "command"
    ctx = make_context(config())
    assert isinstance(ctx.critic, CommandCritic) and ctx.critic.token_free


def test_passing_tests_score_one_with_no_defect() -> None:
    """Exit 0: score 1.0, no defects, the summary says passed and how it was isolated."""
    env = critic(config()).critique(sub(GOOD), GOOD)
    assert (env.score, env.defects, env.critic, env.band) == (1.0, (), "command", "accept")
    assert "passed" in env.summary and "not isolated" in env.summary


def test_a_failing_test_is_a_located_defect_carrying_the_assertion() -> None:
    """One critical ``command`` defect at test_solution.py:5 (category incomplete) whose
    description quotes the assertion with expected/actual; score 0.55; a prescription and a
    reusable pattern come with it; the LLM reviser's prompt (which lists the descriptions)
    therefore carries the assertion and its values."""
    s = sub()
    env = critic(config()).critique(s, BAD)
    [d] = env.defects
    assert (d.location, d.severity, d.source, d.category) == (
        "test_solution.py:5",
        "critical",
        "command",
        "incomplete",
    )
    assert d.description == (
        "test test_add failed: `assert add(2, 3) == 5` — expected 5, got -1 (where -1 = add(2, 3))"
    )
    assert (env.score, env.band) == (0.55, "repair")
    assert "assert add(2, 3) == 5" in env.prescriptions[0]
    assert env.reusable_patterns[0].category == "incomplete"
    prompt = build_repair_prompt(s, BAD, env, "", ())
    assert "`assert add(2, 3) == 5` — expected 5, got -1" in prompt


def test_the_heuristic_companion_is_merged() -> None:
    """The companion's defects follow the command's, the score is the lower of the two."""
    md = "# Notes\n\nnothing here\n"
    s = sub(md, FileRef(path="check.sh", size=1, content="x"), fmt="markdown").model_copy(
        update={"required_fields": ("Summary", "Findings")}
    )
    env = critic(config("true")).critique(s, md)
    assert [d.source for d in env.defects] == ["heuristic", "heuristic"]
    assert env.score == HeuristicCritic().critique(s, md).score == 0.6
    failing = critic(config("false")).critique(s, md)
    assert [d.source for d in failing.defects] == ["command", "heuristic", "heuristic"]
    assert failing.score == 0.55


def test_a_failing_exit_without_a_parseable_failure_carries_the_tail() -> None:
    """A non-zero exit whose output names no failure: one defect with the output's tail."""
    env = critic(config("sh", "-c", "echo first line; echo the end >&2; exit 3")).critique(
        sub(), BAD
    )
    [d] = env.defects
    assert d.location is None and d.source == "command"
    assert "exited 3 and its output names no failure" in d.description
    assert d.description.endswith("first line\nthe end")


def test_the_time_limit_is_a_time_out_defect() -> None:
    """A command past command_timeout_s: its group is killed, one time-out defect."""
    env = critic(config("sh", "-c", "echo started; sleep 30", timeout=0.5)).critique(sub(), BAD)
    [d] = env.defects
    assert "did not finish within 0.5 s: its process group was killed (time-out)" in d.description
    assert "Last output: started" in d.description
    assert env.score == 0.55 and "timed out" in env.summary


def test_the_workspace_holds_the_output_and_every_file() -> None:
    """The output is written as solution.py (python), output.json (a dict), output.md …;
    files by reference are read through the injected reader; a metadata-only file and a file
    named like the output are left out, with a note."""
    listing = ("sh", "-c", "find . -type f | sort; cat data/blob.txt; exit 1")
    blob = FileRef(path="data/blob.txt", size=9, blob="sha256:" + "a" * 64)
    shadow = FileRef(path="solution.py", size=3, content="old")
    meta = FileRef(path="image.png", size=2048)
    env = critic(config(*listing), read_file=lambda f: b"from blob" if f.blob else None).critique(
        sub(GOOD, blob, shadow, meta), GOOD
    )
    [d] = env.defects
    assert "./data/blob.txt\n./solution.py\nfrom blob" in d.description
    assert "file solution.py left out: the output is written there" in env.summary
    assert "file image.png has no content (metadata only)" in env.summary
    assert output_filename(sub(), {"a": 1}) == "output.json"
    assert output_filename(sub(fmt="markdown"), "x") == "output.md"
    assert output_filename(sub(fmt=None), "x") == "output.txt"


def test_lint_failures_are_wrong_format_at_their_line() -> None:
    """ruff through the critic: JSON output is asked for and each diagnostic is a defect."""
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable))
    assert ruff is not None
    cfg = config(ruff, "check", "--isolated", "--no-cache", "--select", "F", "solution.py")
    env = critic(cfg).critique(sub(), "import os\n\n\ndef f():\n    return y\n")
    assert [(d.location, d.category) for d in env.defects] == [
        ("solution.py:1", "wrong_format"),
        ("solution.py:5", "wrong_format"),
    ]
    assert env.defects[1].description == "ruff F821: Undefined name `y`"


def test_scores_fall_with_failures_but_stay_in_the_repair_band() -> None:
    """Fewer failures score strictly higher (a partial fix is an improvement); never < 0.3."""
    scores = [command_score(n) for n in range(0, 20)]
    assert scores[:4] == [1.0, 0.55, 0.53, 0.51]
    assert all(a >= b for a, b in itertools.pairwise(scores)) and min(scores) == 0.3
    assert category_for("pytest", ("incomplete",)) == "incomplete"
    assert category_for("ruff", ("a", "b")) == "a"  # not configured: the first category


def test_without_a_model_the_deterministic_reviser_escalates_needs_model() -> None:
    """The heuristic reviser cannot fix a failing test: escalated / needs_model, the defect
    listed in the notes; with the submission's model the LLM reviser serves it."""
    cfg = config()
    ctx = make_context(cfg, critic=critic(cfg))
    result = run_submission(sub(), ctx)
    assert (result.status, result.stop_reason, result.attempts) == ("escalated", "needs_model", ())
    assert any("assert add(2, 3) == 5" in n for n in result.notes)
    assert isinstance(resolve_for(ctx.reviser, sub()), HeuristicReviser)
    assert isinstance(resolve_for(ctx.reviser, sub(model="openai/gpt-4o-mini")), LLMReviser)


def test_the_command_critic_runs_on_the_cpu_queue() -> None:
    """Token-free, seconds long: critique.critic for ``critic: command`` is routed to
    critique.cpu even when the submission names a model (only LLM critics go to critique.llm)."""
    import workers.tasks  # noqa: F401  (registers the stage tasks the signature is built from)
    from workers.app import app
    from workers.routing import stage_signature

    s = sub(model="openai/gpt-4o-mini")
    sig = stage_signature("critic", {}, config(), s)
    assert sig.options["queue"] == "critique.cpu"
    assert app.amqp.router.route({}, sig.task)["queue"].name == "critique.cpu"
    llm = stage_signature("critic", {}, CritiqueConfig(enabled=True), s)
    assert llm.options["queue"] == "critique.llm"
