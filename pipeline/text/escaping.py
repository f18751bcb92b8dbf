"""Worker-made text made inert where it is shown: on a terminal and in Markdown artifacts.

Defect descriptions and locations, key names, file names and error fields come from worker
output, which is data (docs/security.md, 'Untrusted output'), so wherever they are shown they
must stay text.

- :func:`escape_controls`: every control, format or line-separator character (ESC, BEL, C1
  controls, bidi overrides, zero-width characters, lone surrogates) becomes a visible escape
  such as ``\\x1b``, so a terminal never runs it; all other Unicode is kept. The CLI prints
  worker-made text through it (:mod:`workers.commands._text`).
- :func:`one_line`: any text on one line (every run of whitespace one space), optionally cut:
  the one way an error, a reason or a rule is folded onto a line anywhere in the product.
- :func:`md_text` / :func:`md_cell`: text placed in ``CRITIQUE.md``, ``lessons.md`` or an
  escalation file shows literally: one line, ``&``, ``<`` and ``>`` as HTML entities (no raw
  HTML, no autolink), ``\\``, `````, ``[``, ``]`` and ``|`` backslash-escaped (no code span,
  link or image, no extra table column), controls escaped as above (``cat`` is safe too).
"""

from __future__ import annotations

import unicodedata

_ESCAPED = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Unicode categories shown as escapes: C0/DEL/C1 controls (ESC among them), invisible format
characters (bidi overrides, zero-width), lone surrogates (not encodable), line separators."""

_MARKDOWN = str.maketrans(
    {
        "\\": "\\\\",
        "`": "\\`",
        "[": "\\[",
        "]": "\\]",
        "|": "\\|",
        "&": "&amp;",
        "<": "&lt;",
        ">": "&gt;",
    }
)

MD_CELL_MAX = 200
"""Longest table cell or list line in a Markdown artifact, in characters of the raw text."""


def is_unsafe(ch: str) -> bool:
    """True for a character a terminal or renderer could act on instead of showing it."""
    return unicodedata.category(ch) in _ESCAPED


def escape_controls(text: str) -> str:
    """``text`` with each control/format character as a visible Python escape (``\\x1b``)."""
    if text.isprintable():  # the common case, checked at C speed
        return text
    return "".join(
        ch.encode("unicode_escape").decode("ascii") if is_unsafe(ch) else ch for ch in text
    )


def one_line(value: object, limit: int | None = None) -> str:
    """``str(value)`` on one line: every run of whitespace (line breaks included) one space;
    at most ``limit`` characters when given."""
    line = " ".join(str(value).split())
    return line if limit is None else line[:limit]


def md_text(value: object) -> str:
    """``value`` as one line of Markdown that renders as exactly its text (see the module)."""
    return escape_controls(one_line(value)).translate(_MARKDOWN)


def md_cell(value: object, limit: int = MD_CELL_MAX) -> str:
    """:func:`md_text` cut to ``limit`` characters of the raw text (``…`` marks the cut), so an
    escape is never cut in half; fit for a table cell."""
    text = one_line(value)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return md_text(text)
