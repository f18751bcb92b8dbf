"""The data model: frozen, JSON-safe pydantic v2 values.

Every value that crosses the broker is one of these models dumped with ``model_dump(mode="json")``.
Field names follow the AWP seed where it names them. ``SCHEMA_VERSION`` is stamped on the
top-level documents (``Submission``, ``CritiqueResult``) so readers can refuse what they
do not understand.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    computed_field,
    field_validator,
    model_validator,
)

SCHEMA_VERSION = 1
MAX_ITERATION = 1_000_000
"""Highest iteration a submission may name: iterations end up in hash fields, reports and
archives, and an unbounded integer from the broker (``10**300``) broke ``critique report``."""

Severity = Literal["critical", "warning", "info"]
DefectSource = Literal["l0", "heuristic", "llm", "rubric", "command"]
ClaimedFormat = Literal["json", "markdown", "latex", "text", "python"]
Status = Literal[
    "accepted",
    "accepted_with_warnings",
    "repaired",
    "escalated",
    "failed",
    "unchecked",
    "cancelled",
]
"""What a manager reads. ``unchecked``: critique was explicitly off, nothing was checked (no
score, never ``accepted``); ``cancelled``: ``critique cancel`` / ``client.cancel`` stopped the
pass before it finished (no verdict)."""
UNSCORED: frozenset[str] = frozenset({"unchecked", "cancelled"})
"""Statuses that carry no score: nothing (or not everything) was checked."""
StopReason = Literal[
    "accepted",
    "disabled",
    "cancelled",
    "target",
    "plateau",
    "budget",
    "attempts_exhausted",
    "no_improvement",
    "repair_fixpoint_detected",
    "repair_budget_exhausted",
    "escalate_band",
    "needs_model",
    "worker_repair",
]
"""Why a pass stopped. ``worker_repair`` (status ``escalated``): a repair is due and the
configuration says the worker repairs (``repairer: worker``): the manager re-runs its worker and
submits the new output with ``repair_of`` (:attr:`CritiqueResult.repair_request`)."""
Verdict = Literal[
    "continue",
    "target",
    "plateau",
    "budget",
    "accepted",
    "fixpoint",
    "no_improvement",
    "escalated",
]
Band = Literal["accept", "accept_with_warnings", "repair", "escalate"]
Effort = Literal["trivial", "moderate", "major"]
GateVerdict = Literal["pass", "reject", "bypass", "skip"]

DEFAULT_DEFECT_CATEGORIES: tuple[str, ...] = (
    "missing_data",
    "wrong_format",
    "incomplete",
    "hallucinated",
    "stale",
    "policy_violation",
)

# Identifiers end up in Redis keys and in artifact paths: keep them boring. Always matched with
# fullmatch: ``$`` would also match before a trailing newline ("r\n").
_IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x1f\x7f]")
_BLOB_REF = re.compile(r"sha256:[0-9a-f]{64}")  # pipeline.store.blobs' reference form
MAX_OUTPUT_DEPTH = 100
"""Deepest nesting (objects and arrays) a JSON output may have: every stage message must
serialise it and parse it back (pydantic stops at 200 levels, ``json`` at about 1000)."""


def check_identifier(value: str, what: str) -> str:
    """Return ``value`` if it is a safe identifier (letters, digits, ``._-``, ≤128), else raise."""
    if not _IDENT.fullmatch(value) or ".." in value:
        raise ValueError(
            f"{what} {value!r} is not a valid identifier: use 1-128 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    return value


def check_text(value: str, what: str) -> str:
    """Return ``value`` unless it holds a lone surrogate (``"\\ud800"``), which no UTF-8 text,
    Redis key or JSON message can carry; the error names ``what`` and the offset."""
    if not value.isascii():
        m = _SURROGATE.search(value)
        if m is not None:
            raise ValueError(
                f"{what} holds a lone surrogate {m.group()!r} at offset {m.start()}: not valid "
                "Unicode text (decode the worker's bytes with errors='replace' before submitting)"
            )
    return value


_JsonPath = tuple[Any, Any] | None
"""Where a node sits in a JSON value: ``(key, parent path)``, spelled out only for an error."""


def check_json_value(value: Any, what: str) -> None:
    """Refuse a JSON value that cannot cross the broker: a lone surrogate in any key or
    string, a value JSON has no form for (bytes, a set, NaN), or nesting deeper than
    :data:`MAX_OUTPUT_DEPTH`. Iterative, so a hostile depth cannot exhaust the stack; the
    error names where (``output.a[3].b``)."""

    def where(path: _JsonPath) -> str:
        parts: list[str] = []
        while path is not None:
            key, path = path
            parts.append(f"[{key}]" if isinstance(key, int) else f".{str(key)[:40]}")
        spelled = what + "".join(reversed(parts))
        return spelled if len(spelled) <= 200 else spelled[:199] + "…"

    def bad(text: Any) -> bool:
        return isinstance(text, str) and not text.isascii() and bool(_SURROGATE.search(text))

    if bad(value):
        check_text(value, what)
    # Only containers go on the stack; strings are checked where they sit (fast path: ASCII).
    stack: list[tuple[Any, int, _JsonPath]] = [(value, 0, None)]
    while stack:
        node, depth, path = stack.pop()
        if not isinstance(node, dict | list | tuple):
            continue
        if depth >= MAX_OUTPUT_DEPTH:
            raise ValueError(
                f"{what} nests more than {MAX_OUTPUT_DEPTH} levels deep (at "
                f"{where(path)}); flatten it or send it as a file"
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(k, str) and bad(k):
                check_text(k, f"a key in {where(path)}")
            if bad(v):
                check_text(v, where((k, path)))
            elif isinstance(v, dict | list | tuple):
                stack.append((v, depth + 1, (k, path)))
            elif isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{where((k, path))} is {v}: JSON has no such number")
            elif v is not None and not isinstance(v, str | int | float):
                raise ValueError(
                    f"{where((k, path))} is a {type(v).__name__}: only JSON values "
                    "(objects, arrays, strings, numbers, booleans, null) may be sent"
                )


class Frozen(BaseModel):
    """Base for every value: immutable, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Usage(Frozen):
    """Token usage and cost of one or more LLM calls."""

    tokens_in: int = Field(0, ge=0)
    tokens_out: int = Field(0, ge=0)
    cost: float = Field(0.0, ge=0.0)
    calls: int = Field(0, ge=0)

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            tokens_in=self.tokens_in + other.tokens_in,
            tokens_out=self.tokens_out + other.tokens_out,
            cost=self.cost + other.cost,
            calls=self.calls + other.calls,
        )


class FileRef(Frozen):
    """A file the worker produced: relative ``path`` inside its workspace, size, sha256.

    The content travels inline (``content``, text) when small, or by reference (``blob``,
    a content-addressed store key) when large. Both may be absent when only the metadata
    matters (e.g. a binary deliverable checked by size).
    """

    path: str
    size: int = Field(ge=0, strict=True)
    sha256: str = ""
    content: str | None = None
    blob: str | None = None

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        if not v or v.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", v):
            raise ValueError(f"file path {v!r} must be relative to the workspace")
        parts = re.split(r"[\\/]", v)
        if ".." in parts:
            raise ValueError(f"file path {v!r} must not contain '..'")
        if _CONTROL.search(v):
            raise ValueError(f"file path {v!r} must not contain control characters")
        return check_text(v, "file path")

    @field_validator("content")
    @classmethod
    def _content_text(cls, v: str | None) -> str | None:
        return v if v is None else check_text(v, "file content")

    @field_validator("blob")
    @classmethod
    def _blob_ref(cls, v: str | None) -> str | None:
        if v is not None and not _BLOB_REF.fullmatch(v):
            raise ValueError(
                f"blob reference {v[:80]!r} is not 'sha256:' followed by 64 lower-case hex digits"
            )
        return v


class Submission(Frozen):
    """One worker output to critique."""

    schema_version: int = Field(SCHEMA_VERSION, strict=True)
    run_id: str
    iteration: int = Field(1, ge=1, le=MAX_ITERATION, strict=True)
    """Strict: JSON ``true`` (or ``1.0``, ``"1"``) is not the integer 1."""
    worker_id: str
    subtask_signature: str = ""
    task: str = Field(description="the original instructions the worker got")
    output: str | dict[str, Any]
    claimed_format: ClaimedFormat | None = None
    files: tuple[FileRef, ...] = ()
    required_fields: tuple[str, ...] = ()
    model: str | None = None
    deliverable_expected: bool | None = None
    repair_of: str | None = None
    """The pass whose ``worker_repair`` verdict this output answers (its worker re-run with the
    defects): the service re-critiques it as that pass's next repair attempt (keep-best,
    fixpoint, attempt cap and the run's repair budget carry on). None: a fresh output."""
    repair_tokens: int = Field(0, ge=0, le=10**9, strict=True)
    """With ``repair_of``: the tokens the worker's re-run spent as its provider reported them,
    charged to the run's repair budget with the re-critique's (0: not reported)."""

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str) -> str:
        return check_identifier(v, "run_id")

    @field_validator("worker_id")
    @classmethod
    def _worker_id(cls, v: str) -> str:
        return check_identifier(v, "worker_id")

    @field_validator("repair_of")
    @classmethod
    def _repair_of(cls, v: str | None) -> str | None:
        return v if v is None else check_identifier(v, "repair_of")

    @field_validator("task", "subtask_signature", "model")
    @classmethod
    def _text(cls, v: str | None, info: ValidationInfo) -> str | None:
        return v if v is None else check_text(v, str(info.field_name))

    @field_validator("required_fields")
    @classmethod
    def _fields_text(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            check_text(name, "a required field")
        return v

    @field_validator("output")
    @classmethod
    def _output_json_safe(cls, v: str | dict[str, Any]) -> str | dict[str, Any]:
        check_json_value(v, "output")
        return v

    @model_validator(mode="after")
    def _unique_files(self) -> Submission:
        seen: set[str] = set()
        for f in self.files:
            if f.path in seen:
                raise ValueError(f"file {f.path!r} is listed twice")
            seen.add(f.path)
        return self


@dataclass(frozen=True, slots=True)
class PassRef:
    """One submission pass's identity: its run, iteration, worker and pass id.

    Its two string forms are the run's hash fields: :attr:`field` (``"<iteration>:<worker_id>"``,
    the submission's field in ``submitted``, ``passes`` and ``results``) and :attr:`member`
    (``"<iteration>:<worker_id>:<pass_id>"``, the pass's field in ``results:pass``,
    ``messages``, ``failures``, ``pending``…); :meth:`parse` is the one way back. A worker id is
    an identifier (:func:`~pipeline.models.check_identifier`: no ``:``) and a pass id is hex
    (``workers.runtime.new_pass_id``), so a member splits back into the same parts; a ref whose
    parts do hold a ``:`` (a forged message's pass id) makes a member :meth:`parse` refuses,
    never one it reads as another pass."""

    run_id: str
    iteration: int
    worker_id: str
    pass_id: str

    @classmethod
    def of(cls, sub: Submission, pass_id: str) -> PassRef:
        """The ref of pass ``pass_id`` of submission ``sub``."""
        return cls(sub.run_id, sub.iteration, sub.worker_id, pass_id)

    @staticmethod
    def field_of(iteration: int, worker_id: str) -> str:
        """A submission's hash field ``"<iteration>:<worker_id>"`` (the one place it is written)."""
        return f"{iteration}:{worker_id}"

    @staticmethod
    def member_of(field: str, pass_id: str) -> str:
        """The member of pass ``pass_id`` of the submission whose field is ``field`` (the one
        place ``"<iteration>:<worker_id>:<pass_id>"`` is written)."""
        return f"{field}:{pass_id}"

    @property
    def field(self) -> str:
        """This pass's submission field, ``"<iteration>:<worker_id>"``."""
        return PassRef.field_of(self.iteration, self.worker_id)

    @property
    def member(self) -> str:
        """This pass's field, ``"<iteration>:<worker_id>:<pass_id>"``."""
        return PassRef.member_of(self.field, self.pass_id)

    @classmethod
    def parse(cls, run_id: str, member: str) -> PassRef | None:
        """The ref of a pass ``member`` of run ``run_id``; None when malformed (not three parts,
        or an iteration that is not ASCII digits)."""
        parts = member.split(":")
        if len(parts) != 3 or not (parts[0].isascii() and parts[0].isdigit()):
            return None
        return cls(run_id, int(parts[0]), parts[1], parts[2])


def defect_id(category: str, location: str | None, description: str) -> str:
    """Stable id within a critique: category + location + short hash of the description."""
    digest = hashlib.sha1(description.encode("utf-8")).hexdigest()[:8]
    return f"{category}:{location or '-'}:{digest}"


class Defect(Frozen):
    """One thing wrong with an output."""

    id: str = ""
    category: str
    severity: Severity
    location: str | None = None
    description: str
    source: DefectSource
    false_positive: bool = False
    """Set by grounding when the critic claimed something the filesystem contradicts."""
    check: str | None = None
    """The Layer-0 check that reported it (``no_placeholder``, …): set exactly when ``source``
    is ``l0`` by :meth:`pipeline.contract.models.ContractFailure.to_defect`; None otherwise and
    in payloads written before the field existed."""
    folded: int | None = Field(None, ge=2)
    """Set on a summary defect ("… and N more …", :func:`pipeline.critics.base.bound_envelope`):
    how many defects of its category and severity it stands for, not listed one by one. None
    on every defect listed as itself."""

    @model_validator(mode="after")
    def _fill_id(self) -> Defect:
        if self.check is not None and self.source != "l0":
            raise ValueError(f"check {self.check!r} is set on a {self.source!r} defect (l0 only)")
        if not self.id:
            object.__setattr__(
                self, "id", defect_id(self.category, self.location, self.description)
            )
        return self


class ReusablePattern(Frozen):
    """A lesson a critique offers to the rest of the run."""

    category: str
    description: str
    prevention_rule: str


class Suggestion(Frozen):
    """A rubric critic's structured edit: which dimension it raises, where, and how."""

    dimension: str
    target_section: str | None = None
    edit: str


def band_for(score: float) -> Band:
    """Score band: ≥0.9 accept, ≥0.6 with warnings, ≥0.3 repair, else escalate."""
    if score >= 0.9:
        return "accept"
    if score >= 0.6:
        return "accept_with_warnings"
    if score >= 0.3:
        return "repair"
    return "escalate"


def effort_for(defect_count: int) -> Effort:
    """``trivial`` for ≤1 defect, ``moderate`` for ≤3, ``major`` otherwise."""
    if defect_count <= 1:
        return "trivial"
    if defect_count <= 3:
        return "moderate"
    return "major"


_DERIVED = frozenset({"band", "effort_estimate"})


class CritiqueEnvelope(Frozen):
    """What a critic says about one output.

    ``band`` and ``effort_estimate`` are derived, never stored: ``band_for(score)`` and
    ``effort_for`` over the actionable (critical and warning) defects. They are in every dump;
    a payload that carries them (every one written before they were derived) still validates,
    and they are recomputed from its score and defects.
    """

    worker_id: str
    score: float = Field(ge=0.0, le=1.0)
    scores: dict[str, float] = Field(default_factory=dict)
    defects: tuple[Defect, ...] = ()
    prescriptions: tuple[str, ...] = ()
    reusable_patterns: tuple[ReusablePattern, ...] = ()
    summary: str = ""
    usage: Usage = Field(default_factory=Usage)
    suggestions: tuple[Suggestion, ...] = ()
    critic: str = "heuristic"
    """Which critic produced this envelope (``heuristic``, ``rubric``, ``llm:<model>``, …)."""
    fallback_reason: str | None = None
    """Why a fallback critic answered instead of the configured one, if it did."""
    truncation: str | None = None
    """How the output was cut for the critic, if it was (e.g. ``head 6000 + tail 2000 chars``)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_derived(cls, data: Any) -> Any:
        if isinstance(data, dict) and not _DERIVED.isdisjoint(data):
            return {k: v for k, v in data.items() if k not in _DERIVED}
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def band(self) -> Band:
        """The score band: :func:`band_for` of ``score``."""
        return band_for(self.score)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def effort_estimate(self) -> Effort:
        """:func:`effort_for` of the actionable defect count (info defects, grounding's false
        positives among them, cost no repair effort)."""
        return effort_for(self.actionable_count)

    @property
    def defect_count(self) -> int:
        """How many defects the critic found: a summary defect counts as the ones it folds."""
        return sum(d.folded or 1 for d in self.defects)

    @property
    def actionable_count(self) -> int:
        """How many critical and warning defects the critic found, folded ones included."""
        return sum(d.folded or 1 for d in self.actionable)

    @property
    def critical(self) -> tuple[Defect, ...]:
        return tuple(d for d in self.defects if d.severity == "critical")

    @property
    def actionable(self) -> tuple[Defect, ...]:
        """Critical and warning defects: the ones a repair is asked to fix."""
        return tuple(d for d in self.defects if d.severity in ("critical", "warning"))


class RepairAttempt(Frozen):
    """Exactly the seed's repair artifact, plus ``stop_reason`` on the last attempt."""

    worker_id: str
    attempt: int = Field(ge=1)
    original_score: float
    repaired_score: float
    defects_fixed: int = Field(ge=0)
    defects_remaining: int = Field(ge=0)
    stop_reason: StopReason | None = None


class Pattern(Frozen):
    """A failure pattern accumulated across a run's workers."""

    category: str
    frequency: int = Field(ge=1)
    description: str
    prevention_rule: str
    first_seen_iteration: int = Field(ge=1)
    last_seen_iteration: int = Field(ge=1)


LessonScope = Literal["run", "fleet"]
"""Whose lessons a run sees (``CRITIQUE_LESSONS_SCOPE``): its own, or the fleet's shared ones."""


class Lesson(Frozen):
    """A failure pattern a run taught: the run's own (scope ``run``), or one that recurred
    across the fleet's runs (scope ``fleet``, kept without the run TTL). It names no run:
    other runs are only counted."""

    category: str
    runs: int = Field(ge=1)
    """How many runs taught it (1 for a run's own lesson)."""
    description: str
    prevention_rule: str
    scope: LessonScope = "fleet"
    this_run: bool = False
    """Whether the run the lessons were read for taught it too."""

    @model_validator(mode="before")
    @classmethod
    def _without_run_ids(cls, data: Any) -> Any:
        """An archive written before lessons were scoped holds ``first_run``/``last_run``
        (other runs' ids): read it, without them."""
        if isinstance(data, dict) and ("first_run" in data or "last_run" in data):
            return {k: v for k, v in data.items() if k not in ("first_run", "last_run")}
        return data


class GateEvent(Frozen):
    """One gate's decision, written to the run's trace stream."""

    gate: str
    verdict: GateVerdict
    reason: str
    iteration: int = Field(1, ge=1)
    worker_id: str | None = None
    l0_check: str | None = None
    l0_reason: str | None = None
    violating_path: str | None = None


class DefectRef(Frozen):
    """A defect as the per-round diff matches it: by (category, location) (docs/pipeline.md,
    'Defect diff per round')."""

    category: str
    location: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.category, self.location or "")


class RoundTrace(Frozen):
    """One round of the critique loop, as the trace and the result carry it."""

    round: int = Field(ge=0)
    score: float
    scores: dict[str, float] = Field(default_factory=dict)
    mean: float
    defects: int = Field(ge=0)
    suggestions_applied: int = Field(0, ge=0)
    verdict: Verdict
    fixed: tuple[DefectRef, ...] | None = None
    """From the second round on (else None), the defect diff against the previous round over
    the actionable (critical and warning) defects: gone since the previous round."""
    remaining: tuple[DefectRef, ...] | None = None
    """In the previous round and in this one."""
    new: tuple[DefectRef, ...] | None = None
    """Here now, not in the previous round, and never fixed before."""
    regressed: tuple[DefectRef, ...] | None = None
    """Here now, not in the previous round, but fixed in an earlier round (back again)."""


NEXT_STEP: dict[str, str] = {
    "needs_model": "send it back to its worker with these defects, or configure a model "
    "(CRITIQUE_MODEL, docs/llm.md) to write what is missing",
    "escalate_band": "re-dispatch the subtask: the output scores under 0.3, too far off to repair",
    "repair_fixpoint_detected": "repairs stopped changing it: send it back to its worker with "
    "these defects, or have a person finish it",
    "no_improvement": "repairs did not raise its score: send it back to its worker with these "
    "defects",
    "attempts_exhausted": "its repair attempts ran out: send it back to its worker with these "
    "defects, or raise max_repair_attempts",
    "plateau": "the rubric score stopped improving: send it back to its worker, or use it as it is",
    "budget": "the round cap (rubric.max_rounds) was reached: send it back to its worker",
    "repair_budget_exhausted": "the run's repair budget is spent: raise budget.total_tokens, or "
    "send it back to its worker with these defects",
    "worker_repair": "re-run its worker with these defects, then submit the new output with "
    "repair_of set to this pass (client.submit_repair): the service re-critiques it",
}
"""What the manager should do with an ``escalated`` or ``failed`` output, by stop reason."""

WHY_DEFECTS = 3
"""Deciding defects a one-line explanation names (the envelope lists every one)."""


UNCHECKED_LINE = (
    "critique is off (enabled: false): nothing was checked; do not treat this output as reviewed"
)
"""What an ``unchecked`` verdict says wherever it is printed."""


def score_text(original: float | None, best: float | None) -> str:
    """``0.42 → 0.91`` for scored verdicts; ``no score`` when either side is missing."""
    if original is None or best is None:
        return "no score"
    return f"{original:.2f} → {best:.2f}"


def defect_line(defect: Defect) -> str:
    """``missing_data at findings: required field 'findings' is missing``: one line."""
    where = f" at {defect.location}" if defect.location else ""
    return " ".join(f"{defect.category}{where}: {defect.description}".split())


class RepairRequest(Frozen):
    """A ``worker_repair`` verdict's request: re-run the worker, then submit its output with
    ``repair_of`` = :attr:`of_pass` (docs/client.md, "The worker repairs")."""

    of_pass: str
    """The pass to name in the repaired submission's ``repair_of``."""
    attempt: int = Field(ge=1)
    """The repair attempt the re-run is (1 for the first)."""
    reserved_tokens: int = Field(0, ge=0)
    """Tokens the run's repair budget holds for the re-run and its re-critique (0: no budget
    configured, or nothing is sized); held until the repaired output arrives, the request is
    released (client.release_repair), or the hold's TTL passes."""
    expires_s: float = Field(gt=0)
    """How long the service keeps the pass's state for the repaired output, from the verdict."""


class CritiqueResult(Frozen):
    """The per-output final answer. ``str(result)`` is one line saying what happened, and for
    an escalated or failed output why (its deciding defects) and what to do next."""

    schema_version: int = SCHEMA_VERSION
    run_id: str
    iteration: int = 1
    worker_id: str
    status: Status
    stop_reason: StopReason
    output: str | dict[str, Any]
    """The best output seen (keep-best: never a worse attempt)."""
    original_score: float | None
    best_score: float | None
    """None exactly when ``status`` is ``unchecked`` or ``cancelled`` (:data:`UNSCORED`): no
    score was given, so none is reported (never a made-up 1.00)."""
    envelope: CritiqueEnvelope
    """The envelope of the best output."""
    attempts: tuple[RepairAttempt, ...] = ()
    trace: tuple[RoundTrace, ...] = ()
    usage: Usage = Field(default_factory=Usage)
    repair_usage: Usage = Field(default_factory=Usage)
    """The repair-phase share of ``usage`` (repair calls and re-critiques)."""
    budget_charged: int = Field(0, ge=0)
    """Tokens this pass charged to the run's repair budget (what providers reported for its
    reserved repairs; token-free repairs reserve and charge nothing)."""
    pass_id: str = ""
    """The pass (one submit of this submission; docs/client.md, 'Passes') this result belongs to."""
    notes: tuple[str, ...] = ()
    """Things the user should know (e.g. no total budget configured; fallback critic used)."""
    repair_request: RepairRequest | None = None
    """Set exactly when ``stop_reason`` is ``worker_repair``: what the manager's re-run answers."""

    @property
    def checked(self) -> bool:
        """False for ``unchecked`` and ``cancelled``: no verdict, so no score and no defects."""
        return self.status not in UNSCORED

    def score_text(self) -> str:
        """``0.42 → 0.91``, or ``no score`` for an output nobody (fully) checked."""
        return score_text(self.original_score, self.best_score)

    @property
    def deciding_defects(self) -> tuple[Defect, ...]:
        """The defects that decided an escalated or failed verdict: the best output's actionable
        ones (critical first), grounding's false positives left out; () for other verdicts."""
        if self.status not in ("escalated", "failed"):
            return ()
        left = [d for d in self.envelope.actionable if not d.false_positive]
        return tuple(sorted(left, key=lambda d: d.severity != "critical"))

    @property
    def next_step(self) -> str | None:
        """What the manager should do next with an escalated or failed output, else None."""
        if self.status not in ("escalated", "failed"):
            return None
        return NEXT_STEP.get(self.stop_reason, "send it back to its worker with these defects")

    def why(self) -> tuple[str, ...]:
        """For an escalated or failed output, one line per deciding defect (at most
        :data:`WHY_DEFECTS`, then ``… and N more``) and ``next: …``; () otherwise."""
        step = self.next_step
        if step is None:
            return ()
        deciding = self.deciding_defects
        lines = [defect_line(d) for d in deciding[:WHY_DEFECTS]]
        if len(deciding) > WHY_DEFECTS:
            lines.append(f"… and {len(deciding) - WHY_DEFECTS} more in the envelope")
        if not deciding:
            lines.append(f"no actionable defect listed; score {self.score_text()}")
        return (*lines, f"next: {step}")

    def __str__(self) -> str:
        repairs = len(self.attempts)
        head = (
            f"{self.worker_id} {self.status} ({self.stop_reason}, {repairs} "
            f"repair{'s' if repairs != 1 else ''}) {self.score_text()}"
        )
        if self.status == "unchecked":
            return f"{head}: {UNCHECKED_LINE}"
        why = self.why()
        return f"{head}: {'; '.join(why)}" if why else head

    def trace_event(self, *, round: int, stage: str) -> dict[str, Any]:
        """The pass's ``result`` trace event: one shape whoever writes it (the in-process
        runner with stage ``result``, the distributed gate with stage ``gate``); ``pass_id``
        only when the pass has one."""
        event: dict[str, Any] = {
            "type": "result",
            "stage": stage,
            "worker_id": self.worker_id,
            "iteration": self.iteration,
            "round": round,
            "status": self.status,
            "stop_reason": self.stop_reason,
            "best_score": self.best_score,
            "original_score": self.original_score,
            "attempts": len(self.attempts),
            "tokens": self.usage.tokens,
            "repair_tokens": self.repair_usage.tokens,
            "budget_charged": self.budget_charged,
        }
        if self.pass_id:
            event["pass_id"] = self.pass_id
        return event


def cancelled_result(
    *,
    run_id: str,
    iteration: int,
    worker_id: str,
    pass_id: str,
    by: str,
    output: str | dict[str, Any] = "",
) -> CritiqueResult:
    """The result of a pass that ``critique cancel`` / ``client.cancel`` stopped: ``cancelled``,
    no score, no defects, the note naming who cancelled it. ``output`` is what the pass had
    (the submission's output when known; empty when the pass never started)."""
    return CritiqueResult(
        run_id=run_id,
        iteration=iteration,
        worker_id=worker_id,
        status="cancelled",
        stop_reason="cancelled",
        output=output,
        original_score=None,
        best_score=None,
        envelope=CritiqueEnvelope(
            worker_id=worker_id,
            score=0.0,
            summary=f"cancelled by {by}: the pass stopped before its verdict",
            critic="cancelled",
        ),
        pass_id=pass_id,
        notes=(f"cancelled by {by}: nothing after the cancel was checked or charged",),
    )
