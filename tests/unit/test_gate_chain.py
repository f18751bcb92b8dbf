"""The completion gate chain as data: a tuple of one-gate functions, run in order by a loop,
from which the gate order is derived."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from pipeline.config import CritiqueConfig, OutputContractConfig
from pipeline.loop.gates import (
    COMPLETION_GATES,
    GATE_ORDER,
    Completion,
    GateContext,
    L0Finding,
    TextItem,
    completion_facts,
    evaluate_completion,
)
from pipeline.models import CritiqueEnvelope, CritiqueResult, FileRef, GateEvent

CFG = CritiqueConfig(enabled=True)


def _result(worker: str, best: float) -> CritiqueResult:
    return CritiqueResult(
        run_id="run-chain",
        iteration=1,
        worker_id=worker,
        status="accepted" if best >= 0.6 else "escalated",
        stop_reason="accepted",
        output={"summary": "ok"},
        original_score=best,
        best_score=best,
        envelope=CritiqueEnvelope(worker_id=worker, score=best),
    )


class _RecordingL0:
    """An L0 runner that finds nothing and records which checks it was asked to run."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, ...]] = []

    def __call__(
        self, contract: OutputContractConfig, items: Sequence[TextItem]
    ) -> list[L0Finding]:
        self.asked.append(tuple(contract.checks))
        return []


def _hook(ctx: GateContext) -> GateEvent:
    return GateEvent(gate="evaluation", verdict="pass", reason=f"judged {ctx.task!r}")


def _args(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "run_id": "run-chain",
        "iteration": 3,
        "final_result": {"summary": "Revenue grew 12% in Q3."},
        "results": [_result("w1", 0.5), _result("w2", 0.3)],
        "files": [FileRef(path="notes.txt", size=40, content="Plain notes, nothing to fill.")],
        "task": "Summarise the quarter and attach a chart.",
        "deliverable_expected": None,
        "config": CFG,
        "evaluate": _hook,
    }
    args.update(overrides)
    return args


def test_gate_order_is_derived_from_the_chain_in_its_documented_order() -> None:
    """GATE_ORDER is the chain's names, and the chain runs L0 → critique score → deliverable
    presence → placeholder → file validator → evaluation."""
    assert tuple(g.name for g in COMPLETION_GATES) == GATE_ORDER
    assert GATE_ORDER == (
        "l0",
        "critique_score",
        "deliverable_presence",
        "placeholder",
        "file_validator",
        "evaluation",
    )
    assert len(set(GATE_ORDER)) == len(GATE_ORDER)


def test_each_gate_is_a_small_function_emitting_only_its_own_events() -> None:
    """Every gate in the chain, run alone on the shared facts, emits at least one event, all
    under its own name and for the completion's iteration; none is longer than 40 lines."""
    completion = completion_facts(**_args(l0=_RecordingL0()))
    for gate in COMPLETION_GATES:
        events = gate.check(completion)
        assert events, gate.name
        assert {e.gate for e in events} == {gate.name}
        assert all(e.iteration == 3 for e in events)
        assert len(inspect.getsource(gate.check).splitlines()) <= 40, gate.name


def test_evaluate_completion_is_the_chain_run_in_order_over_one_set_of_facts() -> None:
    """evaluate_completion's events are exactly each gate's events, gate after gate, over the
    same facts; so the events come in GATE_ORDER."""
    decision = evaluate_completion(**_args(l0=_RecordingL0()))
    completion = completion_facts(**_args(l0=_RecordingL0()))
    by_hand = [e for gate in COMPLETION_GATES for e in gate.check(completion)]
    assert list(decision.events) == by_hand
    assert [e.gate for e in decision.events] == list(GATE_ORDER)
    # A low mean, no chart on disk, a 40 B file where a file is asked for: three rejections.
    assert decision.verdict == "rejected"
    assert [r.split(":")[0] for r in decision.reasons] == [
        "critique_score",
        "deliverable_presence",
        "file_validator",
    ]


def test_layer0_runs_once_for_its_gate_then_once_for_the_placeholder_scan() -> None:
    """The L0 runner is asked twice per completion, in chain order: the configured contract
    (the l0 gate), then no_placeholder alone (the placeholder scan, worked out once and shared
    with the decision)."""
    l0 = _RecordingL0()
    evaluate_completion(**_args(l0=l0, config=CritiqueConfig(enabled=True)))
    assert len(l0.asked) == 2
    assert l0.asked[0] == tuple(CFG.output_contract.checks)
    assert l0.asked[1] == ("no_placeholder",)


def test_the_shared_facts_are_worked_out_before_any_gate_runs() -> None:
    """completion_facts reads the files and the mean score once; the Completion it returns
    holds the mean best score over the workers and the text items the gates check."""
    completion = completion_facts(**_args(l0=_RecordingL0()))
    assert isinstance(completion, Completion)
    assert completion.mean == (0.5 + 0.3) / 2
    assert [i.path for i in completion.items] == [None, "notes.txt"]
    assert completion.wants_file and completion.big == () and completion.unread == ()
