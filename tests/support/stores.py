"""What the store contract tests share (tests/integration/test_store_protocols.py and
test_lease_liveness.py): a settable clock and the key prefix their Redis stores write under."""

from __future__ import annotations

PREFIX = "critique-test"
"""The key prefix of every Redis store the contract tests build."""


class FakeClock:
    """A settable clock in seconds, shared by a ledger and its test."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
