"""The proof that a chain is lost on a RabbitMQ broker: a *census* of the pipeline's queues.

RabbitMQ knows where every message of a queue is: *ready* in the queue, or *unacknowledged* on
the channel of the consumer it was delivered to (and redelivered by RabbitMQ itself when that
channel closes). It tells the ready count and the consumer count of a queue to anyone
(``queue.declare`` with ``passive``), but not which messages a consumer holds. The workers tell
that: every worker process reports, every sweep interval, the pass ids of the messages it holds
(reserved, scheduled, running: Celery's worker state) and since when its consumer has held its
messages *steadily* (:class:`ConsumerReport`). Reports live in the store, beside the pending
index, never in the broker.

**A census** (:class:`Census`) is those reports, read first, and then the ready and consumer
counts of the pipeline's queues. A queue is *quiet* at a census when nothing is ready in it and
its consumers are exactly the consumers the live reports account for
(:meth:`Census.quiet`).

**The rule** (:func:`judge_census`), for a pending pass with last progress ``L`` whose next
stage goes to queue ``q``:

1. a live report holds a message of the pass: *alive*;
2. *suspect* at census ``t`` when no live report holds one, every live report was made at least
   :data:`~workers.recovery.base.LOST_GRACE_S` after ``L``, and ``q`` was quiet at ``t``;
3. *lost* at a later census when, with the same ``L``, still no live report holds one, and every
   worker that may have been consuming at ``t`` has reported again at least the grace after
   ``t``, its consumer steady since at least the grace before ``t`` (:meth:`Census.across`).

**Why it is sound** (no queued or held pass is ever taken for lost). Suppose a message ``M`` of
the pass was in ``q`` at ``t``. Nothing was ready: ``M`` was unacknowledged on some consumer's
channel. Every worker counted at ``t`` kept one consumer connection from before ``t`` to after
it (its ``since``), so those were real consumers of ``q`` at ``t``, and as many as RabbitMQ
counted: no other consumer held ``M``. (A stopping worker cancels its consumer, which RabbitMQ
then no longer counts, while its channel still holds what it had prefetched; but its ``since``
is None from that moment, so no suspicion it may touch is confirmed until it says it stopped,
which it does only once its connection is closed.) Its holder neither lost its connection nor
requeued a message since (either moves ``since``), so at its next report, made the grace after
``t`` (enough for Celery to register a delivered message), ``M`` was still in its hands, unless
its stage ran: then its first step record moved ``L`` (the atomic claim refuses a pass that
progressed), or it failed (recorded: the pass leaves the index). Either way the report would
have named the pass. So no message of the pass was in ``q`` at ``t``. None can appear after
``t`` without progress either: a stage of the pass that recorded ``L`` and still publishes its
successor holds its own message until then, and every report at the suspicion was made after
``L``, so it would have named the pass. The re-drive is then claimed atomically, as on Redis.

**Assumptions.** Every consumer of a pipeline queue is a worker of this version (a consumer that
does not report makes its queue never quiet: only the stall rule applies there); a worker
registers a delivered message within :data:`~workers.recovery.base.LOST_GRACE_S`; a stopping
worker (its consumer cancelled, its connection still open for the acknowledgements of the
tasks it finishes) closes its connection within its liveness window after its last report;
hosts' clocks agree to well under the grace (NTP). What the Redis proof leaves open is open here
too: a stage that sends a copy of a message without recording progress (Celery's autoretry after
a transient error; a stale copy of an earlier stage, still queued, replaying after the pass's
current message was lost) can be missed in the instant its copy is in flight, and the pass then
re-driven once more than needed (every stage replays its recorded output).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.models import PassRef
from pipeline.store import keys
from pipeline.store.redis_common import StoreClient, resolve_prefix, store_errors, text
from workers.recovery.base import LOST_GRACE_S, LOST_MARGIN_S

if TYPE_CHECKING:
    from workers.recovery.redriving import RedriveContext

REPORTS_KEPT_S = 600.0
"""A report older than this (or 20 of its intervals, if longer) is deleted when read."""
QUIET_KEPT = 200
"""Censuses remembered (their times and quiet queues): at one per sweep, 1,000 s at 5 s."""
QUIET_TTL_MS = 3_600_000
"""The census history expires an hour after the last census."""


@dataclass(frozen=True)
class ConsumerReport:
    """What one worker process said about its consumer at ``at``: the pass ids of the messages
    it holds, the queues it consumes, since when its consumer has held messages steadily (the
    later of its last connect and its last requeue; None while it consumes nothing, and from
    the moment a stopping worker stops consuming), when the process started reporting
    (``started``: before its consumer started), and whether it stopped for good (``stopped``:
    written only once its consumer connection is closed, so it held nothing from ``at`` on).
    A worker that dies without saying so counts as consuming for three report intervals
    plus a grace after its last report (:meth:`window`)."""

    at: float
    every: float
    started: float
    since: float | None
    queues: frozenset[str] = frozenset()
    pass_ids: frozenset[str] = frozenset()
    stopped: bool = False

    def live(self, now: float) -> bool:
        """Whether the worker still reports: three reports missed (plus a grace) means gone."""
        return not self.stopped and now - self.at <= self.window()

    def window(self) -> float:
        """How long after a report the worker counts as live."""
        return 3.0 * self.every + LOST_GRACE_S

    def consumes(self, queue: str) -> bool:
        """Whether the worker has a consumer on ``queue`` now, by its own account."""
        return self.live_consumer() and queue in self.queues

    def live_consumer(self) -> bool:
        return not self.stopped and self.since is not None

    def dumps(self) -> str:
        return json.dumps(
            {
                "at": self.at,
                "every": self.every,
                "started": self.started,
                "since": self.since,
                "queues": sorted(self.queues),
                "held": sorted(self.pass_ids),
                "stopped": self.stopped,
            }
        )

    @classmethod
    def loads(cls, raw: str | bytes) -> ConsumerReport:
        doc = json.loads(raw)
        since = doc.get("since")
        return cls(
            at=float(doc["at"]),
            every=float(doc["every"]),
            started=float(doc["started"]),
            since=None if since is None else float(since),
            queues=frozenset(map(str, doc.get("queues") or ())),
            pass_ids=frozenset(map(str, doc.get("held") or ())),
            stopped=bool(doc.get("stopped")),
        )


@dataclass(frozen=True)
class QueueCount:
    """What RabbitMQ says of a queue: messages ready in it, and consumers on it."""

    ready: int
    consumers: int


@dataclass(frozen=True)
class Census:
    """The workers' reports (read first) and the pipeline queues' counts, read from ``at`` on.
    A queue missing from ``queues`` could not be counted (it does not exist)."""

    reports: Mapping[str, ConsumerReport]
    queues: Mapping[str, QueueCount]
    at: float
    _live: tuple[ConsumerReport, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        live = tuple(r for r in self.reports.values() if r.live(self.at))
        object.__setattr__(self, "_live", live)

    def held(self) -> frozenset[str]:
        """The pass ids of every message a live worker holds."""
        return frozenset().union(*(r.pass_ids for r in self._live))

    def quiet(self) -> frozenset[str]:
        """The queues with nothing ready and exactly as many consumers as the live reports
        claim: every message of such a queue was in the hands of a reporting worker."""
        out = set()
        for queue, count in self.queues.items():
            claimed = sum(1 for r in self._live if r.consumes(queue))
            if count.ready == 0 and count.consumers == claimed:
                out.add(queue)
        return frozenset(out)

    def fresh_after(self, t: float) -> bool:
        """Whether every live report was made at least the grace after ``t``."""
        return all(r.at >= t + LOST_GRACE_S for r in self._live)

    def across(self, t: float) -> str:
        """Whether the consumers that may have held messages at ``t`` are known to have held
        them steadily since, and said so the grace after ``t``: ``"steady"``; ``"not yet"``
        (some have not reported again since); ``"broken"`` (one reconnected or requeued, stopped
        or went silent: a census at ``t`` proves nothing)."""
        answer = "steady"
        for rep in self.reports.values():
            if not _relevant(rep, t):
                continue
            if not rep.live(self.at) or rep.since is None or rep.since > t - LOST_GRACE_S:
                return "broken"
            if rep.at < t + LOST_GRACE_S:
                answer = "not yet"
        return answer


def _relevant(rep: ConsumerReport, t: float) -> bool:
    """Whether the worker of ``rep`` may have held messages at ``t``: it had started reporting
    by then (a worker reports before it consumes), its connection was not closed for good
    before ``t`` (a stopped report), nor had it gone silent for longer than its window (a
    worker that died without a word: RabbitMQ has closed its connection by then, or counts its
    consumer, which keeps the queue from being quiet)."""
    if rep.started > t:
        return False
    if rep.at >= t:
        return True
    return not rep.stopped and t - rep.at <= rep.window()


def judge_census(
    member: str, last_progress: float, prior: tuple[float, float] | None, census: Census
) -> str:
    """The rule (see the module): ``"alive"`` (a live worker holds a message of the pass),
    ``"young"`` (progress too recent, or a live report older than it: nothing to say yet),
    ``"suspect"`` (record it with ``census.at``: its queue, if quiet now, is checked when it is
    confirmed), ``"wait"`` (a suspect that may be confirmed by a later census), or
    ``"confirm"`` (lost, once the pass's queue is known to have been quiet at the suspicion)."""
    ref = PassRef.parse("", member)
    if ref is not None and ref.pass_id in census.held():
        return "alive"
    if census.at - last_progress < LOST_MARGIN_S or not census.fresh_after(last_progress):
        return "young"
    if prior is not None and prior[0] == last_progress:
        across = census.across(prior[1])
        if across == "steady":
            return "confirm"
        if across == "not yet":
            return "wait"
    return "suspect" if census.quiet() else "young"


# --- where reports and censuses are kept ------------------------------------------------------


def broker_id(vhost: str) -> str:
    """A short, key-safe name of a RabbitMQ virtual host (its workers share one report hash)."""
    return hashlib.sha256(vhost.encode()).hexdigest()[:16]


class CensusStore:
    """The workers' reports (a hash: worker token -> JSON report) and the recent censuses' quiet
    queues (a sorted set: census time -> quiet queues) of one RabbitMQ virtual host, in the
    store, both under one hash tag."""

    def __init__(self, client: StoreClient, broker: str, *, prefix: str | None = None) -> None:
        self._r = client
        base = keys.shared_key(f"{keys.AMQP_CENSUS}:{{{broker}}}", resolve_prefix(prefix))
        self._reports = f"{base}:reports"
        self._quiet = f"{base}:quiet"

    def report(self, token: str, rep: ConsumerReport) -> None:
        """Say what this worker holds (and that it is alive, or stopped)."""
        keep_ms = int(max(REPORTS_KEPT_S, 20 * rep.every) * 1000)
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.hset(self._reports, token, rep.dumps())
            pipe.pexpire(self._reports, keep_ms)
            pipe.execute()

    def reports(self, now: float) -> dict[str, ConsumerReport]:
        """Every worker's last report; unreadable ones and those gone for ten minutes are
        deleted."""
        with store_errors(self._r):
            raw: Any = self._r.hgetall(self._reports)
        out: dict[str, ConsumerReport] = {}
        gone: list[str] = []
        for token, value in raw.items():
            try:
                rep = ConsumerReport.loads(value)
            except (ValueError, KeyError, TypeError):
                gone.append(text(token))
                continue
            if now - rep.at > max(REPORTS_KEPT_S, 20 * rep.every):
                gone.append(text(token))
            else:
                out[text(token)] = rep
        if gone:
            with store_errors(self._r):
                self._r.hdel(self._reports, *gone)
        return out

    def record_quiet(self, at: float, queues: Iterable[str]) -> None:
        """Remember which queues were quiet at the census of ``at``."""
        member = f"{at!r}|{','.join(sorted(queues))}"
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.zadd(self._quiet, {member: at})
            pipe.zremrangebyrank(self._quiet, 0, -QUIET_KEPT - 1)
            pipe.pexpire(self._quiet, QUIET_TTL_MS)
            pipe.execute()

    def quiet_at(self, at: float) -> frozenset[str]:
        """The queues that were quiet at the census of ``at`` (none, if it is not remembered)."""
        with store_errors(self._r):
            rows: Any = self._r.zrangebyscore(self._quiet, at, at)
        for row in rows:
            when, _, queues = text(row).partition("|")
            if float(when) == at:
                return frozenset(q for q in queues.split(",") if q)
        return frozenset()


@dataclass
class CensusLook:
    """One sweep's census and the history its suspects are checked against."""

    census: Census
    store: CensusStore
    _quiet: dict[float, frozenset[str]] = field(default_factory=dict)

    def quiet_at(self, at: float) -> frozenset[str]:
        """The queues quiet at the census of ``at`` (read once per look)."""
        got = self._quiet.get(at)
        if got is None:
            got = self._quiet[at] = self.store.quiet_at(at)
        return got


@dataclass(frozen=True)
class CensusEvidence:
    """A RabbitMQ broker's evidence for :func:`~workers.recovery.redriving.redrive_if_lost`:
    one sweep's census (:func:`judge_census`) and the quiet queues of the censuses its suspects
    were made at."""

    look: CensusLook

    @property
    def at(self) -> float:
        return self.look.census.at

    def judge(self, member: str, last_progress: float, prior: tuple[float, float] | None) -> str:
        return judge_census(member, last_progress, prior, self.look.census)

    def proves(self, ctx: RedriveContext, queue: str, since: float) -> bool:
        return queue in self.look.quiet_at(since)

    def may_prove(self, ctx: RedriveContext, since: float) -> bool:
        return True  # the pass's queue is learnt by examining it (for :meth:`unproven`)

    def unproven(
        self, ctx: RedriveContext, run_id: str, member: str, last_progress: float, queue: str
    ) -> None:
        """A pass suspected while its own queue was busy is suspected afresh at this census if
        its queue is quiet now (the rule holds at any census), else forgotten: its suspicion
        would never move past a busy queue otherwise."""
        census = self.look.census
        if queue in census.quiet():
            ctx.stores.pending.update_suspects(run_id, {member: (last_progress, census.at)}, [])
        else:
            ctx.stores.pending.update_suspects(run_id, {}, [member])
