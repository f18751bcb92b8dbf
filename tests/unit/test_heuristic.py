"""The heuristic critic's penalty table (its reviser: tests/unit/test_honest_reviser.py)."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.critics.heuristic import HeuristicCritic, headings
from pipeline.models import CritiqueEnvelope, Submission


def _sub(output: str | dict[str, Any], required: tuple[str, ...] = (), **kw: Any) -> Submission:
    return Submission(
        run_id="run-1",
        worker_id="w1",
        task="Summarise the quarterly sales report for the board.",
        output=output,
        required_fields=required,
        **kw,
    )


def _critique(output: str | dict[str, Any], required: tuple[str, ...] = ()) -> CritiqueEnvelope:
    return HeuristicCritic().critique(_sub(output, required), output, pitfalls="", round=1)


def test_clean_dict_scores_one_with_no_defects() -> None:
    """A dict with a good confidence, no error and all required fields is a clean 1.0."""
    env = _critique({"summary": "Sales rose 4%.", "confidence": 0.9}, ("summary",))
    assert env.score == 1.0
    assert env.defects == ()
    assert env.band == "accept"
    assert env.critic == "heuristic"
    assert env.usage.tokens == 0 and env.usage.calls == 0


@pytest.mark.parametrize(
    ("output", "required", "score", "expected"),
    [
        ({"summary": "x"}, ("summary",), 0.7, [("missing_data", "critical", "confidence")]),
        (
            {"summary": "x", "confidence": 0.2},
            ("summary",),
            0.8,
            [("incomplete", "warning", "confidence")],
        ),
        (
            {"summary": "x", "confidence": "0.9"},
            ("summary",),
            0.8,
            [("wrong_format", "warning", "confidence")],
        ),
        (
            {"summary": "x", "confidence": 0.9, "error": "timeout"},
            ("summary",),
            0.6,
            [("incomplete", "critical", "error")],
        ),
        (
            {"confidence": 0.9},
            ("summary", "sources"),
            0.6,
            [("missing_data", "critical", "summary"), ("missing_data", "critical", "sources")],
        ),
        (
            {"summary": "", "notes": "  ", "confidence": 0.9},
            (),
            0.8,
            [("incomplete", "warning", "summary"), ("incomplete", "warning", "notes")],
        ),
        (
            {"confidence": 0.1, "error": "boom", "notes": ""},
            (),
            0.3,
            [
                ("incomplete", "warning", "confidence"),
                ("incomplete", "critical", "error"),
                ("incomplete", "warning", "notes"),
            ],
        ),
    ],
)
def test_dict_penalties_follow_the_table_exactly(
    output: dict[str, Any],
    required: tuple[str, ...],
    score: float,
    expected: list[tuple[str, str, str]],
) -> None:
    """Each row of the penalty table subtracts exactly its amount with its severity."""
    env = _critique(output, required)
    assert env.score == score
    assert [(d.category, d.severity, d.location) for d in env.defects] == expected
    assert all(d.source == "heuristic" for d in env.defects)


def test_score_clamps_at_zero() -> None:
    """Penalties beyond 1.0 clamp to 0.0 (escalate band), never a negative score."""
    env = _critique({"error": "crashed"}, ("a", "b", "c"))
    assert env.score == 0.0
    assert env.band == "escalate"
    assert len(env.critical) == 5
    assert env.effort_estimate == "major"


def test_non_numeric_confidence_is_wrong_format_not_missing() -> None:
    """A string or bool confidence is a wrong_format warning, never the missing penalty."""
    for value in ("0.9", True, [0.9]):
        env = _critique({"confidence": value})
        assert env.score == 0.8
        assert [d.category for d in env.defects] == ["wrong_format"]


def test_null_error_and_null_confidence() -> None:
    """A null error is not an error; a null confidence counts as missing."""
    env = _critique({"confidence": None, "error": None})
    assert env.score == 0.7
    assert [(d.category, d.location) for d in env.defects] == [("missing_data", "confidence")]


def test_confidence_as_required_field_is_not_counted_twice() -> None:
    """Listing 'confidence' as required does not add a second penalty for it."""
    env = _critique({"summary": "x"}, ("confidence", "summary"))
    assert env.score == 0.7
    assert len(env.defects) == 1


def test_prescription_and_pattern_for_missing_field() -> None:
    """A missing field carries an 'Add the ...' prescription and an 'Always include' rule."""
    env = _critique({"confidence": 0.9}, ("summary",))
    assert env.prescriptions[0].startswith("Add the 'summary' field")
    assert env.reusable_patterns[0].prevention_rule == (
        "Always include the 'summary' field in your output"
    )
    assert env.reusable_patterns[0].category == "missing_data"


def test_text_output_rules() -> None:
    """Text: no confidence rules; empty is −0.4 critical; each absent heading −0.2 critical."""
    assert _critique("Plain prose answer.").score == 1.0
    empty = _critique("  \n ")
    assert empty.score == 0.6
    assert [(d.category, d.severity) for d in empty.defects] == [("incomplete", "critical")]
    env = _critique("# Summary\n\nfine\n", ("summary", "next_steps", "risks"))
    assert env.score == 0.6
    assert [d.location for d in env.defects] == ["next_steps", "risks"]
    assert all(d.category == "missing_data" for d in env.defects)


def test_headings_match_markdown_and_latex_case_and_underscores() -> None:
    """Headings match case-insensitively with underscores read as spaces; prose does not count."""
    text = (
        "## Next Steps ##\n\\section*{Key_Risks}\n\\subsection{2.1 Budget}\n"
        "summary mentioned in prose\n#hashtag\n"
    )
    env = _critique(text, ("next_steps", "key risks", "budget", "summary"))
    assert [d.location for d in env.defects] == ["summary"]
    assert "next steps" in headings(text)


INVISIBLE_VALUES = ["", "  ", "\u200b", "\u2800\u2800", "\u3164", "\u115f\u1160", "\uffa0",
                    "\u202e\u202c", "\u2066\u2069", "\x1b[0m"]  # fmt: skip


@pytest.mark.parametrize("value", INVISIBLE_VALUES)
def test_required_field_a_reader_sees_nothing_in_is_missing(value: str) -> None:
    """A required field holding only whitespace or invisible characters (zero-width, braille
    blank, Hangul fillers, bidi controls, an escape) is as missing as an empty string: one
    critical missing_data, never also an 'empty string' warning."""
    env = _critique({"summary": value, "confidence": 0.9}, ("summary",))
    assert env.score == 0.8
    assert [(d.category, d.severity, d.location) for d in env.defects] == [
        ("missing_data", "critical", "summary")
    ]
    assert env.defects[0].description == "required field 'summary' is empty"


@pytest.mark.parametrize("value", INVISIBLE_VALUES)
def test_optional_field_a_reader_sees_nothing_in_is_an_empty_field(value: str) -> None:
    """The same values in a field nobody required are the empty-string warning."""
    env = _critique({"summary": "Sales rose.", "notes": value, "confidence": 0.9}, ("summary",))
    assert [(d.category, d.severity, d.location) for d in env.defects] == [
        ("incomplete", "warning", "notes")
    ]


def test_text_output_of_invisible_characters_is_empty() -> None:
    """A text output that shows nothing is the empty-output finding."""
    env = _critique("\u200b\u2800\n\u3164\u202e")
    assert [(d.category, d.severity, d.description) for d in env.defects] == [
        ("incomplete", "critical", "the output is empty")
    ]
