"""The broker-free runner: stage sequencing, Layer-0 handling, trace, patterns, the CLI."""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import CritiqueConfig
from pipeline.critics.base import RevisionResult
from pipeline.critics.heuristic import HeuristicCritic, HeuristicReviser
from pipeline.critics.rubric import DeterministicReviser, RubricCritic
from pipeline.errors import ConfigError, ExtensionLoadError, SubmissionError
from pipeline.loop.stages import (
    DISABLED_NOTE,
    STAGES,
    L0Outcome,
    LoopState,
    finish,
    run_submission,
    start,
)
from pipeline.models import (
    CritiqueEnvelope,
    CritiqueResult,
    Defect,
    GateEvent,
    RepairAttempt,
    Submission,
    Usage,
)
from pipeline.wiring import make_context

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "paper_draft.json"
TASK = "Report the quarterly sales summary as JSON with a confidence."
PLACEHOLDER_LINE = "# Summary\n\nSales grew.\n\nTODO\n"
"""A text output whose only defect the token-free reviser can fix: a placeholder-only line."""
DUPLICATE_HEADING = "# Summary\n\nSales grew.\n\n## Notes\n\nA.\n\n## Notes\n\nB.\n"
"""A text output whose only defect is a duplicate heading (renamed "Notes (2)" by a repair)."""


def _no_l0(sub: Submission, output: Any, previous_size: int | None) -> L0Outcome:
    return L0Outcome()


def _never(previous: str, current: str) -> bool:
    return False


def _sub(output: Any, required: tuple[str, ...] = ("summary",), **kw: Any) -> Submission:
    return Submission(
        run_id="run-1",
        worker_id="w1",
        task=TASK,
        output=output,
        required_fields=required,
        **kw,
    )


def _placeholder_l0(calls: list[int | None]) -> Any:
    """A fake L0 that flags the word TODO as an error and records previous sizes."""

    def l0(sub: Submission, output: Any, previous_size: int | None) -> L0Outcome:
        calls.append(previous_size)
        text = output if isinstance(output, str) else json.dumps(output, indent=2)
        if "TODO" not in text:
            return L0Outcome()
        defect = Defect(
            category="incomplete",
            severity="critical",
            location=f"output:{text.index('TODO')}",
            description="L0 no_placeholder: placeholder 'TODO' found",
            source="l0",
            check="no_placeholder",
        )
        gate = GateEvent(
            gate="l0",
            verdict="reject",
            reason="placeholder 'TODO' found",
            worker_id=sub.worker_id,
            l0_check="no_placeholder",
            l0_reason="placeholder 'TODO' found",
            violating_path="output",
        )
        return L0Outcome(defects=(defect,), gate_events=(gate,))

    return l0


class SpendingCritic:
    """A token-spending critic (token_free = False) that must not run when L0 fails."""

    name = "llm:fake"
    token_free = False
    reads_pitfalls = True

    def __init__(self) -> None:
        self.rounds: list[int] = []

    def critique(
        self, submission: Submission, output: Any, *, pitfalls: str, round: int
    ) -> CritiqueEnvelope:
        self.rounds.append(round)
        env = HeuristicCritic().critique(submission, output, pitfalls=pitfalls, round=round)
        return env.model_copy(
            update={"usage": Usage(tokens_in=100, tokens_out=20, calls=1), "critic": self.name}
        )


def test_stages_are_keyed_by_next_and_state_is_json_safe() -> None:
    """Stepping through STAGES by state.next reaches done; each state round-trips via JSON."""
    ctx = make_context(CritiqueConfig(enabled=True), fixpoint=_never)
    state = start(_sub(DUPLICATE_HEADING, claimed_format="markdown"))
    seen = []
    while state.next != "done":
        seen.append(state.next)
        state = STAGES[state.next](state, ctx)
        again = LoopState.model_validate_json(state.model_dump_json())
        assert again == state
    assert seen == ["l0", "critic", "decide", "repair", "l0", "critic", "decide"]
    result = finish(state)
    assert (result.status, result.stop_reason) == ("repaired", "accepted")
    assert result.output == DUPLICATE_HEADING.replace("## Notes\n\nB", "## Notes (2)\n\nB")
    assert CritiqueResult.model_validate_json(result.model_dump_json()) == result


def test_finish_refuses_an_unfinished_loop() -> None:
    """finish() on a state that is not done is an error, not a half result."""
    with pytest.raises(ValueError, match="not finished"):
        finish(start(_sub({"confidence": 0.9})))


def test_l0_error_skips_a_token_spending_critic() -> None:
    """When L0 fails the configured LLM critic is not called; the score is heuristic − 0.2."""
    critic = SpendingCritic()
    sizes: list[int | None] = []
    ctx = make_context(
        CritiqueConfig(enabled=True),
        critic=critic,
        reviser=HeuristicReviser(),
        l0=_placeholder_l0(sizes),
        fixpoint=_never,
    )
    output = PLACEHOLDER_LINE
    result = run_submission(_sub(output), ctx)
    assert critic.rounds == [2]  # round 1 was token-free
    first = result.trace[0]
    assert first.score == pytest.approx(0.8)
    assert result.attempts[0].original_score == pytest.approx(0.8)
    assert (result.status, result.stop_reason) == ("repaired", "accepted")
    assert result.output == "# Summary\n\nSales grew.\n"
    assert result.usage.calls == 1  # only the re-critique called the critic
    assert result.usage == result.repair_usage  # round 1 spent nothing
    assert sizes[0] is None
    assert sizes[1] == len(output.encode())


def test_l0_gate_events_and_stage_events_reach_the_trace() -> None:
    """Every stage writes an event; L0 failures also write their GateEvent (type gate)."""
    ctx = make_context(CritiqueConfig(enabled=True), l0=_placeholder_l0([]), fixpoint=_never)
    run_submission(_sub(PLACEHOLDER_LINE), ctx)
    events = ctx.trace.read("run-1")
    kinds = [(e["type"], e["stage"]) for e in events]
    assert kinds[:3] == [("stage", "l0"), ("gate", "l0"), ("stage", "critic")]
    assert ("stage", "repair") in kinds
    assert kinds[-1] == ("result", "result")
    gate = events[1]
    assert gate["l0_check"] == "no_placeholder" and gate["verdict"] == "reject"
    rounds = [e for e in events if e["type"] == "round"]
    assert [e["round"] for e in rounds] == [1, 2]
    assert all({"worker_id", "iteration", "round"} <= set(e) for e in events)


def test_token_free_rubric_critic_runs_even_when_l0_fails() -> None:
    """A token-free critic keeps its dimension scores on an L0 failure, minus the penalty."""
    draft = json.loads(FIXTURE.read_text())
    draft["abstract"] = "TODO"
    ctx = make_context(
        CritiqueConfig(enabled=True, critic="rubric"),
        l0=_placeholder_l0([]),
        fixpoint=_never,
    )
    result = run_submission(_sub(draft, ()), ctx)
    first = result.trace[0]
    assert set(first.scores) == {"clarity", "novelty", "evidence", "methodology", "related_work"}
    assert first.score == pytest.approx(first.mean / 10 - 0.2, abs=1e-6)
    assert result.stop_reason != "target"  # the L0 error is critical: target is not met


def test_patterns_are_recorded_per_critique_and_feed_pitfalls() -> None:
    """Each critique records its patterns once under worker:iteration:round; pitfalls follow."""
    seen_pitfalls: list[str] = []

    class Peeking(HeuristicCritic):
        reads_pitfalls = True

        def critique(self, submission: Submission, output: Any, **kw: Any) -> CritiqueEnvelope:
            seen_pitfalls.append(kw["pitfalls"])
            return super().critique(submission, output, **kw)

    ctx = make_context(CritiqueConfig(enabled=True), critic=Peeking(), l0=_no_l0, fixpoint=_never)
    run_submission(_sub({"confidence": 0.9}), ctx)
    top = ctx.patterns.top("run-1")
    assert [(p.category, p.prevention_rule) for p in top] == [
        ("missing_data", "Always include the 'summary' field in your output")
    ]
    assert seen_pitfalls == [""]  # one critique: nothing fixable, so no repair round
    # a second worker in the same run starts with the pitfalls of the first
    run_submission(_sub({"confidence": 0.9}).model_copy(update={"worker_id": "w2"}), ctx)
    assert "- [seen 1x] missing_data: Always include the 'summary' field" in seen_pitfalls[1]
    assert ctx.patterns.top("run-1")[0].frequency == 2


def test_deterministic_critics_are_not_handed_pitfalls() -> None:
    """A critic or reviser with reads_pitfalls = False gets "" (the store is not even read)."""
    seen: list[str] = []

    class Peeking(HeuristicCritic):
        def critique(self, submission: Submission, output: Any, **kw: Any) -> CritiqueEnvelope:
            seen.append(kw["pitfalls"])
            return super().critique(submission, output, **kw)

    ctx = make_context(CritiqueConfig(enabled=True), critic=Peeking(), l0=_no_l0, fixpoint=_never)
    run_submission(_sub({"confidence": 0.9}), ctx)
    run_submission(_sub({"confidence": 0.9}).model_copy(update={"worker_id": "w2"}), ctx)
    assert ctx.patterns.top("run-1")[0].frequency == 2
    assert seen and set(seen) == {""}


def test_pattern_memory_off_records_nothing() -> None:
    """pattern_memory: false records no patterns and passes empty pitfalls."""
    ctx = make_context(
        CritiqueConfig(enabled=True, pattern_memory=False), l0=_no_l0, fixpoint=_never
    )
    run_submission(_sub({"confidence": 0.9}), ctx)
    assert ctx.patterns.top("run-1") == []


def test_disabled_passes_through_unchecked_with_no_score() -> None:
    """enabled: false returns the output unchanged as ``unchecked`` (stop ``disabled``), with no
    score (never accepted, never 1.00), no stage run, no usage, and one result trace event."""

    def explode(*_: Any) -> L0Outcome:
        raise AssertionError("no stage may run when critique is disabled")

    ctx = make_context(CritiqueConfig(enabled=False), l0=explode, fixpoint=_never)
    result = run_submission(_sub("anything TODO"), ctx)
    assert (result.status, result.stop_reason) == ("unchecked", "disabled")
    assert (result.original_score, result.best_score, result.checked) == (None, None, False)
    assert "no score" in str(result) and "accepted" not in str(result)
    assert result.output == "anything TODO"
    assert result.usage == Usage() and result.trace == () and result.attempts == ()
    assert DISABLED_NOTE in result.notes
    [event] = ctx.trace.read("run-1")
    assert (event["type"], event["status"], event["best_score"]) == ("result", "unchecked", None)


def test_default_config_checks_a_todo_output_instead_of_accepting_it() -> None:
    """With no configuration at all critique is on: a TODO placeholder is not accepted."""
    result = run_submission(
        _sub("# Q3 report\n\nTODO: fill in the numbers."),
        make_context(CritiqueConfig(), fixpoint=_never),
    )
    assert result.checked and result.status not in ("accepted", "accepted_with_warnings")
    assert result.best_score is not None and result.best_score < 1.0


def test_make_context_picks_critic_and_reviser_from_config() -> None:
    """heuristic → heuristic pair; rubric → rubric pair; auto → resolved per submission (the
    LLM pair when a model resolves, the heuristic pair otherwise); llm → the LLM pair."""
    from pipeline.critics.base import resolve_for
    from pipeline.critics.llm import LLMCritic, LLMReviser, PairedCritic
    from pipeline.wiring import AutoCritic, AutoReviser

    def never(request: Any) -> Any:
        raise AssertionError("no LLM call expected")

    ctx = make_context(CritiqueConfig(critic="heuristic"), complete=never)
    assert isinstance(ctx.critic, HeuristicCritic) and isinstance(ctx.reviser, HeuristicReviser)
    ctx = make_context(CritiqueConfig(critic="rubric"), complete=never)
    assert isinstance(ctx.critic, RubricCritic) and isinstance(ctx.reviser, DeterministicReviser)

    ctx = make_context(CritiqueConfig(), complete=never)
    assert isinstance(ctx.critic, AutoCritic) and isinstance(ctx.reviser, AutoReviser)
    plain, with_model = _sub({}), _sub({}).model_copy(update={"model": "openai/gpt-4o-mini"})
    assert isinstance(resolve_for(ctx.critic, plain), HeuristicCritic)
    assert isinstance(resolve_for(ctx.reviser, plain), HeuristicReviser)
    assert isinstance(resolve_for(ctx.critic, with_model), LLMCritic)
    assert isinstance(resolve_for(ctx.reviser, with_model), LLMReviser)

    ctx = make_context(CritiqueConfig(critic="llm", paired_critic=True), complete=never)
    assert isinstance(ctx.critic, PairedCritic)
    assert isinstance(resolve_for(ctx.reviser, plain), LLMReviser)
    ctx = make_context(CritiqueConfig(repairer="deterministic"), complete=never)
    assert isinstance(ctx.reviser, HeuristicReviser)
    with pytest.raises(ConfigError, match="critic"):
        make_context(CritiqueConfig(critic="command"))
    with pytest.raises(ExtensionLoadError):
        make_context(CritiqueConfig(repairer="no_such_module_xyz:fix"))


def _function_repairer(
    submission: Submission,
    output: Any,
    envelope: CritiqueEnvelope,
    *,
    pitfalls: str,
    attempts: Sequence[RepairAttempt],
) -> dict[str, Any]:
    return {**output, "summary": "fixed by a function"}


def test_configured_function_repairer_is_loaded() -> None:
    """repairer 'module:function' loads a plain function; a bare output reports no usage (0:
    the text it handled is not usage)."""
    config = CritiqueConfig(enabled=True, repairer="tests.unit.test_runner:_function_repairer")
    ctx = make_context(config, l0=_no_l0, fixpoint=_never)
    result = run_submission(_sub({"confidence": 0.9}), ctx)
    assert result.output == {"confidence": 0.9, "summary": "fixed by a function"}
    assert result.repair_usage == Usage()


def _reporting_repairer(
    submission: Submission,
    output: Any,
    envelope: CritiqueEnvelope,
    *,
    pitfalls: str,
    attempts: Sequence[RepairAttempt],
) -> RevisionResult:
    return RevisionResult(
        output={**output, "summary": "fixed by a model"},
        usage=Usage(tokens_in=120, tokens_out=30, calls=1),
    )


def test_a_function_repairer_reporting_usage_is_charged_what_it_reported() -> None:
    """A 'module:function' repairer that returns a RevisionResult reports its own usage (its
    provider's figure): the result and the budget both count exactly that."""
    config = CritiqueConfig(
        enabled=True,
        repairer="tests.unit.test_runner:_reporting_repairer",
        budget={"total_tokens": 1_000_000},
    )
    ctx = make_context(config, l0=_no_l0, fixpoint=_never)
    result = run_submission(_sub({"confidence": 0.9}), ctx)
    assert result.repair_usage == Usage(tokens_in=120, tokens_out=30, calls=1)
    assert result.budget_charged == ctx.budget.spent("run-1") == 150


def test_reviser_failure_refunds_the_reservation() -> None:
    """A reviser that raises gives its reserved tokens back and the error propagates."""

    class Broken:
        name = "broken"
        token_free = False
        reads_pitfalls = True

        def revise(self, *a: Any, **kw: Any) -> RevisionResult:
            raise RuntimeError("reviser crashed")

    ctx = make_context(
        CritiqueConfig(enabled=True, budget={"total_tokens": 1_000_000}),
        reviser=Broken(),
        l0=_no_l0,
        fixpoint=_never,
    )
    with pytest.raises(RuntimeError, match="crashed"):
        run_submission(_sub({"confidence": 0.9}), ctx)
    cap = ctx.config.repair_token_cap
    assert cap is not None
    assert ctx.budget.reserve("run-1", "probe", cap, cap, 60.0)  # the whole cap is free again


def test_not_a_paper_raises_submission_error() -> None:
    """The rubric loop on a non-paper output raises SubmissionError (could not evaluate)."""
    ctx = make_context(CritiqueConfig(enabled=True, critic="rubric"), l0=_no_l0, fixpoint=_never)
    with pytest.raises(SubmissionError, match="not a paper"):
        run_submission(_sub({"confidence": 0.9}), ctx)


def _fixture_run(**fakes: Any) -> CritiqueResult:
    draft = json.loads(FIXTURE.read_text())
    ctx = make_context(CritiqueConfig(enabled=True, critic="rubric"), **fakes)
    sub = _sub(draft, (), claimed_format="json")
    return run_submission(sub, ctx)


def _assert_climbs_to_target(result: CritiqueResult) -> None:
    means = [t.mean for t in result.trace]
    assert all(b > a for a, b in pairwise(means)), means
    assert [t.verdict for t in result.trace][-1] == "target"
    assert all(v == "continue" for v in [t.verdict for t in result.trace][:-1])
    assert (result.status, result.stop_reason) == ("repaired", "target")
    assert all(v >= 8.0 for v in result.envelope.scores.values())
    assert result.trace[0].suggestions_applied == 0
    assert all(t.suggestions_applied > 0 for t in result.trace[1:])
    assert result.usage == result.repair_usage == Usage()  # token-free: no usage at all


def test_deterministic_pair_climbs_to_target_on_the_draft() -> None:
    """The rubric pair on the weak fixture draft rises every round and ends in target."""
    result = _fixture_run(l0=_no_l0, fixpoint=_never)
    _assert_climbs_to_target(result)
    assert result.original_score < 0.5


def test_deterministic_pair_with_real_l0_and_fixpoint() -> None:
    """With the real Layer-0 suite and simhash fixpoint the draft still climbs to target."""
    _assert_climbs_to_target(_fixture_run())


def test_real_l0_placeholder_goes_to_repair_token_free() -> None:
    """A real L0 placeholder-only line is repaired without any critic tokens on round 1."""
    critic = SpendingCritic()
    ctx = make_context(CritiqueConfig(enabled=True), critic=critic)
    result = run_submission(_sub(PLACEHOLDER_LINE, claimed_format="markdown"), ctx)
    assert critic.rounds == [2]
    assert result.status == "repaired"
    assert "TODO" not in json.dumps(result.output)
    assert any(e["type"] == "gate" for e in ctx.trace.read("run-1"))


# --- the CLI -----------------------------------------------------------------------------------


def _cli(argv: list[str]) -> int:
    import argparse

    from workers.commands import loop

    parser = argparse.ArgumentParser()
    loop.add_arguments(parser)
    return loop.run(parser.parse_args(argv))


def test_cli_rubric_prints_the_round_table(capsys: pytest.CaptureFixture[str]) -> None:
    """`critique loop draft.json` prints one row per round and exits 0 on target."""
    code = _cli([str(FIXTURE)])
    out = capsys.readouterr().out
    assert code == 0
    assert "clarity" in out and "related_work" in out
    assert "stop reason: target" in out and "status: repaired" in out


def test_cli_json_and_exit_code_on_budget(capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints the CritiqueResult; a round cap that stops early is a verdict (escalated):
    exit 0, like every verdict (the CLI's exit-code table)."""
    code = _cli([str(FIXTURE), "--max-rounds", "1", "--json"])
    result = CritiqueResult.model_validate_json(capsys.readouterr().out)
    assert code == 0
    assert (result.stop_reason, result.status) == ("budget", "escalated")


def test_cli_heuristic_with_required_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--critic heuristic --required on a result missing those fields invents nothing: it ends
    escalated / needs_model with the fields named in the notes (a verdict: exit 0)."""
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"confidence": 0.9}))
    code = _cli([str(path), "--critic", "heuristic", "--required", "summary", "sources"])
    out = capsys.readouterr().out
    assert code == 0
    assert "status: escalated" in out and "stop reason: needs_model" in out
    assert "required field 'summary' is missing" in out
    assert "required field 'sources' is missing" in out


def test_cli_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Unreadable files and non-papers exit 2 with a message on stderr."""
    assert _cli([str(tmp_path / "missing.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"title": "no sections"}')
    assert _cli([str(bad)]) == 2
    bad.write_text("not json")
    assert _cli([str(bad)]) == 2
    assert "not a paper" in capsys.readouterr().err


def test_outputs_over_max_output_bytes_are_refused() -> None:
    """A submission (output + task + its required field name) over max_output_bytes is a
    SubmissionError naming the size and the limit."""
    from pipeline.errors import SubmissionError
    from pipeline.loop.admission import admit

    limit = 100 + len(TASK.encode()) + len("summary")
    config = CritiqueConfig(enabled=True, max_output_bytes=limit)
    admit(_sub("x" * 100), config)
    with pytest.raises(SubmissionError, match=f"{limit + 1} bytes, over max_output_bytes"):
        run_submission(_sub("x" * 101), make_context(config, l0=_no_l0, fixpoint=_never))
