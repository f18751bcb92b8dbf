"""One scan of a document for the six default checks: compiled when built, pure Python otherwise.

Why compiled: the budget is 100 ms for all six checks on a 10 MB output (2-core machine). Python
passes cannot get there: one alternation regex of the placeholders alone takes ≈ 590 ms,
``str.split`` ≈ 73 ms, word fingerprinting with the ``simhash`` package ≈ 1.5 s. ``_fastscan.c``
(plain CPython C API, built by ``setup.py`` as an *optional* extension so an install without a
compiler still succeeds) walks the string's code units once. Word hashing is branch-free (each
character updates a running hash; a word end only advances an index into a small buffer), and
everything else the checks need — newlines, delimiters, quotes, backticks, ``?``, a word that
starts like a placeholder — is rare and handled out of line. :func:`scan_py` is the reference
with the same semantics (regexes and line-by-line Python, numpy for many fingerprints), used
when the extension is missing; the tests cross-check the two on thousands of generated
documents. Measured with ``bench/l0.py``: about 55 ms for the scan of 10 MB, 100× the reference.
Offsets are character offsets.

Definitions shared by both implementations:

* whitespace: ``str.isspace`` characters; lines end at ``\\n`` only; a blank line holds only
  whitespace. A *word* character is ``\\w`` (``str.isalnum()`` or ``_``).
* placeholders (:data:`PLACEHOLDERS`): a match must not touch a word character on either side.
  ``TODO``, ``XXX``, ``TBD``, ``FIXME``, ``Author Name``/``AUTHOR NAME`` are case-sensitive
  (lower-case "todo" and "author name" are ordinary words); ``Lorem ipsum``, ``TITLE GOES HERE``
  and ``to be filled`` are ASCII case-insensitive; words of a phrase may be separated by any
  whitespace. ``???`` is any run of three or more question marks, reported once per run.
  Placeholders are searched everywhere, code and strings included.
* disguised placeholders: :func:`scan` also searches the text as a reader sees it
  (:func:`pipeline.text.textnorm.normalize`: ANSI escapes and zero-width characters removed,
  NFKC-folded, look-alike letters mapped to Latin; and in display order where bidi controls
  reverse a run, :func:`pipeline.text.textnorm.display_order`), so ``\\x1b[31mTODO``,
  ``TO\\u200bDO``, ``ＴＯＤＯ``, ``ꓔꓳꓓꓳ`` and ``RLO ODOT`` are found too, at their offsets in
  the original text; in JSON mode ``\\u001b`` (how JSON writes ESC) counts as ESC too. Pure
  ASCII text without ESC skips this entirely (the hot path is unchanged); :func:`scan_py` is
  the reference for the raw scan only.
* modes (:func:`mode_for`): ``MD`` (markdown and plain text), ``LATEX``, ``PY``, ``JSON``,
  ``OTHER`` (files of unknown type: placeholders only).
* MD: a fence opens on a line with at most three leading spaces and ≥3 backticks (whose info
  string has no backtick) or tildes, and closes on a line of at least as many of the same
  character followed only by whitespace (or at the end of the text). Fence lines are invisible
  to paragraphs, headings and delimiters. Outside fences a backslash escapes the next
  non-whitespace character; a run of 1-32 backticks opens an inline code span that closes at
  the next run of exactly as many backticks on the same line (else the run is literal); an ATX
  heading is a line of at most three spaces, 1-6 ``#`` and a space, tab or line end, its title
  trimmed of an optional closing ``#`` run. Prose has no string literals: quotes and
  apostrophes are ordinary characters.
* LATEX: ``%`` starts a comment to the end of the line unless escaped; a backslash escapes the
  next non-whitespace character.
* both MD and LATEX: ``\\section``, ``\\subsection``, ``\\subsubsection`` (``*`` and ``[..]``
  allowed) followed by a ``{title}`` closed on the same line are headings; paragraphs are runs
  of non-blank lines, their words ``str.split()``.
* PY: ``#`` comments; strings are ``'…'``/``"…"`` (ending at the closing quote or an unescaped
  line end) and ``'''…'''``/``\"\"\"…\"\"\"``; a backslash escapes the next character (prefixes
  such as ``r``/``b``/``f`` change nothing for tokenising).
* JSON: strings are ``"…"`` with backslash escapes, ending at the closing quote or a line end.
* delimiters ``()``, ``[]``, ``{}`` count outside strings, comments, fences and code spans.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass, replace
from typing import Any

from pipeline.text import textnorm
from pipeline.text.compiled import FASTSCAN
from pipeline.text.simhash import fingerprints

MODE_OTHER, MODE_MD, MODE_LATEX, MODE_PY, MODE_JSON = 0, 1, 2, 3, 4
WANT_PLACEHOLDERS, WANT_PARAS, WANT_HEADINGS, WANT_DELIMS = 1, 2, 4, 8
WANT_ALL = WANT_PLACEHOLDERS | WANT_PARAS | WANT_HEADINGS | WANT_DELIMS

PLACEHOLDERS: tuple[tuple[str, bool], ...] = (
    ("TODO", False),
    ("XXX", False),
    ("???", False),
    ("Lorem ipsum", True),
    ("TBD", False),
    ("FIXME", False),
    ("TITLE GOES HERE", True),
    ("Author Name", False),
    ("AUTHOR NAME", False),
    ("to be filled", True),
)
"""(pattern, ASCII case-insensitive); the order is the pattern id the scanners report."""

DELIMITER_PAIRS: tuple[tuple[str, str], ...] = (("(", ")"), ("[", "]"), ("{", "}"))

MAX_HITS = 1000
"""Placeholder hits kept per document (all of them are counted)."""
MIN_PARAGRAPH_WORDS = 20
"""Paragraphs shorter than this are not fingerprinted (signatures, list items may repeat)."""

_EXTENSION_MODES = {
    ".md": MODE_MD,
    ".markdown": MODE_MD,
    ".txt": MODE_MD,
    ".rst": MODE_MD,
    ".tex": MODE_LATEX,
    ".py": MODE_PY,
    ".pyi": MODE_PY,
    ".json": MODE_JSON,
    ".ipynb": MODE_JSON,
    ".geojson": MODE_JSON,
}
_FORMAT_MODES = {
    "markdown": MODE_MD,
    "text": MODE_MD,
    "latex": MODE_LATEX,
    "python": MODE_PY,
    "json": MODE_JSON,
}


def mode_for(path: str | None, claimed_format: str | None) -> int:
    """Scan mode: the claimed format when given, else the file extension; prose otherwise.

    A file whose extension is unknown (``.csv``, ``.yaml``, …) gets ``MODE_OTHER``; the output
    itself (no path) and extension-less files are prose.
    """
    if claimed_format is not None:
        return _FORMAT_MODES.get(claimed_format, MODE_MD)
    if path is None:
        return MODE_MD
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    if "." not in name.lstrip("."):
        return MODE_MD
    ext = "." + name.rsplit(".", 1)[-1].lower()
    return _EXTENSION_MODES.get(ext, MODE_OTHER)


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What one scan found: raw spans; the checks turn them into failures."""

    hits: list[tuple[int, int, int]]
    """(pattern id, start, end) of the first :data:`MAX_HITS` placeholder matches."""
    total_hits: int
    paragraphs: list[tuple[int, int, int, int]]
    """(start, end, words, fingerprint) of paragraphs with at least ``min_words`` words."""
    headings: list[tuple[int, int, int]]
    """(offset, title start, title end); the title may be empty."""
    delimiters: tuple[tuple[int, int, int, int], ...]
    """Per pair of :data:`DELIMITER_PAIRS`: opens, closes, offset of the earliest opener
    never closed (-1), offset of the first closer with nothing open (-1)."""


def compiled_available() -> bool:
    """True when the C scanner is built and importable."""
    return FASTSCAN is not None


def scan(
    text: str,
    mode: int,
    want: int = WANT_ALL,
    *,
    min_words: int = MIN_PARAGRAPH_WORDS,
    max_hits: int = MAX_HITS,
    engine: str = "auto",
) -> ScanResult:
    """Scan ``text`` once. ``engine``: ``auto`` (compiled if built), ``c`` or ``python``."""
    if engine not in ("auto", "c", "python"):
        raise ValueError(f"engine must be 'auto', 'c' or 'python', not {engine!r}")
    ext = FASTSCAN if engine != "python" else None
    if ext is None and engine == "c":
        raise RuntimeError("the compiled scanner is not built (python setup.py build_ext)")
    if ext is not None:
        hits, total, paras, heads, delims = ext.scan(text, mode, want, min_words, max_hits)
        result = ScanResult(hits, total, paras, heads, tuple(delims))
    else:
        result = scan_py(text, mode, want, min_words=min_words, max_hits=max_hits)
    json_escapes = mode == MODE_JSON
    if want & WANT_PLACEHOLDERS and textnorm.needs_work(text, json_escapes=json_escapes):
        result = _add_disguised(text, result, ext, max_hits, json_escapes)
    return result


def _placeholders(text: str, ext: Any, max_hits: int) -> tuple[list[tuple[int, int, int]], int]:
    """Placeholder hits and their total in ``text``, with the compiled scanner when built."""
    if ext is not None:
        found, total = ext.scan(text, MODE_OTHER, WANT_PLACEHOLDERS, 3, max_hits)[:2]
        return found, total
    res = scan_py(text, MODE_OTHER, WANT_PLACEHOLDERS, max_hits=max_hits)
    return res.hits, res.total_hits


def _add_disguised(
    text: str, raw: ScanResult, ext: Any, max_hits: int, json_escapes: bool
) -> ScanResult:
    """``raw`` plus the placeholders only the text as a reader sees it shows (ANSI-wrapped,
    split by zero-width characters, fullwidth, look-alike letters; and, where bidi controls
    reverse part of it, in display order: :func:`pipeline.text.textnorm.display_order`), at their
    offsets in ``text``.

    A hit that overlaps one already found is the same placeholder and is not counted twice;
    raw hits are always kept (a zero-width space can end a word in the raw text).
    """
    norm = textnorm.normalize(text, json_escapes=json_escapes)
    if norm.identity and norm.text == text:
        return raw
    readings: list[textnorm.Normalized | textnorm.Reordered] = [norm]
    shown = textnorm.display_order(norm)
    if shown is not None:
        readings.append(shown)
    taken = sorted((s, e) for _, s, e in raw.hits)
    extra: list[tuple[int, int, int]] = []
    total = raw.total_hits
    for reading in readings:
        found, found_total = _placeholders(reading.text, ext, max_hits)
        total = max(total, found_total)
        for pid, s, e in found:
            start, end = reading.span(s, e)
            i = bisect_left(taken, (end, -1))  # the hits that start before this one ends
            if i > 0 and taken[i - 1][1] > start:
                continue  # overlaps one (hits are disjoint: the last to start ends last)
            taken.insert(i, (start, end))
            extra.append((pid, start, end))
    if not extra:
        return raw
    hits = sorted([*raw.hits, *extra])[:max_hits]
    return replace(raw, hits=hits, total_hits=max(raw.total_hits + len(extra), total))


# ---- the pure-Python reference -------------------------------------------------------------


def _placeholder_regex() -> re.Pattern[str]:
    alts = []
    for pid, (pat, ci) in enumerate(PLACEHOLDERS):
        if pat == "???":
            alts.append(rf"(?P<p{pid}>\?{{3,}})")
            continue
        parts = []
        for ch in pat:
            if ch == " ":
                parts.append(r"\s+")
            elif ci and ch.isalpha():
                parts.append(f"[{ch.lower()}{ch.upper()}]")
            else:
                parts.append(re.escape(ch))
        alts.append(rf"(?P<p{pid}>(?<!\w){''.join(parts)}(?!\w))")
    return re.compile("|".join(alts))


_PLACEHOLDER_RE = _placeholder_regex()


def has_placeholder(text: str) -> bool:
    """True when ``text`` as it is holds a placeholder (the reference scan's rule)."""
    return _PLACEHOLDER_RE.search(text) is not None


_MD_TOKEN = re.compile(r"\\\S|`+|[()\[\]{}]")
_LATEX_TOKEN = re.compile(r"\\\S|%|[()\[\]{}]")
_PY_TOKEN = re.compile(
    r"#[^\n]*"
    r"|'''(?:[^'\\]|\\(?:.|\Z)|'(?!''))*(?:'''|\Z)"
    r'|"""(?:[^"\\]|\\(?:.|\Z)|"(?!""))*(?:"""|\Z)'
    r"|'(?:[^'\\\n]|\\(?:.|\Z))*(?:'|(?=\n)|\Z)"
    r'|"(?:[^"\\\n]|\\(?:.|\Z))*(?:"|(?=\n)|\Z)'
    r"|[()\[\]{}]",
    re.DOTALL,
)
_JSON_TOKEN = re.compile(r'"(?:[^"\\\n]|\\(?:.|\Z))*(?:"|(?=\n)|\Z)|[()\[\]{}]', re.DOTALL)
_BACKTICK_RUN = re.compile(r"`+")
_DELIM_INDEX = {"(": (0, True), ")": (0, False), "[": (1, True), "]": (1, False)}
_DELIM_INDEX.update({"{": (2, True), "}": (2, False)})


class _Delims:
    """Running delimiter statistics, fed in text order."""

    __slots__ = ("closes", "depth", "opens", "rise", "unmatched")

    def __init__(self) -> None:
        self.opens = [0, 0, 0]
        self.closes = [0, 0, 0]
        self.depth = [0, 0, 0]
        self.rise = [-1, -1, -1]
        self.unmatched = [-1, -1, -1]

    def feed(self, ch: str, pos: int) -> None:
        t, is_open = _DELIM_INDEX[ch]
        if is_open:
            self.opens[t] += 1
            if self.depth[t] == 0:
                self.rise[t] = pos
            self.depth[t] += 1
        else:
            self.closes[t] += 1
            if self.depth[t] == 0:
                if self.unmatched[t] < 0:
                    self.unmatched[t] = pos
            else:
                self.depth[t] -= 1

    def result(self) -> tuple[tuple[int, int, int, int], ...]:
        return tuple(
            (self.opens[t], self.closes[t], self.rise[t], self.unmatched[t]) for t in range(3)
        )


def _fence_open(line: str) -> tuple[str, int] | None:
    stripped = line[: min(3, len(line) - len(line.lstrip(" ")))]
    rest = line[len(stripped) :]
    if not rest or rest[0] not in "`~":
        return None
    ch = rest[0]
    run = len(rest) - len(rest.lstrip(ch))
    if run < 3:
        return None
    if ch == "`" and "`" in rest[run:]:
        return None
    return ch, run


def _fence_close(line: str, ch: str, length: int) -> bool:
    rest = line[min(3, len(line) - len(line.lstrip(" "))) :]
    run = len(rest) - len(rest.lstrip(ch))
    return run >= length and (rest[run:] == "" or rest[run:].isspace())


def _atx(line: str, off: int) -> tuple[int, int, int] | None:
    lead = min(3, len(line) - len(line.lstrip(" ")))
    rest = line[lead:]
    run = len(rest) - len(rest.lstrip("#"))
    if not 1 <= run <= 6:
        return None
    after = rest[run:]
    if after and after[0] not in " \t\r":
        return None
    ts = lead + run + (len(after) - len(after.lstrip()))
    title = line[ts:].rstrip()
    te = ts + len(title)
    closing = len(title) - len(title.rstrip("#"))
    if closing:
        h = te - closing
        if h == ts or line[h - 1] in " \t":
            te = ts + len(line[ts:h].rstrip())
    return off + lead, off + ts, off + te


def _section(text: str, p: int) -> tuple[int, int, int] | None:
    """A \\section-like command at the backslash ``p``: (p, title start, title end)."""
    n = len(text)
    j = p + 1
    for _ in range(2):
        if text.startswith("sub", j):
            j += 3
        else:
            break
    if not text.startswith("section", j):
        return None
    j += 7
    if j < n and text[j] == "*":
        j += 1
    while j < n and text[j] in " \t":
        j += 1
    if j < n and text[j] == "[":
        j += 1
        while j < n and text[j] not in "]\n":
            j += 1
        if j >= n or text[j] != "]":
            return None
        j += 1
        while j < n and text[j] in " \t":
            j += 1
    if j >= n or text[j] != "{":
        return None
    j += 1
    ts = j
    depth = 1
    while j < n and j - ts <= 1000:
        c = text[j]
        if c == "\n":
            return None
        if c == "\\":
            j += 2 if j + 1 < n and text[j + 1] != "\n" else 1
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return p, ts, j
        j += 1
    return None


def _code_span_end(line: str, start: int, run: int) -> int:
    """End (in the line) of the inline code span opened by ``run`` backticks at ``start``."""
    if run > 32:
        return -1
    for m in _BACKTICK_RUN.finditer(line, start + run):
        if m.end() - m.start() == run:
            return m.end()
    return -1


def _prose_line(
    text: str, line: str, off: int, latex: bool, want_heads: bool, d: _Delims, heads: list[Any]
) -> None:
    """Delimiters and LaTeX sections of one prose line outside fences."""
    token_re = _LATEX_TOKEN if latex else _MD_TOKEN
    code_until = -1
    for m in token_re.finditer(line):
        s = m.start()
        if s < code_until:
            continue
        tok = m.group()
        c = tok[0]
        if c == "\\":
            if want_heads and tok[1:] == "s":
                sec = _section(text, off + s)
                if sec is not None:
                    heads.append(sec)
        elif c == "`":
            end = _code_span_end(line, s, len(tok))
            if end >= 0:
                code_until = end
        elif c == "%":
            return
        else:
            d.feed(c, off + s)


def _close_paragraph(
    lines: list[tuple[int, str]], min_words: int, out: list[tuple[int, int, list[str]]]
) -> None:
    if not lines:
        return
    words = " ".join(ln for _, ln in lines).split()
    if len(words) >= min_words:
        o0, l0 = lines[0]
        o1, l1 = lines[-1]
        out.append((o0 + len(l0) - len(l0.lstrip()), o1 + len(l1.rstrip()), words))
    lines.clear()


def scan_py(
    text: str,
    mode: int,
    want: int = WANT_ALL,
    *,
    min_words: int = MIN_PARAGRAPH_WORDS,
    max_hits: int = MAX_HITS,
) -> ScanResult:
    """Pure-Python scan with exactly the compiled scanner's results."""
    min_words = max(3, min_words)
    hits: list[tuple[int, int, int]] = []
    total = 0
    if want & WANT_PLACEHOLDERS:
        for m in _PLACEHOLDER_RE.finditer(text):
            total += 1
            if len(hits) < max_hits:
                pid = int((m.lastgroup or "p0")[1:])
                hits.append((pid, m.start(), m.end()))
    d = _Delims()
    heads: list[tuple[int, int, int]] = []
    paras: list[tuple[int, int, list[str]]] = []
    want_struct = bool(want & (WANT_DELIMS | WANT_HEADINGS))
    want_heads = bool(want & WANT_HEADINGS)
    if mode in (MODE_MD, MODE_LATEX) and (want_struct or want & WANT_PARAS):
        track = bool(want & WANT_PARAS)
        latex = mode == MODE_LATEX
        fence: tuple[str, int] | None = None
        current: list[tuple[int, str]] = []
        off = 0
        for line in text.split("\n"):
            excluded = False
            if not latex:
                if fence is not None:
                    excluded = True
                    if _fence_close(line, *fence):
                        fence = None
                else:
                    fence = _fence_open(line)
                    excluded = fence is not None
                    if not excluded and want_heads:
                        h = _atx(line, off)
                        if h is not None:
                            heads.append(h)
            if excluded or not line or line.isspace():
                if track:
                    _close_paragraph(current, min_words, paras)
            else:
                if track:
                    current.append((off, line))
                if want_struct:
                    _prose_line(text, line, off, latex, want_heads, d, heads)
            off += len(line) + 1
        if track:
            _close_paragraph(current, min_words, paras)
    elif mode in (MODE_PY, MODE_JSON) and want_struct:
        token_re = _PY_TOKEN if mode == MODE_PY else _JSON_TOKEN
        for m in token_re.finditer(text):
            c = m.group()[0]
            if c in _DELIM_INDEX:
                d.feed(c, m.start())
    heads.sort()
    fps = fingerprints([w for _, _, w in paras]) if paras else []
    return ScanResult(
        hits=hits,
        total_hits=total,
        paragraphs=[(s, e, len(w), fp) for (s, e, w), fp in zip(paras, fps, strict=True)],
        headings=heads,
        delimiters=d.result(),
    )
