"""The critic and reviser protocols every implementation follows.

A critic scores one output and lists its defects; a reviser applies a critique's prescriptions to
produce the next output. Both are plain objects with one method, so an LLM critic, the rubric
critic, a command critic and the heuristic fallback are interchangeable in the loop.

Capabilities are attributes every critic and reviser declares (part of the protocols):

- ``token_free``: it spends no tokens (it reads the output deterministically, or calls no
  model). A token-free critic may run even when Layer-0 failed (see :func:`merge_l0`); a
  token-free reviser's repairs reserve nothing from the repair budget.
- ``reads_pitfalls``: it reads the Known Pitfalls text. Deterministic ones say False, so the
  runner does not even read pattern memory for them (they are handed ``""``).

A reviser loaded from configuration (``repairer: package.module:function``) that declares
neither is adapted by :func:`pipeline.wiring.load_reviser` as token-spending and
pitfall-reading.

Optional capabilities are protocols of their own, checked with ``isinstance``:

- :class:`PerSubmission` (``resolve(submission)``): a wrapper that picks the critic or reviser
  per submission (``critic: auto``); the runner asks :func:`resolve_for` for the one that
  serves a submission and reads the capabilities there.
- :class:`Planner` (``plan(submission, output, envelope)``): a reviser that knows in advance
  what it can fix (a deterministic one) returns the revision ``revise`` would return, without
  side effects. The runner asks it before spending a repair round: when the plan fixes nothing,
  the loop stops with ``needs_model`` and lists the plan's ``unfixable`` defects.
  A plan of None (an LLM with a model) means it may fix anything.
- :class:`PromptedReviser` and :class:`SizedCritic` (the repair budget, docs/pipeline.md, 'The
  repair budget'): a reviser that sends the repair prompt to a model sizes its call from that prompt
  (``repair_bound(..., prompt=...) -> (tokens, output_tokens)``) and takes it ready-made
  (``revise(..., prompt=...)``), so the runner renders it once per round; a critic's
  ``critique_bound(submission, output, *, output_tokens, pitfalls, round) -> tokens`` sizes a
  re-critique. Without them the runner estimates (:mod:`pipeline.loop.repair`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import Field

from pipeline.models import (
    CritiqueEnvelope,
    Defect,
    Frozen,
    RepairAttempt,
    ReusablePattern,
    Submission,
    Suggestion,
    Usage,
    defect_id,
)

L0_ERROR_PENALTY = 0.2
"""Score subtracted per Layer-0 error (a critical L0 defect) in the token-free envelope."""
L0_WARNING_PENALTY = 0.1
"""Score subtracted per Layer-0 warning in the token-free envelope."""


class Critic(Protocol):
    """Scores one output and lists its defects."""

    name: str
    token_free: bool
    """True when it spends no tokens (deterministic): it may run even when Layer-0 failed."""
    reads_pitfalls: bool
    """False when it ignores the Known Pitfalls text (pattern memory is then not read for it)."""

    def critique(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        pitfalls: str,
        round: int,
    ) -> CritiqueEnvelope:
        """Critique ``output`` (the current version of ``submission.output``) in ``round``."""
        ...


class Refusal(Frozen):
    """A defect a reviser left alone, and why (e.g. fixing it would invent content)."""

    defect: Defect
    reason: str

    def line(self) -> str:
        """One line for notes and the CLI: severity, category, where, what, why not."""
        d = self.defect
        where = f" at {d.location}" if d.location else ""
        return f"[{d.severity}] {d.category}{where}: {d.description} (not fixed: {self.reason})"


class RevisionResult(Frozen):
    """What a reviser returns: the new output, what it cost, how many suggestions it applied."""

    output: str | dict[str, Any]
    usage: Usage = Field(default_factory=Usage)
    suggestions_applied: int = Field(0, ge=0)
    note: str | None = None
    """Something the user should know about this revision (e.g. a fallback reviser answered)."""
    unfixable: tuple[Refusal, ...] = ()
    """The defects this reviser could not fix honestly, each with the reason (deterministic
    revisers list every critical and warning defect they left alone)."""


class Reviser(Protocol):
    """Repairs an output: fixes only the defects the envelope names, keeps everything else."""

    name: str
    token_free: bool
    """True when it calls no model: its repairs reserve nothing from the repair budget."""
    reads_pitfalls: bool
    """False when it ignores the Known Pitfalls text (pattern memory is then not read for it)."""

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        """Return the repaired output for ``envelope``'s critical and warning defects."""
        ...


@runtime_checkable
class PerSubmission(Protocol):
    """A critic or reviser that picks, per submission, the one that serves it (``auto``)."""

    def resolve(self, submission: Submission) -> Any:
        """The critic or reviser that serves ``submission``."""
        ...


def resolve_for(obj: Any, submission: Submission) -> Any:
    """The critic or reviser that actually serves ``submission``: a :class:`PerSubmission`
    wrapper picks per submission, everything else is itself."""
    return obj.resolve(submission) if isinstance(obj, PerSubmission) else obj


@runtime_checkable
class Planner(Protocol):
    """A reviser that can say, without side effects, what ``revise`` would return."""

    def plan(
        self, submission: Submission, output: str | dict[str, Any], envelope: CritiqueEnvelope
    ) -> RevisionResult | None:
        """The revision ``revise`` would return; None when it cannot tell (a model may fix
        anything)."""
        ...


@runtime_checkable
class PromptedReviser(Protocol):
    """A reviser that sends the repair prompt to a model: the runner renders the
    prompt once per round (:func:`pipeline.critics.llm_prompts.build_repair_prompt`), sizes the
    call with :meth:`repair_bound` and hands the same prompt to ``revise(..., prompt=...)``."""

    def repair_bound(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str = "",
        attempts: Sequence[RepairAttempt] = (),
        prompt: str | None = None,
        max_tokens: int | None = None,
    ) -> tuple[int, int]:
        """``(tokens, output_tokens)``: the repair call's counted prompt plus its
        ``max_tokens``, and the repaired output's size bound. ``max_tokens``: a lower bound
        for the call's reply than its own (a round sized from what the run's repairs used)."""
        ...

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str = "",
        attempts: Sequence[RepairAttempt] = (),
        prompt: str | None = None,
        max_tokens: int | None = None,
    ) -> RevisionResult:
        """Repair with ``prompt`` (rendered by the caller) when given, the call's reply bound
        lowered to ``max_tokens`` when given (as :meth:`repair_bound` sized it)."""
        ...


@runtime_checkable
class SizedCritic(Protocol):
    """A critic that can size one critique call of a repaired output, for the repair budget."""

    def critique_bound(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        output_tokens: int,
        pitfalls: str = "",
        round: int = 1,
        reply_tokens: int | None = None,
    ) -> int:
        """Tokens one critique of ``output`` grown to ``output_tokens`` may spend; with
        ``reply_tokens``, its reply counted at that many tokens when that is less than its own
        bound (a round sized from what the run's repairs used: the call is then made within
        what the reservation leaves, :func:`pipeline.llm.completion.complete_within`)."""
        ...


def clamp_score(score: float) -> float:
    """Clamp to [0, 1] and round away float noise (0.30000000000000004 → 0.3)."""
    return round(min(1.0, max(0.0, score)), 6)


def l0_prescription(defect: Defect) -> str:
    """The repair instruction for one Layer-0 defect."""
    where = f" at {defect.location}" if defect.location else ""
    return f"Fix the output-contract failure{where}: {defect.description}"


def merge_l0(envelope: CritiqueEnvelope, l0_defects: Sequence[Defect]) -> CritiqueEnvelope:
    """The token-free envelope used when Layer-0 failed (no critic tokens are spent then).

    Rule: take a token-free critic's envelope (the heuristic, or a deterministic critic), put the
    L0 defects first, and subtract 0.2 per L0 error (critical) and 0.1 per L0 warning, clamped
    to [0, 1]. Usage is zero; ``fallback_reason`` says why the configured critic did not run.
    """
    errors = sum(1 for d in l0_defects if d.severity == "critical")
    warnings = sum(1 for d in l0_defects if d.severity == "warning")
    score = clamp_score(envelope.score - L0_ERROR_PENALTY * errors - L0_WARNING_PENALTY * warnings)
    defects = (*l0_defects, *envelope.defects)
    prescriptions = (
        *(l0_prescription(d) for d in l0_defects if d.severity != "info"),
        *envelope.prescriptions,
    )
    # One score on the line: the token-free critic's own summary ends "score 1.00", which read
    # as a contradiction of the penalised score next to it.
    summary = (
        f"layer-0 contract failed ({errors} error(s), {warnings} warning(s)): critic skipped, "
        f"no tokens spent; score {score:.2f} = the token-free {envelope.critic} critic's "
        f"{envelope.score:.2f} less {L0_ERROR_PENALTY:.1f} per Layer-0 error and "
        f"{L0_WARNING_PENALTY:.1f} per warning"
    )
    return envelope.model_copy(
        update={
            "score": score,
            "defects": defects,
            "prescriptions": prescriptions,
            "summary": summary,
            "usage": Usage(),
            "fallback_reason": "layer-0 contract failed: no critic tokens spent",
        }
    )


# --- bounds: what one critique may hold, whatever the output and the critic -------------------
#
# A critique's size must not grow faster than its input (issue 28: 400k empty JSON fields once
# became 400k defects, prescriptions and patterns, copied into every stage's state). Every
# envelope the loop keeps goes through :func:`bound_envelope`: at most MAX_DEFECTS defects (the
# rest folded into one summary defect per category and severity that says how many it stands
# for), and every text clipped with "…".

MAX_DEFECTS = 100
"""Defects listed per envelope (and per Layer-0 outcome); summary defects included."""
MAX_FOLD_GROUPS = 20
"""Summary defects by (category, severity); smaller groups past these share one per severity."""
DESCRIPTION_CHARS = 300
"""Longest defect description kept (the rest cut, ending in "…")."""
LOCATION_CHARS = 120
"""Longest defect location kept."""
CATEGORY_CHARS = 64
"""Longest defect category kept."""
MAX_PRESCRIPTIONS = 100
"""Prescriptions per envelope (duplicates dropped first)."""
PRESCRIPTION_CHARS = 500
"""Longest prescription kept."""
MAX_PATTERNS = 40
"""Reusable patterns per envelope: twice what pattern memory records from one critique, taken
in turn from each category so the few rare ones survive a flood of one kind."""
PATTERN_CHARS = 300
"""Longest reusable-pattern description or prevention rule kept."""
MAX_SUGGESTIONS = 100
"""Rubric suggestions per envelope."""
SUGGESTION_CHARS = 1000
"""Longest suggestion edit kept."""
SUMMARY_CHARS = 2000
"""Longest envelope summary (and fallback reason) kept."""
_SHOWN_LOCATIONS = 3
"""Locations a summary defect names (the first ones it folds), each cut to 40 characters."""
_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ending in "…" when it was cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _clipped(d: Defect) -> Defect:
    """``d`` with its description, location and category clipped; when anything was cut, a
    new id hashed over the full location and description (stable, still distinct)."""
    location = None if d.location is None else clip(d.location, LOCATION_CHARS)
    description = clip(d.description, DESCRIPTION_CHARS)
    category = clip(d.category, CATEGORY_CHARS)
    if (location, description, category) == (d.location, d.description, d.category):
        return d
    full = f"{d.location or ''}\n{d.description}"
    return d.model_copy(
        update={
            "category": category,
            "location": location,
            "description": description,
            "id": defect_id(category, location, full),
        }
    )


class _Group:
    """Defects of one (category, severity) left out of a bounded list."""

    def __init__(self, category: str, severity: str, first: Defect) -> None:
        self.category = category
        self.severity = severity
        self.count = 0
        self.members: list[Defect] = []
        self.sources: list[str] = []
        self.checks: set[str | None] = set()
        self.locations: list[str] = []
        self.categories: Counter[str] = Counter()
        self.first = first

    def add(self, d: Defect) -> None:
        self.members.append(d)
        self.count += d.folded or 1
        self.sources.append(d.source)
        self.checks.add(d.check)
        self.categories[d.category] += d.folded or 1
        if d.folded is None and d.location and len(self.locations) < _SHOWN_LOCATIONS:
            self.locations.append(clip(d.location, 40))

    def defect(self, other: bool) -> Defect:
        """The summary defect of this group (``other``: the groups past MAX_FOLD_GROUPS); a
        group of one defect is that defect (a summary defect already, or one listed as itself:
        folding again changes nothing, and no summary ever stands for a single defect)."""
        if len(self.members) == 1:
            return _clipped(self.members[0])
        category = clip(
            self.categories.most_common(1)[0][0] if other else self.category, CATEGORY_CHARS
        )
        if other:
            names = ", ".join(c for c, _ in self.categories.most_common(4))
            more = "…" if len(self.categories) > 4 else ""
            what = (
                f"and {self.count} more {self.severity} defect(s) in "
                f"{len(self.categories)} other categories ({names}{more})"
            )
        else:
            what = f"and {self.count} more {category} {self.severity} defect(s)"
        where = f"; the first at: {', '.join(self.locations)}" if self.locations else ""
        source = self.first.source
        one_check = len(self.checks) == 1 and all(s == "l0" for s in self.sources)
        check = next(iter(self.checks)) if source == "l0" and one_check else None
        return Defect.model_validate(
            {
                "id": f"{category}:{'more-other' if other else 'more'}:{self.severity}",
                "category": category,
                "severity": self.severity,
                "location": None,
                "description": clip(f"{what}, not listed one by one{where}", DESCRIPTION_CHARS),
                "source": source,
                "check": check,
                "folded": self.count,
            }
        )


def fold_defects(defects: Sequence[Defect], limit: int = MAX_DEFECTS) -> tuple[Defect, ...]:
    """At most ``limit`` defects, each clipped (:data:`DESCRIPTION_CHARS`,
    :data:`LOCATION_CHARS`): the first ones by severity (critical, then warning, then info; in
    their own order within one), then one summary defect per (category, severity) saying how
    many more it stands for (``folded``) and where the first of them are. Folding a folded
    list again gives the same counts (a summary defect is counted as the defects it folds)."""
    listed = [i for i, d in enumerate(defects) if d.folded is None]
    if len(defects) <= limit and len(listed) == len(defects):
        return tuple(_clipped(d) for d in defects)
    order = sorted(listed, key=lambda i: _SEVERITY_RANK[defects[i].severity])
    keep = limit - 1
    while True:
        kept = set(order[:keep])
        groups: dict[tuple[str, str], _Group] = {}
        for i, d in enumerate(defects):
            if i not in kept:
                key = (d.category, d.severity)
                if key not in groups:
                    groups[key] = _Group(d.category, d.severity, d)
                groups[key].add(d)
        summaries = min(len(groups), MAX_FOLD_GROUPS + len(_SEVERITY_RANK))
        if keep + summaries <= limit or keep == 0:
            break
        keep = max(0, limit - summaries)
    ranked = sorted(groups.values(), key=lambda g: (_SEVERITY_RANK[g.severity], -g.count))
    folded = [g.defect(other=False) for g in ranked[:MAX_FOLD_GROUPS]]
    others: dict[str, _Group] = {}
    for g in ranked[MAX_FOLD_GROUPS:]:
        lump = others.setdefault(g.severity, _Group(g.category, g.severity, g.first))
        lump.members += g.members
        lump.count += g.count
        lump.sources += g.sources
        lump.checks |= g.checks
        lump.categories.update(g.categories)
        lump.locations += g.locations[: _SHOWN_LOCATIONS - len(lump.locations)]
    folded += [g.defect(other=True) for g in others.values()]
    return (*(_clipped(defects[i]) for i in sorted(kept)), *folded)


def _bounded_patterns(patterns: Sequence[ReusablePattern]) -> tuple[ReusablePattern, ...]:
    """Distinct patterns, texts clipped, at most :data:`MAX_PATTERNS`, taken in turn from each
    category (first appearance order), so no category crowds out the others."""
    clipped = dict.fromkeys(
        p
        if len(p.description) <= PATTERN_CHARS and len(p.prevention_rule) <= PATTERN_CHARS
        else p.model_copy(
            update={
                "description": clip(p.description, PATTERN_CHARS),
                "prevention_rule": clip(p.prevention_rule, PATTERN_CHARS),
            }
        )
        for p in patterns
    )
    if len(clipped) <= MAX_PATTERNS:
        return tuple(clipped)
    queues: dict[str, list[ReusablePattern]] = {}
    for p in clipped:
        queues.setdefault(p.category, []).append(p)
    out: list[ReusablePattern] = []
    depth = 0
    while len(out) < MAX_PATTERNS:
        for queue in queues.values():
            if depth < len(queue) and len(out) < MAX_PATTERNS:
                out.append(queue[depth])
        depth += 1
    chosen = set(out)
    return tuple(p for p in clipped if p in chosen)


def _bounded_prescriptions(prescriptions: Sequence[str]) -> tuple[str, ...]:
    """Distinct prescriptions, clipped, at most :data:`MAX_PRESCRIPTIONS` (the last one then
    says how many more there were)."""
    distinct = list(dict.fromkeys(clip(p, PRESCRIPTION_CHARS) for p in prescriptions))
    if len(distinct) <= MAX_PRESCRIPTIONS:
        return tuple(distinct)
    more = len(distinct) - (MAX_PRESCRIPTIONS - 1)
    return (
        *distinct[: MAX_PRESCRIPTIONS - 1],
        f"(and {more} more prescriptions of the same kinds, for the defects summarised as "
        "'and N more')",
    )


def _bounded_suggestions(suggestions: Sequence[Suggestion]) -> tuple[Suggestion, ...]:
    out = []
    for s in suggestions[:MAX_SUGGESTIONS]:
        if len(s.edit) > SUGGESTION_CHARS or len(s.target_section or "") > LOCATION_CHARS:
            section = None if s.target_section is None else clip(s.target_section, LOCATION_CHARS)
            s = s.model_copy(
                update={"edit": clip(s.edit, SUGGESTION_CHARS), "target_section": section}
            )
        out.append(s)
    return tuple(out)


def bound_envelope(envelope: CritiqueEnvelope) -> CritiqueEnvelope:
    """``envelope`` within the per-critique bounds above, whatever critic wrote it: defects
    folded (:func:`fold_defects`), prescriptions, patterns and suggestions capped, every text
    clipped. The score is the critic's; counts stay true (``defect_count``,
    ``actionable_count`` include what was folded). Idempotent; an envelope already within
    the bounds comes back as it is."""
    update: dict[str, Any] = {}
    defects = fold_defects(envelope.defects)
    if defects != envelope.defects:
        update["defects"] = defects
    prescriptions = _bounded_prescriptions(envelope.prescriptions)
    if prescriptions != envelope.prescriptions:
        update["prescriptions"] = prescriptions
    patterns = _bounded_patterns(envelope.reusable_patterns)
    if patterns != envelope.reusable_patterns:
        update["reusable_patterns"] = patterns
    suggestions = _bounded_suggestions(envelope.suggestions)
    if suggestions != envelope.suggestions:
        update["suggestions"] = suggestions
    if len(envelope.summary) > SUMMARY_CHARS:
        update["summary"] = clip(envelope.summary, SUMMARY_CHARS)
    if envelope.fallback_reason is not None and len(envelope.fallback_reason) > SUMMARY_CHARS:
        update["fallback_reason"] = clip(envelope.fallback_reason, SUMMARY_CHARS)
    return envelope.model_copy(update=update) if update else envelope
