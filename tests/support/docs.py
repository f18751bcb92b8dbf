"""The docs' runnable examples: each fenced ``python`` block followed by a ``text`` block is a
script and the output it prints (README.md, docs/*.md)."""

from __future__ import annotations

import contextlib
import io
import itertools
import re
from typing import Any

from tests.support.workers import ROOT

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(doc: str) -> list[tuple[str, str]]:
    """Every fenced block of ``doc`` (a path under the repository root): (language, body)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def example_pairs(doc: str) -> list[tuple[str, str]]:
    """Each ``python`` block that is followed by a ``text`` block: (code, expected output)."""
    return [
        (code, shown)
        for (lang, code), (next_lang, shown) in itertools.pairwise(blocks(doc))
        if lang == "python" and next_lang == "text"
    ]


def run_python(code: str, name: str, namespace: dict[str, Any] | None = None) -> str:
    """``code`` executed as a script would be (in ``namespace`` when a later example continues
    an earlier one), its stdout returned."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(
            compile(code, name, "exec"),
            {"__name__": "__main__"} if namespace is None else namespace,
        )
    return out.getvalue()


def assert_examples_print_what_the_page_shows(doc: str, count: int) -> None:
    """Run ``doc``'s ``count`` examples in order in one namespace (each may continue the one
    before) and compare what each prints with the text block under it."""
    pairs = example_pairs(doc)
    assert len(pairs) == count, f"{doc}: {len(pairs)} examples with output, expected {count}"
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for i, (code, shown) in enumerate(pairs):
        printed = run_python(code, f"{doc} example {i}", namespace)
        assert printed.splitlines() == shown.splitlines(), f"{doc} example {i}"
