"""The canonical text of an output (pipeline.llm.tokens.text_of, pipeline.contract.output_text):
indented JSON exactly as ``json.dumps(indent=2)`` writes it, kept per dict content, never stale
after the dict changes."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from pipeline.contract import output_text
from pipeline.llm.tokens import text_of

CASES: list[Any] = [
    {"summary": "Sales rose 4%.", "findings": ["north", "south"], "confidence": 0.9},
    {"ünïcode": "naïve — “quotes”", "emoji": "🙂", "nested": {"a": [1, 2.5, None, True]}},
    {1: "int key", "z": {}, "a": []},
    {"floats": [0.1, 1e-7, 1e300, -0.0], "big": 10**30},
    {"b": 1, "a": 2},  # insertion order, not sorted
]


@pytest.mark.parametrize("output", CASES)
def test_the_text_is_indented_json_as_json_writes_it(output: Any) -> None:
    want = json.dumps(output, ensure_ascii=False, indent=2)
    assert text_of(output) == want
    assert output_text(output) == want
    assert text_of(output) == want  # the kept text, the same


def test_a_string_is_its_own_text() -> None:
    assert text_of("plain text") == "plain text"


def test_a_changed_dict_gets_its_new_text() -> None:
    output: dict[str, Any] = {"summary": "first"}
    assert '"first"' in text_of(output)
    output["summary"] = "second"
    assert '"second"' in text_of(output) and '"first"' not in text_of(output)


def test_nan_reads_as_json_writes_it() -> None:
    output = {"score": math.nan, "inf": math.inf}
    assert text_of(output) == json.dumps(output, ensure_ascii=False, indent=2)
