"""The compiled scanner and the pure-Python reference agree exactly; modes follow the formats."""

from __future__ import annotations

import random

import pytest

from pipeline.contract._scan import (
    MODE_JSON,
    MODE_LATEX,
    MODE_MD,
    MODE_OTHER,
    MODE_PY,
    mode_for,
    scan,
    scan_py,
)

needs_c = pytest.mark.fastscan

# Pieces chosen to hit every rule: fences, escapes, code spans, strings, comments, headings,
# sections, placeholders, Unicode whitespace and word characters, CR and odd spacing.
PIECES = [
    "`",
    "``",
    "```",
    "~~~",
    "\\",
    "\n",
    "\n",
    "\n\n",
    " ",
    " ",
    "  ",
    "#",
    "## ",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "'",
    '"',
    "'''",
    '"""',
    "%",
    "TODO",
    "todo",
    "???",
    "?",
    "??",
    "Lorem ipsum",
    "lorem\nIPSUM",
    "\\section{A}",
    "\\subsection*{B {c}}",
    "\\section[x]{Y}",
    "\\section{",
    "word",
    "alpha",
    "beta",
    "to",
    "the",
    "é",
    "日本",
    "\t",
    "\r",
    "_",
    "XXX",
    "TBD",
    "MASTODON",
    "\x1c",
    "\u2003",
    "\U0001d518",
    "to be\tfilled",
    "Author  Name",
    "   ```py",
    "\n    ~~~~\n",
    "x#",
    "Title goes HERE",
    "FIXME",
    "Tl",
    "AUTHOR NAME",
]
ALL_MODES = (MODE_OTHER, MODE_MD, MODE_LATEX, MODE_PY, MODE_JSON)


def random_doc(r: random.Random) -> str:
    return "".join(r.choice(PIECES) for _ in range(r.randint(0, 90)))


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_compiled_and_python_scanners_agree_on_random_documents(seed: int) -> None:
    """On 300 random documents per seed, every mode gives identical scan results."""
    r = random.Random(seed)
    for _ in range(300):
        text = random_doc(r)
        for mode in ALL_MODES:
            assert scan(text, mode, min_words=3, engine="c") == scan_py(text, mode, min_words=3), (
                mode,
                text,
            )


@needs_c
@pytest.mark.parametrize("want", [1, 2, 4, 8, 15])
def test_scanners_agree_for_each_subset_of_needs(want: int) -> None:
    """Asking for only some results changes nothing in the ones asked for."""
    r = random.Random(want)
    for _ in range(200):
        text = random_doc(r)
        for mode in ALL_MODES:
            assert scan(text, mode, want, min_words=3, engine="c") == scan_py(
                text, mode, want, min_words=3
            )


@needs_c
def test_scanners_agree_on_long_prose_with_many_words() -> None:
    """Long paragraphs (past the compiled word buffer) and real fingerprints agree."""
    r = random.Random(9)
    words = ["alpha", "beta", "TODO", "gamma", "délta", "ε", "(x)", "`y`", "to", "the"]
    paras = [" ".join(r.choice(words) for _ in range(r.randint(1, 3000))) for _ in range(40)]
    text = "\n\n".join(paras) + "\n```\n" + paras[0] + "\n```\n" + paras[1]
    for mode in (MODE_MD, MODE_LATEX):
        assert scan(text, mode, engine="c") == scan_py(text, mode)


def test_result_shapes() -> None:
    """Hits, paragraphs, headings and delimiter statistics come back as documented."""
    text = "# Head\n\nTODO " + "word " * 25 + "(x\n"
    res = scan_py(text, MODE_MD)
    assert res.hits == [(0, 8, 12)]
    assert res.total_hits == 1
    [(start, end, words, fp)] = res.paragraphs
    assert (start, end, words) == (8, len(text) - 1, 27) and isinstance(fp, int)
    assert res.headings == [(0, 2, 6)]
    assert res.delimiters[0] == (1, 0, len(text) - 3, -1)


def test_hits_are_capped_but_counted() -> None:
    """Only max_hits placeholder matches are kept; all are counted."""
    res = scan_py("TODO " * 50, MODE_OTHER, max_hits=5)
    assert len(res.hits) == 5 and res.total_hits == 50


@pytest.mark.parametrize(
    ("path", "claimed", "mode"),
    [
        (None, None, MODE_MD),
        (None, "json", MODE_JSON),
        ("a/b.py", None, MODE_PY),
        ("a/b.py", "markdown", MODE_MD),
        ("x.JSON", None, MODE_JSON),
        ("paper.tex", None, MODE_LATEX),
        ("README", None, MODE_MD),
        ("notes.txt", None, MODE_MD),
        ("data.csv", None, MODE_OTHER),
        ("conf.yaml", None, MODE_OTHER),
        (".env", None, MODE_MD),
    ],
)
def test_mode_for(path: str | None, claimed: str | None, mode: int) -> None:
    """The claimed format wins; else the extension; unknown extensions only get placeholders."""
    assert mode_for(path, claimed) == mode


def test_other_mode_checks_only_placeholders() -> None:
    """A CSV with brackets and '#' lines reports placeholders and nothing structural."""
    res = scan_py("# a\n(TODO\n# a\n", MODE_OTHER)
    assert res.total_hits == 1 and res.headings == [] and res.delimiters[0] == (0, 0, -1, -1)


def test_unknown_engine_is_rejected() -> None:
    """engine must be auto, c or python."""
    with pytest.raises(ValueError):
        scan("x", MODE_MD, engine="rust")


@needs_c
def test_compiled_placeholder_table_is_the_python_one() -> None:
    """``_scan.PLACEHOLDERS`` is the one placeholder list: the C table (a copy the compiler
    needs) reports every entry under the same pattern id, with the same case rule."""
    from pipeline.contract._scan import PLACEHOLDERS, WANT_PLACEHOLDERS

    for pid, (pattern, case_insensitive) in enumerate(PLACEHOLDERS):
        for variant in {pattern, pattern.swapcase()}:
            text = f"see {variant} here"
            found = scan_py(text, MODE_OTHER, WANT_PLACEHOLDERS).hits
            compiled = scan(text, MODE_OTHER, WANT_PLACEHOLDERS, engine="c").hits
            assert compiled == found, (pattern, variant)
            if variant == pattern or case_insensitive:
                assert (pid, 4, 4 + len(variant)) in found, (pattern, variant)
