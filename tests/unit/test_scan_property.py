"""Property: the compiled scanner and its pure-Python twin agree on any text (hypothesis).

The hand-written cross-checks in ``test_contract_scan.py`` draw from a fixed list of pieces;
here hypothesis builds documents from those rules' raw material (fences, headings, sections,
placeholders, delimiters, quotes, escapes) mixed with arbitrary Unicode — surrogates excluded,
which a ``str`` from JSON or a file can never hold — and from arbitrary bytes read as a file is
(UTF-8, undecodable bytes replaced), and shrinks any disagreement to a minimal
text. Both layers are compared: the raw scan (``_fastscan.scan`` against ``scan_py``) and the
public :func:`scan`, which adds the disguised-placeholder pass, with each engine.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.contract._scan import (
    MODE_JSON,
    MODE_LATEX,
    MODE_MD,
    MODE_OTHER,
    MODE_PY,
    PLACEHOLDERS,
    WANT_ALL,
    ScanResult,
    scan,
    scan_py,
)
from pipeline.text.compiled import FASTSCAN

pytestmark = pytest.mark.fastscan

MODES = [MODE_OTHER, MODE_MD, MODE_LATEX, MODE_PY, MODE_JSON]

# The syntax every rule of the scanners turns on, and text that looks like it but is not.
TOKENS = [
    *(p for p, _ in PLACEHOLDERS),
    "todo", "Todo", "lorem IPSUM", "to  be\nfilled", "Author\tName", "AUTHOR  NAME", "xTODO",
    "TODO_", "??", "????", "?",
    "```", "````", "``", "`", "~~~", "~~~~", "   ```py", "    ```", "```a`b",
    "#", "# ", "## ", "###### ", "####### ", " #", "# Title #", "#\t", "\\#",
    "\\section{A}", "\\subsection*{B {c}}", "\\subsubsection[x]{Y}", "\\section{", "\\section",
    "\\sub", "\\section[", "\\", "\\\\", "%", "\\%",
    "(", ")", "[", "]", "{", "}",
    "'", '"', "'''", '"""', "\\'", '\\"',
    "\n", "\n", "\n\n", "\n  \n", "\r", "\r\n", "\t", " ", "  ", "   ",
    "\u00a0", "\u2003", "\u2028", "\u0085", "\x1c", "\x0b", "\x0c",
    "\x1b[31m", "\x1b[0m", "\u200b", "\u200d", "\ufeff", "\\u001b",
    "ＴＯＤＯ", "ТОDO", "Fıxme", "é", "日本語", "\U0001d518", "ß", "İ", "ǅ", "_", "٣",
    "\ua4d4\ua4f3\ua4d3\ua4f3", "\u1d1b\u1d0f", "\u202e", "\u202b", "\u2067", "\u202c",
    "\u2069", "ODOT", "\u2800",
    "word", "alpha", "beta", "gamma", "the", "same words again",
]  # fmt: skip

# Arbitrary characters: any code point but lone surrogates.
ANY_CHAR = st.characters(blacklist_categories=("Cs",))
PIECE = st.one_of(
    st.sampled_from(TOKENS),
    st.text(ANY_CHAR, min_size=1, max_size=6),
    st.text(st.sampled_from("ab \n"), min_size=1, max_size=12),
)
# Line starts: the rules that look at the start of a line (fences, ATX headings, indentation).
LINE_START = st.sampled_from(
    ["", "", "", "", "```", "````", "~~~", "~~~~", "   ```", "    ```", "```py", "~~~ x",
     "# ", "## ", "###### ", "####### ", "#", "   # ", "\\section{", "\\subsection*{", "  ", "\t"]
)  # fmt: skip
# Long runs of ordinary words too, so paragraphs reach the fingerprinting threshold.
WORDS = st.lists(
    st.sampled_from(["alpha", "beta", "gamma", "delta", "TODO", "é", "(", "}"]), min_size=3
).map(" ".join)
LINE = st.tuples(LINE_START, st.lists(st.one_of(PIECE, WORDS), max_size=8).map("".join)).map(
    "".join
)
DOCUMENT = st.lists(LINE, max_size=25).map("\n".join)


def raw_compiled(text: str, mode: int, want: int, min_words: int, max_hits: int) -> ScanResult:
    """The extension's own scan, without the disguised-placeholder pass of :func:`scan`."""
    assert FASTSCAN is not None
    hits, total, paras, heads, delims = FASTSCAN.scan(text, mode, want, min_words, max_hits)
    return ScanResult(hits, total, paras, heads, tuple(delims))


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    text=DOCUMENT,
    mode=st.sampled_from(MODES),
    want=st.integers(min_value=0, max_value=WANT_ALL),
    min_words=st.integers(min_value=3, max_value=25),
    max_hits=st.integers(min_value=0, max_value=8),
)
def test_compiled_and_python_scanners_agree_on_any_text(
    text: str, mode: int, want: int, min_words: int, max_hits: int
) -> None:
    """For any text, mode, subset of needs, paragraph threshold and hit cap, the compiled scan
    equals the pure-Python reference, raw and with the disguised-placeholder pass."""
    assert raw_compiled(text, mode, want, min_words, max_hits) == scan_py(
        text, mode, want, min_words=min_words, max_hits=max_hits
    )
    kw = {"min_words": min_words, "max_hits": max_hits}
    assert scan(text, mode, want, engine="c", **kw) == scan(text, mode, want, engine="python", **kw)


@settings(max_examples=150, deadline=None)
@given(text=st.text(ANY_CHAR, max_size=200), mode=st.sampled_from(MODES))
def test_scanners_agree_on_arbitrary_unicode(text: str, mode: int) -> None:
    """Unstructured Unicode of every category (no surrogates): the same result from both."""
    assert scan(text, mode, engine="c") == scan(text, mode, engine="python")
    assert raw_compiled(text, mode, WANT_ALL, 20, 1000) == scan_py(text, mode)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=300), mode=st.sampled_from(MODES))
def test_scanners_agree_on_arbitrary_bytes_read_as_a_file(data: bytes, mode: int) -> None:
    """Any bytes, decoded as a file's content is (UTF-8, undecodable bytes replaced): the same
    result from both."""
    text = data.decode("utf-8", "replace")
    assert scan(text, mode, engine="c") == scan(text, mode, engine="python")
    assert raw_compiled(text, mode, WANT_ALL, 3, 1000) == scan_py(text, mode, min_words=3)
