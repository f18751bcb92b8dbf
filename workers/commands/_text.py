"""Worker-made text made safe for a terminal: the one helper every command prints it through.

File names, defect descriptions and locations, failure reasons and registry keys come from
worker output (or from a Redis that anyone on the broker can write), so a terminal must never
interpret them: an ESC sequence could retitle the window, clear the screen or hide a line.
:func:`escape_controls` (:mod:`pipeline.text.escaping`) shows every control, format and
line-separator character as a visible escape (``\\x1b``, ``\\n``, ``\\u202e``) and keeps all
other Unicode; :func:`json_line` does the same inside JSON (``\\u001b``), so ``--json`` output
stays valid and decodes to the same values.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.text.escaping import escape_controls, is_unsafe

__all__ = ["json_line", "printable"]


def printable(text: str, limit: int = 300) -> str:
    """One terminal-safe line of at most ``limit`` characters: controls escaped (newlines
    included, so it stays one line), cut with ``…``."""
    cleaned = escape_controls(text)
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 1] + "…"


def _json_escape(ch: str) -> str:
    return json.dumps(ch)[1:-1]  # \u001b, or a surrogate pair for an astral character


def json_line(doc: Any, **options: Any) -> str:
    """``doc`` as one line of JSON (UTF-8 text kept) with no raw control or format character:
    those json leaves raw (DEL, C1, bidi, lone surrogates) become ``\\uXXXX`` escapes. Pass no
    ``indent``: the line breaks it adds would be escaped too."""
    text = json.dumps(doc, ensure_ascii=False, **options)
    if text.isprintable():
        return text
    return "".join(_json_escape(ch) if is_unsafe(ch) else ch for ch in text)
