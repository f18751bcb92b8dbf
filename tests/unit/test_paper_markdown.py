"""A Markdown paper draft reads into the rubric critic's paper shape, and `critique loop` takes
one as it takes the JSON format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.critics.rubric import parse_paper
from pipeline.text.paper_markdown import MarkdownPaperError, paper_from_markdown
from workers.cli import main

DRAFT = """---
originality: medium
---
# Sparse Attention for Long Legal Documents

We apply sparse attention to long legal contracts.

## Introduction

Contracts are long [@beltagy2020; @zaheer2020]. See Figure 1.

```
## not a heading: code
```

## Data

We collected 2,000 leases \\cite{registry}.

![leases per year](fig-leases.png)

## Results

Sparse attention was faster [1, 2].

### Speed

Twice as fast.
"""


def test_sections_figures_and_citations() -> None:
    """Title, abstract, originality from front matter; one section per ## heading (### stays
    in the body, ## inside a code fence is text); figures and the three citation styles."""
    paper = paper_from_markdown(DRAFT)
    assert paper["title"] == "Sparse Attention for Long Legal Documents"
    assert paper["abstract"] == "We apply sparse attention to long legal contracts."
    assert paper["originality_tag"] == "medium"
    assert [s["id"] for s in paper["sections"]] == ["introduction", "data", "results"]
    intro, data, results = paper["sections"]
    assert intro["cites"] == ["beltagy2020", "zaheer2020"]
    assert intro["figure_refs"] == ["figure-1"]
    assert "## not a heading: code" in intro["body"]
    assert data["cites"] == ["registry"] and data["figure_refs"] == ["fig-leases.png"]
    assert results["cites"] == ["1", "2"] and "### Speed" in results["body"]
    assert parse_paper(paper).title == paper["title"]


def test_not_a_paper() -> None:
    """No title or no section is a clear error."""
    with pytest.raises(MarkdownPaperError, match="no title"):
        paper_from_markdown("## Intro\n\ntext\n")
    with pytest.raises(MarkdownPaperError, match="no sections"):
        paper_from_markdown("# Title\n\nonly an abstract\n")


def test_loop_reads_a_markdown_paper(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`critique loop paper.md` runs the rubric loop on it (before, only JSON was read)."""
    path = tmp_path / "paper.md"
    path.write_text(DRAFT, "utf-8")
    assert main(["loop", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] in ("repaired", "accepted", "accepted_with_warnings")
    assert result["output"]["title"] == "Sparse Attention for Long Legal Documents"
    bad = tmp_path / "notes.md"
    bad.write_text("just some notes\n", "utf-8")
    assert main(["loop", str(bad)]) == 2
    assert "is not a Markdown paper: no title" in capsys.readouterr().err
