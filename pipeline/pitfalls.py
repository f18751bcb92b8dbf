"""Pattern memory as text (SPEC §5.7): the "Known Pitfalls" block and ``lessons.md``.

The pitfalls block is injected into the next worker's and the repairer's prompts, so its format
is fixed byte for byte (the seed's ``- [seen Nx] category: prevention_rule`` lines).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.injection import detect_injection
from pipeline.models import CritiqueEnvelope, Defect, Lesson, Pattern, ReusablePattern
from pipeline.store.base import MAX_PATTERNS_PER_CRITIQUE
from pipeline.store.keys import pattern_key

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


def prevention_rule_for(defect: Defect) -> str:
    """A prevention rule derived from a defect (when the critic gave none): a built-in
    Layer-0 check's defect (:attr:`Defect.check`) gets that check's fixed rule, any other one
    a rule quoting its description."""
    if defect.check in L0_RULES:
        return L0_RULES[defect.check]
    desc = _one_line(defect.description).rstrip(".")
    return f"Check your output for this before returning it: {desc}"


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
    envelope: CritiqueEnvelope, limit: int = MAX_PATTERNS_PER_CRITIQUE
) -> list[ReusablePattern]:
    """What a critique teaches the run: its reusable patterns, plus uncovered defects — at
    most ``limit`` (SPEC §3: 20 per critique), chosen deterministically.

    Every critical or warning defect (not a grounding false positive) that no reusable pattern
    of the same category and description covers adds a pattern with a derived rule; patterns
    are de-duplicated by (category, normalized prevention rule), first occurrence kept. Text
    that tries to instruct a model (an LLM critic quoting a hostile output) is left out.

    Which ones when there are more than ``limit``: critical before warning (a reusable pattern
    takes the worst severity among its category's defects; warning when it has none); within a
    severity, categories with the most defects first (ties: first appearance), one pattern per
    category in turn — so 20,000 missing fields cannot crowd out the one injection or format
    pattern — and within a category in envelope order (reusable patterns, then defects).
    """

    def instructs(*texts: str) -> bool:
        # Patterns reach later prompts OUTSIDE the untrusted-data block: text an LLM critic
        # copied from a hostile output ("ignore your instructions ...") must not travel there.
        return any(detect_injection(t) for t in texts)

    counted = [d for d in envelope.defects if d.severity != "info" and not d.false_positive]
    frequency = Counter(d.category for d in counted)
    worst: dict[str, int] = {}
    for d in counted:
        worst[d.category] = min(worst.get(d.category, 1), _SEVERITY_RANK[d.severity])
    found: dict[str, _Candidate] = {}
    covered: set[tuple[str, str]] = set()
    for p in envelope.reusable_patterns:
        if instructs(p.description, p.prevention_rule):
            continue
        key = pattern_key(p.category, p.prevention_rule)
        if key not in found:
            found[key] = _Candidate(p.category, worst.get(p.category, 1), len(found), p, None)
        covered.add((p.category, _one_line(p.description).casefold()))
    for d in counted:
        if (d.category, _one_line(d.description).casefold()) in covered:
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
                elif c.defect is not None and not (
                    c.defect.source == "llm" and instructs(c.defect.description)
                ):
                    out.append(
                        ReusablePattern(
                            category=c.defect.category,
                            description=c.defect.description,
                            prevention_rule=c.rule,
                        )
                    )
            depth += 1
    return out


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
