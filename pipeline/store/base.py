"""The store protocols every stage talks to."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pipeline.models import Lesson, Pattern, ReusablePattern
from pipeline.store.leases import LeaseHolder


def encode_event(event: Mapping[str, Any]) -> str:
    """A trace event as every trace sink stores it: compact JSON; NaN or a non-JSON value
    raises ValueError or TypeError (a stored event is a snapshot, never a live object)."""
    return json.dumps(dict(event), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


MAX_PATTERNS_PER_CRITIQUE = 20
"""Pattern memory records at most this many patterns per critique. Which ones is
decided by :func:`pipeline.loop.pitfalls.patterns_from_envelope`; the stores keep the first this
many distinct patterns they are given (a guard for any other caller)."""
MAX_PATTERNS_PER_RUN = 1000
"""At most this many distinct patterns are kept per run. A new pattern arriving when the run is
full evicts the least-seen one (of those, the first recorded), so a flood of one-off patterns
cannot grow a run's memory or push out patterns that recur."""
MAX_LESSONS = 1000
"""At most this many fleet lessons are kept (``CRITIQUE_LESSONS_SCOPE=fleet``: shared by every
run). A new lesson arriving when full evicts the one seen in the fewest runs (of those, the first
learned)."""
MAX_LESSONS_PER_RUN = 50
"""At most this many of the fleet's lessons may be brought by one run (the run that taught a
pattern first): a run that floods distinct patterns fills its share, never the whole cap, so
it cannot push out what other runs taught. Its further patterns stay in its own memory."""


def run_lesson(pattern: Pattern) -> Lesson:
    """One of a run's own patterns as a run-scope lesson: taught by that one run."""
    return Lesson(
        category=pattern.category,
        runs=1,
        description=pattern.description,
        prevention_rule=pattern.prevention_rule,
        scope="run",
        this_run=True,
    )


class PatternStore(Protocol):
    """Per-run failure patterns ("Known Pitfalls"), most frequent first: what the stages record
    and read. The lessons drawn from them (run or fleet scope) are read by the runtime from
    :meth:`pipeline.store.redis.RedisPatternStore.lessons`, their one implementation."""

    def record(
        self,
        run_id: str,
        critique_key: str,
        iteration: int,
        patterns: Sequence[ReusablePattern],
        pass_key: str = "",
    ) -> bool:
        """Count ``patterns`` once for ``critique_key``; a repeated key changes nothing. Only the
        first :data:`MAX_PATTERNS_PER_CRITIQUE` distinct patterns are recorded.

        A pattern counts once per ``pass_key`` (a submission pass; "" = the critique key
        itself): a later critique of the same pass (its repair rounds) does not count a pattern
        that pass already counted, while a new pass (a resubmission) counts it again. A run
        keeps at most :data:`MAX_PATTERNS_PER_RUN` patterns. With fleet lessons
        (``CRITIQUE_LESSONS_SCOPE=fleet``, the Redis store), a pattern's first count in a run
        also counts one run for its fleet lesson (at most :data:`MAX_LESSONS` lessons, at most
        :data:`MAX_LESSONS_PER_RUN` of them brought by one run).

        Returns True when this call recorded them, False when the key was already recorded.
        """
        ...

    def top(self, run_id: str, limit: int = 10) -> list[Pattern]:
        """The run's ``limit`` most frequent patterns (ties: first recorded first); reads at
        most ``limit`` entries however many patterns tie."""
        ...


@dataclass(frozen=True)
class BudgetSnapshot:
    """A run's repair budget as one read saw it (for refusal messages and status)."""

    spent: int = 0
    """Tokens charged so far (what providers reported for committed repairs)."""
    held: int = 0
    """Tokens held by live (unsettled, unexpired) reservations."""
    holders: int = 0
    """How many live reservations hold them (repairs in flight)."""
    overrun: int = 0
    """Tokens charged beyond their reservations (a provider reported more than it was allowed);
    while it is above 0 the run's budget grants no new reservation."""
    queued: int = 0
    """Tokens asked by reservations that have waited longer than the one asking (they are
    served first): 0 in a plain snapshot."""
    waiters: int = 0
    """How many reservations ask for them."""


@dataclass(frozen=True)
class RepairUsage:
    """What a run's committed repair rounds really used, as their commits recorded it: the
    history a round is sized from when its full bound would pass the cap (docs/pipeline.md,
    "The repair budget"; :func:`pipeline.loop.repair.tight_output_tokens`). Each commit brings its
    round's figures once; the run keeps the largest of each."""

    rounds: int = 0
    """Committed rounds that brought figures (0: no history yet)."""
    growth: int = 0
    """The largest growth a model's repair showed, in thousandths: the repaired output's tokens
    (the larger of what the provider reported it wrote and the output's own estimate) per
    token of the output it repaired. 0: no model-written repair committed yet."""
    reply: int = 0
    """The longest re-critique reply (completion tokens, as the provider reported them); 0:
    none yet."""
    spent: int = 0
    """The run's spent tokens, read in the same step (:meth:`BudgetLedger.usage`); 0 in one
    round's figures (what :meth:`BudgetLedger.commit` is given)."""


WAITER_GRACE_S = 10.0
"""A waiting reservation keeps its place in the queue this long after its last ask; one that
stops asking (its task died, or gave up) then no longer holds back younger ones."""

Verdict = Literal["granted", "wait", "refused"]
"""A budget ask's answer: the tokens are held; only held (or queued) tokens block them, so ask
again; or refused for good (spent + asked passes the cap, the run overran, or the wait ran out)."""


@dataclass(frozen=True)
class BudgetAnswer:
    """What :meth:`BudgetLedger.ask` answered, with the budget as it saw it (the same atomic
    step, so a refusal's reason is never a later state)."""

    verdict: Verdict
    budget: BudgetSnapshot
    waited_s: float = 0.0
    """How long this lease has waited so far (since its first ask that had to wait)."""

    @property
    def granted(self) -> bool:
        """True when the tokens are held (or the lease was already live or committed)."""
        return self.verdict == "granted"


class BudgetLedger(Protocol):
    """The run-wide repair-budget semaphore: reserve → commit or refund, idempotent per lease.

    A lease id is unique per (submission pass, attempt). Lease states: *live* (reserved),
    *committed* (charged), *refunded* (released uncharged), and *waiting* (asked, holds
    nothing yet). Rules, the same for every implementation:

    - ``reserve`` of a new lease holds its tokens if spent + held + queued + tokens ≤ cap (no
      reservation waits: queued is 0) and no overrun was ever charged in the run; of a live
      lease, or a committed one, it answers True and holds nothing new (a re-run stage gets the
      same lease back, never a second one); of a refunded lease, or a live one whose ``ttl_s``
      passed (its holder died: the work was redelivered), it reserves afresh against the cap.
    - ``commit`` charges the real figure it is given, even above the reservation (the run's
      overrun grows by the excess, which closes the budget to new reservations): a provider's
      reported usage is never under-counted. A repeated commit charges nothing more and returns
      the first charge. An unknown lease charges nothing (0).
    - ``commit`` with a round's ``usage`` keeps the run's largest growth and re-critique reply
      (:class:`RepairUsage`), once per lease, with the charge; ``usage`` reads them back.
    - ``refund`` of a live lease releases its hold; of anything else it does nothing.
    - ``ask`` with a wait (the budget waits rather than refuses while tokens are only held): a
      reservation that fits ``cap − spent`` but not ``cap − spent − held − queued``
      answers ``wait`` until ``wait_s`` has passed since its first such answer (kept per lease,
      so the bound holds across re-asks from other processes); ``queued`` are the tokens of
      reservations that started waiting before it (first come, first served), each counted
      while it keeps asking (:data:`WAITER_GRACE_S`). It is ``refused`` when spent + its tokens
      pass the cap, when the run overran, or when it still does not fit once the wait ran out.
      A waiting lease holds nothing and cannot be committed (commit charges 0).
    - Holders (:mod:`pipeline.store.leases`; a Redis ledger made with a ``holder``, the
      distributed runtime's: the in-memory ledger records none): a lease granted
      is recorded as the asking holder's, and a live lease asked for again by another holder
      becomes that one's (the stage that spends under it holds it). A held lease stops holding
      at its TTL or, sooner, ``dead_s`` after its holder's last grant, hand-over or ``beat``,
      whichever comes first: a dead holder's tokens come back, for every reader at once, as an
      expired lease's do. ``beat`` (:meth:`pipeline.store.redis.RedisBudgetLedger.beat`)
      moves the deadline of a holder's own live leases on, and never revives one past it (its
      tokens may be another repair's by then); ``park`` makes a live lease no process's (only
      its TTL ends it). A ledger without a holder records none, and its leases end at their
      TTL only (``park`` then changes nothing: it answers whether the lease is live).
    """

    @property
    def holder(self) -> LeaseHolder | None:
        """Who holds the leases this ledger grants (None: no one; only TTLs end them)."""
        ...

    def ask(
        self, run_id: str, lease_id: str, tokens: int, cap: int, ttl_s: float, wait_s: float = 0.0
    ) -> BudgetAnswer:
        """Hold ``tokens`` against ``cap`` (spent + held + queued + tokens ≤ cap), say ``wait``
        (within ``wait_s`` of the lease's first wait, when spent + tokens ≤ cap), or refuse."""
        ...

    def reserve(self, run_id: str, lease_id: str, tokens: int, cap: int, ttl_s: float) -> bool:
        """Hold ``tokens`` against ``cap`` (spent + held + queued + tokens ≤ cap), or refuse
        (:meth:`ask` without a wait)."""
        ...

    def try_reserve(
        self, run_id: str, lease_id: str, tokens: int, cap: int, ttl_s: float
    ) -> BudgetSnapshot | None:
        """:meth:`ask` without a wait, answering None when granted and, when refused, the
        budget as the refusal saw it (read in the same atomic step, so a refusal's reason is
        never a later state: spent + held + queued + tokens > cap, or an overrun, holds in it)."""
        ...

    def commit(
        self,
        run_id: str,
        lease_id: str,
        actual_tokens: int,
        *,
        outside: int = 0,
        usage: RepairUsage | None = None,
    ) -> int:
        """Charge ``actual_tokens`` once and release the hold; returns the charge. ``outside``
        of them were spent where the service could not bound them (a manager's worker re-run,
        as it reported): charged, but never counted as an overrun of the reservation.
        ``usage``: the round's figures (its growth, its re-critique's reply), kept into the
        run's :class:`RepairUsage` by their largest, in the same atomic step as the charge (so
        a repeated commit brings nothing twice)."""
        ...

    def refund(self, run_id: str, lease_id: str) -> None:
        """Release the lease's hold without charging anything."""
        ...

    def park(self, run_id: str, lease_id: str) -> bool:
        """Make a live lease no process's (only its TTL ends it); False when it is not live."""
        ...

    def spent(self, run_id: str) -> int:
        """Tokens committed so far in the run."""
        ...

    def snapshot(self, run_id: str) -> BudgetSnapshot:
        """Spent, held (and by how many leases) and overrun, as of now."""
        ...

    def usage(self, run_id: str) -> RepairUsage:
        """What the run's committed repair rounds really used, with its spent tokens (one
        read)."""
        ...


class TraceSink(Protocol):
    """The run's single trace channel: every stage and gate event, in order."""

    def emit(self, run_id: str, event: Mapping[str, Any]) -> None:
        """Append one JSON-safe event to the run's trace."""
        ...

    def read(self, run_id: str) -> list[dict[str, Any]]:
        """Every event of the run so far, oldest first."""
        ...


class CritiqueCache(Protocol):
    """Critique envelopes by content key, shared by every run and worker."""

    def get(self, key: str) -> str | None:
        """The cached envelope JSON, or None."""
        ...

    def put(self, key: str, envelope_json: str, ttl_s: float) -> None:
        """Keep ``envelope_json`` under ``key`` for ``ttl_s`` seconds."""
        ...

    def claim(self, key: str, ttl_s: float) -> bool:
        """Claim the right to critique ``key`` for ``ttl_s`` (True: this caller critiques,
        others wait for its envelope)."""
        ...

    def release(self, key: str) -> None:
        """Drop this key's claim (after :meth:`put`, or on failure)."""
        ...


class BlobStore(Protocol):
    """Content-addressed bytes: large outputs and files travel as ``sha256:<hex>`` references."""

    def put(self, data: bytes, *, live: bool = False) -> str:
        """Store ``data`` and return its reference (the same bytes always give the same one).
        ``live``: only a live chain needs it (a stage state), so it may expire sooner; a blob
        stored for longer by another writer keeps its longer life."""
        ...

    def get(self, ref: str) -> bytes:
        """The bytes ``ref`` names; raises ``BlobMissingError`` (a KeyError) when absent."""
        ...
