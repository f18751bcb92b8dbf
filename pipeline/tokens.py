"""Token estimates for sizing, and the canonical text of an output.

:func:`estimate_tokens` (about one token per four characters, never less than one) sizes what
cannot be counted by a tokenizer: repair reservations for revisers and critics that cannot size
their own calls (:mod:`pipeline.repair`). It is never usage: usage is what providers reported,
so a deterministic (token-free) stage reports 0 tokens, and results, the repair
budget and ``critique ab`` add up.
"""

from __future__ import annotations

import json
from typing import Any

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
