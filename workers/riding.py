"""Reads that ride through a store outage: a Sentinel failover, a Redis restart, a cluster node's
promotion.

A failover takes the Sentinels' ``down-after-milliseconds`` plus a few seconds; a restarted
Redis answers again once it has loaded its data. Until then every read of the store raises
:class:`~pipeline.errors.StoreUnavailableError`, which says "not now", not "never". A manager
waiting on 2,000 verdicts should not see 2,000 errors for an outage its results outlive, so the
client's and the CLI's reads retry it with backoff (50 ms, doubling to 1 s) and report it only
when it outlasts the read's own deadline (a ``wait``'s ``timeout``) or, for a read without one,
``CRITIQUE_OUTAGE_S`` (default 120: the same window the workers' publishes and result writes
ride out). The report says what was unreachable and for how long.

Only :class:`StoreUnavailableError` is retried (a :class:`~workers.unreachable.
BrokerUnavailableError` is one): a refused, malformed or unverifiable record is raised at once.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from pipeline import settings
from pipeline.errors import StoreUnavailableError

T = TypeVar("T")
log = logging.getLogger(__name__)

DEFAULT_OUTAGE_S = settings.number(settings.OUTAGE_S, {})
FIRST_DELAY_S = 0.05
MAX_DELAY_S = 1.0
STREAM_UP_S = 5.0
"""A followed stream that broke after this long was up until then (a new outage, not the
same one going on)."""


def outage_s() -> float:
    """How long a read without a deadline of its own rides out an outage (``$CRITIQUE_OUTAGE_S``,
    default 120 s; at least 1 s)."""
    try:
        return settings.number(settings.OUTAGE_S)
    except ValueError:
        return DEFAULT_OUTAGE_S


class Outage:
    """One read loop's view of an outage: when it began, what the store last said, and the
    next backoff. ``clock`` is monotonic seconds (a test's own clock)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        notice: Callable[[str], None] | None = None,
    ) -> None:
        self._clock = clock
        self._notice = notice or _log_notice
        self.since: float | None = None
        self.last: StoreUnavailableError | None = None
        self._delay = FIRST_DELAY_S
        self.episodes = 0
        """How many separate outages this loop rode through (each counted when it began)."""

    def failed(self, exc: StoreUnavailableError, began: float | None = None) -> float:
        """Record a failed read (``began``: when that read started, the outage's start when it
        is the first); returns how long to back off before the next one (jittered, so many
        waiting clients do not all knock at once when the new master answers)."""
        if self.since is None:
            self.since = self._clock() if began is None else began
            self.episodes += 1
            self._delay = FIRST_DELAY_S
            self._notice(f"{exc.message}; retrying (a failover or a restart is ridden out)")
        self.last = exc
        delay = self._delay * random.uniform(0.5, 1.0)
        self._delay = min(MAX_DELAY_S, self._delay * 2)
        return delay

    def back_off(
        self,
        exc: StoreUnavailableError,
        deadline: float | None,
        why: str,
        began: float | None = None,
    ) -> None:
        """A failed read (:meth:`failed`), then the pause before the next one, cut to what is
        :meth:`left` before ``deadline``; when nothing is left, the outage's :meth:`error`
        (``why``: why the loop stopped retrying) is raised instead."""
        pause = self.failed(exc, began)
        left = self.left(deadline)
        if left <= 0:
            raise self.error(why) from exc
        time.sleep(min(pause, left))

    def ok(self) -> None:
        """A read answered: the outage (if any) is over."""
        self.since = None
        self.last = None

    @property
    def down_s(self) -> float:
        """Seconds since the first failed read of the current outage (0 when none)."""
        return 0.0 if self.since is None else self._clock() - self.since

    def left(self, deadline: float | None) -> float:
        """Seconds a read loop may still ride this outage out: to its ``deadline`` (monotonic),
        or with none what is left of :func:`outage_s`."""
        if deadline is not None:
            return deadline - self._clock()
        return outage_s() - self.down_s

    def error(self, why: str) -> StoreUnavailableError:
        """The outage as the one error the caller sees: the store's own line, how long it has
        been away, and ``why`` the read stopped retrying."""
        last = self.last
        message = last.message if last is not None else "the store could not be reached"
        tenths = math.floor(self.down_s * 10) / 10  # 2.0 for 2.004: the same words each time
        return StoreUnavailableError(
            f"{message}; unreachable for {tenths:.1f} s ({why})",
            hint=last.hint if last is not None else None,
        )


def gave_up(what: str, timeout: float | None) -> str:
    """Why a read loop stopped retrying: ``what``'s own ``timeout``, or ``CRITIQUE_OUTAGE_S``."""
    if timeout is None:
        return f"retried {settings.OUTAGE_S.name}={outage_s():g} s"
    return f"retried until the {what}'s timeout of {timeout:g} s"


def _log_notice(line: str) -> None:
    log.warning("%s", line)


def ride(
    read: Callable[[], T],
    *,
    deadline: float | None = None,
    notice: Callable[[str], None] | None = None,
) -> T:
    """``read()``, retried through :class:`StoreUnavailableError` until ``deadline`` (monotonic
    seconds; default :func:`outage_s` from now), then that error with how long the store was
    away. ``notice`` gets one line when an outage begins (default: a logged warning)."""
    limit = time.monotonic() + outage_s() if deadline is None else deadline
    outage = Outage(notice=notice)
    while True:
        began = time.monotonic()
        try:
            return read()
        except StoreUnavailableError as exc:
            why = "retried until the read's deadline" if deadline else gave_up("read", None)
            outage.back_off(exc, limit, why, began)


def ride_iter(
    start: Callable[[str], Iterator[tuple[str, T]]], last_id: str = "0-0"
) -> Iterator[tuple[str, T]]:
    """Follow a stream (``start(after_id)`` yields ``(entry id, item)``) through outages: when
    one breaks it, start again after the last entry yielded, so nothing is yielded twice or
    skipped; an outage longer than :func:`outage_s` is raised as :func:`ride` does."""
    outage = Outage()
    while True:
        began = time.monotonic()
        try:
            for entry_id, item in start(last_id):
                outage.ok()
                last_id = entry_id
                yield entry_id, item
            return
        except StoreUnavailableError as exc:
            if time.monotonic() - began > STREAM_UP_S:  # it followed the stream a while: was up
                outage.ok()
            outage.back_off(exc, None, gave_up("read", None))
