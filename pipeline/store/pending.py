"""The pending index and queue-drain probes: what the stall sweeper reads (``workers.recovery``).

A submission pass is *pending* from its submit until its result is stored. Each run keeps a
sorted set ``pending`` of its pending passes (``"<iteration>:<worker_id>:<sid>"``) scored by the
pass's last progress (unix seconds): the submit, then every first record of a chain step
(``RedisRunStore.record_step`` moves the score in the same script), and ``put_result`` removes
the pass. A shared sorted set ``pending:runs`` lists the runs that may have pending passes.

Being old is not enough to be stalled: a message can sit in a long queue. A *probe* is a tiny
task sent to a queue at time ``sent``; when a worker runs it, every message enqueued on that
queue before ``sent`` has been taken off it (the Redis transport's queues are FIFO). Each
queue's ``drained`` sorted set keeps the recent probes' sent and run times, so "has the queue
been drained past time T, and when" is a lookup in one short list.

Being stalled is the backstop. A pass is *lost* sooner, once the sweeper has proved that no
message of it exists (``workers.recovery``): it first records the pass as a *suspect* (its last
progress, and when it saw no message of the pass among the broker's unacknowledged ones), then
confirms it after its queue was drained past that time. Each run keeps its suspects in a hash
``suspects`` (``"<progress>@<seen at>"`` per pass).

Times are the callers' wall clocks (``time.time()``); hosts are assumed NTP-synchronised to
well under the stall time.
"""

from __future__ import annotations

from typing import Any

from pipeline.store import keys
from pipeline.store.redis_common import (
    StoreClient,
    resolve_prefix,
    resolve_ttl_ms,
    store_errors,
    text,
)

PROBE_TTL_S = 3600
"""Probe keys expire an hour after the last probe (or with the run TTL, if shorter: only pending
passes read them): with no sweeper left, stall detection falls back to age alone
(:meth:`RedisPendingIndex.probed` is False)."""
DRAINED_KEEP = 1000
"""Probes remembered per queue (at one probe per sweep interval, over an hour of history)."""

# KEYS[1] pending sorted set, KEYS[2] resumes hash. ARGV: member, seen (the last-progress
# score the caller judged stalled), now, max claims, TTL (ms). Returns -1 when the pass made
# progress since (score > seen) or is no longer pending; 0 when it was claimed max times
# already (it is dropped from the index: the caller gives up on it); else the claim count.
# A claim's score is its ``now``: the same call again (redis-py re-sends a command whose reply
# was lost) finds that score and answers the count it took, taking none.
_CLAIM = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s and tonumber(s) == tonumber(ARGV[3]) and tonumber(ARGV[3]) > tonumber(ARGV[2]) then
  return tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '1')
end
if (not s) or tonumber(s) > tonumber(ARGV[2]) then return -1 end
local n = redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('PEXPIRE', KEYS[2], ARGV[5])
if n > tonumber(ARGV[4]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return n
"""

# KEYS[1] the run index. ARGV: run id, the score the caller saw. Removes the run only when
# nobody re-added it since (a submit in between moves its score).
_PRUNE = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s and tonumber(s) <= tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 1
end
return 0
"""

# KEYS[1] a queue's probe hash. ARGV: now, every (s), resend after (s), TTL (ms). Returns 1 (and
# records now as the outstanding probe) when a probe is due: none outstanding and the last one
# sent at least ``every`` ago, or the outstanding one older than ``resend`` (presumed lost).
_PROBE_DUE = """
local now = tonumber(ARGV[1])
local sent = tonumber(redis.call('HGET', KEYS[1], 'sent') or '0')
local done = tonumber(redis.call('HGET', KEYS[1], 'done') or '0')
local wait = tonumber(ARGV[2])
if sent > done then wait = tonumber(ARGV[3]) end
if now - sent < wait then return 0 end
redis.call('HSET', KEYS[1], 'sent', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""

# KEYS[1] a queue's probe hash, KEYS[2] its drained sorted set. ARGV: sent, consumed, TTL (ms),
# entries kept.
_PROBE_DONE = """
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1] .. '@' .. ARGV[2])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -tonumber(ARGV[4]) - 1)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
local done = tonumber(redis.call('HGET', KEYS[1], 'done') or '0')
if tonumber(ARGV[1]) > done then redis.call('HSET', KEYS[1], 'done', ARGV[1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


class RedisPendingIndex:
    """Pending submission passes by last progress, the sweep lock, and queue-drain probes."""

    def __init__(
        self, client: StoreClient, *, prefix: str | None = None, ttl_s: float | None = None
    ) -> None:
        self._r = client
        self._prefix = resolve_prefix(prefix)
        self._ttl_ms = resolve_ttl_ms(ttl_s)
        self._probe_ttl_ms = min(PROBE_TTL_S * 1000, self._ttl_ms)
        self._claim = client.register_script(_CLAIM)
        self._prune = client.register_script(_PRUNE)
        self._probe_due = client.register_script(_PROBE_DUE)
        self._probe_done = client.register_script(_PROBE_DONE)

    def _run_key(self, run_id: str, suffix: str) -> str:
        return keys.run_key(run_id, suffix, self._prefix)

    def _shared(self, suffix: str) -> str:
        return keys.shared_key(suffix, self._prefix)

    def _probe_keys(self, queue: str) -> list[str]:
        """A queue's probe hash and drained set, with a ``{queue}`` hash tag: one cluster slot,
        so one script may update both."""
        probe = self._shared(f"{keys.PROBE}:{{{queue}}}")
        return [probe, f"{probe}:{keys.PROBE_DRAINED}"]

    # -- the pending index ---------------------------------------------------------------------
    def add(self, run_id: str, member: str, now: float) -> None:
        """A pass entered the pipeline at ``now``: index it (and its run)."""
        key = self._run_key(run_id, keys.PENDING)
        runs = self._shared(keys.PENDING_RUNS)
        with store_errors(self._r):
            # Two cluster slots (the run's and the shared index): not one transaction.
            pipe = self._r.pipeline(transaction=False)
            pipe.zadd(key, {member: now})
            pipe.pexpire(key, self._ttl_ms)
            pipe.zadd(runs, {run_id: now})
            pipe.pexpire(runs, self._ttl_ms)
            pipe.execute()

    def runs(self, limit: int = 10_000) -> list[tuple[str, float]]:
        """Runs that may have pending passes, with their index score (last submit)."""
        with store_errors(self._r):
            rows: Any = self._r.zrange(
                self._shared(keys.PENDING_RUNS), 0, limit - 1, withscores=True
            )
        return [(text(m), float(s)) for m, s in rows]

    def stale(self, run_id: str, before: float, limit: int) -> list[tuple[str, float]]:
        """Pending passes of the run whose last progress is at or before ``before``, oldest
        first, with that time."""
        with store_errors(self._r):
            rows: Any = self._r.zrangebyscore(
                self._run_key(run_id, keys.PENDING), "-inf", before, 0, limit, withscores=True
            )
        return [(text(m), float(s)) for m, s in rows]

    def count(self, run_id: str) -> int:
        """Pending passes of the run."""
        with store_errors(self._r):
            return int(self._r.zcard(self._run_key(run_id, keys.PENDING)))

    def last_progress(self, run_id: str, member: str) -> float | None:
        """The pass's last progress, or None when it is not pending."""
        with store_errors(self._r):
            score = self._r.zscore(self._run_key(run_id, keys.PENDING), member)
        return None if score is None else float(score)

    def claim(self, run_id: str, member: str, seen: float, now: float, max_claims: int) -> int:
        """Claim a stalled pass for one re-drive, atomically: see ``_CLAIM`` (-1 progressed or
        settled, 0 claimed too often and dropped, else the claim count). A claim counts as
        progress, so the next one comes a stall time later at the earliest."""
        script_keys = [self._run_key(run_id, keys.PENDING), self._run_key(run_id, keys.RESUMES)]
        with store_errors(self._r):
            got = self._claim(
                keys=script_keys, args=[member, repr(seen), repr(now), max_claims, self._ttl_ms]
            )
        return int(got)

    def touch(self, run_id: str, member: str, now: float) -> None:
        """Count ``now`` as the pass's progress (if it is pending): an explicit re-drive."""
        with store_errors(self._r):
            self._r.zadd(self._run_key(run_id, keys.PENDING), {member: now}, xx=True)

    def drop(self, run_id: str, member: str) -> None:
        """Remove a pass from the index (settled, superseded, or given up on)."""
        with store_errors(self._r):
            self._r.zrem(self._run_key(run_id, keys.PENDING), member)

    def prune_run(self, run_id: str, seen: float) -> bool:
        """Drop a run from the run index if it was not re-added since its score ``seen``; the
        caller checked that the run has no pending pass."""
        with store_errors(self._r):
            return bool(
                self._prune(keys=[self._shared(keys.PENDING_RUNS)], args=[run_id, repr(seen)])
            )

    # -- suspects of being lost ---------------------------------------------------------------
    def suspects(self, run_id: str) -> dict[str, tuple[float, float]]:
        """The run's suspects: pass -> (its last progress then, when no message of it was seen)."""
        with store_errors(self._r):
            raw: Any = self._r.hgetall(self._run_key(run_id, keys.SUSPECTS))
        out: dict[str, tuple[float, float]] = {}
        for field, value in raw.items():
            seen, _, since = text(value).partition("@")
            try:
                out[text(field)] = (float(seen), float(since))
            except ValueError:
                continue  # not ours: update_suspects replaces or drops it
        return out

    def update_suspects(
        self, run_id: str, add: dict[str, tuple[float, float]], drop: list[str]
    ) -> None:
        """Record ``add`` (pass -> (last progress, seen at)) as suspects; forget ``drop``."""
        if not add and not drop:
            return
        key = self._run_key(run_id, keys.SUSPECTS)
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            if drop:
                pipe.hdel(key, *drop)
            if add:
                pipe.hset(key, mapping={m: f"{p!r}@{t!r}" for m, (p, t) in add.items()})
                pipe.pexpire(key, self._ttl_ms)
            pipe.execute()

    def clear_suspects(self, run_id: str) -> None:
        """Forget every suspect of the run (none of its passes is old enough to be one)."""
        with store_errors(self._r):
            self._r.delete(self._run_key(run_id, keys.SUSPECTS))

    # -- the sweep lock -------------------------------------------------------------------------
    def try_lock(self, token: str, ttl_s: float) -> bool:
        """Take the cluster-wide sweep lock for ``ttl_s`` (not released: it paces the sweeps)."""
        with store_errors(self._r):
            return bool(
                self._r.set(
                    self._shared(keys.SWEEP_LOCK), token, nx=True, px=max(1, int(ttl_s * 1000))
                )
            )

    # -- queue-drain probes ---------------------------------------------------------------------
    def probe_due(self, queue: str, now: float, every_s: float, resend_s: float) -> bool:
        """True (and recorded as sent at ``now``) when a probe should go to ``queue`` now."""
        with store_errors(self._r):
            got = self._probe_due(
                keys=self._probe_keys(queue)[:1],
                args=[repr(now), every_s, resend_s, self._probe_ttl_ms],
            )
        return bool(got)

    def probe_done(self, queue: str, sent: float, consumed: float) -> None:
        """A probe sent at ``sent`` ran at ``consumed``: the queue was drained past ``sent``."""
        with store_errors(self._r):
            self._probe_done(
                keys=self._probe_keys(queue),
                args=[repr(sent), repr(consumed), self._probe_ttl_ms, DRAINED_KEEP],
            )

    def probed(self, queue: str) -> bool:
        """Whether probes run on ``queue`` (one was sent within :data:`PROBE_TTL_S`)."""
        with store_errors(self._r):
            return bool(self._r.exists(self._probe_keys(queue)[0]))

    def drained(self, queue: str) -> list[tuple[float, float]]:
        """The queue's remembered probes, ``(sent, ran)`` in order of sending."""
        with store_errors(self._r):
            rows: Any = self._r.zrange(self._probe_keys(queue)[1], 0, -1)
        out = []
        for row in rows:
            sent, _, ran = text(row).partition("@")
            out.append((float(sent), float(ran)))
        return out
