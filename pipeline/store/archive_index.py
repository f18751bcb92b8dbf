"""What the archiver (``workers.archiving``) reads and keeps in Redis: which runs to look at,
how far each run is from expiring, and which state of a run was archived last.

- ``archive:runs`` (shared sorted set): run id -> when the archiver looks at the run next (unix
  s). A submit sets it to now (:meth:`RedisRunStore.mark_submitted`); the archiver moves it on.
- ``archive:done:{<run_id>}`` (string, in the run's cluster slot): JSON ``{token, path, host,
  at}`` of the run's last archive; ``token`` is the run's state then (:meth:`state`), so a run
  is archived again only after it changed. It outlives the run's keys by a day, so a run that
  expired archived is told apart from one that expired unarchived.
- ``archive:lock`` (string): the worker archiving now (expires; never released: it paces).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pipeline.store import keys
from pipeline.store.redis_common import StoreClient, resolve_prefix, store_errors, text

RECORD_SUFFIXES: tuple[str, ...] = (
    keys.RESULTS,
    keys.PASS_RESULTS,
    keys.FAILURES,
    keys.TRACE,
    keys.PATTERNS_FREQ,
)
"""The run keys that hold what an archive keeps (its results, failures, trace and pattern
counts): the run must be archived before the first of them expires."""
MARKER_EXTRA_MS = 24 * 3600 * 1000
"""How long a run's archive marker outlives the run's longest-lived key."""


@dataclass(frozen=True)
class RunState:
    """One read of a run as the archiver sees it."""

    token: str
    """Changes whenever the run gains a trace event, a result or a failure."""
    exists: bool
    """Redis still holds a key of the run (any of them)."""
    pending: int
    """Passes still pending (no result, no failure)."""
    last_activity: float
    """Unix time of the run's last trace event (0.0 without one)."""
    expires_in_s: float | None
    """Seconds until the first of the run's record keys (:data:`RECORD_SUFFIXES`) expires;
    None when none of them is there."""
    lives_s: float
    """Seconds until the last of the run's keys expires (0.0 when none is left)."""
    marker: dict[str, Any] | None
    """The run's last archive (``token``, ``path``, ``host``, ``at``), if one is recorded."""

    @property
    def gone(self) -> bool:
        """Redis holds no key of the run any more."""
        return not self.exists

    @property
    def archived(self) -> bool:
        """The run's current state is the one archived last."""
        return self.marker is not None and self.marker.get("token") == self.token


class RedisArchiveIndex:
    """The archiver's index of runs, its per-run markers and its lock."""

    def __init__(self, client: StoreClient, *, prefix: str | None = None) -> None:
        self._r = client
        self._prefix = resolve_prefix(prefix)

    def _run(self, run_id: str, suffix: str) -> str:
        return keys.run_key(run_id, suffix, self._prefix)

    def _marker(self, run_id: str) -> str:
        keys.run_key(run_id, keys.ARCHIVE_DONE, self._prefix)  # checks the run id
        return keys.shared_key(f"{keys.ARCHIVE_DONE}:{{{run_id}}}", self._prefix)

    @property
    def _index(self) -> str:
        return keys.shared_key(keys.ARCHIVE_RUNS, self._prefix)

    # -- the index -------------------------------------------------------------------------------
    def due(self, now: float, limit: int) -> list[str]:
        """Up to ``limit`` runs whose next look is due (at or before ``now``), oldest first."""
        with store_errors(self._r):
            rows: Any = self._r.zrangebyscore(self._index, "-inf", now, 0, limit)
        return [text(m) for m in rows]

    def known(self, limit: int = 10_000) -> list[str]:
        """Up to ``limit`` run ids the index holds (every run submitted to this store whose
        keys have not expired yet): the names an unknown run id is compared with."""
        with store_errors(self._r):
            rows: Any = self._r.zrange(self._index, 0, limit - 1)
        return [text(m) for m in rows]

    def later(self, run_id: str, at: float) -> None:
        """Look at the run again at ``at`` (unless it left the index meanwhile)."""
        with store_errors(self._r):
            self._r.zadd(self._index, {run_id: at}, xx=True)

    def forget(self, run_id: str) -> None:
        """Take the run off the index (its keys are gone)."""
        with store_errors(self._r):
            self._r.zrem(self._index, run_id)

    def listed(self, run_id: str) -> float | None:
        """When the archiver looks at the run next, or None when it is not indexed."""
        with store_errors(self._r):
            got = self._r.zscore(self._index, run_id)
        return None if got is None else float(got)

    # -- a run's state ---------------------------------------------------------------------------
    def pending(self, run_id: str) -> list[str]:
        """The run's pending pass members (no result, no failure yet)."""
        with store_errors(self._r):
            rows: Any = self._r.zrange(self._run(run_id, keys.PENDING), 0, -1)
        return sorted(text(m) for m in rows)

    def state(self, run_id: str) -> RunState:
        """The run's state token, pending passes, last activity, expiry and marker, in one
        round trip."""
        every = [self._run(run_id, s) for s in keys.RUN_KEY_SUFFIXES]
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.xrevrange(self._run(run_id, keys.TRACE), "+", "-", count=1)
            for suffix in (keys.PASS_RESULTS, keys.RESULTS, keys.FAILURES):
                pipe.hlen(self._run(run_id, suffix))
            pipe.zcard(self._run(run_id, keys.PENDING))
            for name in every:
                pipe.pttl(name)
            pipe.get(self._marker(run_id))
            got = pipe.execute()
        last = text(got[0][0][0]) if got[0] else ""
        ttls = dict(zip(keys.RUN_KEY_SUFFIXES, (int(t) for t in got[5:-1]), strict=True))
        records = [ttls[s] for s in RECORD_SUFFIXES if ttls[s] >= 0]
        alive = [t for t in ttls.values() if t >= 0 or t == -1]
        marker = None
        if got[-1] is not None:
            try:
                doc = json.loads(text(got[-1]))
            except ValueError:
                doc = None
            marker = doc if isinstance(doc, dict) else None
        return RunState(
            token="/".join([last, *(str(int(n)) for n in got[1:4])]),
            exists=bool(alive),
            pending=int(got[4]),
            last_activity=int(last.split("-")[0]) / 1000 if last else 0.0,
            expires_in_s=min(records) / 1000 if records else None,
            lives_s=max([0, *alive]) / 1000,
            marker=marker,
        )

    def mark(self, run_id: str, doc: dict[str, Any], lives_s: float) -> None:
        """Record the run's last archive (``doc``: token, path, host, at), kept a day past
        ``lives_s`` (how long the run's keys still live)."""
        ttl_ms = int(lives_s * 1000) + MARKER_EXTRA_MS
        with store_errors(self._r):
            self._r.set(self._marker(run_id), json.dumps(doc), px=ttl_ms)

    def keep_marker(self, run_id: str, lives_s: float) -> None:
        """Keep the run's marker a day past ``lives_s`` (its keys' life grew)."""
        with store_errors(self._r):
            self._r.pexpire(self._marker(run_id), int(lives_s * 1000) + MARKER_EXTRA_MS)

    def marker(self, run_id: str) -> dict[str, Any] | None:
        """The run's last archive as recorded (``token``, ``path``, ``host``, ``at``), if any."""
        with store_errors(self._r):
            raw = self._r.get(self._marker(run_id))
        if raw is None:
            return None
        try:
            doc = json.loads(text(raw))
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    # -- the lock --------------------------------------------------------------------------------
    def try_lock(self, token: str, ttl_s: float) -> bool:
        """Take the fleet-wide archiving lock for ``ttl_s`` (not released: it paces the passes)."""
        with store_errors(self._r):
            return bool(
                self._r.set(
                    keys.shared_key(keys.ARCHIVE_LOCK, self._prefix),
                    token,
                    nx=True,
                    px=max(1, int(ttl_s * 1000)),
                )
            )
