"""The store protocols every stage talks to (SPEC §4)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pipeline.models import Lesson, Pattern, ReusablePattern


def encode_event(event: Mapping[str, Any]) -> str:
    """A trace event as every trace sink stores it: compact JSON; NaN or a non-JSON value
    raises ValueError or TypeError (a stored event is a snapshot, never a live object)."""
    return json.dumps(dict(event), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


MAX_PATTERNS_PER_CRITIQUE = 20
"""SPEC §3: pattern memory records at most this many patterns per critique. Which ones is
decided by :func:`pipeline.pitfalls.patterns_from_envelope`; the stores keep the first this
many distinct patterns they are given (a guard for any other caller)."""


class PatternStore(Protocol):
    """Per-run failure patterns ("Known Pitfalls"), most frequent first."""

    def record(
        self,
        run_id: str,
        critique_key: str,
        iteration: int,
        patterns: Sequence[ReusablePattern],
    ) -> bool:
        """Count ``patterns`` once for ``critique_key``; a repeated key changes nothing. Only the
        first :data:`MAX_PATTERNS_PER_CRITIQUE` distinct patterns are recorded.

        Returns True when this call recorded them, False when the key was already recorded.
        """
        ...

    def top(self, run_id: str, limit: int = 10) -> list[Pattern]:
        """The run's patterns, most frequent first (ties: earliest first seen, then category)."""
        ...

    def lessons(self, limit: int = 50, min_runs: int = 2) -> list[Lesson]:
        """Patterns that occurred in at least ``min_runs`` runs, most runs first (all runs)."""
        ...


class BudgetLedger(Protocol):
    """The run-wide repair-budget semaphore: reserve → commit or refund, idempotent per lease.

    A lease id is unique per (task id, attempt); reserving, committing or refunding the same
    lease twice has the effect of doing it once. A reservation whose holder dies expires
    after ``ttl_s`` and its tokens come back; reserving that lease id again (the redelivered
    work) reserves afresh against the cap.
    """

    def reserve(self, run_id: str, lease_id: str, tokens: int, cap: int, ttl_s: float) -> bool:
        """Hold ``tokens`` against ``cap`` (spent + held + tokens ≤ cap), or refuse."""
        ...

    def commit(self, run_id: str, lease_id: str, actual_tokens: int) -> int:
        """Charge ``min(actual, reserved)`` and release the hold; returns the charge."""
        ...

    def refund(self, run_id: str, lease_id: str) -> None:
        """Release the lease's hold without charging anything."""
        ...

    def spent(self, run_id: str) -> int:
        """Tokens committed so far in the run."""
        ...


class TraceSink(Protocol):
    """The run's single trace channel: every stage and gate event, in order."""

    def emit(self, run_id: str, event: Mapping[str, Any]) -> None:
        """Append one JSON-safe event to the run's trace."""
        ...

    def read(self, run_id: str) -> list[dict[str, Any]]:
        """Every event of the run so far, oldest first."""
        ...


class BlobStore(Protocol):
    """Content-addressed bytes: large outputs and files travel as ``sha256:<hex>`` references."""

    def put(self, data: bytes) -> str:
        """Store ``data`` and return its reference (the same bytes always give the same one)."""
        ...

    def get(self, ref: str) -> bytes:
        """The bytes ``ref`` names; raises ``BlobMissingError`` (a KeyError) when absent."""
        ...
