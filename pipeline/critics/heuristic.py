"""The heuristic critic and its deterministic reviser.

The heuristic answers when no LLM is available (or the LLM failed) and builds the token-free
envelope when Layer-0 fails. Penalty table, starting from 1.0 and clamped to [0, 1]:

JSON-object outputs (a worker's result dict):
    missing ``confidence`` (absent or null)          −0.3 critical  missing_data
    ``confidence`` not a number (e.g. the string "0.9", a bool) −0.2 warning wrong_format
    ``confidence`` < 0.3                             −0.2 warning   incomplete
    ``error`` present (not null, not blank)          −0.4 critical  incomplete
    each missing required field (absent, null, or a blank string) −0.2 critical missing_data
    each other empty-string field (blank)            −0.1 warning   incomplete

Blank means a reader sees nothing: empty, whitespace, or only invisible characters (zero-width,
the braille blank, Hangul fillers, bidi controls, escape sequences;
:func:`pipeline.text.textnorm.looks_blank`), so ``"\\u200b"`` is as empty as ``""``.

A non-numeric confidence is a format problem, not a missing value: the worker did report one.
``confidence`` is never double-counted as a required field, and a blank ``error`` string counts
as an empty field rather than a reported error.

Text outputs: empty (blank) −0.4 critical ``incomplete``; each required field is read
as a required heading (a Markdown ``#`` heading or a LaTeX ``\\section``-family title matching the
field case-insensitively, underscores read as spaces); absent −0.2 critical ``missing_data``.

Names in findings: a field or section name appears in a defect's location and description
only as :func:`pipeline.security.pattern_text.name_token` gives it (a plain name of at most 40
characters as written, anything else a stand-in such as ``field#3f2a0c1d``), and a rule names
only a plain name (any other gets the generic rule of its kind, so twenty odd keys are one
pattern, not twenty). An output key therefore never carries its text into pattern memory,
lessons or a repair prompt; an ``error`` field's text is not quoted either. Only a prescription
may name a required field as the manager wrote it.

The reviser (:class:`HeuristicReviser`) invents nothing: of these defects it fixes
only a numeric-string ``confidence`` ("0.8" → 0.8) and, in text outputs, the Layer-0 defects
:mod:`pipeline.critics.edits` can fix exactly; every other defect it returns as unfixable.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from pipeline.critics.base import Refusal, RevisionResult, clamp_score
from pipeline.critics.edits import numeric_confidence, revise_text
from pipeline.models import (
    CritiqueEnvelope,
    Defect,
    RepairAttempt,
    ReusablePattern,
    Submission,
)
from pipeline.security.pattern_text import name_token
from pipeline.text.textnorm import looks_blank

MISSING_CONFIDENCE = 0.3
NON_NUMERIC_CONFIDENCE = 0.2
LOW_CONFIDENCE = 0.2
LOW_CONFIDENCE_BELOW = 0.3
ERROR_PRESENT = 0.4
MISSING_FIELD = 0.2
EMPTY_FIELD = 0.1
EMPTY_TEXT = 0.4
MISSING_HEADING = 0.2

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
    """A string a reader sees nothing in: empty, whitespace, or only invisible characters
    (U+200B, the braille blank, Hangul fillers, bidi controls, …: :func:`looks_blank`)."""
    return isinstance(value, str) and looks_blank(value)


def _required_findings(output: dict[str, Any], required: Sequence[str]) -> list[_Finding]:
    """A missing-field finding per required field that is absent, null or blank."""
    found: list[_Finding] = []
    for field in dict.fromkeys(required):
        if field == "confidence":
            continue  # covered by the confidence rules, never counted twice
        value = output.get(field)
        if value is None or _blank(value):
            # A required field nobody can see (an empty string, or only invisible
            # characters) gives the reader nothing: it is missing, not merely empty.
            name = name_token(field)
            found.append(
                _finding(
                    MISSING_FIELD,
                    "missing_data",
                    "critical",
                    name,
                    f"required field '{name}' is {'missing' if value is None else 'empty'}",
                    # The manager named the field: its prescription may say it as given.
                    f"Add the '{field}' field with content that answers the task.",
                    f"Always include the '{name}' field in your output"
                    if name == field
                    else "Always include every required field in your output",
                )
            )
    return found


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
        # The error's text is the worker's: it stays in the output, never in a finding.
        found.append(
            _finding(
                ERROR_PRESENT,
                "incomplete",
                "critical",
                "error",
                f"the output reports an error in its 'error' field ({len(str(error))} characters)",
                "Resolve the reported error and remove the 'error' field.",
                "Resolve errors before returning; never return a result with an 'error' field",
            )
        )
    found += _required_findings(output, required)
    counted = set(required) - {"confidence"}  # a blank required field is already missing
    for field, value in output.items():
        if field != "confidence" and field not in counted and _blank(value):
            # The key is the worker's text: only its token (a plain name, or a stand-in such
            # as field#3f2a0c1d) goes into the finding, so it never leaves the output.
            name = name_token(field)
            which = (
                f"the '{name}' field"
                if name == field
                else f"the empty-string field whose key is not a plain name ({name})"
            )
            found.append(
                _finding(
                    EMPTY_FIELD,
                    "incomplete",
                    "warning",
                    name,
                    f"field '{name}' is an empty string",
                    f"Fill {which} with real content, or remove it if it does not apply.",
                    f"Never leave the '{name}' field as an empty string"
                    if name == field
                    else "Never leave a field as an empty string",
                )
            )
    return found


def _text_findings(output: str, required: Sequence[str]) -> list[_Finding]:
    found: list[_Finding] = []
    if looks_blank(output):
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
            name = name_token(field, "section")
            found.append(
                _finding(
                    MISSING_HEADING,
                    "missing_data",
                    "critical",
                    name,
                    f"required section '{name}' is missing (no heading with that title)",
                    # The manager named the section: its prescription may say it as given.
                    f"Add a section headed '{_label(field)}' with the content it calls for.",
                    f"Always include a '{_label(name)}' section heading in your output"
                    if name == field
                    else "Always include every required section heading in your output",
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
            summary=(
                f"heuristic: {len(defects)} defect(s), {critical} critical; score {score:.2f}"
            ),
            critic="heuristic",
        )


MISSING_FIELD_REASON = "filling it would invent content only the worker (or a model) has"
MISSING_CONFIDENCE_REASON = "a confidence cannot be derived without a model; any number is a guess"
LOW_CONFIDENCE_REASON = "raising it would claim a certainty the worker did not report"
NOT_A_NUMBER_REASON = "it is not a plain number from 0 to 1; making it one would be a guess"
ERROR_REASON = "the worker reported an error; deleting the field would hide it"
EMPTY_FIELD_REASON = "filling it would invent content; a model or the worker must write it"
EMPTY_OUTPUT_REASON = "the output is empty; writing it needs a model"
MISSING_SECTION_REASON = "writing the section would invent content; a model must write it"
IN_JSON_VALUE_REASON = "it is inside a JSON value; the deterministic reviser does not edit values"
OTHER_SOURCE_REASON = (
    "the deterministic reviser fixes only Layer-0 and heuristic defects it can vouch for"
)


def _dict_fix(out: dict[str, Any], d: Defect) -> str | Refusal:
    """Fix one heuristic defect of a JSON result in ``out`` (what was done), or refuse it."""
    if d.location == "confidence":
        if d.category != "wrong_format":
            reason = (
                MISSING_CONFIDENCE_REASON if d.category == "missing_data" else LOW_CONFIDENCE_REASON
            )
            return Refusal(defect=d, reason=reason)
        number = numeric_confidence(out.get("confidence"))
        if number is None:
            return Refusal(defect=d, reason=NOT_A_NUMBER_REASON)
        out["confidence"] = number
        return "wrote the text confidence as a number"
    if d.location == "error":
        return Refusal(defect=d, reason=ERROR_REASON)
    if d.category == "missing_data":
        return Refusal(defect=d, reason=MISSING_FIELD_REASON)
    return Refusal(defect=d, reason=EMPTY_FIELD_REASON)


def _text_refusal(d: Defect) -> Refusal:
    reason = MISSING_SECTION_REASON if d.category == "missing_data" else EMPTY_OUTPUT_REASON
    return Refusal(defect=d, reason=reason)


def _note(fixed: Sequence[str], refused: Sequence[Refusal]) -> str | None:
    parts = []
    if fixed:
        counts = {what: fixed.count(what) for what in dict.fromkeys(fixed)}
        parts.append(
            "fixed: " + "; ".join(f"{w} (×{n})" if n > 1 else w for w, n in counts.items())
        )
    if refused:
        parts.append(f"{len(refused)} defect(s) left for a model (fixing them would invent)")
    return "; ".join(parts) or None


class HeuristicReviser:
    """The token-free reviser: makes only the edits it can vouch for.

    It deletes a verbatim repeated paragraph, drops a line holding nothing but a placeholder,
    suffixes a duplicate heading, removes what keeps exact JSON from parsing, and writes a
    numeric-string ``confidence`` as the number (:mod:`pipeline.critics.edits`). It never fills
    a missing field or section, never deletes an ``error`` field, never touches text around a
    placeholder: every such defect is returned in ``unfixable`` with the reason, and the loop
    ends ``escalated`` / ``needs_model`` when nothing fixable is left. Token-free: its usage
    is 0 (the text it handled is not usage).
    """

    name = "deterministic-heuristic"
    token_free = True  # no model call: a repair by it reserves no repair budget
    reads_pitfalls = False  # deterministic: the Known Pitfalls text would be ignored

    def plan(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
    ) -> RevisionResult:
        """The revision :meth:`revise` makes, with every defect it leaves alone and why."""
        fixed: list[tuple[Defect, str]] = []
        refused: list[Refusal] = []
        new: str | dict[str, Any]
        if isinstance(output, dict):
            out = dict(output)
            for d in envelope.actionable:
                if d.source == "heuristic":
                    got = _dict_fix(out, d)
                    if isinstance(got, Refusal):
                        refused.append(got)
                    else:
                        fixed.append((d, got))
                elif d.source == "l0":
                    refused.append(Refusal(defect=d, reason=IN_JSON_VALUE_REASON))
                else:
                    refused.append(Refusal(defect=d, reason=OTHER_SOURCE_REASON))
            new = out
        else:
            l0 = [d for d in envelope.actionable if d.source == "l0"]
            outcome = revise_text(output, submission.claimed_format, l0)
            fixed += outcome.fixed
            for d in envelope.actionable:
                if d.source == "heuristic":
                    refused.append(_text_refusal(d))
                elif d.source != "l0":
                    refused.append(Refusal(defect=d, reason=OTHER_SOURCE_REASON))
            refused += outcome.refused
            new = outcome.text
        order = {d.id: i for i, d in enumerate(envelope.actionable)}
        refused.sort(key=lambda r: order.get(r.defect.id, len(order)))
        return RevisionResult(
            output=new,
            suggestions_applied=len(fixed),
            note=_note([what for _d, what in fixed], refused),
            unfixable=tuple(refused),
        )

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str = "",
        attempts: Sequence[RepairAttempt] = (),
    ) -> RevisionResult:
        """Apply the honest fixes of :meth:`plan` (deterministic: the same answer every time)."""
        return self.plan(submission, output, envelope)
