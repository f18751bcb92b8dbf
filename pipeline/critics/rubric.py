"""The deterministic rubric critic and its reviser: the critic-loop convergence pair.

A paper is ``{title, abstract, originality_tag: low|medium|high, sections: [{id, title, body,
figure_refs: [], cites: []}]}``. Five dimensions, each 0–10:

    clarity       min(10, 3 + mean section-body length in characters / 50)
    novelty       9 / 6 / 3 for originality high / medium / low
    evidence      min(10, 2 + 2 × figure refs + 1.5 × citations, over all sections)
    methodology   9 if a section whose title starts with "method" has a body, else 4
    related_work  9 if a section titled "related work" has a body, else 4

Score = weighted mean over the configured dimensions / 10 (:func:`weighted_mean`, which the
loop's rubric rules read too: the plateau compares rounds' means). Every dimension below the target
yields one :class:`Suggestion` and one ``warning`` defect; the reviser applies each suggestion
as an append-style edit, so a revised draft scores higher on exactly that dimension.

The pair is the documented demo and test pair (docs/pipeline.md, 'The critique loop
without a broker'), not a token-free way to improve a
real paper: :class:`DeterministicReviser` writes the edits the critic suggested with stock text
(generic sentences, placeholder figure and citation ids, a raised originality tag) that says
nothing about the paper. Every revision says so in its note, which reaches the result's notes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.config import RUBRIC_DIMENSIONS, RubricConfig
from pipeline.critics.base import RevisionResult, clamp_score
from pipeline.errors import ConfigError, SubmissionError
from pipeline.llm.tokens import text_of
from pipeline.models import (
    CritiqueEnvelope,
    Defect,
    RepairAttempt,
    ReusablePattern,
    Submission,
    Suggestion,
)

Originality = Literal["low", "medium", "high"]
NOVELTY: dict[str, float] = {"low": 3.0, "medium": 6.0, "high": 9.0}
_NEXT_ORIGINALITY: dict[str, Originality] = {"low": "medium", "medium": "high", "high": "high"}


def weighted_mean(scores: Mapping[str, float], rubric: RubricConfig) -> float:
    """Weighted mean (0–10) over the configured dimensions that ``scores`` has."""
    dims = [d for d in rubric.dimensions if d in scores]
    total = sum(rubric.weight(d) for d in dims)
    if total <= 0:
        return 0.0
    return round(sum(rubric.weight(d) * scores[d] for d in dims) / total, 6)


class PaperSection(BaseModel):
    """One section of a paper; unknown keys are kept so a revision changes nothing else."""

    model_config = ConfigDict(frozen=True, extra="allow")

    id: str = Field(min_length=1)
    title: str
    body: str = ""
    figure_refs: tuple[str, ...] = ()
    cites: tuple[str, ...] = ()


class Paper(BaseModel):
    """A paper draft as the rubric critic reads it."""

    model_config = ConfigDict(frozen=True, extra="allow")

    title: str
    abstract: str = ""
    originality_tag: Originality = "low"
    sections: tuple[PaperSection, ...]


def parse_paper(output: str | dict[str, Any]) -> Paper:
    """Read a paper from a dict or a JSON string; anything else is a :class:`SubmissionError`."""
    data: Any = output
    if isinstance(output, str):
        try:
            data = json.loads(output)
        except ValueError as exc:
            raise SubmissionError(
                f"output is not a paper: not valid JSON ({exc})",
                hint="the rubric critic needs {title, abstract, originality_tag, sections}",
            ) from None
    if not isinstance(data, dict):
        raise SubmissionError(
            f"output is not a paper: expected a JSON object, got {type(data).__name__}",
            hint="the rubric critic needs {title, abstract, originality_tag, sections}",
        )
    try:
        return Paper.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "paper"
        raise SubmissionError(
            f"output is not a paper: field {where!r}: {first['msg']}",
            hint="sections need {id, title, body, figure_refs, cites}; "
            "originality_tag is low, medium or high",
        ) from None


def _norm(title: str) -> str:
    return " ".join(title.casefold().split())


def _method_section(paper: Paper) -> PaperSection | None:
    return next((s for s in paper.sections if _norm(s.title).startswith("method")), None)


def _related_section(paper: Paper) -> PaperSection | None:
    return next((s for s in paper.sections if _norm(s.title) == "related work"), None)


def score_paper(paper: Paper) -> dict[str, float]:
    """The five dimension scores (0–10) of ``paper``, per the module docstring."""
    bodies = [len(s.body) for s in paper.sections]
    mean_len = sum(bodies) / len(bodies) if bodies else 0.0
    figures = sum(len(s.figure_refs) for s in paper.sections)
    cites = sum(len(s.cites) for s in paper.sections)
    method = any(_norm(s.title).startswith("method") and s.body.strip() for s in paper.sections)
    related = any(_norm(s.title) == "related work" and s.body.strip() for s in paper.sections)
    return {
        "clarity": round(min(10.0, 3.0 + mean_len / 50.0), 6),
        "novelty": NOVELTY[paper.originality_tag],
        "evidence": round(min(10.0, 2.0 + 2.0 * figures + 1.5 * cites), 6),
        "methodology": 9.0 if method else 4.0,
        "related_work": 9.0 if related else 4.0,
    }


_WHY: dict[str, tuple[str, str]] = {
    "clarity": (
        "section bodies are too short to explain their point",
        "Give every section a body that explains its point in several sentences",
    ),
    "novelty": (
        "the draft does not claim what is new",
        "State the contribution and what is new about it explicitly",
    ),
    "evidence": (
        "claims are not backed by figures and citations",
        "Back every claim with a figure reference or a citation",
    ),
    "methodology": (
        "there is no Method section with a body",
        "Always include a Method section that says how the work was done",
    ),
    "related_work": (
        "there is no Related Work section with a body",
        "Always include a Related Work section that places the work among prior work",
    ),
}


def _suggestion(paper: Paper, dimension: str) -> Suggestion:
    if dimension == "clarity":
        target = min(paper.sections, key=lambda s: len(s.body)) if paper.sections else None
        if target is None:
            return Suggestion(
                dimension="clarity", edit="Add a section whose body explains the main idea."
            )
        return Suggestion(
            dimension="clarity",
            target_section=target.id,
            edit=f"Expand section '{target.title}' with a paragraph that explains its point.",
        )
    if dimension == "novelty":
        return Suggestion(
            dimension="novelty",
            edit="Raise the originality claim one step and state what is new.",
        )
    if dimension == "evidence":
        target = (
            min(paper.sections, key=lambda s: len(s.figure_refs) + len(s.cites))
            if paper.sections
            else None
        )
        return Suggestion(
            dimension="evidence",
            target_section=target.id if target else None,
            edit="Add a figure reference and a citation that support the section's claim.",
        )
    if dimension == "methodology":
        method = _method_section(paper)
        return Suggestion(
            dimension="methodology",
            target_section=method.id if method else None,
            edit="Write the Method section's body."
            if method
            else "Add a Method section that says how the work was done.",
        )
    if dimension == "related_work":
        related = _related_section(paper)
        return Suggestion(
            dimension="related_work",
            target_section=related.id if related else None,
            edit="Write the Related Work section's body."
            if related
            else "Add a Related Work section that places the work among prior work.",
        )
    raise ConfigError(f"the deterministic rubric critic has no dimension {dimension!r}")


def _check_dimensions(rubric: RubricConfig) -> None:
    unknown = [d for d in rubric.dimensions if d not in RUBRIC_DIMENSIONS]
    if unknown:
        raise ConfigError(
            f"the deterministic rubric critic scores only {list(RUBRIC_DIMENSIONS)}; "
            f"rubric.dimensions names {unknown}",
            key="rubric.dimensions",
        )


class RubricCritic:
    """The deterministic rubric critic: token-free, so its usage is 0."""

    name = "rubric"
    token_free = True
    reads_pitfalls = False  # deterministic: the Known Pitfalls text would be ignored

    def __init__(self, rubric: RubricConfig | None = None) -> None:
        self.rubric = rubric or RubricConfig()
        _check_dimensions(self.rubric)

    def critique(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        pitfalls: str = "",
        round: int = 1,
    ) -> CritiqueEnvelope:
        """Score the paper; one suggestion and one warning defect per dimension below target."""
        paper = parse_paper(output)
        all_scores = score_paper(paper)
        scores = {d: all_scores[d] for d in self.rubric.dimensions}
        target = self.rubric.target_score
        low = [d for d in self.rubric.dimensions if scores[d] < target]
        suggestions = tuple(_suggestion(paper, d) for d in low)
        defects = tuple(
            Defect(
                category="incomplete",
                severity="warning",
                location=d,
                description=f"{d} is below the target score {target:g}: {_WHY[d][0]}",
                source="rubric",
            )
            for d in low
        )
        patterns = tuple(
            ReusablePattern(
                category="incomplete",
                description=f"{d} below target: {_WHY[d][0]}",
                prevention_rule=_WHY[d][1],
            )
            for d in low
        )
        mean = weighted_mean(scores, self.rubric)
        score = clamp_score(mean / 10.0)
        return CritiqueEnvelope(
            worker_id=submission.worker_id,
            score=score,
            scores=scores,
            defects=defects,
            prescriptions=tuple(s.edit for s in suggestions),
            reusable_patterns=patterns,
            summary=(
                f"rubric round {round}: mean {mean:.2f}/10, "
                f"{len(low)} dimension(s) below {target:g}"
            ),
            suggestions=suggestions,
            critic="rubric",
        )


_CLARITY_SENTENCES: tuple[str, ...] = (
    "To make the argument of this part easier to follow, we restate its goal, walk through "
    "the reasoning step by step, and say what the reader should take away before moving on.",
    "We also spell out the assumptions this part depends on, explain why each one is "
    "reasonable for {topic}, and point to where later sections rely on them.",
    "A short worked example illustrates the idea: it starts from a concrete input, shows each "
    "intermediate quantity, and ends with the number reported in our evaluation.",
    "Finally, we relate this part to the overall question of the paper and note which of its "
    "conclusions would change if the setting of {topic} were different.",
)


def _topic(paper: Paper) -> str:
    return paper.title.strip() or "this study"


def _unique_id(paper_sections: Sequence[Mapping[str, Any]], wanted: str) -> str:
    taken = {str(s.get("id")) for s in paper_sections}
    if wanted not in taken:
        return wanted
    n = 2
    while f"{wanted}-{n}" in taken:
        n += 1
    return f"{wanted}-{n}"


DEMO_NOTE = (
    "demo reviser: applied {n} rubric suggestion(s) with stock text (generic sentences, "
    "placeholder figure/citation ids, a raised originality tag); not the author's content"
)
"""The note on every revision of :class:`DeterministicReviser` that changed the draft."""


class DeterministicReviser:
    """Applies rubric suggestions as append-style edits; touches nothing they do not name.

    The demo half of the deterministic pair: the text it adds is stock text, and
    each revision's note says so (:data:`DEMO_NOTE`).
    """

    name = "deterministic-rubric"
    token_free = True  # no model call: a repair by it reserves no repair budget
    reads_pitfalls = False  # deterministic: the Known Pitfalls text would be ignored

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str = "",
        attempts: Sequence[RepairAttempt] = (),
    ) -> RevisionResult:
        """Return the revised paper (a dict) and how many suggestions changed it."""
        paper = parse_paper(output)
        # Edit a deep copy of the draft as given, so keys the rubric ignores stay untouched.
        doc: dict[str, Any] = json.loads(output if isinstance(output, str) else text_of(output))
        applied = 0
        for suggestion in envelope.suggestions:
            if self._apply(doc, paper, suggestion):
                applied += 1
        return RevisionResult(
            output=doc,
            suggestions_applied=applied,
            note=DEMO_NOTE.format(n=applied) if applied else None,
        )

    @staticmethod
    def _section(doc: dict[str, Any], section_id: str | None) -> dict[str, Any] | None:
        if section_id is None:
            return None
        return next((s for s in doc["sections"] if s.get("id") == section_id), None)

    def _apply(self, doc: dict[str, Any], paper: Paper, s: Suggestion) -> bool:
        topic = _topic(paper)
        sections: list[dict[str, Any]] = doc["sections"]
        if s.dimension == "clarity":
            target = self._section(doc, s.target_section)
            if target is None:
                return False
            body = str(target.get("body", ""))
            # A paragraph of two sentences from the pool, rotating so no body repeats itself.
            n = sum(body.count(p[:40]) for p in _CLARITY_SENTENCES)
            paragraph = " ".join(
                _CLARITY_SENTENCES[(n + i) % len(_CLARITY_SENTENCES)].format(topic=topic)
                for i in range(2)
            )
            target["body"] = _append(body, paragraph)
            return True
        if s.dimension == "novelty":
            current = doc.get("originality_tag", "low")
            if current == "high":
                return False
            doc["originality_tag"] = _NEXT_ORIGINALITY[current]
            return True
        if s.dimension == "evidence":
            target = self._section(doc, s.target_section)
            if target is None:
                return False
            figures = sum(len(x.get("figure_refs", [])) for x in sections) + 1
            cites = sum(len(x.get("cites", [])) for x in sections) + 1
            target.setdefault("figure_refs", []).append(f"fig{figures}")
            target.setdefault("cites", []).append(f"ref{cites}")
            target["body"] = _append(
                str(target.get("body", "")),
                f"Figure {figures} shows the measurement behind this claim, and [ref{cites}] "
                "reports a consistent result.",
            )
            return True
        if s.dimension in ("methodology", "related_work"):
            method = s.dimension == "methodology"
            title = "Method" if method else "Related Work"
            body = (
                f"We describe how we studied {topic}: the data we used, each step applied to "
                "it, and the measurements we report, in enough detail for another team to "
                "repeat the study."
                if method
                else f"Earlier work on {topic} approached the problem from several directions; "
                "this section contrasts those approaches with ours and states where our "
                "contribution departs from them."
            )
            target = self._section(doc, s.target_section)
            if target is not None:
                if str(target.get("body", "")).strip():
                    return False
                target["body"] = body
                return True
            new: dict[str, Any] = {
                "id": _unique_id(sections, "method" if method else "related-work"),
                "title": title,
                "body": body,
                "figure_refs": [],
                "cites": [],
            }
            sections.insert(_insert_at(sections, method), new)
            return True
        return False


def _append(body: str, sentence: str) -> str:
    return f"{body.rstrip()} {sentence}".strip()


_LATE = ("result", "experiment", "evaluation", "discussion", "conclusion")


def _insert_at(sections: Sequence[Mapping[str, Any]], method: bool) -> int:
    """Related Work goes after the first section; Method before results/conclusions."""
    if not method:
        return min(1, len(sections))
    for i, s in enumerate(sections):
        if _norm(str(s.get("title", ""))).startswith(_LATE):
            return i
    return len(sections)


def make_deterministic_pair(
    rubric: RubricConfig | None = None,
) -> tuple[RubricCritic, DeterministicReviser]:
    """The rubric critic and the reviser that knows how to raise each of its dimensions."""
    return RubricCritic(rubric), DeterministicReviser()
