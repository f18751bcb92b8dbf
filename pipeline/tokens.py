"""Token estimates for deterministic (non-LLM) critics and revisers.

Deterministic stages spend no real tokens, but they report an *estimate* so the run-wide repair
budget (SPEC §5.3) applies to them exactly as it will to LLM stages: about one token per four
characters, never less than one.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.models import Usage

CHARS_PER_TOKEN = 4


def estimate_tokens(text: str) -> int:
    """Estimated tokens of ``text``: ⌈len / 4⌉, at least 1."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def text_of(output: str | dict[str, Any]) -> str:
    """Canonical text of an output: strings as they are, dicts as indented JSON.

    The same canonical form as ``pipeline.contract.output_text`` (kept here too so critics do not
    depend on the contract package).
    """
    if isinstance(output, str):
        return output
    return json.dumps(output, ensure_ascii=False, indent=2)


def estimate_usage(text_in: str, text_out: str) -> Usage:
    """Usage of a deterministic step that read ``text_in`` and wrote ``text_out`` (calls = 0)."""
    return Usage(tokens_in=estimate_tokens(text_in), tokens_out=estimate_tokens(text_out), calls=0)
