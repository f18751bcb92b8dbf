"""Lease liveness: a repair-budget lease belongs to a live process.

A lease (:class:`~pipeline.store.base.BudgetLedger`) is held by the process that asked for it
last: the ``decide`` that reserved it, then the repair and the re-critique that spend under it
(each asks for it again as it starts, which hands the lease over to its own process). The
holder is named by a :class:`LeaseHolder` id, ``<host>/<pid>/<random>``: a process, not a node,
so a prefork pool child killed alone loses its own leases while its siblings keep theirs, and a
restarted worker (same node name, new process) is a new holder whose predecessor's leases
nothing beats any more.

A holder keeps its leases alive by *beating* them: a daemon thread of its own (never the one
running the task, so a holder busy in a long model call still beats) asks the ledger every
``CRITIQUE_LEASE_BEAT_S`` (default 5 s) to move each lease's liveness deadline to now +
``CRITIQUE_LEASE_DEAD_S`` (default 20 s). A lease whose deadline passes (its holder was killed,
OOM-killed, lost its node or its network) no longer holds anything, for every reader at once:
the waiting repairs, snapshots and the fleet metrics, the same as a lease past its TTL, with
no reaper to wait for. It is dead for good: a holder that beats after its deadline does not
get it back (its tokens may have been granted to another repair meanwhile); its commit still
charges what it really spent. The deadline lives in the run's own keys (one cluster slot),
and is moved and read by the ledger's one script, on the Redis server's clock.

``CRITIQUE_LEASE_DEAD_S=0`` turns liveness off: leases then come back only after
``CRITIQUE_LEASE_TTL_S``, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Literal, Protocol

from pipeline import settings
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_LEASE_BEAT_S = settings.number(settings.LEASE_BEAT_S, {})  # 5 s (pipeline.settings)
DEFAULT_LEASE_DEAD_S = settings.number(settings.LEASE_DEAD_S, {})  # 20 s
"""Four beats: a holder whose beats fail three times in a row (a Redis blip, a stalled
thread) keeps its leases; a dead one's come back within 20 s, plus a waiting repair's next
ask (about a second)."""

Beat = Literal["kept", "gone", "lapsed"]
"""What a beat found of one lease: still held by this holder (its deadline moved on); settled,
handed over to another holder, or unknown (nothing to beat any more); or lapsed: still this
holder's, but past its deadline or TTL (it holds nothing now)."""


class BeatingLedger(Protocol):
    """What a :class:`LeaseHolder` needs of a ledger: a beat of some of a run's leases."""

    def beat(self, run_id: str, lease_ids: list[str]) -> dict[str, Beat]: ...


def _seconds(setting: settings.Setting, default: float) -> float:
    name = setting.name
    raw = settings.raw(setting)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds ≥ 0", key=name)
    return value


def lease_dead_s() -> float:
    """Seconds a lease lives without a beat: ``$CRITIQUE_LEASE_DEAD_S`` (default 20; 0: no
    liveness, only the TTL)."""
    return _seconds(settings.LEASE_DEAD_S, DEFAULT_LEASE_DEAD_S)


def lease_beat_s(dead_s: float) -> float:
    """Seconds between beats: ``$CRITIQUE_LEASE_BEAT_S`` (default 5), at most a third of
    ``dead_s`` (two beats may fail and a live holder still keeps its leases)."""
    beat = _seconds(settings.LEASE_BEAT_S, DEFAULT_LEASE_BEAT_S) or DEFAULT_LEASE_BEAT_S
    return min(beat, dead_s / 3) if dead_s > 0 else beat


def process_holder_id() -> str:
    """A fresh holder id for this process: ``<host>/<pid>/<8 hex>`` (the random part tells a
    restarted process that got the same pid from its predecessor)."""
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


class LeaseHolder:
    """Who holds the leases a ledger grants, and how long they live without a beat.

    ``name`` fixes the id (tests: two holders in one process); by default it is this process's
    (:func:`process_holder_id`, made anew in a forked child, which holds nothing of its
    parent's). With ``beat_s``, every lease granted through a ledger of this holder is beaten
    from a daemon thread, started on the first one, until it is settled or handed over; without
    it nothing beats (tests beat by hand, :meth:`beat_now`)."""

    def __init__(self, dead_s: float, *, beat_s: float | None = None, name: str | None = None):
        if dead_s <= 0:
            raise ValueError("a lease holder needs a liveness window (dead_s > 0)")
        self.dead_s = dead_s
        self.beat_s = beat_s
        self._name = name
        self._reset()
        _holders.add(self)

    def _reset(self) -> None:
        """A new process: a new id, nothing held, no thread (a fork copies none)."""
        self._pid = os.getpid()
        self._id = self._name or process_holder_id()
        self._lock = threading.Lock()
        self._held: dict[tuple[int, str], tuple[BeatingLedger, set[str]]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._last_error = 0.0

    @property
    def id(self) -> str:
        """This holder's id, as lease records name it."""
        return self._id

    def hold(self, ledger: BeatingLedger, run_id: str, lease_id: str) -> None:
        """``lease_id`` of ``run_id`` was granted to this holder through ``ledger``: beat it."""
        if self.beat_s is None or self._stopped:
            return
        with self._lock:
            _, leases = self._held.setdefault((id(ledger), run_id), (ledger, set()))
            leases.add(lease_id)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="critique-lease-beat", daemon=True
                )
                self._thread.start()

    def drop(self, ledger: BeatingLedger, run_id: str, lease_id: str) -> None:
        """Stop beating ``lease_id`` (this process settled or parked it)."""
        with self._lock:
            entry = self._held.get((id(ledger), run_id))
            if entry is not None:
                entry[1].discard(lease_id)
                if not entry[1]:
                    del self._held[(id(ledger), run_id)]

    def held(self) -> dict[str, set[str]]:
        """The leases this holder beats now, by run (for tests and status)."""
        with self._lock:
            out: dict[str, set[str]] = {}
            for (_, run_id), (_, leases) in self._held.items():
                out.setdefault(run_id, set()).update(leases)
            return out

    def beat_now(self) -> None:
        """Beat every lease held now, once; forget the ones no longer this holder's. A lease
        that lapsed while this process still held it is logged: the process was alive but
        beat nothing for ``dead_s`` (a stalled thread, a long Redis outage), and its repair's
        tokens may now be granted twice (its commit still charges what it spent)."""
        with self._lock:
            work = [(key, ledger, sorted(leases)) for key, (ledger, leases) in self._held.items()]
        for key, ledger, leases in work:
            got = ledger.beat(key[1], leases)
            lost = [lease for lease in leases if got.get(lease, "gone") != "kept"]
            lapsed = [lease for lease in lost if got.get(lease) == "lapsed"]
            if lapsed:
                log.warning(
                    "budget lease(s) %s of run %s lapsed while this process held them (no beat "
                    "for %g s): their tokens no longer count as held",
                    ", ".join(lapsed),
                    key[1],
                    self.dead_s,
                )
            if lost:
                with self._lock:
                    entry = self._held.get(key)
                    if entry is not None:
                        entry[1].difference_update(lost)
                        if not entry[1]:
                            del self._held[key]

    def _run(self) -> None:
        assert self.beat_s is not None
        while not self._stopped:
            self._wake.wait(self.beat_s)
            if self._stopped:
                break
            try:
                self.beat_now()
            except Exception as exc:  # Redis away, mostly: the next beat tries again
                now = time.monotonic()
                if now - self._last_error >= 60:
                    self._last_error = now
                    log.warning("lease beat: %s: %s", type(exc).__name__, exc)

    def stop(self) -> None:
        """Stop beating (tests: a holder that died). Nothing is released: its leases lapse."""
        self._stopped = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            with contextlib.suppress(RuntimeError):
                thread.join(timeout=5)


_holders: weakref.WeakSet[LeaseHolder] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for holder in list(_holders):
        holder._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)

_process_holder: LeaseHolder | None = None
_process_lock = threading.Lock()


def process_holder() -> LeaseHolder | None:
    """This process's lease holder, from the environment (``CRITIQUE_LEASE_DEAD_S``,
    ``CRITIQUE_LEASE_BEAT_S``), beating from its own thread; None when liveness is off
    (``CRITIQUE_LEASE_DEAD_S=0``). One per process: every ledger of it shares the thread."""
    global _process_holder
    dead = lease_dead_s()
    if dead <= 0:
        return None
    with _process_lock:
        if _process_holder is None:
            _process_holder = LeaseHolder(dead, beat_s=lease_beat_s(dead))
        return _process_holder
