"""The A/B experiment's domain (:mod:`pipeline.loop.ab`): the workload parser, the worker's prompt,
the independent defect counter, the CSV, the verdict and the escalation file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.loop.ab import (
    CSV_COLUMNS,
    ABInput,
    ABInputError,
    ABRow,
    DefectCount,
    DefectCounter,
    escalation_markdown,
    generation_request,
    output_from_reply,
    parse_inputs,
    summarize,
    verdict_line,
    write_csv,
)
from pipeline.models import CritiqueEnvelope, CritiqueResult, Defect
from pipeline.security.sandbox import NO_ISOLATION
from tests.fakes.ab_models import ADD_TEST, INPUTS

JSONL = "".join(json.dumps(i) + "\n" for i in INPUTS)


def test_the_workload_parses_with_blank_lines_and_comments() -> None:
    """Every input line becomes an ABInput; blank lines and ``#`` comments are skipped."""
    items = parse_inputs("# the workload\n\n" + JSONL)
    assert [(i.input_id, i.kind) for i in items] == [
        ("add_numbers", "python"),
        ("sales_summary", "json"),
        ("incident_report", "markdown"),
    ]
    [ref] = items[0].file_refs()
    assert (ref.path, ref.size, len(ref.sha256), ref.content) == (
        "test_solution.py",
        len(ADD_TEST),
        64,
        ADD_TEST,
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "in.jsonl:2: not valid JSON"),
        ("[1, 2]", "in.jsonl:2: expected a JSON object, got list"),
        ('{"input_id": "x", "kind": "json"}', "in.jsonl:2: field 'task': Field required"),
        ('{"input_id": "x", "task": "t", "kind": "yaml"}', "in.jsonl:2: field 'kind'"),
        ('{"input_id": "../x", "task": "t", "kind": "json"}', "in.jsonl:2: field 'input_id'"),
        ('{"input_id": "x", "task": "t", "kind": "json", "oops": 1}', "field 'oops'"),
        ('{"input_id": "x", "task": "t", "kind": "python"}', "a python input needs 'files'"),
        (
            '{"input_id": "x", "task": "t", "kind": "python", "files": '
            '[{"path": "solution.py", "content": ""}]}',
            "where the output goes",
        ),
        (
            '{"input_id": "x", "task": "t", "kind": "python", "files": '
            '[{"path": "../t.py", "content": ""}]}',
            "in.jsonl:2: field 'files.0.path'",
        ),
        (
            '{"input_id": "add_numbers", "task": "t", "kind": "json"}',
            "used twice (first on line 1)",
        ),
    ],
)
def test_a_bad_line_is_one_error_naming_the_line(line: str, message: str) -> None:
    """The first bad line raises ABInputError whose message names ``file:line`` and why."""
    first = json.dumps(INPUTS[0])
    with pytest.raises(ABInputError, match=r"^in\.jsonl:2: ") as info:
        parse_inputs(f"{first}\n{line}\n", "in.jsonl")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_an_empty_workload_is_refused() -> None:
    with pytest.raises(ABInputError, match="no inputs"):
        parse_inputs("\n# only a comment\n", "in.jsonl")


def test_the_worker_prompt_and_how_its_reply_becomes_the_output() -> None:
    """The worker sees the task and the contract; a JSON reply becomes an object (text when it
    is not one), a fenced python reply is unwrapped and ends with a newline."""
    py, js, md = (ABInput.model_validate(i) for i in INPUTS)
    req = generation_request(js, "openai/m", 512)
    assert req.json_mode and req.purpose == "generate" and req.max_tokens == 512
    assert req.messages[0].content.startswith("You are the worker.")
    assert "fields: summary, findings, confidence" in req.messages[0].content
    assert req.messages[1].content == js.task
    assert "sections (as headings): Summary, Timeline, Root cause" in (
        generation_request(md, "m", 1).messages[0].content
    )
    assert "solution.py" in generation_request(py, "m", 1).messages[0].content
    assert output_from_reply(js, '```json\n{"a": 1}\n```') == {"a": 1}
    assert output_from_reply(js, "sorry, no") == "sorry, no"
    assert output_from_reply(py, "```python\ndef f():\n    pass\n```") == "def f():\n    pass\n"
    assert output_from_reply(md, "# T\n") == "# T\n"


def counter() -> DefectCounter:
    return DefectCounter(timeout_s=30, isolation=NO_ISOLATION)


def test_the_counter_counts_fields_and_headings_without_a_critic() -> None:
    """json: each required field absent, null or blank (a non-object counts one plus every
    field); markdown: each required section without its heading; plus Layer-0 failures."""
    c = counter()
    js = ABInput.model_validate(INPUTS[1])
    assert c.count(js, {"summary": "ok", "findings": "  ", "confidence": 0.9}).total == 1
    assert c.count(js, {"summary": "ok", "findings": "f", "confidence": None}).contract == 1
    assert c.count(js, "not json").contract == 4
    md = ABInput.model_validate(INPUTS[2])
    got = c.count(md, "# Report\n\n## 1. Summary\n\nok\n\n## root_cause\n\nx\n")
    assert (got.contract, got.details) == (1, ("required section 'Timeline' has no heading",))
    placeholder = c.count(md, "## Summary\n\nTODO\n\n## Timeline\n\nx\n\n## Root cause\n\ny\n")
    assert (placeholder.l0, placeholder.contract) == (1, 0)


def test_the_counter_runs_ruff_and_the_inputs_tests_for_python() -> None:
    """python: each ruff violation (E4,E7,E9,F) in solution.py plus each failing test (a
    clean module counts 0: the integration test's fixed outputs)."""
    c = counter()
    py = ABInput.model_validate(INPUTS[0])
    bad = c.count(py, "import os\n\n\ndef add(a, b):\n    return a - b\n")
    assert (bad.ruff, bad.tests, bad.total) == (1, 2, 3)
    assert any("F401" in d for d in bad.details)
    broken = c.count(py, "def add(a, b)\n    return a + b\n")
    assert broken.ruff >= 1 and broken.tests == 1  # the syntax error: one collection error


def row(mode: str, defects: int, tokens: int = 0, input_id: str = "x") -> ABRow:
    return ABRow(
        run_id=f"r-{input_id}-{mode}",
        mode=mode,  # type: ignore[arg-type]
        input_id=input_id,
        defects=defects,
        latency_s=1.23456,
        tokens_in=tokens,
        tokens_out=0,
        loops=1 if mode == "B" else 0,
    )


def test_the_verdict() -> None:
    """Pass at a reduction of at least 80% (exactly 0.8 passes), or when A has no defect;
    tokens per defect fixed is the extra B tokens over the defects B removed."""
    s = summarize([row("A", 5, 100), row("B", 1, 500)])
    assert (s.mean_a, s.mean_b, s.reduction, s.verdict, s.tokens_per_defect_fixed) == (
        5.0,
        1.0,
        0.8,
        "pass",
        100.0,
    )
    assert summarize([row("A", 5), row("B", 2)]).verdict == "fail"
    zero = summarize([row("A", 0, 100), row("B", 0, 300)])
    assert (zero.reduction, zero.verdict, zero.tokens_per_defect_fixed) == (None, "pass", None)
    worse = summarize([row("A", 1), row("B", 3)])
    assert (worse.reduction, worse.verdict) == (-2.0, "fail")
    assert verdict_line(s).startswith("verdict: pass — defects per output 5.00 (A) → 1.00 (B)")
    assert "nothing to reduce" in verdict_line(zero)


def test_the_csv_has_exactly_the_specs_columns(tmp_path: Path) -> None:
    """Header and cells, latency to the millisecond."""
    path = tmp_path / "ab.csv"
    write_csv([row("A", 2, 10), row("B", 0, 30)], path)
    assert CSV_COLUMNS == (
        "run_id",
        "mode",
        "input_id",
        "defects",
        "latency_s",
        "tokens_in",
        "tokens_out",
        "loops",
    )
    assert path.read_text() == (
        "run_id,mode,input_id,defects,latency_s,tokens_in,tokens_out,loops\n"
        "r-x-A,A,x,2,1.235,10,0,0\n"
        "r-x-B,B,x,0,1.235,30,0,1\n"
    )


def test_the_escalation_file_has_three_lines_and_the_three_choices() -> None:
    """Summary (outcome, what remains, the first remaining defect), then retry / accept best /
    manual, the remaining defects, what the counter found, and the best output fenced."""
    defect = Defect(
        category="incomplete",
        severity="critical",
        location="test_solution.py:5",
        description="test test_add failed: `assert add(2, 3) == 5`",
        source="command",
    )
    result = CritiqueResult(
        run_id="ab-1-add-b1",
        worker_id="add",
        status="escalated",
        stop_reason="no_improvement",
        output="def add(a, b):\n    return a - b  # ```\n",
        original_score=0.55,
        best_score=0.55,
        envelope=CritiqueEnvelope(worker_id="add", score=0.55, defects=(defect,)),
    )
    counted = DefectCount(tests=1, details=("test test_add failure: assert -1 == 5",))
    text = escalation_markdown(row("B", 1, input_id="add"), result, counted, retry_command="ab x")
    lines = text.splitlines()
    assert lines[0] == "# Escalation: add (r-add-B)"
    assert lines[2].startswith("add ended `escalated` (no_improvement) after 0 repair(s)")
    assert lines[3].startswith("1 defect(s) remain by the critic; the independent counter finds 1")
    assert lines[4].startswith("First remaining: [critical] incomplete at test_solution.py:5")
    for choice in ("- **retry**", "- **accept best**", "- **manual**"):
        assert any(line.startswith(choice) for line in lines)
    assert "`ab x`" in text and "````\ndef add(a, b):" in text
