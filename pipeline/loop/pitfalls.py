"""Pattern memory as text: what a critique teaches, the "Known Pitfalls" lines and
``lessons.md``.

The pitfalls block is injected into the next worker's and the repairer's prompts, so its format
is fixed byte for byte (the seed's ``- [seen Nx] category: prevention_rule`` lines,
:func:`render_pitfalls`), between the header and the footer that says the list is data, not
instructions (:data:`~pipeline.critics.llm_prompts.PITFALLS_HEADER`,
:data:`~pipeline.critics.llm_prompts.PITFALLS_FOOTER`); where this service puts it into a prompt
it sits inside a delimited data block (:func:`pipeline.critics.llm_prompts.pitfalls_block`).

What pattern memory stores is structure, never the worker's words (issue 28): a pattern
derived from a defect (:func:`patterns_from_envelope`) is built from its category, a bounded,
sanitised location and the check that failed; an LLM critic's own free-text patterns are cleaned
and capped, and dropped when the injection scan flags them or when they copy a long output key
verbatim. Those rules (:func:`~pipeline.security.pattern_text.name_token`,
:func:`~pipeline.security.pattern_text.stored_text`,
:func:`~pipeline.security.pattern_text.safe_pattern`) are :mod:`pipeline.security.pattern_text`'s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.critics.llm_prompts import PITFALLS_FOOTER, PITFALLS_HEADER
from pipeline.models import (
    CritiqueEnvelope,
    Defect,
    Lesson,
    LessonScope,
    Pattern,
    ReusablePattern,
)
from pipeline.security.pattern_text import (
    MAX_DESCRIPTION_CHARS,
    MAX_NAME_CHARS,
    MAX_RULE_CHARS,
    long_keys,
    name_token,
    safe_pattern,
    stored_text,
)
from pipeline.store.base import MAX_PATTERNS_PER_CRITIQUE
from pipeline.store.keys import pattern_key
from pipeline.text.escaping import md_text, one_line


def render_pitfalls(patterns: Sequence[Pattern]) -> str:
    """The Known Pitfalls block, one line per pattern in the given order, then the line that
    says the list is data (:data:`~pipeline.critics.llm_prompts.PITFALLS_FOOTER`); "" when none."""
    if not patterns:
        return ""
    lines = "".join(
        f"- [seen {p.frequency}x] {p.category}: {one_line(p.prevention_rule)}\n" for p in patterns
    )
    return PITFALLS_HEADER + lines + PITFALLS_FOOTER


L0_RULES: dict[str, str] = {
    "no_placeholder": "Replace every placeholder (TODO, TBD, Lorem ipsum, …) with real content",
    "no_text_loop": "Say each thing once: never repeat a paragraph, not even reworded",
    "file_size_delta": "Keep a repair close to the previous output's size: fix only what was asked",
    "no_duplicate_headings": "Give every heading a distinct title",
    "balanced_delimiters": "Close every bracket, brace and parenthesis you open",
    "json_valid_if_claimed": "When the output is JSON, return one valid JSON document",
}
"""Fixed prevention rules for Layer-0 defects, so the same check failing in different outputs
(different offsets, different text) is one pattern with a growing count, not many."""


def _where(defect: Defect) -> str:
    """The `` in '<name>'`` part of a derived rule when the defect's location is a plain name
    (:func:`name_token` keeps it), else "": a derived pattern never quotes an odd location,
    not even as a stand-in."""
    if defect.location is None:
        return ""
    token = name_token(defect.location, "location")
    return "" if token.startswith("location#") else f" in '{token}'"


def prevention_rule_for(defect: Defect) -> str:
    """A structural prevention rule for a defect the critic gave no pattern for: a built-in
    Layer-0 check's defect (:attr:`Defect.check`) gets that check's fixed rule, any other one
    a rule built from its category and plain location, never from its description's words."""
    if defect.check in L0_RULES:
        return L0_RULES[defect.check]
    return f"Check your output for {defect.category} problems{_where(defect)} before returning it"


def description_for(defect: Defect) -> str:
    """The structural description stored for a pattern derived from ``defect``: the check
    that failed, or its severity, category and plain location."""
    if defect.check in L0_RULES:
        return f"Layer-0 check {defect.check} failed"
    return f"a {defect.severity} {defect.category} defect{_where(defect)}"


_SEVERITY_RANK = {"critical": 0, "warning": 1}


@dataclass
class _Candidate:
    """A pattern a critique could record, with what ranks it."""

    category: str
    rank: int  # 0 critical, 1 warning
    index: int  # first appearance in the envelope
    pattern: ReusablePattern | None  # the critic's own reusable pattern
    defect: Defect | None  # else the defect it is derived from
    rule: str = ""


def patterns_from_envelope(
    envelope: CritiqueEnvelope, limit: int = MAX_PATTERNS_PER_CRITIQUE, output: Any = None
) -> list[ReusablePattern]:
    """What a critique teaches the run: its reusable patterns, plus uncovered defects — at
    most ``limit`` (20 per critique by default), chosen deterministically.

    Every critical or warning defect (not a grounding false positive) that no reusable pattern
    of the same category and description covers adds a structural pattern
    (:func:`prevention_rule_for`, :func:`description_for`); patterns are de-duplicated by
    (category, normalized prevention rule), first occurrence kept. The critic's own patterns
    pass :func:`safe_pattern` (``output``: the critiqued output, whose long keys they may not
    copy): text that tries to instruct a model (an LLM critic quoting a hostile output) is
    left out, the rest cleaned and capped.

    Which ones when there are more than ``limit``: critical before warning (a reusable pattern
    takes the worst severity among its category's defects; warning when it has none); within a
    severity, categories with the most defects first (ties: first appearance), one pattern per
    category in turn — so 20,000 missing fields cannot crowd out the one injection or format
    pattern — and within a category in envelope order (reusable patterns, then defects).
    """

    # Patterns reach later prompts and every later run's lessons: text a critic copied from a
    # hostile output ("ignore your instructions ...", a 200-character key) must not travel.
    output_keys = long_keys(output)
    actionable = [d for d in envelope.defects if d.severity != "info" and not d.false_positive]
    frequency: Counter[str] = Counter()
    for d in actionable:
        frequency[d.category] += d.folded or 1
    # A summary defect ("and N more …", pipeline.critics.base.fold_defects) counts in the
    # frequencies but teaches no pattern of its own: its listed siblings do.
    counted = [d for d in actionable if d.folded is None]
    worst: dict[str, int] = {}
    for d in counted:
        worst[d.category] = min(worst.get(d.category, 1), _SEVERITY_RANK[d.severity])
    found: dict[str, _Candidate] = {}
    covered: set[tuple[str, str]] = set()
    dropped: set[tuple[str, str, str]] = set()
    for given in envelope.reusable_patterns:
        seen = (given.category, given.prevention_rule, given.description)
        if seen in dropped:
            continue
        p = safe_pattern(given, output_keys)
        if p is None:
            dropped.add(seen)
            continue
        key = pattern_key(p.category, p.prevention_rule)
        if key not in found:
            found[key] = _Candidate(p.category, worst.get(p.category, 1), len(found), p, None)
        covered.add((given.category, one_line(given.description).casefold()))
    for d in counted:
        if (d.category, one_line(d.description).casefold()) in covered:
            continue
        rule = prevention_rule_for(d)
        key = pattern_key(d.category, rule)
        got = found.get(key)
        if got is None:
            severity = _SEVERITY_RANK[d.severity]
            found[key] = _Candidate(d.category, severity, len(found), None, d, rule)
        else:
            got.rank = min(got.rank, _SEVERITY_RANK[d.severity])
    out: list[ReusablePattern] = []
    for rank in (0, 1):
        queues: dict[str, list[_Candidate]] = {}
        for c in found.values():
            if c.rank == rank:
                queues.setdefault(c.category, []).append(c)
        order = sorted(queues, key=lambda cat: (-frequency[cat], queues[cat][0].index))
        depth = 0
        while len(out) < limit and any(depth < len(queues[cat]) for cat in order):
            for cat in order:
                if depth >= len(queues[cat]) or len(out) >= limit:
                    continue
                c = queues[cat][depth]
                if c.pattern is not None:
                    out.append(c.pattern)
                elif c.defect is not None:
                    out.append(
                        ReusablePattern(
                            category=c.defect.category,
                            description=description_for(c.defect),
                            prevention_rule=c.rule,
                        )
                    )
            depth += 1
    return out


def render_lessons(
    lessons: Sequence[Lesson], *, run_id: str | None = None, scope: LessonScope = "run"
) -> str:
    """``lessons.md`` for ``run_id``: its lessons in the given order, under the intro of their
    ``scope`` (the run's own patterns, or the fleet's that recurred across runs).

    A lesson is labelled with how many runs taught it and whether this run did; no other run
    is named. Every stored string is shown as pattern memory keeps it (no control characters,
    capped: a row a Redis writer planted cannot carry more) and literally
    (:func:`pipeline.text.escaping.md_text`)."""
    lines = ["# Lessons", ""]
    if run_id is not None:
        lines += [f"Run {md_text(run_id)}.", ""]
    if scope == "run":
        lines.append(
            "Failure patterns this run taught, most frequent first (lessons are kept per run)."
        )
    else:
        lines.append(
            "Failure patterns that recurred across the fleet's runs, most runs first. Lessons "
            "are shared by every run: each says how many runs taught it, never which."
        )
    lines.append("")
    if not lessons:
        lines.append(
            "No failure patterns recorded yet."
            if scope == "run"
            else "No recurring failure patterns recorded yet."
        )
        return "\n".join(lines) + "\n"
    for i, lesson in enumerate(lessons, 1):
        category = md_text(stored_text(lesson.category, MAX_NAME_CHARS * 2))
        lines += [
            f"## {i}. {category} ({_taught_by(lesson)})",
            "",
            f"- **Rule:** {md_text(stored_text(lesson.prevention_rule, MAX_RULE_CHARS))}",
            f"- **What happened:** "
            f"{md_text(stored_text(lesson.description, MAX_DESCRIPTION_CHARS))}",
            "",
        ]
    return "\n".join(lines)


def _taught_by(lesson: Lesson) -> str:
    """Who taught a lesson, in counts: this run, and how many runs in all."""
    if lesson.scope == "run":
        return "taught by this run"
    runs = f"seen in {lesson.runs} run{'s' if lesson.runs != 1 else ''}"
    return f"{runs}, this one among them" if lesson.this_run else runs
