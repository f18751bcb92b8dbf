"""The token-free reviser invents nothing: its honest edits, its refusals, the loop's
``needs_model`` stop, and property tests over generated outputs."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import CritiqueConfig, load_config
from pipeline.critics.base import merge_l0
from pipeline.critics.heuristic import HeuristicCritic, HeuristicReviser
from pipeline.critics.rubric import DEMO_NOTE
from pipeline.llm.tokens import text_of
from pipeline.loop.stages import run_submission
from pipeline.models import CritiqueEnvelope, CritiqueResult, Submission
from pipeline.wiring import contract_l0, make_context

TASK = "Summarise the Q3 sales report for the south region."
LOOP = (
    "Customers in every district told us that freshness matters more than price, that they "
    "would pay a small premium for beans roasted within the last week, and that a flexible "
    "delivery schedule is the feature most likely to keep them subscribed."
)
"""A paragraph of 20+ words, so Layer-0 no_text_loop sees it when it is repeated."""
L0 = contract_l0(CritiqueConfig(enabled=True))


def _sub(
    output: str | dict[str, Any],
    required: tuple[str, ...] = (),
    claimed: str | None = None,
    worker: str = "w1",
) -> Submission:
    return Submission.model_validate(
        {
            "run_id": "run-honest",
            "worker_id": worker,
            "task": TASK,
            "output": output,
            "required_fields": list(required),
            "claimed_format": claimed
            if claimed
            else ("json" if isinstance(output, dict) else None),
        }
    )


def _envelope(sub: Submission, output: str | dict[str, Any] | None = None) -> CritiqueEnvelope:
    """The envelope the loop builds: the heuristic critic plus the real Layer-0 defects."""
    out = sub.output if output is None else output
    env = HeuristicCritic().critique(sub, out)
    l0 = L0(sub, out, None).defects
    if any(d.severity == "critical" for d in l0):
        return merge_l0(env, l0)
    return env.model_copy(update={"defects": (*l0, *env.defects)})


def _revise(sub: Submission) -> Any:
    return HeuristicReviser().revise(sub, sub.output, _envelope(sub), pitfalls="", attempts=())


def _run(sub: Submission, **overrides: Any) -> CritiqueResult:
    config = load_config(
        env={}, overrides={"enabled": True, "critic": "heuristic", "repairer": "deterministic"}
    )
    if overrides:
        config = config.model_copy(update=overrides)
    return run_submission(sub, make_context(config))


# --- refusals: nothing is invented ---------------------------------------------------------


def test_missing_field_is_never_filled_but_listed_as_unfixable() -> None:
    """A JSON result missing a required field stays as it is; the field is listed, with why."""
    sub = _sub({"summary": "Sales rose.", "confidence": 0.8}, ("summary", "findings"))
    result = _revise(sub)
    assert result.output == sub.output
    assert result.suggestions_applied == 0
    [refusal] = result.unfixable
    assert refusal.defect.location == "findings" and "invent" in refusal.reason


def test_error_field_is_never_deleted() -> None:
    """An ``error`` field stays; the defect is listed as unfixable."""
    output = {"summary": "Sales rose.", "findings": "x", "confidence": 0.8, "error": "timed out"}
    result = _revise(_sub(output, ("summary", "findings")))
    assert result.output == output
    assert [r.defect.location for r in result.unfixable] == ["error"]


def test_placeholder_inside_a_sentence_is_left_untouched() -> None:
    """`Sales rose overall. TODO: add numbers.` is not cut to `Sales rose overall. : add …`."""
    text = "Sales rose overall. TODO: add numbers."
    result = _revise(_sub(text))
    assert result.output == text
    assert "line with other text" in result.unfixable[0].reason


def test_missing_confidence_low_confidence_and_empty_fields_are_not_invented() -> None:
    """No confidence is made up or raised, no empty string is filled."""
    for output in (
        {"summary": "Sales rose.", "findings": "x"},
        {"summary": "Sales rose.", "findings": "x", "confidence": 0.1},
        {"summary": "", "findings": "x", "confidence": 0.9},
        {"summary": "Sales rose.", "findings": "x", "confidence": "high"},
        {"summary": "Sales rose.", "findings": "x", "confidence": "1.5"},
    ):
        result = _revise(_sub(output, ("summary", "findings")))
        assert result.output == output
        assert result.unfixable


def test_missing_section_and_empty_text_are_not_written() -> None:
    """A missing required heading is not appended; an empty output stays empty."""
    text = "# Report\n\n## Summary\n\nSales rose.\n"
    assert _revise(_sub(text, ("summary", "findings"))).output == text
    assert _revise(_sub("", ("summary",))).output == ""


def test_near_duplicate_paragraph_is_not_chosen_between() -> None:
    """Two paragraphs that differ in a word are not a verbatim repeat: neither is deleted."""
    text = f"# R\n\n{LOOP}\n\n{LOOP.replace('every', 'each')}\n"
    result = _revise(_sub(text))
    assert result.output == text
    assert "near-duplicate" in result.unfixable[0].reason


def test_an_edit_that_would_empty_a_section_is_refused() -> None:
    """Dropping a placeholder or a copy that is a section's only content would hide the gap."""
    only_tbd = "# R\n\n## Summary\n\nSales rose.\n\n## Findings\n\nTBD\n"
    result = _revise(_sub(only_tbd))
    assert result.output == only_tbd
    assert "section 'Findings' empty" in result.unfixable[0].reason
    copy_as_section = f"# R\n\n## Summary\n\n{LOOP}\n\n## Findings\n\n{LOOP}\n"
    assert _revise(_sub(copy_as_section)).output == copy_as_section


def test_placeholders_in_headings_code_and_json_values_are_refused() -> None:
    """A placeholder heading, a placeholder in a code block or inside a JSON value stays."""
    for sub in (
        _sub("# R\n\n## TODO\n\nSales rose.\n"),
        _sub("# R\n\nSales rose.\n\n```\nTODO\n```\n"),
        _sub({"summary": "TBD", "findings": "x", "confidence": 0.9}),
    ):
        result = _revise(sub)
        assert result.output == sub.output and result.unfixable


def test_unrecoverable_json_is_not_completed() -> None:
    """Truncated JSON text is refused: completing it would be a guess."""
    text = "{'summary': 'Three tiers', 'confidence': 0.8,"
    result = _revise(_sub(text, claimed="json"))
    assert result.output == text
    assert any("not recoverable exactly" in r.reason for r in result.unfixable)


# --- the honest edits ----------------------------------------------------------------------


def test_repeated_paragraph_is_deleted_keeping_the_first() -> None:
    """A verbatim repeat (whitespace aside) is deleted; one copy and everything else stay."""
    text = f"# R\n\n## Findings\n\nNorth grew.\n\n{LOOP}\n\n{LOOP}\n\n{LOOP.replace(' ', '  ')}\n"
    result = _revise(_sub(text))
    assert result.output == f"# R\n\n## Findings\n\nNorth grew.\n\n{LOOP}\n"
    assert result.suggestions_applied == 2 and result.unfixable == ()


def test_placeholder_only_lines_are_dropped() -> None:
    """Lines holding nothing but a placeholder and punctuation go; nothing else changes."""
    text = "# R\n\n## Findings\n\nNorth grew.\n\n- TBD: ...\n\nTODO\n\nSouth shrank.\n"
    result = _revise(_sub(text))
    assert result.output == "# R\n\n## Findings\n\nNorth grew.\n\nSouth shrank.\n"
    assert result.unfixable == ()


def test_duplicate_headings_get_numeric_suffixes() -> None:
    """The 2nd and 3rd occurrence become (2) and (3), skipping a title already taken; LaTeX too."""
    text = (
        "# R\n\n## Results\n\nA.\n\n## Results (2)\n\nB.\n\n## results\n\nC.\n\n## Results\n\nD.\n"
    )
    result = _revise(_sub(text))
    assert result.output == (
        "# R\n\n## Results\n\nA.\n\n## Results (2)\n\nB.\n\n## results (3)\n\nC.\n\n"
        "## Results (4)\n\nD.\n"
    )
    latex = "\\section{Results}\nA.\n\\section{Results}\nB.\n"
    new = _revise(_sub(latex, claimed="latex")).output
    assert new == "\\section{Results}\nA.\n\\section{Results (2)}\nB.\n"


def test_numeric_string_confidence_becomes_the_number() -> None:
    """`"0.8"` becomes 0.8; nothing else in the result changes."""
    output = {"summary": "a", "findings": "b", "confidence": "0.80", "notes": ""}
    result = _revise(_sub(output, ("summary", "findings")))
    assert result.output == {**output, "confidence": 0.8}
    assert [r.defect.location for r in result.unfixable] == ["notes"]


def test_json_in_a_fence_with_a_trailing_comma_is_recovered_exactly() -> None:
    """Only the fence and the trailing comma go; the JSON text is otherwise kept as written."""
    text = '```json\n{"tiers": [19, 29, 39], "currency": "EUR",}\n```\n'
    result = _revise(_sub(text, claimed="json"))
    assert result.output == '{"tiers": [19, 29, 39], "currency": "EUR"}'
    assert json.loads(result.output)["tiers"] == [19, 29, 39]


def test_plan_is_revise_without_side_effects() -> None:
    """plan() answers exactly what revise() returns, and the input is never mutated."""
    output = {"summary": "a", "findings": "b", "confidence": "0.5", "error": "x"}
    sub = _sub(output, ("summary", "findings"))
    env = _envelope(sub)
    reviser = HeuristicReviser()
    assert reviser.plan(sub, output, env) == reviser.revise(sub, output, env)
    assert output["confidence"] == "0.5"


# --- the loop ------------------------------------------------------------------------------


def test_loop_missing_field_ends_needs_model_without_a_repair_round() -> None:
    """Nothing fixable: escalated / needs_model at once (no attempt, no repair tokens), the
    field named in the notes and in the final envelope; the trace verdict is escalated."""
    sub = _sub({"summary": "Sales rose.", "confidence": 0.8}, ("summary", "findings"))
    result = _run(sub)
    assert (result.status, result.stop_reason) == ("escalated", "needs_model")
    assert result.attempts == () and result.repair_usage.tokens == 0
    assert result.output == sub.output
    assert any("required field 'findings' is missing" in n for n in result.notes)
    assert [d.location for d in result.envelope.critical] == ["findings"]
    assert result.trace[-1].verdict == "escalated"


def test_loop_error_field_ends_needs_model_with_the_error_kept() -> None:
    """A result carrying an error is not laundered into accepted: the error stays."""
    output = {"summary": "s", "findings": "f", "confidence": 0.8, "error": "tool timed out"}
    result = _run(_sub(output, ("summary", "findings")))
    assert (result.status, result.stop_reason) == ("escalated", "needs_model")
    assert isinstance(result.output, dict) and result.output["error"] == "tool timed out"


def test_loop_placeholder_in_a_sentence_ends_needs_model_untouched() -> None:
    """The sentence around the placeholder is never edited."""
    text = "Sales rose overall. TODO: add numbers."
    result = _run(_sub(text))
    assert (result.status, result.stop_reason) == ("escalated", "needs_model")
    assert result.output == text
    assert any("no_placeholder" in n for n in result.notes)


def test_loop_repeated_paragraph_is_repaired_to_one_copy() -> None:
    """A verbatim repeated paragraph ends repaired / accepted with one copy left."""
    text = f"# R\n\n## Findings\n\n{LOOP}\n\n{LOOP}\n"
    result = _run(_sub(text, ("findings",)))
    assert (result.status, result.stop_reason) == ("repaired", "accepted")
    assert str(result.output).count(LOOP) == 1


def test_loop_duplicate_heading_is_repaired_with_a_suffix() -> None:
    """A duplicate heading ends repaired / accepted, the second renamed ``Findings (2)``."""
    text = "# R\n\n## Findings\n\nNorth grew.\n\n## Findings\n\nSouth shrank.\n"
    result = _run(_sub(text, ("findings",)))
    assert (result.status, result.stop_reason) == ("repaired", "accepted")
    assert "## Findings (2)\n\nSouth shrank." in str(result.output)


def test_loop_applies_the_honest_fix_then_stops_needs_model() -> None:
    """Part fixable: the copy is deleted (kept as best), re-checked, then needs_model for the
    missing section — also when that was the last allowed attempt."""
    text = f"# R\n\n## Summary\n\n{LOOP}\n\n{LOOP}\n"
    for attempts in (2, 1):
        result = _run(_sub(text, ("summary", "findings")), max_repair_attempts=attempts)
        assert (result.status, result.stop_reason) == ("escalated", "needs_model")
        assert len(result.attempts) == 1 and result.attempts[0].stop_reason == "needs_model"
        assert str(result.output).count(LOOP) == 1
        assert result.best_score > result.original_score
        assert any("required section 'findings' is missing" in n for n in result.notes)


def test_quickstart_default_configuration_invents_nothing() -> None:
    """`enabled: true` and nothing else (auto critic and reviser, no model): needs_model."""
    ctx = make_context(load_config(env={}, overrides={"enabled": True}))
    sub = _sub({"summary": "Sales rose.", "confidence": 0.8}, ("summary", "findings"))
    result = run_submission(sub, ctx)
    assert (result.status, result.stop_reason) == ("escalated", "needs_model")
    assert result.output == sub.output


def test_rubric_demo_reviser_says_its_text_is_stock_text() -> None:
    """The rubric demo pair still reaches its target, and its notes say the added text is the
    demo reviser's stock text, not the author's."""
    from workers.commands._samples import PAPER_DRAFT, overrides_for

    ctx = make_context(load_config(env={}, overrides=overrides_for("rubric")))
    result = run_submission(_sub(PAPER_DRAFT, claimed="json"), ctx)
    assert result.stop_reason == "target"
    prefix = DEMO_NOTE.split("{n}")[0]
    assert any(prefix in n for n in result.notes)


# --- properties over generated outputs -----------------------------------------------------

WORDS = ("sales", "north", "south", "grew", "fell", "price", "beans", "team", "plan", "weekly")
TITLES = ("Summary", "Findings", "Results", "Findings", "Notes")
PLACEHOLDER_LINES = ("TODO", "TBD: ...", "- TBD", "FIXME!", "???", "Lorem ipsum", "**XXX**")
SUFFIX = re.compile(r" \(\d+\)(?=\s*(?:#+\s*)?$|\})", re.MULTILINE)


def _tokens(text: str) -> Counter[str]:
    """Words, with numbers read as numbers (so "0.80" and 0.8 are the same token)."""
    out: Counter[str] = Counter()
    for tok in re.findall(r"\d+(?:\.\d+)?|\.\d+|[^\W\d_]+", text):
        out[repr(float(tok)) if tok[0] in ".0123456789" else tok] += 1
    return out


sentences = st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map(
    lambda ws: " ".join(ws).capitalize() + "."
)
long_paragraph = st.lists(st.sampled_from(WORDS), min_size=20, max_size=26).map(" ".join)
blocks = st.one_of(
    st.sampled_from(TITLES).map(lambda t: f"## {t}"),
    sentences,
    st.sampled_from(PLACEHOLDER_LINES),
    sentences.map(lambda s: f"{s} TODO: add numbers."),
    long_paragraph,
    st.just(LOOP),
    st.just("```\nTODO\n```"),
)
documents = st.lists(blocks, min_size=0, max_size=12).map(lambda bs: "\n\n".join(bs) + "\n")
required = st.lists(st.sampled_from(("summary", "findings", "results")), max_size=2, unique=True)

json_values = st.one_of(
    st.text(alphabet="abc TODO\n", max_size=12),
    st.integers(-5, 5),
    st.lists(st.sampled_from(WORDS), max_size=3),
    st.none(),
)
confidences = st.one_of(
    st.floats(0, 1),
    st.sampled_from(("0.8", "0.80", ".5", " 0.3 ", "1", "0", "high", "1.5", "", "TBD")),
    st.booleans(),
)


@st.composite
def results(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(("summary", "findings", "notes", "sources")), unique=True))
    out: dict[str, Any] = {k: draw(json_values) for k in keys}
    if draw(st.booleans()):
        out["confidence"] = draw(confidences)
    if draw(st.booleans()):
        out["error"] = draw(st.sampled_from(("tool timed out", "", "HTTP 503")))
    return out


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(text=documents, req=required)
def test_property_text_result_words_are_a_subset_of_the_input(text: str, req: list[str]) -> None:
    """Over generated Markdown: the revision's words (as a multiset) come from the input, except
    a duplicate heading's numeric suffix; every actionable defect is either fixed or listed as
    unfixable; plan() agrees with revise()."""
    sub = _sub(text, tuple(req), claimed="markdown")
    env = _envelope(sub)
    reviser = HeuristicReviser()
    result = reviser.revise(sub, text, env)
    assert isinstance(result.output, str)
    unsuffixed = SUFFIX.sub("", result.output)
    assert not _tokens(unsuffixed) - _tokens(text)
    assert reviser.plan(sub, text, env) == result
    assert result.suggestions_applied + len(result.unfixable) == len(env.actionable)


@SETTINGS
@given(output=results(), req=required)
def test_property_json_result_adds_no_key_and_keeps_the_error(
    output: dict[str, Any], req: list[str]
) -> None:
    """Over generated JSON results: no key is added or removed, ``error`` is kept as it was, a
    numeric-string confidence in [0, 1] becomes that number, every other value is unchanged,
    and the words come from the input."""
    sub = _sub(output, tuple(req))
    result = HeuristicReviser().revise(sub, output, _envelope(sub))
    new = result.output
    assert isinstance(new, dict)
    assert new.keys() == output.keys()
    if "error" in output:
        assert new["error"] == output["error"]
    conf = output.get("confidence")
    numeric = isinstance(conf, str) and re.fullmatch(r"\s*(\d+(\.\d+)?|\.\d+)\s*", conf)
    if numeric and 0.0 <= float(str(conf)) <= 1.0:
        assert new["confidence"] == float(str(conf))
        assert not isinstance(new["confidence"], str)
    assert {k: v for k, v in new.items() if k != "confidence"} == {
        k: v for k, v in output.items() if k != "confidence"
    }
    assert not _tokens(text_of(new)) - _tokens(text_of(output))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=documents, req=required)
def test_property_the_whole_loop_invents_nothing(text: str, req: list[str]) -> None:
    """Through the broker-free loop (real Layer-0, heuristic critic, token-free reviser): the
    result's words come from the input plus heading suffixes; repaired only when the result is
    acceptable, needs_model with the remaining defects listed otherwise."""
    result = _run(_sub(text, tuple(req), claimed="markdown"))
    assert isinstance(result.output, str)
    assert not _tokens(SUFFIX.sub("", result.output)) - _tokens(text)
    assert result.stop_reason not in ("no_improvement", "attempts_exhausted")
    if result.stop_reason == "needs_model":
        assert result.status == "escalated"
        assert any(n.startswith("needs_model: [") for n in result.notes)
    if result.status == "repaired":
        assert result.stop_reason == "accepted"
