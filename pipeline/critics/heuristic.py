"""The heuristic critic (SPEC §5.2) and its deterministic reviser.

The heuristic answers when no LLM is available (or the LLM failed) and builds the token-free
envelope when Layer-0 fails. Penalty table, starting from 1.0 and clamped to [0, 1]:

JSON-object outputs (a worker's result dict):
    missing ``confidence`` (absent or null)          −0.3 critical  missing_data
    ``confidence`` not a number (e.g. the string "0.9", a bool) −0.2 warning wrong_format
    ``confidence`` < 0.3                             −0.2 warning   incomplete
    ``error`` present (not null, not blank)          −0.4 critical  incomplete
    each missing required field (absent or null)     −0.2 critical  missing_data
    each empty-string field (blank after strip)      −0.1 warning   incomplete

A non-numeric confidence is a format problem, not a missing value: the worker did report one.
``confidence`` is never double-counted as a required field, and a blank ``error`` string counts
as an empty field rather than a reported error.

Text outputs: empty (whitespace only) −0.4 critical ``incomplete``; each required field is read
as a required heading (a Markdown ``#`` heading or a LaTeX ``\\section``-family title matching the
field case-insensitively, underscores read as spaces); absent −0.2 critical ``missing_data``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from pipeline.critics.base import RevisionResult, clamp_score
from pipeline.models import (
    CritiqueEnvelope,
    Defect,
    RepairAttempt,
    ReusablePattern,
    Submission,
    band_for,
    effort_for,
)
from pipeline.tokens import estimate_usage, text_of

MISSING_CONFIDENCE = 0.3
NON_NUMERIC_CONFIDENCE = 0.2
LOW_CONFIDENCE = 0.2
LOW_CONFIDENCE_BELOW = 0.3
ERROR_PRESENT = 0.4
MISSING_FIELD = 0.2
EMPTY_FIELD = 0.1
EMPTY_TEXT = 0.4
MISSING_HEADING = 0.2

REPAIRED_CONFIDENCE = 0.5
"""Confidence the deterministic reviser writes when the worker gave none or an unusable one."""

PLACEHOLDER_TOKENS: tuple[str, ...] = (
    "Lorem ipsum",
    "TITLE GOES HERE",
    "Author Name",
    "to be filled",
    "TODO",
    "XXX",
    "???",
    "TBD",
    "FIXME",
)
"""The default placeholders of SPEC §5.1, longest first (the reviser removes those L0 names)."""

_MD_HEADING = re.compile(r"^[ \t]{0,3}#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
_TEX_HEADING = re.compile(r"\\(?:chapter|(?:sub){0,2}section|paragraph)\*?\s*\{([^{}]*)\}")
_NUMBERING = re.compile(r"^\d+(?:\.\d+)*\.?\s+")


def normalize_title(title: str) -> str:
    """Compare headings and field names: case-folded, ``_``/``-`` as spaces, numbering dropped."""
    t = title.replace("_", " ").replace("-", " ").casefold()
    t = _NUMBERING.sub("", " ".join(t.split()))
    return t.strip(" :.")


def headings(text: str) -> set[str]:
    """Normalized titles of every Markdown and LaTeX heading in ``text``."""
    found = [m.group(1) for m in _MD_HEADING.finditer(text)]
    found += [m.group(1) for m in _TEX_HEADING.finditer(text)]
    return {normalize_title(h) for h in found}


def _label(field: str) -> str:
    words = field.replace("_", " ").strip()
    return words[:1].upper() + words[1:]


class _Finding:
    """One heuristic finding: a defect with its penalty, prescription and lesson."""

    def __init__(
        self,
        penalty: float,
        defect: Defect,
        prescription: str,
        rule: str,
    ) -> None:
        self.penalty = penalty
        self.defect = defect
        self.prescription = prescription
        self.pattern = ReusablePattern(
            category=defect.category, description=defect.description, prevention_rule=rule
        )


def _finding(
    penalty: float,
    category: str,
    severity: str,
    location: str | None,
    description: str,
    prescription: str,
    rule: str,
) -> _Finding:
    defect = Defect.model_validate(
        {
            "category": category,
            "severity": severity,
            "location": location,
            "description": description,
            "source": "heuristic",
        }
    )
    return _Finding(penalty, defect, prescription, rule)


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and not (isinstance(value, float) and math.isnan(value))
    )


def _blank(value: Any) -> bool:
    return isinstance(value, str) and not value.strip()


def _dict_findings(output: dict[str, Any], required: Sequence[str]) -> list[_Finding]:
    found: list[_Finding] = []
    confidence = output.get("confidence")
    if confidence is None:
        found.append(
            _finding(
                MISSING_CONFIDENCE,
                "missing_data",
                "critical",
                "confidence",
                "the 'confidence' field is missing",
                "Add the 'confidence' field: a number between 0 and 1 saying how sure the "
                "result is.",
                "Always include a numeric 'confidence' field in your output",
            )
        )
    elif not _is_number(confidence):
        found.append(
            _finding(
                NON_NUMERIC_CONFIDENCE,
                "wrong_format",
                "warning",
                "confidence",
                f"the 'confidence' field is not a number (got {type(confidence).__name__})",
                "Give 'confidence' as a number between 0 and 1, not as text.",
                "Always give 'confidence' as a number between 0 and 1",
            )
        )
    elif confidence < LOW_CONFIDENCE_BELOW:
        found.append(
            _finding(
                LOW_CONFIDENCE,
                "incomplete",
                "warning",
                "confidence",
                f"confidence {confidence:g} is below {LOW_CONFIDENCE_BELOW:g}",
                "Resolve what makes the result uncertain, then report the confidence it earns.",
                "Resolve uncertainty before returning instead of reporting a confidence below 0.3",
            )
        )
    error = output.get("error")
    if error is not None and not _blank(error):
        shown = str(error)
        shown = shown if len(shown) <= 120 else shown[:117] + "..."
        found.append(
            _finding(
                ERROR_PRESENT,
                "incomplete",
                "critical",
                "error",
                f"the output reports an error: {shown}",
                "Resolve the reported error and remove the 'error' field.",
                "Resolve errors before returning; never return a result with an 'error' field",
            )
        )
    for field in dict.fromkeys(required):
        if field == "confidence":
            continue  # covered by the confidence rules, never counted twice
        if output.get(field) is None:
            found.append(
                _finding(
                    MISSING_FIELD,
                    "missing_data",
                    "critical",
                    field,
                    f"required field '{field}' is missing",
                    f"Add the '{field}' field with content that answers the task.",
                    f"Always include the '{field}' field in your output",
                )
            )
    for field, value in output.items():
        if field != "confidence" and _blank(value):
            found.append(
                _finding(
                    EMPTY_FIELD,
                    "incomplete",
                    "warning",
                    field,
                    f"field '{field}' is an empty string",
                    f"Fill the '{field}' field with real content, or remove it if it does "
                    "not apply.",
                    f"Never leave the '{field}' field as an empty string",
                )
            )
    return found


def _text_findings(output: str, required: Sequence[str]) -> list[_Finding]:
    found: list[_Finding] = []
    if not output.strip():
        found.append(
            _finding(
                EMPTY_TEXT,
                "incomplete",
                "critical",
                None,
                "the output is empty",
                "Write the output the task asks for; the submission is empty.",
                "Never return an empty output",
            )
        )
    present = headings(output)
    for field in dict.fromkeys(required):
        if normalize_title(field) not in present:
            found.append(
                _finding(
                    MISSING_HEADING,
                    "missing_data",
                    "critical",
                    field,
                    f"required section '{field}' is missing (no heading with that title)",
                    f"Add a section headed '{_label(field)}' with the content it calls for.",
                    f"Always include a '{_label(field)}' section heading in your output",
                )
            )
    return found


class HeuristicCritic:
    """Deterministic, token-free critic: the penalty table of the module docstring."""

    name = "heuristic"
    token_free = True
    reads_pitfalls = False  # deterministic: the Known Pitfalls text would be ignored

    def critique(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        pitfalls: str = "",
        round: int = 1,
    ) -> CritiqueEnvelope:
        """Score ``output`` against ``submission.required_fields``; usage is zero."""
        if isinstance(output, dict):
            found = _dict_findings(output, submission.required_fields)
        else:
            found = _text_findings(output, submission.required_fields)
        score = clamp_score(1.0 - sum(f.penalty for f in found))
        defects = tuple(f.defect for f in found)
        critical = sum(1 for d in defects if d.severity == "critical")
        return CritiqueEnvelope(
            worker_id=submission.worker_id,
            score=score,
            defects=defects,
            prescriptions=tuple(f.prescription for f in found),
            reusable_patterns=tuple(dict.fromkeys(f.pattern for f in found)),
            effort_estimate=effort_for(len(defects)),
            summary=(
                f"heuristic: {len(defects)} defect(s), {critical} critical; score {score:.2f}"
            ),
            band=band_for(score),
            critic="heuristic",
        )


def _task_excerpt(task: str, limit: int = 160) -> str:
    text = task
    for token in PLACEHOLDER_TOKENS:
        text = _token_pattern(token).sub("", text)
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + "…"
    return text or "the assigned task"


FILLER_TASK_WORDS = 8
"""Words of the task quoted in a filler section (keeps the paragraph under 20 words)."""


def _first_words(text: str, n: int) -> str:
    words = text.split()
    return " ".join(words[:n]) + ("…" if len(words) > n else "")


def _derived_value(field: str, task: str) -> str:
    return f"{_label(field)} for the task: {_task_excerpt(task)}"


def _token_pattern(token: str) -> re.Pattern[str]:
    escaped = re.escape(token)
    if token[:1].isalnum():
        escaped = rf"\b{escaped}"
    if token[-1:].isalnum():
        escaped = rf"{escaped}\b"
    return re.compile(escaped + r"[ \t]?", re.IGNORECASE)


def named_placeholders(defects: Sequence[Defect]) -> list[str]:
    """Placeholder tokens that Layer-0 defects name (in their description or location)."""
    names: list[str] = []
    for d in defects:
        if d.source != "l0" or d.severity == "info":
            continue
        where = f"{d.description} {d.location or ''}".casefold()
        for token in PLACEHOLDER_TOKENS:
            if token.casefold() in where and token not in names:
                names.append(token)
    return names


def _strip_tokens(value: Any, tokens: Sequence[str]) -> Any:
    if isinstance(value, str):
        for token in tokens:
            value = _token_pattern(token).sub("", value)
        return value
    if isinstance(value, dict):
        return {k: _strip_tokens(v, tokens) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip_tokens(v, tokens) for v in value]
    return value


def _coerce_confidence(value: Any) -> float:
    try:
        parsed = float(value)
    except (TypeError, ValueError):
        return REPAIRED_CONFIDENCE
    if math.isnan(parsed) or not 0.0 <= parsed <= 1.0:
        return REPAIRED_CONFIDENCE
    return max(parsed, REPAIRED_CONFIDENCE)


class HeuristicReviser:
    """Deterministic repair of heuristic (and L0 placeholder) defects — only those named.

    Dict outputs: adds a missing required field with a value derived from the task, sets a
    missing, non-numeric or low ``confidence``, removes the ``error`` field, fills empty strings.
    Text outputs: appends each missing required heading with a sentence derived from the task.
    Both: removes placeholder tokens that Layer-0 defects name. Usage is an estimate, calls 0.
    """

    name = "deterministic-heuristic"
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
        """Apply one fix per actionable defect this reviser understands."""
        actionable = envelope.actionable
        applied = 0
        new: str | dict[str, Any]
        if isinstance(output, dict):
            new, applied = self._revise_dict(submission, dict(output), actionable)
        else:
            new, applied = self._revise_text(submission, output, actionable)
        tokens = named_placeholders(actionable)
        if tokens:
            stripped = _strip_tokens(new, tokens)
            if stripped != new:
                applied += 1
                new = stripped
        return RevisionResult(
            output=new,
            usage=estimate_usage(text_of(output), text_of(new)),
            suggestions_applied=applied,
        )

    @staticmethod
    def _revise_dict(
        submission: Submission, out: dict[str, Any], defects: Sequence[Defect]
    ) -> tuple[dict[str, Any], int]:
        applied = 0
        for d in defects:
            if d.source != "heuristic" or d.location is None:
                continue
            field = d.location
            if field == "error":
                if field in out:
                    del out[field]
                    applied += 1
            elif field == "confidence":
                out[field] = _coerce_confidence(out.get(field))
                applied += 1
            elif (d.category == "missing_data" and out.get(field) is None) or (
                d.category == "incomplete" and _blank(out.get(field))
            ):
                out[field] = _derived_value(field, submission.task)
                applied += 1
        return out, applied

    @staticmethod
    def _revise_text(
        submission: Submission, text: str, defects: Sequence[Defect]
    ) -> tuple[str, int]:
        applied = 0
        latex = submission.claimed_format == "latex" or bool(_TEX_HEADING.search(text))
        present = headings(text)
        for d in defects:
            if d.source != "heuristic" or d.category != "missing_data" or d.location is None:
                continue
            field = d.location
            if normalize_title(field) in present:
                continue
            title = _label(field)
            # Under 20 words, so several filler sections never read as a text loop (L0
            # no_text_loop looks at paragraphs of 20+ words).
            sentence = f"This section covers the {field.replace('_', ' ')} for the task: "
            sentence += _first_words(_task_excerpt(submission.task), FILLER_TASK_WORDS)
            block = (
                f"\\section{{{title}}}\n{sentence}\n" if latex else f"## {title}\n\n{sentence}\n"
            )
            sep = "" if not text.strip() else ("\n" if text.endswith("\n") else "\n\n")
            text = (text + sep + block) if text.strip() else block
            present.add(normalize_title(field))
            applied += 1
        return text, applied
