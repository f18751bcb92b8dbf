"""Values of the Layer-0 contract: what a check reads, what it reports, what a run returns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Protocol, runtime_checkable

from pydantic import Field

from pipeline.models import ClaimedFormat, Defect, Frozen, GateEvent, Severity

L0Severity = Literal["error", "warning"]

DEFAULT_CATEGORY: dict[str, str] = {
    "no_placeholder": "incomplete",
    "no_text_loop": "policy_violation",
    "file_size_delta": "policy_violation",
    "no_duplicate_headings": "wrong_format",
    "balanced_delimiters": "wrong_format",
    "json_valid_if_claimed": "wrong_format",
}
"""Defect category per built-in check; extension checks default to ``policy_violation``."""


class ContractInput(Frozen):
    """One text to check: the output itself (``path`` None) or one of its files."""

    text: str
    path: str | None = None
    claimed_format: ClaimedFormat | None = None
    previous_size: int | None = Field(None, ge=0)
    """Size in bytes of the previous attempt's output, for ``file_size_delta``."""


class ContractFailure(Frozen):
    """One failed check: which, how bad, why, and where (character offset into the text)."""

    check: str
    severity: L0Severity
    reason: str
    path: str | None = None
    offset: int | None = None
    category: str | None = None
    """Defect category override (extension checks may set it); None = the check's default."""

    @property
    def location(self) -> str:
        """``path:offset`` (``output`` for the output itself), without the offset when unknown."""
        where = self.path or "output"
        return where if self.offset is None else f"{where}:{self.offset}"

    def to_defect(self) -> Defect:
        """The failure as a critique defect (source ``l0``; error → critical)."""
        category = self.category or DEFAULT_CATEGORY.get(self.check, "policy_violation")
        severity: Severity = "critical" if self.severity == "error" else "warning"
        return Defect(
            category=category,
            severity=severity,
            location=self.location,
            description=f"L0 {self.check}: {self.reason}",
            source="l0",
            check=self.check,
        )

    def to_gate_event(self, iteration: int, worker_id: str | None) -> GateEvent:
        """The failure as the L0 gate's rejection, for the run's trace stream.

        Meant for errors: warnings do not reject (the caller decides whether to log them).
        """
        return GateEvent(
            gate="l0",
            verdict="reject",
            reason=f"{self.check}: {self.reason}",
            iteration=iteration,
            worker_id=worker_id,
            l0_check=self.check,
            l0_reason=self.reason,
            violating_path=self.path,
        )


class ContractReport(Frozen):
    """Every failure of a contract run, and how long it took."""

    failures: tuple[ContractFailure, ...] = ()
    elapsed_ms: float = 0.0
    check_ms: dict[str, float] = Field(default_factory=dict)
    """Time per check (``scan`` is the shared single pass the built-in checks read)."""

    @property
    def ok(self) -> bool:
        """True when no failure is an error (warnings pass)."""
        return not any(f.severity == "error" for f in self.failures)

    @property
    def errors(self) -> tuple[ContractFailure, ...]:
        return tuple(f for f in self.failures if f.severity == "error")

    @property
    def warnings(self) -> tuple[ContractFailure, ...]:
        return tuple(f for f in self.failures if f.severity == "warning")

    def defects(self) -> list[Defect]:
        """All failures as defects, in report order."""
        return [f.to_defect() for f in self.failures]


@runtime_checkable
class OutputContractCheck(Protocol):
    """A Layer-0 check: a name, and a callable from one input to its failures."""

    name: str

    def __call__(self, doc: ContractInput) -> Iterable[ContractFailure]: ...
