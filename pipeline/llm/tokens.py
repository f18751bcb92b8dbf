"""Token estimates for sizing, and the canonical text of an output.

:func:`estimate_tokens` (about one token per four characters, never less than one) sizes what
cannot be counted by a tokenizer: repair reservations for revisers and critics that cannot size
their own calls (:mod:`pipeline.loop.repair`). It is never usage: usage is what providers reported,
so a deterministic (token-free) stage reports 0 tokens, and results, the repair
budget and ``critique ab`` add up.

A repair may grow its output only as far as Layer-0's ``file_size_delta`` check accepts
(:data:`SIZE_GROWTH_LIMIT`, :data:`SIZE_MIN_GROWTH_TOKENS`): :func:`grown_output_tokens` is that
size in tokens, and :func:`repair_reply_tokens` the ``max_tokens`` of a repair call.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

CHARS_PER_TOKEN = 4

SIZE_GROWTH_LIMIT = 2.5
"""A repair may grow the output at most this much before L0 ``file_size_delta`` rejects it."""
SIZE_MIN_GROWTH_TOKENS = 256
"""Layer-0 never rejects a repair that grew by 1 KiB or less (``SIZE_DELTA_MIN_GROWTH``), about
this many tokens: a short output may get a section added."""


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


def grown_output_tokens(output: str | dict[str, Any]) -> int:
    """The most tokens (estimated) a repair of ``output`` may write before Layer-0's
    ``file_size_delta`` rejects it: 2.5× the output's, or the output plus 1 KiB when that is
    more (:data:`SIZE_MIN_GROWTH_TOKENS`)."""
    tokens = estimate_tokens(text_of(output))
    return max(math.ceil(SIZE_GROWTH_LIMIT * tokens), tokens + SIZE_MIN_GROWTH_TOKENS) + 1


def repair_reply_tokens(output: str | dict[str, Any], max_tokens: int) -> int:
    """The ``max_tokens`` of a repair call: room for the repaired output to grow to the size
    Layer-0 still accepts (:func:`grown_output_tokens`), never more than the configured
    ``llm.max_tokens``."""
    return max(1, min(max_tokens, grown_output_tokens(output)))
