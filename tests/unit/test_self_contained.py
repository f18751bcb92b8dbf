"""The repository explains itself: no tracked file points at a specification or design document
the repository does not hold, and every relative Markdown link in README.md and docs/ resolves
(the file, and for ``#anchor`` links the heading, slugged as GitHub does)."""

from __future__ import annotations

import itertools
import re
import subprocess
import unicodedata
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCOPE = (
    "pipeline",
    "workers",
    "tests",
    "docs",
    "deploy",
    "bench",
    "README.md",
    "celeryconfig.py",
)
"""What must read without any other document: the code, the tests, the docs, the deploy files,
the benchmarks."""

OUTSIDE_REFERENCES = re.compile(r"SPEC\.md|SPEC §|SPEC 5|DESIGN\.md|DESIGN habit")
"""How a line points at the product's specification or design notes, which live outside the
repository."""

EXEMPT: tuple[str, ...] = ("tests/unit/test_self_contained.py",)
"""Files left out of the check: this one spells the patterns it looks for."""


def tracked(*paths: str) -> list[str]:
    """The files git tracks under ``paths``, relative to the repository root."""
    done = subprocess.run(
        ["git", "ls-files", "--", *paths], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return [line for line in done.stdout.splitlines() if (ROOT / line).is_file()]


def outside_references() -> list[str]:
    """``path:line: text`` for each line in scope that points at a document the repository
    lacks, the exempt files left out."""
    found = []
    for path in tracked(*SCOPE):
        if path in EXEMPT:
            continue
        try:
            text = (ROOT / path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file holds no prose
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_REFERENCES.search(line):
                found.append(f"{path}:{n}: {line.strip()}")
    return found


def test_no_file_points_at_a_spec_or_design_document_the_repository_lacks() -> None:
    assert outside_references() == []


def test_every_exempt_file_still_exists() -> None:
    """An allow-list entry for a file that is gone (renamed, deleted) is stale: drop it."""
    assert [p for p in EXEMPT if not (ROOT / p).is_file()] == []


# --- relative links in README.md and docs/*.md -------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[(?:[^\]\n]|\][^(\n])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]\n]*\]\(([^)\s]+)\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """``text`` without fenced blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed (letters,
    digits, ``_`` and ``-`` stay), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    kept = (c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return "".join(kept).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file, with GitHub's ``-1``, ``-2`` … for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken_links(doc: str) -> list[str]:
    """Each relative link of ``doc`` whose file or heading is missing, as ``target (why)``."""
    source = ROOT / doc
    text = prose(source.read_text(encoding="utf-8"))
    targets = [m.group(1) for rx in (LINK, IMAGE, REFERENCE) for m in rx.finditer(text)]
    bad = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # http:, https:, mailto: … are not the repository's to resolve
        file_part, _, anchor = target.partition("#")
        dest = (source.parent / file_part).resolve() if file_part else source
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading with that anchor in {dest.name})")
    return bad


DOCS = ["README.md", *sorted(p for p in tracked("docs") if p.endswith(".md"))]


def test_the_slug_follows_githubs_rules() -> None:
    assert slug("Running it distributed (Celery + Redis)") == "running-it-distributed-celery--redis"
    assert slug("The A/B experiment: `critique ab`") == "the-ab-experiment-critique-ab"
    assert slug("Exit codes of every `critique` command") == "exit-codes-of-every-critique-command"
    assert slug("Processes × threads") == "processes--threads"


def test_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text("# Title\n\n[here](#title) [gone](#nope) [lost](missing.md) `[x](y.md)`\n")
    assert broken_links(str(doc)) == [
        "#nope (no heading with that anchor in a.md)",
        "missing.md (no such file)",
    ]


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc: str) -> None:
    assert broken_links(doc) == []


# --- repository paths named in prose ----------------------------------------------------------

CODE_PATH = re.compile(r"`((?:pipeline|workers|tests|bench|deploy|docs)/[A-Za-z0-9_./-]+)`")
"""A repository path written as code in a doc (``pipeline/loop/stages.py``); brace lists such as
``pipeline/store/{redis,runs}.py`` are left to the reader."""


def missing_paths(doc: str) -> list[str]:
    """Each repository path ``doc`` names in backticks that the checkout does not have."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    return sorted(
        {m.group(1) for m in CODE_PATH.finditer(text) if not (ROOT / m.group(1)).exists()}
    )


def test_a_path_that_moved_is_reported(tmp_path: Path) -> None:
    """A doc naming a file that a refactor moved is caught (here a module that never existed)."""
    doc = tmp_path / "b.md"
    doc.write_text("Where: `workers/tasks.py` and `workers/no_such_module.py`.\n")
    assert missing_paths(str(doc)) == ["workers/no_such_module.py"]


@pytest.mark.parametrize("doc", [*DOCS, "bench/README.md"])
def test_every_repository_path_a_doc_names_exists(doc: str) -> None:
    assert missing_paths(doc) == []


def test_the_shipped_example_outputs_are_the_ones_operations_md_shows() -> None:
    """README's ``critique submit docs/examples/outputs.jsonl`` submits exactly the lines that
    docs/operations.md's ``$ cat outputs.jsonl`` shows (and its transcript test runs)."""
    page = (ROOT / "docs/operations.md").read_text(encoding="utf-8").splitlines()
    start = page.index("$ cat outputs.jsonl") + 1
    shown = list(itertools.takewhile(lambda line: not line.startswith("$ "), page[start:]))
    shipped = (ROOT / "docs/examples/outputs.jsonl").read_text(encoding="utf-8").splitlines()
    assert shipped == shown
    assert "docs/examples/outputs.jsonl" in (ROOT / "README.md").read_text(encoding="utf-8")
