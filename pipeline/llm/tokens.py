"""Token estimates for sizing, and the canonical text of an output.

:func:`estimate_tokens` (about one token per four characters, never less than one) sizes what
cannot be counted by a tokenizer: repair reservations for revisers and critics that cannot size
their own calls (:mod:`pipeline.loop.repair`). It is never usage: usage is what providers reported,
so a deterministic (token-free) stage reports 0 tokens, and results, the repair
budget and ``critique ab`` add up.
"""

from __future__ import annotations

import functools
import json
from typing import Any

CHARS_PER_TOKEN = 4


def estimate_tokens(text: str) -> int:
    """Estimated tokens of ``text``: ⌈len / 4⌉, at least 1."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def text_of(output: str | dict[str, Any]) -> str:
    """Canonical text of an output: strings as they are, dicts as indented JSON (also
    ``pipeline.contract.output_text``).

    A stage asks for the same dict's text many times (Layer-0's checks, the critic's prompt,
    the sizing of a repair: about ten per output). Indented JSON takes Python's pure-Python
    encoder (the C one does compact JSON only), and each run leaves reference cycles for the
    GC: the text is kept per dict, keyed by its compact JSON (C-encoded, so a lookup costs a
    fraction of an indented encoding), for the last :data:`_TEXTS_KEPT` dicts.
    """
    if isinstance(output, str):
        return output
    key = json.dumps(output, ensure_ascii=False, sort_keys=False)
    return _indented(key)


_TEXTS_KEPT = 256
"""Outputs whose indented text :func:`text_of` keeps (a worker's threads' recent ones)."""


@functools.lru_cache(maxsize=_TEXTS_KEPT)
def _indented(compact: str) -> str:
    return json.dumps(json.loads(compact), ensure_ascii=False, indent=2)
