"""A paper draft written in Markdown, read into the rubric critic's paper shape.

The rubric critic and its reviser work on ``{title, abstract, originality_tag, sections: [{id,
title, body, figure_refs, cites}]}`` (:class:`pipeline.critics.rubric.Paper`). A draft in
Markdown maps onto it like this:

- optional front matter between two ``---`` lines (YAML): ``title``, ``abstract``,
  ``originality_tag`` (or ``originality``: ``low`` | ``medium`` | ``high``; default ``low``);
- the first ``# Heading`` is the title; the text between it and the first ``## Heading`` is the
  abstract (a ``## Abstract`` section is the abstract too);
- every ``## Heading`` starts a section (its id is the heading's slug, made unique); its body is
  everything up to the next ``##`` (deeper headings stay in the body);
- ``figure_refs``: image targets (``![alt](fig1.png)``) and mentions such as ``Figure 2`` or
  ``Fig. 2`` (as ``figure-2``);
- ``cites``: Pandoc citations (``[@smith2020; @lee2021]``), LaTeX ``\\cite{a,b}`` and numeric
  ones (``[1]``, ``[2, 3]``).

Headings inside fenced code blocks are text. Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_H1 = re.compile(r"^#\s+(.+?)\s*#*\s*$")
_H2 = re.compile(r"^##\s+(.+?)\s*#*\s*$")
_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FIGURE = re.compile(r"\bFig(?:ure|\.)?\s*(\d+)\b", re.IGNORECASE)
_PANDOC = re.compile(r"\[([^\]]*@[^\]]*)\]")
_PANDOC_KEY = re.compile(r"@([A-Za-z0-9_][\w:.#$%&+?<>~/-]*)")
_LATEX = re.compile(r"\\cite[tp]?\*?(?:\[[^\]]*\])*\{([^}]*)\}")
_NUMERIC = re.compile(r"\[(\d+(?:\s*[,;–-]\s*\d+)*)\](?!\()")


class MarkdownPaperError(ValueError):
    """The text is not a Markdown paper; the message says what is missing."""


def _slug(title: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", title.casefold()).strip("-")
    return slug or "section"


def _front_matter(lines: list[str]) -> tuple[dict[str, Any], list[str]]:
    if not lines or lines[0].strip() != "---":
        return {}, lines
    for i in range(1, len(lines)):
        if lines[i].strip() in ("---", "..."):
            try:
                meta = yaml.safe_load("\n".join(lines[1:i])) or {}
            except yaml.YAMLError as exc:
                raise MarkdownPaperError(f"front matter is not valid YAML: {exc}") from None
            if not isinstance(meta, dict):
                raise MarkdownPaperError("front matter must be a mapping (key: value lines)")
            return meta, lines[i + 1 :]
    return {}, lines


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def figure_refs(body: str) -> list[str]:
    """Image targets and ``Figure N`` mentions in ``body``, in order, once each."""
    refs = [m.group(1) for m in _IMAGE.finditer(body)]
    refs += [f"figure-{m.group(1)}" for m in _FIGURE.finditer(body)]
    return _unique(refs)


def citations(body: str) -> list[str]:
    """Citation keys in ``body`` (Pandoc, LaTeX ``\\cite``, numeric), in order, once each."""
    found: list[tuple[int, str]] = []
    for m in _PANDOC.finditer(body):
        found += [(m.start(), k.group(1).rstrip(".,;:")) for k in _PANDOC_KEY.finditer(m.group(1))]
    for m in _LATEX.finditer(body):
        found += [(m.start(), k.strip()) for k in m.group(1).split(",") if k.strip()]
    for m in _NUMERIC.finditer(body):
        found += [(m.start(), n) for n in re.findall(r"\d+", m.group(1))]
    return _unique([key for _, key in sorted(found, key=lambda pair: pair[0])])


def paper_from_markdown(text: str) -> dict[str, Any]:
    """The paper dict of a Markdown draft; :class:`MarkdownPaperError` when it has no title
    (``# Title`` or front matter) or no ``## Section``."""
    meta, lines = _front_matter(text.splitlines())
    title: str | None = str(meta["title"]) if meta.get("title") else None
    preamble: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    in_fence = False
    for line in lines:
        if _FENCE.match(line):
            in_fence = not in_fence
        h2 = None if in_fence else _H2.match(line)
        h1 = None if in_fence or h2 else _H1.match(line)
        if h1 and title is None and not sections:
            title = h1.group(1)
            continue
        if h2:
            sections.append((h2.group(1), []))
            continue
        (sections[-1][1] if sections else preamble).append(line)
    if not title:
        raise MarkdownPaperError("no title: start the paper with a '# Title' line")
    abstract = "\n".join(preamble).strip()
    body_sections: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for heading, body_lines in sections:
        body = "\n".join(body_lines).strip()
        if heading.casefold() == "abstract" and not abstract:
            abstract = body
            continue
        base = _slug(heading)
        seen[base] = seen.get(base, 0) + 1
        ident = base if seen[base] == 1 else f"{base}-{seen[base]}"
        body_sections.append(
            {
                "id": ident,
                "title": heading,
                "body": body,
                "figure_refs": figure_refs(body),
                "cites": citations(body),
            }
        )
    if not body_sections:
        raise MarkdownPaperError("no sections: give the paper '## Section' headings")
    originality = meta.get("originality_tag", meta.get("originality", "low"))
    return {
        "title": title,
        "abstract": str(meta.get("abstract") or abstract),
        "originality_tag": str(originality).strip().lower(),
        "sections": body_sections,
    }
