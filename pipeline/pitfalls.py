"""Pattern memory as text (SPEC §5.7): the "Known Pitfalls" block and ``lessons.md``.

The pitfalls block is injected into the next worker's and the repairer's prompts, so its format
is fixed byte for byte (the seed's ``- [seen Nx] category: prevention_rule`` lines).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pipeline.models import CritiqueEnvelope, Lesson, Pattern, ReusablePattern
from pipeline.store.memory import pattern_key

PITFALLS_HEADER = (
    "## Known Pitfalls\n"
    "\n"
    "The following issues have occurred in prior workers during this run.\n"
    "Avoid repeating them:\n"
    "\n"
)


def render_pitfalls(patterns: Sequence[Pattern]) -> str:
    """The Known Pitfalls block, one line per pattern in the given order; "" when none."""
    if not patterns:
        return ""
    lines = "".join(
        f"- [seen {p.frequency}x] {p.category}: {_one_line(p.prevention_rule)}\n" for p in patterns
    )
    return PITFALLS_HEADER + lines


def _one_line(text: str) -> str:
    return " ".join(text.split())


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

_L0_CHECK = re.compile(r"^L0 ([a-z0-9_]+):")


def prevention_rule_for(description: str) -> str:
    """A prevention rule derived from a defect description (when the critic gave none); a
    built-in Layer-0 check's defect gets that check's fixed rule."""
    m = _L0_CHECK.match(description)
    if m and m.group(1) in L0_RULES:
        return L0_RULES[m.group(1)]
    desc = _one_line(description).rstrip(".")
    return f"Check your output for this before returning it: {desc}"


def patterns_from_envelope(envelope: CritiqueEnvelope) -> list[ReusablePattern]:
    """What a critique teaches the run: its reusable patterns, plus uncovered defects.

    Every critical or warning defect (not a grounding false positive) that no reusable pattern
    of the same category and description covers adds a pattern with a derived rule; the result
    is de-duplicated by (category, normalized prevention rule), first occurrence kept. Text
    that tries to instruct a model (an LLM critic quoting a hostile output) is left out.
    """
    from pipeline.critics.llm import detect_injection

    def instructs(*texts: str) -> bool:
        # Patterns reach later prompts OUTSIDE the untrusted-data block: text an LLM critic
        # copied from a hostile output ("ignore your instructions ...") must not travel there.
        return any(detect_injection(t) for t in texts)

    out: dict[str, ReusablePattern] = {}
    covered: set[tuple[str, str]] = set()
    for p in envelope.reusable_patterns:
        if instructs(p.description, p.prevention_rule):
            continue
        out.setdefault(pattern_key(p.category, p.prevention_rule), p)
        covered.add((p.category, _one_line(p.description).casefold()))
    for d in envelope.defects:
        if d.severity == "info" or d.false_positive:
            continue
        if (d.category, _one_line(d.description).casefold()) in covered:
            continue
        if d.source == "llm" and instructs(d.description):
            continue
        p = ReusablePattern(
            category=d.category,
            description=d.description,
            prevention_rule=prevention_rule_for(d.description),
        )
        out.setdefault(pattern_key(p.category, p.prevention_rule), p)
    return list(out.values())


def render_lessons(lessons: Sequence[Lesson]) -> str:
    """``lessons.md``: failure patterns that recurred across runs, most runs first as given."""
    lines = [
        "# Lessons",
        "",
        "Failure patterns that recurred across runs, most frequent first.",
        "",
    ]
    if not lessons:
        lines.append("No recurring failure patterns recorded yet.")
        return "\n".join(lines) + "\n"
    for i, lesson in enumerate(lessons, 1):
        lines += [
            f"## {i}. {lesson.category} (seen in {lesson.runs} runs)",
            "",
            f"- **Rule:** {_one_line(lesson.prevention_rule)}",
            f"- **What happened:** {_one_line(lesson.description)}",
            f"- **Runs:** first {lesson.first_run}, latest {lesson.last_run}",
            "",
        ]
    return "\n".join(lines)
