"""What the LLM critic and the adjudicator must reply, and how their replies are parsed.

A reply is a bare JSON object or one inside a ```json fence, validated with pydantic
(:class:`CriticReply`, :class:`AdjudicatorReply`; the critic prompt's schema is derived from
:func:`critic_schema`). A score outside [0, 1] is unusable (:class:`EnvelopeParseError`, so the
caller re-asks: a 0-10 answer must not become 1.0); an unconfigured category becomes
``incomplete`` (the description says so); band and effort are recomputed.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline.critics.base import clamp_score
from pipeline.models import (
    CritiqueEnvelope,
    Defect,
    ReusablePattern,
    Severity,
)

FALLBACK_CATEGORY = "incomplete"

_SEVERITY_ALIASES: dict[str, str] = {
    "error": "critical",
    "high": "critical",
    "major": "critical",
    "blocker": "critical",
    "medium": "warning",
    "minor": "warning",
    "warn": "warning",
    "low": "info",
    "note": "info",
    "suggestion": "info",
}


class EnvelopeParseError(ValueError):
    """An LLM reply that cannot be used: not a JSON object, or not the asked-for shape."""


# --- what the LLM must return ---------------------------------------------------------------


class _Lenient(BaseModel):
    """LLM replies: extra keys are ignored (models add them), values are frozen once parsed."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class CriticDefect(_Lenient):
    """One defect as the critic reports it (the pipeline adds id and source)."""

    category: str = Field(description="one of the configured defect categories")
    severity: Severity
    location: str | None = Field(
        None, description="field, file:line or section id where the defect is; null if none"
    )
    description: str = ""

    @field_validator("severity", mode="before")
    @classmethod
    def _severity(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip().lower()
            return _SEVERITY_ALIASES.get(v, v)
        return v

    @field_validator("location", mode="before")
    @classmethod
    def _location(cls, v: Any) -> Any:
        if isinstance(v, int | float) and not isinstance(v, bool):
            return str(v)
        if isinstance(v, str) and not v.strip():
            return None
        return v


class CriticPattern(_Lenient):
    """A lesson for the rest of the run."""

    category: str
    description: str
    prevention_rule: str = Field(description="one imperative sentence a worker can follow")


class CriticReply(_Lenient):
    """The JSON object the critic must reply with; the prompt's schema is derived from it."""

    score: float = Field(allow_inf_nan=False, description="0.0 to 1.0")
    scores: dict[str, float] = Field(
        default_factory=dict, description="optional dimension scores, 0 to 10"
    )
    defects: list[CriticDefect] = Field(default_factory=list)
    prescriptions: list[str] = Field(
        default_factory=list, description="one concrete repair instruction per defect to fix"
    )
    reusable_patterns: list[CriticPattern] = Field(default_factory=list)
    summary: str = ""

    @field_validator("score", mode="before")
    @classmethod
    def _not_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("score must be a number, not a boolean")
        return v


class Ruling(_Lenient):
    """The adjudicator's verdict on one defect."""

    id: str
    verdict: Literal["uphold", "reject"]
    reason: str = ""

    @field_validator("verdict", mode="before")
    @classmethod
    def _verdict(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip().lower()
            return {"upheld": "uphold", "rejected": "reject"}.get(v, v)
        return v


class AdjudicatorReply(_Lenient):
    """The JSON object the adjudicator must reply with."""

    rulings: list[Ruling]


def critic_schema(categories: Sequence[str]) -> dict[str, Any]:
    """JSON schema of :class:`CriticReply`, with ``category`` restricted to ``categories``."""
    schema: dict[str, Any] = json.loads(_critic_reply_schema())  # a copy of the one built once
    for name in ("CriticDefect", "CriticPattern"):
        schema["$defs"][name]["properties"]["category"]["enum"] = list(categories)
    return schema


@functools.cache
def _critic_reply_schema() -> str:
    """``CriticReply.model_json_schema()`` as JSON (pydantic takes milliseconds per build)."""
    return json.dumps(CriticReply.model_json_schema())


# --- parsing --------------------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*(?:(?:json|JSON)[ \t]*)?\r?\n(.*?)```", re.DOTALL)
_WHOLE_FENCE = re.compile(r"\s*```[\w+.-]*[ \t]*\r?\n(.*?)\r?\n?```\s*", re.DOTALL)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def json_object(text: str) -> dict[str, Any]:
    """The JSON object in an LLM reply: the bare reply, or the first ```json fenced block."""
    body = text.strip()
    if not body:
        raise EnvelopeParseError("the reply is empty")
    fenced = _FENCE.search(body)
    candidates = [fenced.group(1)] if fenced and body.startswith("```") else [body]
    if fenced and not body.startswith("```"):
        candidates.append(fenced.group(1))
    problem = ""
    for candidate in candidates:
        try:
            value = _loads(candidate)
        except ValueError as exc:
            problem = f"the reply is not valid JSON ({exc})"
            continue
        if isinstance(value, dict):
            return value
        problem = f"the reply is JSON but a {type(value).__name__}, not an object"
    raise EnvelopeParseError(problem)


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    return f"{loc}: {first['msg']}"


def _normalize_category(category: str) -> str:
    return re.sub(r"[\s\-]+", "_", category.strip().lower())


def _category(raw: str, categories: Sequence[str]) -> tuple[str, bool]:
    """(configured category, True when ``raw`` was not configured and got the fallback)."""
    norm = _normalize_category(raw)
    if norm in categories:
        return norm, False
    if FALLBACK_CATEGORY in categories or not categories:
        return FALLBACK_CATEGORY, True
    return categories[0], True


def parse_envelope(
    text: str, *, worker_id: str, model: str, categories: Sequence[str]
) -> CritiqueEnvelope:
    """Turn the critic's reply into an envelope, or raise :class:`EnvelopeParseError`.

    A score outside [0, 1] raises (it is re-asked, never clamped); dimension scores are clamped
    to [0, 10]; every defect's source is ``llm``; an unconfigured category becomes
    ``incomplete`` (said in the description); duplicate defects (same id) are kept once;
    band and effort (actionable defects) are recomputed.
    """
    data = json_object(text)
    try:
        reply = CriticReply.model_validate(data)
    except ValidationError as exc:
        raise EnvelopeParseError(
            f"the JSON does not match the schema: {_first_error(exc)}"
        ) from None
    defects: dict[str, Defect] = {}
    for d in reply.defects:
        category, unknown = _category(d.category, categories)
        description = " ".join(d.description.split()) or "(no description given)"
        if unknown:
            description += f" [category {d.category!r} is not configured; reported as {category!r}]"
        defect = Defect(
            category=category,
            severity=d.severity,
            location=d.location,
            description=description,
            source="llm",
        )
        defects.setdefault(defect.id, defect)
    patterns = tuple(
        dict.fromkeys(
            ReusablePattern(
                category=_category(p.category, categories)[0],
                description=p.description,
                prevention_rule=p.prevention_rule,
            )
            for p in reply.reusable_patterns
        )
    )
    if not 0.0 <= reply.score <= 1.0:
        # Not clamped: a 7 on a 0-10 scale clamped to 1.0 would accept a mediocre output.
        raise EnvelopeParseError(
            f"score {reply.score:g} is outside 0.0-1.0 (scores are fractions, not 0-10 marks)"
        )
    score = clamp_score(reply.score)
    summary = reply.summary.strip()
    kept = tuple(defects.values())
    return CritiqueEnvelope(
        worker_id=worker_id,
        score=score,
        scores={k: min(10.0, max(0.0, v)) for k, v in reply.scores.items()},
        defects=kept,
        prescriptions=tuple(p.strip() for p in reply.prescriptions if p.strip()),
        reusable_patterns=patterns,
        summary=summary,
        critic=f"llm:{model}",
    )


def parse_rulings(text: str) -> dict[str, Ruling]:
    """The adjudicator's rulings by defect id, or raise :class:`EnvelopeParseError`."""
    data = json_object(text)
    try:
        reply = AdjudicatorReply.model_validate(data)
    except ValidationError as exc:
        raise EnvelopeParseError(
            f"the JSON does not match the schema: {_first_error(exc)}"
        ) from None
    return {r.id: r for r in reply.rulings}


def unfence(reply: str, previous: str) -> str:
    """A text reply wrapped whole in one code fence is unwrapped (unless the output was too)."""
    m = _WHOLE_FENCE.fullmatch(reply)
    if m and not previous.lstrip().startswith("```"):
        return m.group(1)
    return reply
