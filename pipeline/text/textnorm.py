"""Text as a reader sees it, for the scans that must not be fooled by how it is encoded.

The Layer-0 placeholder scan and the LLM critic's injection scan look for ASCII phrases
(``TODO``, "ignore previous instructions"). Text can show such a phrase while its code points
spell something else; :func:`normalize` undoes the usual tricks and keeps an offset map, so a
hit found in the normalised text still reports its offset in the ORIGINAL text:

1. **Removed:** ANSI / terminal escape sequences (CSI ``ESC [ … m`` colours and cursor moves,
   OSC/DCS strings up to BEL or ST and at most the end of the line, two-character escapes, a
   lone ESC, the 8-bit C1 forms; with ``json_escapes``, also written ``\\u001b[31m``, as a
   dict output's ANSI codes reach the scans), zero-width and other invisible format
   characters (ZWSP, ZWNJ, ZWJ, word joiner, BOM, soft hyphen, bidi controls, variation
   selectors, tag characters, …) and combining marks of the Latin/Greek/Cyrillic/symbol
   blocks (so ``T̶O̶D̶O̶`` reads ``TODO``).
2. **NFKC-folded**, character by character: fullwidth ``ＴＯＤＯ``, mathematical ``𝐓𝐎𝐃𝐎``,
   ligatures, no-break and other spaces become their plain forms.
3. **Confusables** (:data:`CONFUSABLES`) mapped to the Latin letter they imitate, in
   *mixed-script words only*: a word holding both a Latin letter and a look-alike (``іgnore``
   with a Cyrillic ``і``). A word written wholly in Cyrillic or Greek is that language's word
   and is left as it is, so Russian or Greek prose is never read as English (mixed-script
   detection in the sense of Unicode TR39; it also keeps non-Latin text cheap). Letters of
   scripts and symbol sets an output for this pipeline holds no prose in (:data:`LOOKALIKES`:
   Lisu, Cherokee, Coptic, Latin small capitals, negative circled/squared letters) are mapped
   wherever they stand, so ``ꓔꓳꓓꓳ`` (all Lisu) reads ``TODO``. The braille blank U+2800
   reads as a space.

Bidi controls are removed in step 1, which reads a right-to-left run in stored order; an
override displays ``RLO ODOT`` as TODO, so :func:`display_order` gives the same normalised text
with each RLE/RLO/RLI run reversed, and the scans read both. :func:`looks_blank` says whether a
reader sees anything at all (a required field of U+200B is as empty as ``""``).

ASCII control characters other than ESC (a NUL or a backspace inside a word) are left as they
are: looking for them would cost the ASCII fast path a pass of its own.

Cost: pure ASCII text without ESC — the common case — needs no work at all (``isascii`` is
O(1) in CPython and ``"\\x1b" in text`` a memchr; with ``json_escapes``, one more memchr
for a backslash); :func:`needs_work` says so and :func:`normalize` returns the text itself.
Otherwise the text goes through numpy as an array of code points and lookup tables (built
once, ~80 ms): linear, no Python loop per character (only per unusual escape sequence).
Measured on the 2-core VM: 10 MB of Russian prose ≈ 90 ms (≈ 300 ms when NFKC changes a
character somewhere, e.g. one "…"), 10 MB of fullwidth text ≈ 230 ms, 10 MB dense with ANSI
colour codes ≈ 350 ms. The offset map is one int32 per original character, kept only when
characters were removed or expanded.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "CONFUSABLES",
    "LOOKALIKES",
    "Normalized",
    "Reordered",
    "display_order",
    "fold",
    "looks_blank",
    "needs_work",
    "normalize",
]

# Look-alike letters → the ASCII letter they imitate. Derived from Unicode TR39
# ``confusables.txt`` (https://www.unicode.org/Public/security/latest/confusables.txt): the
# entries whose prototype is a single ASCII letter, for Cyrillic, Greek, Armenian and the
# Latin-script look-alikes (dotless i, script g, Latin alpha/iota), restricted to letters that
# render like that letter in common fonts, and made case-preserving (the placeholder scan is
# case-sensitive; TR39 skeletons are not: it maps Cyrillic І to "l" and Greek κ to "ĸ", here
# they become "I" and "k"). Fullwidth and mathematical letters are not listed: NFKC maps them.
CONFUSABLES: dict[str, str] = {
    # Cyrillic capitals
    "\u0410": "A", "\u0412": "B", "\u0415": "E", "\u041a": "K", "\u041c": "M",
    "\u041d": "H", "\u041e": "O", "\u0420": "P", "\u0421": "C", "\u0422": "T",
    "\u0423": "Y", "\u0425": "X", "\u0405": "S", "\u0406": "I", "\u0408": "J",
    "\u04c0": "I", "\u04ae": "Y", "\u051a": "Q", "\u051c": "W",
    # Cyrillic small
    "\u0430": "a", "\u0435": "e", "\u043e": "o", "\u0440": "p", "\u0441": "c",
    "\u0443": "y", "\u0445": "x", "\u0455": "s", "\u0456": "i", "\u0458": "j",
    "\u0501": "d", "\u051b": "q", "\u051d": "w", "\u04bb": "h", "\u04cf": "l",
    "\u04af": "y", "\u0475": "v", "\u0433": "r", "\u043f": "n",
    # Greek capitals
    "\u0391": "A", "\u0392": "B", "\u0395": "E", "\u0396": "Z", "\u0397": "H",
    "\u0399": "I", "\u039a": "K", "\u039c": "M", "\u039d": "N", "\u039f": "O",
    "\u03a1": "P", "\u03a4": "T", "\u03a5": "Y", "\u03a7": "X", "\u03f9": "C",
    "\u037f": "J",
    # Greek small
    "\u03bf": "o", "\u03b1": "a", "\u03b9": "i", "\u03bd": "v", "\u03c1": "p",
    "\u03c5": "u", "\u03f2": "c", "\u03f3": "j", "\u03ba": "k", "\u03b3": "y",
    # Armenian small
    "\u0585": "o", "\u057d": "u", "\u0578": "n", "\u0570": "h",
    # Latin-script look-alikes (not ASCII)
    "\u0131": "i", "\u0261": "g", "\u0251": "a", "\u0269": "i",
}  # fmt: skip

# Look-alikes mapped wherever they stand, not only in mixed-script words: letters of scripts
# and symbol sets an output for this pipeline holds no prose in, which imitate Latin capitals
# closely enough that a word spelled wholly in them reads as English (``ꓔꓳꓓꓳ`` in Lisu reads
# TODO). Our own reading of TR39's confusables for the letters the placeholder and injection
# phrases use, case-preserving like :data:`CONFUSABLES`: Lisu (the Fraser alphabet is built
# from Latin capitals), Cherokee (its small letters are small-capital forms of the capitals and
# map with them), Coptic, Latin small capitals (``ᴛᴏᴅᴏ`` reads TODO, so they map to capitals),
# and the negative circled/squared letters and the estimated sign (symbols NFKC leaves alone).
# Cyrillic, Greek and Armenian stay mixed-script only: Russian "ХХХ век" is a real phrase.
LOOKALIKES: dict[str, str] = {
    # Lisu
    "\ua4d0": "B", "\ua4d1": "P", "\ua4d3": "D", "\ua4d4": "T", "\ua4d6": "G",
    "\ua4d7": "K", "\ua4d9": "J", "\ua4da": "C", "\ua4dc": "Z", "\ua4dd": "F",
    "\ua4df": "M", "\ua4e0": "N", "\ua4e1": "L", "\ua4e2": "S", "\ua4e3": "R",
    "\ua4e6": "V", "\ua4e7": "H", "\ua4ea": "W", "\ua4eb": "X", "\ua4ec": "Y",
    "\ua4ee": "A", "\ua4f0": "E", "\ua4f2": "I", "\ua4f3": "O", "\ua4f4": "U",
    # Cherokee (capitals; the small letters are added below)
    "\u13a0": "D", "\u13a1": "R", "\u13a2": "T", "\u13a9": "Y", "\u13aa": "A",
    "\u13ab": "J", "\u13ac": "E", "\u13b3": "W", "\u13b7": "M", "\u13bb": "H",
    "\u13bd": "Y", "\u13c0": "G", "\u13c3": "Z", "\u13d2": "R", "\u13d4": "W",
    "\u13d5": "S", "\u13d9": "V", "\u13da": "S", "\u13de": "L", "\u13df": "C",
    "\u13e2": "P", "\u13e6": "K", "\u13f3": "G", "\u13f4": "B",
    # Coptic
    "\u2c82": "B", "\u2c8e": "H", "\u2c92": "I", "\u2c94": "K", "\u2c98": "M",
    "\u2c9a": "N", "\u2c9e": "O", "\u2ca2": "P", "\u2ca4": "C", "\u2ca6": "T",
    "\u2ca8": "Y", "\u2cac": "X", "\u2cd0": "L", "\u2c93": "i", "\u2c9f": "o",
    "\u2ca3": "p", "\u2ca5": "c", "\u2ca9": "y", "\u2cad": "x",
    # Latin small capitals
    "\u1d00": "A", "\u0299": "B", "\u1d04": "C", "\u1d05": "D", "\u1d07": "E",
    "\ua730": "F", "\u0262": "G", "\u029c": "H", "\u026a": "I", "\u1d0a": "J",
    "\u1d0b": "K", "\u029f": "L", "\u1d0d": "M", "\u0274": "N", "\u1d0f": "O",
    "\u1d18": "P", "\ua7af": "Q", "\u0280": "R", "\ua731": "S", "\u1d1b": "T",
    "\u1d1c": "U", "\u1d20": "V", "\u1d21": "W", "\u028f": "Y", "\u1d22": "Z",
    # symbols
    "\u212e": "e",
}  # fmt: skip
LOOKALIKES.update(
    {src.lower(): dst for src, dst in LOOKALIKES.items() if "\u13a0" <= src <= "\u13f5"}
)
LOOKALIKES.update({chr(base + i): chr(0x41 + i) for base in (0x1F150, 0x1F170) for i in range(26)})

_BLANK_AS_SPACE = (0x2800,)
"""Characters that render as an empty cell (the braille blank): read as a space, so they
separate words like one and a field holding only them is blank."""

_LATIN_LOOKALIKES = "\u0131\u0261\u0251\u0269"

_ESCAPE = re.compile(
    r"\x1b\[[0-?]{0,64}[ -/]{0,16}[@-~]"  # CSI: colours, cursor moves, erase
    r"|\x1b[\]PX^_][^\x07\x1b\n]{0,4096}(?:\x07|\x1b\\)?"  # OSC/DCS/SOS/PM/APC strings
    r"|\x1b[ -/]{0,8}[0-~]"  # two-character and nF escapes
    r"|\x1b"  # a lone ESC
    r"|\x9b[0-?]{0,64}[ -/]{0,16}[@-~]"  # 8-bit CSI
    r"|\x9b"
)
"""An escape sequence starting at an ESC (or 8-bit CSI); bounded, so matching is linear."""
_JSON_ESCAPE = re.compile(
    r"\\u001[bB](?:\[[0-?]{0,64}[ -/]{0,16}[@-~]"  # CSI
    r'|\][^"\\\n]{0,4096}(?:\\u0007|\\u001[bB]\\\\)?'  # OSC string up to BEL or ST
    r"|[ -/]{0,8}[0-Z^-~])?"  # two-character escapes (not a backslash: that ends the escape)
)
"""The same, written inside a JSON string (``json.dumps`` turns ESC into ``\\u001b``): how
a dict output's ANSI codes reach the scans."""

_INVISIBLE: tuple[tuple[int, int], ...] = (
    (0x80, 0x9F),  # C1 controls (ESC / 8-bit CSI sequences are matched by _ESCAPE)
    (0x00AD, 0x00AD),  # soft hyphen
    (0x034F, 0x034F),  # combining grapheme joiner
    (0x061C, 0x061C),  # Arabic letter mark
    (0x115F, 0x1160),  # Hangul fillers
    (0x17B4, 0x17B5),  # Khmer inherent vowels (invisible)
    (0x180B, 0x180F),  # Mongolian variation selectors, vowel separator
    (0x200B, 0x200F),  # ZWSP, ZWNJ, ZWJ, LRM, RLM
    (0x202A, 0x202E),  # bidi embeddings and overrides
    (0x2060, 0x206F),  # word joiner, invisible operators, bidi isolates, deprecated format
    (0x3164, 0x3164),  # Hangul filler
    (0xFE00, 0xFE0F),  # variation selectors
    (0xFEFF, 0xFEFF),  # BOM / zero-width no-break space
    (0xFFA0, 0xFFA0),  # halfwidth Hangul filler
    (0xFFF9, 0xFFFB),  # interlinear annotation
    (0x16FE4, 0x16FE4),  # Khitan small script filler
    (0x1BCA0, 0x1BCA3),  # shorthand format controls
    (0x1D173, 0x1D17A),  # musical symbol format controls
)
"""Zero-width and other invisible characters (format characters, fillers, variation
selectors) removed before scanning. Tags and the variation selectors supplement (plane 14)
are removed by a range test."""
_MARKS: tuple[tuple[int, int], ...] = (
    (0x0300, 0x036F),  # combining diacritical marks
    (0x0483, 0x0489),  # Cyrillic combining marks
    (0x1AB0, 0x1AFF),  # combining diacritical marks extended
    (0x1DC0, 0x1DFF),  # combining diacritical marks supplement
    (0x20D0, 0x20FF),  # combining marks for symbols (enclosing circles, overlays)
    (0xFE20, 0xFE2F),  # combining half marks
)
"""Combining marks of the Latin, Greek, Cyrillic and symbol blocks (strike-through, accents)."""
_TABLE_SIZE = 0x110000
_NFKC_LIMIT = 0x20000
"""NFKC is looked up for planes 0 and 1 (fullwidth, mathematical letters, ligatures); higher
code points (CJK extensions, tags, private use) are kept unless removed."""
MAX_EXPANSION = 4
"""A character whose NFKC form is longer than this (Arabic ligatures, squared words) is kept
as it is: no ASCII phrase hides in it, and the normalised text stays ≤ 4× the original."""


def needs_work(text: str, *, json_escapes: bool = False) -> bool:
    """False when :func:`normalize` would return ``text`` unchanged: pure ASCII without ESC
    (nor, with ``json_escapes``, ESC written ``\\u001b``)."""
    if not text.isascii() or "\x1b" in text:
        return True
    # "\\" first: a one-character search is a memchr, the five-character one is not.
    return json_escapes and "\\" in text and "\\u001" in text


class _Tables:
    """Lookup tables indexed by code point, built once on first use (about 50 ms, 12 MB)."""

    def __init__(self) -> None:
        import numpy as np

        size = _TABLE_SIZE
        lens = np.ones(size, dtype=np.uint8)
        offs = np.arange(size, dtype=np.int32)
        extra: list[int] = []
        for lo, hi in (*_INVISIBLE, *_MARKS, (0xE0000, 0xE0FFF)):
            lens[lo : hi + 1] = 0
        removed = lens[:_NFKC_LIMIT] == 0
        for cp in range(0x80, _NFKC_LIMIT):
            ch = chr(cp)
            if not unicodedata.decomposition(ch) or removed[cp]:
                continue
            nf = unicodedata.normalize("NFKC", ch)
            if nf == ch or len(nf) > MAX_EXPANSION:
                continue
            lens[cp] = len(nf)
            offs[cp] = size + len(extra)
            extra.extend(ord(c) for c in nf)
        for cp in _BLANK_AS_SPACE:
            offs[cp] = 0x20  # data[0x20] is the space
        self.lens = lens
        """Characters each code point becomes: 0 removed, 1 (itself or its NFKC form), 2-4."""
        self.offs = offs
        """Where in :attr:`data` its characters start."""
        self.data = np.concatenate(
            [np.arange(size, dtype=np.uint32), np.array(extra, dtype=np.uint32)]
        )
        changed = offs != np.arange(size, dtype=np.int32)
        changed |= lens != 1
        changed[0x1B] = True  # ESC starts a sequence to remove
        self.changed = changed
        """True where stage 1 (removal, NFKC) does anything."""
        latin = np.zeros(size, dtype=bool)
        for ch in f"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz{_LATIN_LOOKALIKES}":
            latin[ord(ch)] = True
        self.latin = latin
        target = np.arange(size, dtype=np.uint32)
        kind = np.zeros(size, dtype=np.uint8)
        for table, k in ((CONFUSABLES, 1), (LOOKALIKES, 2)):
            for src, dst in table.items():
                target[ord(src)] = ord(dst)
                kind[ord(src)] = k
        self.kind = kind
        """1: a look-alike of :data:`CONFUSABLES` (mixed-script words only), 2: of
        :data:`LOOKALIKES` (everywhere), 0: neither."""
        self.target = target
        word = np.zeros(size, dtype=bool)
        word[:_NFKC_LIMIT] = [chr(cp).isalnum() or cp == 0x5F for cp in range(_NFKC_LIMIT)]
        word[0x20000:0x323B0] = True  # CJK ideograph extensions
        self.word = word
        bidi = np.zeros(size, dtype=np.uint8)
        bidi[list(_RUN_ENDS)] = 1
        bidi[[ord(c) for c in _RTL_OPENERS]] = 2
        self.bidi = bidi
        """2: opens a right-to-left run; 1: ends one (any other bidi control, a paragraph end)."""


@lru_cache(maxsize=1)
def _tables() -> _Tables:
    return _Tables()


class Normalized:
    """A normalised text and the map from its offsets back to the original's."""

    __slots__ = ("_ends", "original", "text")

    def __init__(
        self,
        original: str,
        text: str,
        ends: npt.NDArray[Any] | None = None,
    ) -> None:
        self.original = original
        self.text = text
        """The normalised text (``original`` itself when nothing needed doing)."""
        self._ends = ends
        """Per original character, the normalised offset where its output ends (None when
        offsets are the same in both texts)."""

    @property
    def identity(self) -> bool:
        """True when offsets are the same in both texts (nothing was removed or expanded)."""
        return self._ends is None

    def start(self, pos: int) -> int:
        """Original offset of the character at normalised offset ``pos``."""
        if self._ends is None:
            return pos
        import numpy as np

        return int(np.searchsorted(self._ends, pos, side="right"))

    def end(self, pos: int) -> int:
        """Original (exclusive) end offset for the normalised exclusive end ``pos``."""
        if self._ends is None or pos <= 0:
            return self.start(pos)
        import numpy as np

        return int(np.searchsorted(self._ends, pos - 1, side="right")) + 1

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span of the normalised span ``[start, end)``."""
        return self.start(start), self.end(end)

    def at(self, pos: int) -> int:
        """Normalised offset where the output of original character ``pos`` begins."""
        if self._ends is None or pos <= 0:
            return pos
        return int(self._ends[pos - 1])

    def __repr__(self) -> str:
        return f"Normalized({self.text[:40]!r}{'…' if len(self.text) > 40 else ''})"


def normalize(text: str, *, json_escapes: bool = False) -> Normalized:
    """``text`` with escapes and invisible characters removed, NFKC-folded, and look-alike
    letters of mixed-script words mapped to Latin (see the module docstring), with the map
    back to original offsets. Pure ASCII text without ESC is returned as it is.

    ``json_escapes``: the text is (or may be) JSON, so ``\\u001b`` in it is an ESC as well.
    """
    if not needs_work(text, json_escapes=json_escapes):
        return Normalized(text, text)
    import numpy as np

    t = _tables()
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    json_escaped = json_escapes and "\\u001" in text
    if json_escaped or t.changed[codes].any():
        folded, ends = _fold(text, codes, t, json_escaped)
    else:
        folded, ends = codes, None
    mapped = _map_confusables(folded, t)
    if mapped is codes:
        return Normalized(text, text)
    return Normalized(text, mapped.tobytes().decode("utf-32-le", "surrogatepass"), ends)


def _escapes(
    text: str, codes: npt.NDArray[np.uint32], lens: npt.NDArray[Any], json_escaped: bool
) -> None:
    """Zero ``lens`` over every escape sequence, raw or JSON-escaped. The usual CSI form
    (``ESC [`` parameters, final byte) is found vectorised; anything else goes through
    :data:`_ESCAPE` (and :data:`_JSON_ESCAPE`)."""
    import numpy as np

    n = len(codes)
    marks = np.zeros(n + 1, dtype=np.int32)
    if json_escaped:
        for found in _JSON_ESCAPE.finditer(text):
            marks[found.start()] += 1
            marks[found.end()] -= 1
    esc = np.flatnonzero((codes == 0x1B) | (codes == 0x9B))
    if len(esc) == 0:
        lens[np.cumsum(marks[:n]) > 0] = 0
        return
    final = np.append(np.flatnonzero((codes >= 0x40) & (codes <= 0x7E)), n)  # n: none left
    param = (codes >= 0x20) & (codes <= 0x3F)
    bad = np.concatenate(([0], np.cumsum(~param, dtype=lens.dtype)))
    body = esc + np.where(codes[esc] == 0x1B, 2, 1)  # first parameter byte
    csi = (body <= n) & (codes[np.minimum(esc + 1, n - 1)] == 0x5B) | (codes[esc] == 0x9B)
    end = final[np.searchsorted(final, np.minimum(body, n))]
    csi &= (end < n) & (end - esc <= 82) & (bad[end] - bad[np.minimum(body, end)] == 0)
    # Distinct CSI sequences never share a start or an end (ESC is not a parameter byte), so
    # plain fancy-index updates count each once.
    marks[esc[csi]] += 1
    marks[end[csi] + 1] -= 1
    done = 0
    for start in esc[~csi].tolist():
        if start < done:
            continue
        m = _ESCAPE.match(text, start)
        done = m.end() if m else start + 1
        marks[start] += 1
        marks[done] -= 1
    lens[np.cumsum(marks[:n]) > 0] = 0


def _fold(
    text: str, codes: npt.NDArray[np.uint32], t: _Tables, json_escaped: bool
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[Any] | None]:
    """Stage 1: remove escapes and invisible characters, NFKC-fold; the new code points and
    the offset map (None when every character still maps to exactly one)."""
    import numpy as np

    wide = np.int32 if len(codes) * MAX_EXPANSION < 2**31 else np.int64
    lens: npt.NDArray[Any] = t.lens[codes].astype(wide)
    _escapes(text, codes, lens, json_escaped)
    offs = t.offs[codes]
    first = t.data[offs]
    if bool((lens == 1).all()):
        return first, None
    ends: npt.NDArray[Any] = np.cumsum(lens, dtype=wide)
    out = first[lens > 0]
    multi = np.flatnonzero(lens > 1)
    if len(multi):
        # The 2nd-4th characters of each expansion, inserted after its first one.
        more = lens[multi] - 1
        before = np.cumsum(more) - more
        at = np.repeat(ends[multi] - before - more, more)
        step = np.arange(int(more.sum())) - np.repeat(before, more)
        out = np.insert(out, at, t.data[np.repeat(offs[multi] + 1, more) + step])
    return out, ends


def _map_confusables(codes: npt.NDArray[np.uint32], t: _Tables) -> npt.NDArray[np.uint32]:
    """Stage 2: :data:`LOOKALIKES` mapped to Latin everywhere, then :data:`CONFUSABLES` in
    every word that mixes them with Latin (a new array, or ``codes`` itself when nothing
    changes)."""
    import numpy as np

    kind = t.kind[codes]
    if not kind.any():
        return codes
    out = codes
    always = kind == 2
    if always.any():  # before the mixed-script test: their targets count as Latin there
        out = codes.copy()
        out[always] = t.target[codes[always]]
    conf = kind == 1
    if len(out) < 2 or not conf.any():
        return out
    latin = t.latin[out]
    hits = np.flatnonzero((latin[:-1] & conf[1:]) | (conf[:-1] & latin[1:]))
    if len(hits) == 0:
        return out
    word_id = np.cumsum(~t.word[out], dtype=np.int64)
    mixed = np.zeros(int(word_id[-1]) + 1, dtype=bool)
    mixed[word_id[hits]] = True
    where = mixed[word_id] & conf
    if out is codes:
        out = codes.copy()
    out[where] = t.target[out[where]]
    return out


_RTL_OPENERS = "\u202b\u202e\u2067"
"""RLE, RLO, RLI: a run they open lasts to the next bidi control (its PDF/PDI closer, or
another opener) or the end of the paragraph."""
_RUN_ENDS = (
    *range(0x202A, 0x202F),  # LRE RLE PDF LRO RLO
    *range(0x2066, 0x206A),  # LRI RLI FSI PDI
    *(0x0A, 0x0D, 0x1C, 0x1D, 0x1E, 0x85, 0x2029),  # paragraph separators (bidi class B)
)


class Reordered:
    """A normalised text in display order: each right-to-left run reversed (see
    :func:`display_order`), with the map back to the original's offsets."""

    __slots__ = ("_ends", "_norm", "_starts", "text")

    def __init__(
        self, norm: Normalized, text: str, starts: npt.NDArray[Any], ends: npt.NDArray[Any]
    ) -> None:
        self._norm = norm
        self.text = text
        self._starts = starts
        self._ends = ends
        """The reversed runs ``[starts[k], ends[k])`` in normalised offsets, in order and
        disjoint."""

    def _run_at(self, pos: int) -> tuple[int, int] | None:
        import numpy as np

        k = int(np.searchsorted(self._starts, pos, side="right")) - 1
        if k >= 0 and pos < self._ends[k]:
            return int(self._starts[k]), int(self._ends[k])
        return None

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span holding every character of the display span ``[start, end)``."""
        first, last = self._run_at(start), self._run_at(end - 1)
        if first is not None and first == last:
            a, b = first
            lo, hi = a + b - end, a + b - start  # wholly inside one run: mirrored
        else:
            lo = first[0] if first is not None else start
            hi = last[1] if last is not None else end
        return self._norm.span(lo, hi)


def display_order(norm: Normalized) -> Reordered | None:
    """``norm``'s text as it is displayed when bidi controls reverse part of it, or None when
    no right-to-left run (RLE, RLO or RLI up to its PDF/PDI) holds two characters or more.

    Normalising removes the controls, which reads the text in stored order; an override
    shows ``RLO ODOT`` as TODO, so the scans read this order too (a hit in either counts).
    Every run is reversed, embeddings and isolates included: for Latin letters only an
    override reverses, but reading more orders costs no more than a second scan. Linear and
    vectorised (numpy), whatever the number of runs: one index permutation of the text.
    """
    original = norm.original
    if not any(c in original for c in _RTL_OPENERS):
        return None
    import numpy as np

    codes = np.frombuffer(original.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    bidi = _tables().bidi[codes]
    openers = np.flatnonzero(bidi == 2)
    stops = np.append(np.flatnonzero(bidi), len(codes))
    run_end = stops[np.searchsorted(stops, openers, side="right")]  # an opener is a stop too
    # Original offsets → normalised: where each original character's output begins.
    begins = np.arange(len(codes) + 1) if norm._ends is None else np.append(0, norm._ends)
    starts, ends = begins[openers + 1], begins[run_end]
    keep = ends - starts >= 2
    starts, ends = starts[keep], ends[keep]
    if len(starts) == 0:
        return None
    view = np.frombuffer(norm.text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    m = len(view)
    owner = np.zeros(m + 1, dtype=np.int64)  # k + 1 inside run k, 0 outside
    ids = np.arange(1, len(starts) + 1)
    owner[starts] += ids  # runs are disjoint and non-empty: no index repeats within one update
    owner[ends] -= ids
    owner = np.cumsum(owner[:m])
    inside = owner > 0
    index = np.arange(m)
    mirror = (starts + ends - 1)[owner[inside] - 1]
    index[inside] = mirror - index[inside]
    shown = view[index].tobytes().decode("utf-32-le", "surrogatepass")
    return Reordered(norm, shown, starts, ends)


_SHOWN = re.compile(
    "[^\\s\x00-\x1f\x7f"
    + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in (*_INVISIBLE, *_MARKS, (0xE0000, 0xE0FFF)))
    + "".join(chr(cp) for cp in _BLANK_AS_SPACE)
    + "]"
)
"""A character a reader sees: not whitespace, not an ASCII control, not removed by
:func:`normalize` (invisible, combining mark), not a blank cell."""


def looks_blank(text: str) -> bool:
    """True when a reader sees nothing in ``text``: only whitespace, invisible characters
    (zero-width, fillers, bidi controls, tags, …), ASCII controls, blank cells and escape
    sequences. An empty string and one of U+200B are the same to a reader, so the checks
    that refuse one refuse both. Stops at the first visible character."""
    if _SHOWN.search(text) is None:
        return True
    if "\x1b" not in text and "\x9b" not in text:
        return False
    return _SHOWN.search(normalize(text).text) is None


def fold(text: str, *, json_escapes: bool = False) -> str:
    """Only the normalised text of :func:`normalize` (no offsets)."""
    return normalize(text, json_escapes=json_escapes).text
