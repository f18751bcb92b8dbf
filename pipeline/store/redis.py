"""Redis implementations of the run stores, behind the protocols of ``base``.

Each store takes an injected client (:data:`~pipeline.store.redis_common.StoreClient`: a
``redis.Redis``, or a ``redis.cluster.RedisCluster``; ``decode_responses`` False or True: both
work), a key prefix and a run TTL (defaults from :mod:`pipeline.store.keys`). Multi-key updates
are single Lua scripts (``register_script``: EVALSHA with a NOSCRIPT fallback), so a run's
state is changed atomically and every write path refreshes the run keys' expiry. Connection
failures surface as :class:`~pipeline.errors.StoreUnavailableError` (transient, retried).
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pipeline.models import Lesson, LessonScope, Pattern, ReusablePattern
from pipeline.security import signing
from pipeline.store import keys
from pipeline.store.base import (
    MAX_LESSONS,
    MAX_LESSONS_PER_RUN,
    MAX_PATTERNS_PER_CRITIQUE,
    MAX_PATTERNS_PER_RUN,
    WAITER_GRACE_S,
    BudgetAnswer,
    BudgetSnapshot,
    RepairUsage,
    Verdict,
    encode_event,
    run_lesson,
)
from pipeline.store.keys import pattern_key
from pipeline.store.leases import Beat, LeaseHolder
from pipeline.store.packing import pack_event, unpack
from pipeline.store.redis_common import (
    StoreClient,
    connection_kwargs,
    decodes_responses,
    replicated,
    resolve_prefix,
    resolve_ttl_ms,
    store_errors,
    text,
)

log = logging.getLogger(__name__)

# --- pattern memory --------------------------------------------------------------------------

ORDER_SPACE = 1 << 26
"""Ranks in ``patterns:freq`` and ``lessons:runs`` are ``count + (ORDER_SPACE - order) /
ORDER_SPACE``: the integer part is the count, the fraction orders ties first-recorded first, so
``ZREVRANGE 0 limit-1`` reads exactly the entries it returns however many patterns tie. Both
parts stay exact in a double while counts are below 2**27; orders past ``ORDER_SPACE - 1`` share
the last one (ties among them then fall back to Redis's member order)."""

# Shared Lua helpers: the rank of a new entry, and eviction of the least-seen entry (of those,
# the first recorded: the highest rank within the lowest count) from a sorted set and its hash.
_RANK_LUA = (
    f"local SPACE = {ORDER_SPACE}\n"
    + """
local function first_rank(order)
  if order > SPACE - 1 then order = SPACE - 1 end
  return string.format('%.17g', 1 + (SPACE - order) / SPACE)
end
local function least_seen(zkey)
  local low = redis.call('ZRANGE', zkey, 0, 0, 'WITHSCORES')
  if #low == 0 then return nil end
  local count = math.floor(tonumber(low[2]))
  local victim = redis.call('ZREVRANGEBYSCORE', zkey, '(' .. string.format('%.0f', count + 1),
                            string.format('%.0f', count), 'LIMIT', 0, 1)
  if #victim == 0 then return low[1] end
  return victim[1]
end
local function evict_one(zkey, hkey)
  local victim = least_seen(zkey)
  if victim == nil then return end
  redis.call('ZREM', zkey, victim)
  redis.call('HDEL', hkey, victim)
end
"""
)

# KEYS: seen, freq, detail, counted, seq. ARGV: critique key, iteration, run TTL (ms), pass key,
# most patterns per run, then per pattern (deduplicated by the caller): pattern key, category,
# description, prevention rule. A pattern counts once per pass ("<pass>|<sha1>" in counted) and
# is new to the run once ("@run|<sha1>"). Returns 0 when the critique was recorded before, else
# {1, keys of patterns new to the run}.
_RECORD_PATTERNS = (
    _RANK_LUA
    + """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then
  return 0
end
local iteration = tonumber(ARGV[2])
local pass = ARGV[4]
local cap = tonumber(ARGV[5])
local new = {1}
for i = 6, #ARGV, 4 do
  local pkey = ARGV[i]
  local digest = redis.sha1hex(pkey)
  if redis.call('SADD', KEYS[4], pass .. '|' .. digest) == 1 then
    local raw = redis.call('HGET', KEYS[3], pkey)
    local row
    if raw then
      row = cjson.decode(raw)
      if iteration < row.first_seen_iteration then row.first_seen_iteration = iteration end
      if iteration > row.last_seen_iteration then row.last_seen_iteration = iteration end
      redis.call('ZINCRBY', KEYS[2], 1, pkey)
    else
      while redis.call('ZCARD', KEYS[2]) >= cap do evict_one(KEYS[2], KEYS[3]) end
      local order = redis.call('INCR', KEYS[5])
      row = {category = ARGV[i + 1], description = ARGV[i + 2], prevention_rule = ARGV[i + 3],
             first_seen_iteration = iteration, last_seen_iteration = iteration, order = order}
      redis.call('ZADD', KEYS[2], first_rank(order), pkey)
      if redis.call('SADD', KEYS[4], '@run|' .. digest) == 1 then
        new[#new + 1] = pkey
      end
    end
    redis.call('HSET', KEYS[3], pkey, cjson.encode(row))
  end
end
for i = 1, 5 do
  redis.call('PEXPIRE', KEYS[i], ARGV[3])
end
return new
"""
)

# Fleet lessons (CRITIQUE_LESSONS_SCOPE=fleet). KEYS: lessons runs (sorted set), detail (hash),
# seq (string), held (hash: sha1 of a run id -> lessons that run brought, still kept), shared by
# every run. ARGV: run id, lessons TTL (ms), most lessons kept, most brought by one run, then
# per pattern new to that run: pattern key, category, description, rule. A known lesson counts
# one more run; a new one is kept only while the run brings fewer than its share, and evicts
# the least seen (its bringer then holds one fewer). Rows name no run: ``by`` is the bringer's
# sha1, and ids left by older rows are dropped when the row is next counted. Returns how many
# new lessons the run's share refused. Every write pushes the lessons' expiry out again.
_RECORD_LESSONS = (
    _RANK_LUA
    + """
local cap, share = tonumber(ARGV[3]), tonumber(ARGV[4])
local me = redis.sha1hex(ARGV[1])
local refused = 0
local function drop_one()
  local victim = least_seen(KEYS[1])
  if victim == nil then return end
  local raw = redis.call('HGET', KEYS[2], victim)
  local by = raw and cjson.decode(raw).by
  if type(by) == 'string' and redis.call('HINCRBY', KEYS[4], by, -1) <= 0 then
    redis.call('HDEL', KEYS[4], by)
  end
  redis.call('ZREM', KEYS[1], victim)
  redis.call('HDEL', KEYS[2], victim)
end
for i = 5, #ARGV, 4 do
  local pkey = ARGV[i]
  local raw = redis.call('HGET', KEYS[2], pkey)
  if raw then
    redis.call('ZINCRBY', KEYS[1], 1, pkey)
    local row = cjson.decode(raw)
    if row.first_run ~= nil or row.last_run ~= nil then
      row.first_run, row.last_run = nil, nil
      redis.call('HSET', KEYS[2], pkey, cjson.encode(row))
    end
  elseif tonumber(redis.call('HGET', KEYS[4], me) or '0') < share then
    while redis.call('ZCARD', KEYS[1]) >= cap do drop_one() end
    local order = redis.call('INCR', KEYS[3])
    local row = {category = ARGV[i + 1], description = ARGV[i + 2],
                 prevention_rule = ARGV[i + 3], order = order, by = me}
    redis.call('ZADD', KEYS[1], first_rank(order), pkey)
    redis.call('HSET', KEYS[2], pkey, cjson.encode(row))
    redis.call('HINCRBY', KEYS[4], me, 1)
  else
    refused = refused + 1
  end
end
for i = 1, 4 do
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
end
return refused
"""
)

# KEYS: freq, detail. ARGV: limit (≥ 1). Returns [pattern key, rank, detail JSON]* of the
# ``limit`` highest ranks: exactly the entries it reads (the rank already orders ties).
_TOP_PATTERNS = """
local rows = redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
local out = {}
for i = 1, #rows, 2 do
  local detail = redis.call('HGET', KEYS[2], rows[i])
  if detail then
    out[#out + 1] = rows[i]
    out[#out + 1] = rows[i + 1]
    out[#out + 1] = detail
  end
end
return out
"""


def _count(rank: Any) -> int:
    """The count held in a rank (its integer part; see :data:`ORDER_SPACE`)."""
    return math.floor(float(text(rank) if isinstance(rank, bytes | str) else rank))


def _fleet_lesson(raw: Any, rank: Any, *, this_run: bool) -> Lesson | None:
    """A fleet lesson from its stored row (None when the row does not read as one): its
    texts, and the count of runs that taught it, never who they were."""
    if raw is None:
        return None
    try:
        d = json.loads(text(raw))
        return Lesson(
            category=d["category"],
            runs=_count(rank),
            description=d["description"],
            prevention_rule=d["prevention_rule"],
            scope="fleet",
            this_run=this_run,
        )
    except (ValueError, KeyError, TypeError):
        return None


class RedisPatternStore:
    """Pattern memory: ranks in a sorted set, details in a hash, exactly once per critique.

    The "seen" set of critique keys, the per-pass "counted" set and the counts are updated in
    one Lua script, so a task delivered twice (or run concurrently) counts its patterns once,
    and the repair rounds of one pass count a pattern once.

    Lessons follow ``lessons_scope`` (default ``$CRITIQUE_LESSONS_SCOPE``, read at each call;
    ``run`` when unset). Under ``run`` a run's lessons are its own patterns and nothing is
    shared. Under ``fleet`` a pattern's first occurrence in a run also counts one run for its
    cross-run lesson, in a second script: the lessons keys are shared by every run (another
    cluster slot), bounded (:data:`~pipeline.store.base.MAX_LESSONS`, of which one run brings
    at most :data:`~pipeline.store.base.MAX_LESSONS_PER_RUN`) and expire ``lessons_ttl_s``
    after the last write (default ``$CRITIQUE_LESSONS_TTL_S`` or 30 days).
    """

    def __init__(
        self,
        client: StoreClient,
        prefix: str | None = None,
        ttl_s: float | None = None,
        lessons_ttl_s: float | None = None,
        lessons_scope: LessonScope | None = None,
    ) -> None:
        self._client = client
        self._lessons_scope = lessons_scope
        self._prefix = resolve_prefix(prefix)
        self._ttl_ms = resolve_ttl_ms(ttl_s)
        lessons_s = keys.lessons_ttl_s() if lessons_ttl_s is None else lessons_ttl_s
        if lessons_s <= 0:
            raise ValueError(f"lessons TTL must be positive, got {lessons_s!r}")
        self._lessons_ttl_ms = max(1, int(lessons_s * 1000))
        self._record = client.register_script(_RECORD_PATTERNS)
        self._top = client.register_script(_TOP_PATTERNS)
        self._learn = client.register_script(_RECORD_LESSONS)

    def _keys(self, run_id: str, *suffixes: str) -> list[str]:
        return [keys.run_key(run_id, s, self._prefix) for s in suffixes]

    def record(
        self,
        run_id: str,
        critique_key: str,
        iteration: int,
        patterns: Sequence[ReusablePattern],
        pass_key: str = "",
    ) -> bool:
        """Count ``patterns`` once for ``critique_key`` and once per ``pass_key``; False when
        the critique key was already recorded."""
        if iteration < 1:
            raise ValueError(f"iteration must be ≥ 1, got {iteration}")
        args: list[str | int] = [
            critique_key,
            iteration,
            self._ttl_ms,
            pass_key or critique_key,
            MAX_PATTERNS_PER_RUN,
        ]
        seen: set[str] = set()
        for p in patterns:
            if len(seen) >= MAX_PATTERNS_PER_CRITIQUE:
                break
            key = pattern_key(p.category, p.prevention_rule)
            if key not in seen:
                seen.add(key)
                args += [key, p.category, p.description, p.prevention_rule]
        script_keys = self._keys(
            run_id,
            keys.PATTERNS_SEEN,
            keys.PATTERNS_FREQ,
            keys.PATTERNS_DETAIL,
            keys.PATTERNS_COUNTED,
            keys.PATTERNS_SEQ,
        )
        with store_errors(self._client):
            got = replicated(self._client, self._record, script_keys, args)
            if not isinstance(got, list):
                return False
            new = {text(k) for k in got[1:]}
            if new and self._scope() == "fleet":
                lesson_args: list[str | int] = [
                    run_id,
                    self._lessons_ttl_ms,
                    MAX_LESSONS,
                    MAX_LESSONS_PER_RUN,
                ]
                for i in range(5, len(args), 4):
                    if args[i] in new:
                        lesson_args += args[i : i + 4]
                refused = self._learn(keys=self._lesson_keys(), args=lesson_args)
                if refused:
                    log.info("run %s: %s new lesson(s) past its share not kept", run_id, refused)
        return True

    def _scope(self) -> LessonScope:
        return self._lessons_scope or keys.lessons_scope()

    def _lesson_keys(self) -> list[str]:
        return [keys.shared_key(k, self._prefix) for k in keys.LESSONS_KEYS]

    def lessons(
        self, limit: int = 50, min_runs: int = 2, *, run_id: str | None = None
    ) -> list[Lesson]:
        """The lessons ``run_id`` may see, at most ``limit`` (reads at most that many entries).

        Run scope (the default): the run's own patterns, most frequent first (none without a
        run id; ``min_runs`` does not apply: one run taught each). Fleet scope: patterns that
        occurred in at least ``min_runs`` runs, most runs first (ties: first learned first),
        each marked when ``run_id`` taught it too; they expire ``CRITIQUE_LESSONS_TTL_S`` after
        the last write. No lesson names a run. A fleet row that does not read as a lesson
        (planted by a Redis writer) is skipped. The one implementation: the in-memory store
        keeps no lessons (nothing broker-free reads them)."""
        if limit <= 0:
            return []
        if self._scope() == "run":
            return [] if run_id is None else [run_lesson(p) for p in self.top(run_id, limit)]
        runs_key, detail_key, _, _ = self._lesson_keys()
        with store_errors(self._client):
            reply: Any = self._client.zrevrangebyscore(
                runs_key, "+inf", max(min_runs, 0), start=0, num=limit, withscores=True
            )
            members = [member for member, _ in reply]
            details = list(self._client.hmget(detail_key, members)) if members else []
            own: list[Any] = [None] * len(members)
            if run_id is not None and members:
                own_key = keys.run_key(run_id, keys.PATTERNS_DETAIL, self._prefix)
                own = list(self._client.hmget(own_key, members))
        out: list[Lesson] = []
        for (_, rank), raw, mine in zip(reply, details, own, strict=True):
            lesson = _fleet_lesson(raw, rank, this_run=mine is not None)
            if lesson is not None:
                out.append(lesson)
        return out

    def top(self, run_id: str, limit: int = 10) -> list[Pattern]:
        """The run's ``limit`` most frequent patterns, ties in first-recorded order; the script
        reads only those ``limit`` entries, however many patterns tie."""
        if limit <= 0:
            return []
        script_keys = self._keys(run_id, keys.PATTERNS_FREQ, keys.PATTERNS_DETAIL)
        with store_errors(self._client):
            flat = self._top(keys=script_keys, args=[limit])
        out: list[Pattern] = []
        for i in range(0, len(flat), 3):
            detail = json.loads(text(flat[i + 2]))
            out.append(
                Pattern(
                    category=detail["category"],
                    frequency=_count(flat[i + 1]),
                    description=detail["description"],
                    prevention_rule=detail["prevention_rule"],
                    first_seen_iteration=int(detail["first_seen_iteration"]),
                    last_seen_iteration=int(detail["last_seen_iteration"]),
                )
            )
        return out


# --- repair-budget semaphore -----------------------------------------------------------------

# One script for the whole lease protocol (the rules: pipeline.store.base.BudgetLedger).
# KEYS: budget hash, leases hash, live sorted set, waiting sorted set.
# ARGV[1] = op ("reserve" | "commit" | "refund" | "release" | "beat" | "park" | "holds" |
# "snapshot"), ARGV[2] = run TTL (ms),
# ARGV[3] = now in µs, or "" to use the server's TIME (the default: one clock for every host).
#   reserve:  ARGV[4] lease id, ARGV[5] tokens, ARGV[6] cap, ARGV[7] lease TTL (µs),
#             ARGV[8] wait (µs), ARGV[9] waiter grace (µs), ARGV[10] holder ("" none),
#             ARGV[11] the holder's liveness window (µs; 0 none) →
#             [verdict (0 granted, 1 wait, 2 refused), spent, held, holders, overrun, queued,
#              waiters, waited (µs)] (all 0 but the verdict for a live or committed lease; a
#             live lease asked for by a holder is handed over to it)
#   commit:   ARGV[4] lease id, ARGV[5] actual tokens, ARGV[6] of them spent outside the service
#             (a worker's re-run: never an overrun), ARGV[7] the round's growth (thousandths),
#             ARGV[8] its re-critique's reply (tokens) → the charge (the first one, when
#             repeated); the first commit keeps the largest growth and reply in the budget hash
#   refund:   ARGV[4] lease id → 0
#   release:  ARGV[4..] lease-id prefixes (one per cancelled pass) → how many live or waiting
#             leases under them were refunded (a cancel: nothing of those passes stays held)
#   beat:     ARGV[4] holder, ARGV[5] liveness window (µs), ARGV[6..] lease ids → per lease,
#             1 kept (still this holder's and live: its deadline moved on), 0 gone (settled,
#             handed over, unknown), 2 lapsed (this holder's, but its deadline or TTL passed:
#             never revived)
#   park:     ARGV[4] lease id → 1 when the live lease is now held by no process (only its TTL
#             ends it: a repair handed to the manager's worker), else 0
#   holds:    → [lease id, tokens, deadline (µs), now (µs), holder]* of live leases
#   snapshot: → [spent, held, holders, overrun]
# A lease record is "tokens:expires_us:state:charge[:holder]" (state 0 live, 1 committed,
# 2 refunded, 3 waiting: then expires_us is when it began to wait; holder: the process that
# holds it, pipeline.store.leases); records stay until the run expires, so a repeated reserve,
# commit or refund of a lease id is answered from its record. The live set scores each live
# lease with the moment it stops holding: its TTL, or sooner its holder's liveness deadline
# (now + the window at each grant, hand-over and beat), so a dead holder's lease is released
# for every reader at once. The budget hash holds "spent" and "overrun" (tokens charged past
# their reservations; above 0 it refuses every new reservation of the run), "cap" (the cap
# the last reservation asked against, read by the exporter: pipeline.store.metrics), and what
# the committed rounds used ("rounds" that brought figures, the largest "growth" and "reply":
# pipeline.store.base.RepairUsage, read back with HMGET by RedisBudgetLedger.usage). The
# waiting set scores each waiting lease with the time it stops counting as queued (its last
# ask + the grace): older waiters are served first.
_BUDGET = """
local op = ARGV[1]
local function now_us()
  if ARGV[3] ~= '' then return tonumber(ARGV[3]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function parse(rec)
  local tokens, expires, state, charge, holder =
    string.match(rec, '^(%d+):(%-?%d+):(%d):?(%d*):?(.*)$')
  if charge == nil or charge == '' then charge = '0' end
  return tonumber(tokens), tonumber(expires), tonumber(state), tonumber(charge), holder or ''
end
local function record(tokens, expires, state, charge, holder)
  local rec = string.format('%.0f:%.0f:%d:%.0f', tokens, expires, state, charge)
  if holder ~= nil and holder ~= '' then rec = rec .. ':' .. holder end
  return rec
end
local function deadline(expires, holder, now, live)
  if holder ~= '' and live > 0 then return math.min(expires, now + live) end
  return expires
end
local function live_until(lease)
  local score = redis.call('ZSCORE', KEYS[3], lease)
  if score then return tonumber(score) end
  return nil
end
local function touch()
  for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
end
local function live_sum(now)
  local held, n = 0, 0
  local live = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. string.format('%.0f', now), '+inf')
  for _, lease in ipairs(live) do
    held = held + parse(redis.call('HGET', KEYS[2], lease))
    n = n + 1
  end
  return held, n
end
local function number(field)
  return tonumber(redis.call('HGET', KEYS[1], field) or '0')
end

if op == 'reserve' then
  local lease, tokens, cap = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
  redis.call('HSET', KEYS[1], 'cap', ARGV[6])  -- the run's cap, for the fleet metrics
  local wait, grace = tonumber(ARGV[8]), tonumber(ARGV[9])
  local holder, live = ARGV[10] or '', tonumber(ARGV[11] or '0')
  local now = now_us()
  local since = now
  local rec = redis.call('HGET', KEYS[2], lease)
  if rec then
    local rtokens, expires, state, charge = parse(rec)
    if state == 1 then return {0, 0, 0, 0, 0, 0, 0, 0} end
    if state == 0 then
      local untl = live_until(lease)
      if untl and untl > now then
        if holder ~= '' then
          -- Whoever asks for a live lease holds it from now (the stage that spends under it).
          redis.call('HSET', KEYS[2], lease, record(rtokens, expires, 0, charge, holder))
          redis.call('ZADD', KEYS[3], string.format('%.0f', deadline(expires, holder, now, live)),
                     lease)
        end
        return {0, 0, 0, 0, 0, 0, 0, 0}
      end
    end
    if state == 3 then since = expires end
    -- Refunded, or past its TTL or its holder's deadline unsettled (its holder died; the work
    -- was redelivered): reserve afresh below, against the cap, as if the lease were new.
  end
  local nowf = string.format('%.0f', now)
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', nowf)
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', nowf)
  local held, n = live_sum(now)
  local queued, ahead = 0, 0
  for _, other in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do
    if other ~= lease then
      local orec = redis.call('HGET', KEYS[2], other)
      if orec then
        local otokens, osince, ostate = parse(orec)
        if ostate == 3 and (osince < since or (osince == since and other < lease)) then
          queued = queued + otokens
          ahead = ahead + 1
        end
      end
    end
  end
  local spent, overrun = number('spent'), number('overrun')
  local function answer(verdict)
    return {verdict, string.format('%.0f', spent), string.format('%.0f', held), n,
            string.format('%.0f', overrun), string.format('%.0f', queued), ahead,
            string.format('%.0f', now - since)}
  end
  if overrun == 0 and spent + held + queued + tokens <= cap then
    local expires = now + tonumber(ARGV[7])
    redis.call('HSET', KEYS[2], lease, record(tokens, expires, 0, 0, holder))
    redis.call('ZADD', KEYS[3], string.format('%.0f', deadline(expires, holder, now, live)), lease)
    redis.call('ZREM', KEYS[4], lease)
    redis.call('HSETNX', KEYS[1], 'spent', '0')
    touch()
    return answer(0)
  end
  if overrun == 0 and spent + tokens <= cap and now - since < wait then
    redis.call('HSET', KEYS[2], lease, record(tokens, since, 3, 0, holder))
    redis.call('ZADD', KEYS[4], string.format('%.0f', now + grace), lease)
    redis.call('HSETNX', KEYS[1], 'spent', '0')
    touch()
    return answer(1)
  end
  redis.call('ZREM', KEYS[4], lease)
  return answer(2)
elseif op == 'commit' then
  local lease = ARGV[4]
  local rec = redis.call('HGET', KEYS[2], lease)
  if not rec then return 0 end
  local tokens, expires, state, charge, holder = parse(rec)
  if state == 1 then return charge end
  if state == 3 then return 0 end
  local actual = math.max(tonumber(ARGV[5]), 0)
  local inside = actual - math.min(math.max(tonumber(ARGV[6] or '0'), 0), actual)
  redis.call('HSET', KEYS[2], lease, record(tokens, expires, 1, actual, holder))
  redis.call('ZREM', KEYS[3], lease)
  redis.call('HINCRBY', KEYS[1], 'spent', string.format('%.0f', actual))
  if inside > tokens then
    redis.call('HINCRBY', KEYS[1], 'overrun', string.format('%.0f', inside - tokens))
  end
  local grow, reply = tonumber(ARGV[7] or '0') or 0, tonumber(ARGV[8] or '0') or 0
  if grow > 0 or reply > 0 then
    redis.call('HINCRBY', KEYS[1], 'rounds', 1)
    if grow > number('growth') then
      redis.call('HSET', KEYS[1], 'growth', string.format('%.0f', grow))
    end
    if reply > number('reply') then
      redis.call('HSET', KEYS[1], 'reply', string.format('%.0f', reply))
    end
  end
  touch()
  return actual
elseif op == 'refund' then
  local lease = ARGV[4]
  local rec = redis.call('HGET', KEYS[2], lease)
  if rec then
    local tokens, expires, state, _, holder = parse(rec)
    if state == 0 then
      redis.call('HSET', KEYS[2], lease, record(tokens, expires, 2, 0, holder))
      redis.call('ZREM', KEYS[3], lease)
      touch()
    end
  end
  return 0
elseif op == 'release' then
  local n = 0
  for i = 3, 4 do
    for _, lease in ipairs(redis.call('ZRANGE', KEYS[i], 0, -1)) do
      for p = 4, #ARGV do
        if string.sub(lease, 1, #ARGV[p]) == ARGV[p] then
          local rec = redis.call('HGET', KEYS[2], lease)
          if rec then
            local tokens, expires, state, _, holder = parse(rec)
            if state == 0 or state == 3 then
              redis.call('HSET', KEYS[2], lease, record(tokens, expires, 2, 0, holder))
              n = n + 1
            end
          end
          redis.call('ZREM', KEYS[i], lease)
          break
        end
      end
    end
  end
  if n > 0 then touch() end
  return n
elseif op == 'beat' then
  local holder, live = ARGV[4], tonumber(ARGV[5])
  local now = now_us()
  local out = {}
  for i = 6, #ARGV do
    local lease, code = ARGV[i], 0
    local rec = redis.call('HGET', KEYS[2], lease)
    if rec then
      local _, expires, state, _, rholder = parse(rec)
      if state == 0 and rholder == holder and holder ~= '' then
        local untl = live_until(lease)
        if untl and untl > now then
          redis.call('ZADD', KEYS[3], string.format('%.0f', deadline(expires, holder, now, live)),
                     lease)
          code = 1
        else
          code = 2  -- its deadline passed before this beat: released, never revived
        end
      end
    end
    out[#out + 1] = code
  end
  return out
elseif op == 'park' then
  local lease = ARGV[4]
  local now = now_us()
  local rec = redis.call('HGET', KEYS[2], lease)
  if not rec then return 0 end
  local tokens, expires, state, charge = parse(rec)
  local untl = live_until(lease)
  if state ~= 0 or not untl or untl <= now then return 0 end
  redis.call('HSET', KEYS[2], lease, record(tokens, expires, 0, charge, ''))
  redis.call('ZADD', KEYS[3], string.format('%.0f', expires), lease)
  touch()
  return 1
elseif op == 'holds' then
  local now = now_us()
  local out = {}
  local live = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. string.format('%.0f', now), '+inf',
                          'WITHSCORES')
  for i = 1, #live, 2 do
    local lease = live[i]
    local tokens, _, _, _, holder = parse(redis.call('HGET', KEYS[2], lease))
    out[#out + 1] = lease
    out[#out + 1] = string.format('%.0f', tokens)
    out[#out + 1] = string.format('%.0f', tonumber(live[i + 1]))
    out[#out + 1] = string.format('%.0f', now)
    out[#out + 1] = holder
  end
  return out
elseif op == 'snapshot' then
  local held, n = live_sum(now_us())
  return {string.format('%.0f', number('spent')), string.format('%.0f', held), n,
          string.format('%.0f', number('overrun'))}
end
return redis.error_reply('unknown budget op ' .. tostring(op))
"""


_VERDICTS: tuple[Verdict, ...] = ("granted", "wait", "refused")
_BEATS: tuple[Beat, ...] = ("gone", "kept", "lapsed")


class RedisBudgetLedger:
    """The run-wide repair-budget semaphore as one Lua script over three run keys, with the
    lease rules of :class:`~pipeline.store.base.BudgetLedger`: the product's rule, of which
    :class:`~pipeline.store.memory.MemoryBudgetLedger` implements the holder-less part for the
    broker-free loop (tests/integration/test_store_protocols.py runs both on the same cases).

    Time comes from the Redis server (``TIME`` inside the script) so every host agrees on lease
    expiry; pass ``clock`` (seconds, any epoch) only for deterministic tests. A commit charges
    the real figure when the lease exists and is not yet committed, even after it expired or
    was refunded: the tokens were really spent, so the ledger says so. Keep lease TTLs above
    the task time limit so that only dead holders expire.

    With a ``holder`` (:class:`~pipeline.store.leases.LeaseHolder`) every lease this ledger
    grants, or is asked for while live, is recorded as that holder's and lives only while the
    holder beats it (:mod:`pipeline.store.leases`); without one, leases carry no holder and
    only their TTL ends them.
    """

    def __init__(
        self,
        client: StoreClient,
        prefix: str | None = None,
        ttl_s: float | None = None,
        clock: Callable[[], float] | None = None,
        *,
        holder: LeaseHolder | None = None,
    ) -> None:
        self._client = client
        self._prefix = resolve_prefix(prefix)
        self._ttl_s = ttl_s
        self._ttl_ms = resolve_ttl_ms(ttl_s)
        self._clock = clock
        self._holder = holder
        self._script = client.register_script(_BUDGET)

    @property
    def holder(self) -> LeaseHolder | None:
        """Who holds the leases this ledger grants (None: no one; only TTLs apply)."""
        return self._holder

    def with_holder(self, holder: LeaseHolder | None) -> RedisBudgetLedger:
        """This ledger (same client, keys and clock) for another holder: a second process."""
        return RedisBudgetLedger(
            self._client, self._prefix, self._ttl_s, self._clock, holder=holder
        )

    def _live_args(self) -> tuple[str, int]:
        if self._holder is None:
            return "", 0
        return self._holder.id, int(self._holder.dead_s * 1_000_000)

    def _call(self, run_id: str, op: str, *args: str | int) -> Any:
        script_keys = [
            keys.run_key(run_id, s, self._prefix)
            for s in (keys.BUDGET, keys.BUDGET_LEASES, keys.BUDGET_LIVE, keys.BUDGET_WAITING)
        ]
        now = "" if self._clock is None else str(int(self._clock() * 1_000_000))
        args_ = [op, self._ttl_ms, now, *args]
        with store_errors(self._client):
            if op == "commit":  # a charge: on the replicas CRITIQUE_STORE_REPLICAS asks for
                return replicated(self._client, self._script, script_keys, args_)
            return self._script(keys=script_keys, args=args_)

    def reserve(self, run_id: str, lease_id: str, tokens: int, cap: int, ttl_s: float) -> bool:
        """Hold ``tokens`` against ``cap`` (spent + live holds + queued + tokens ≤ cap, no
        overrun), or refuse. Reserving a live or committed lease id again answers True, holding
        nothing new."""
        return self.ask(run_id, lease_id, tokens, cap, ttl_s).granted

    def try_reserve(
        self, run_id: str, lease_id: str, tokens: int, cap: int, ttl_s: float
    ) -> BudgetSnapshot | None:
        """:meth:`ask` without a wait: None when granted; when refused, the budget the script's
        refusal saw (the same atomic step)."""
        answer = self.ask(run_id, lease_id, tokens, cap, ttl_s)
        return None if answer.granted else answer.budget

    def ask(
        self, run_id: str, lease_id: str, tokens: int, cap: int, ttl_s: float, wait_s: float = 0.0
    ) -> BudgetAnswer:
        """Grant, ``wait`` or refuse (the rules: :class:`~pipeline.store.base.BudgetLedger`),
        with the budget the script saw; the wait's start is kept in the lease's record, so it
        is measured on the Redis server's clock across every re-ask."""
        if tokens < 0:
            raise ValueError(f"cannot reserve a negative number of tokens ({tokens})")
        answer = self._call(
            run_id,
            "reserve",
            lease_id,
            tokens,
            cap,
            int(ttl_s * 1_000_000),
            int(max(0.0, wait_s) * 1_000_000),
            int(WAITER_GRACE_S * 1_000_000),
            *self._live_args(),
        )
        verdict, spent, held, holders, overrun, queued, waiters, waited_us = (
            int(x) for x in answer
        )
        if verdict == 0 and self._holder is not None:
            self._holder.hold(self, run_id, lease_id)
        snap = BudgetSnapshot(
            spent=spent,
            held=held,
            holders=holders,
            overrun=overrun,
            queued=queued,
            waiters=waiters,
        )
        return BudgetAnswer(_VERDICTS[verdict], snap, waited_us / 1_000_000)

    def commit(
        self,
        run_id: str,
        lease_id: str,
        actual_tokens: int,
        *,
        outside: int = 0,
        usage: RepairUsage | None = None,
    ) -> int:
        """Charge ``actual_tokens`` and release the hold; a repeat returns the first charge;
        0 for an unknown lease. ``outside`` of them (a worker's re-run) is never an overrun.
        ``usage``: the round's growth and reply, kept by their largest with the first charge."""
        seen = usage if usage is not None else RepairUsage()
        charged = int(
            self._call(
                run_id,
                "commit",
                lease_id,
                int(actual_tokens),
                int(outside),
                max(0, int(seen.growth)),
                max(0, int(seen.reply)),
            )
        )
        if self._holder is not None:
            self._holder.drop(self, run_id, lease_id)
        return charged

    def refund(self, run_id: str, lease_id: str) -> None:
        """Release a live lease's hold without charging anything (later calls do nothing)."""
        self._call(run_id, "refund", lease_id)
        if self._holder is not None:
            self._holder.drop(self, run_id, lease_id)

    def beat(self, run_id: str, lease_ids: Sequence[str]) -> dict[str, Beat]:
        """Keep this ledger's holder's live leases among ``lease_ids`` alive for another
        liveness window; what each one was found to be (:data:`~pipeline.store.leases.Beat`).
        A lease past its deadline is never revived. Without a holder: every one is "gone"."""
        if not lease_ids:
            return {}
        if self._holder is None:
            return dict.fromkeys(lease_ids, "gone")
        holder, live_us = self._live_args()
        codes = self._call(run_id, "beat", holder, live_us, *lease_ids)
        return {lease: _BEATS[int(code)] for lease, code in zip(lease_ids, codes, strict=True)}

    def park(self, run_id: str, lease_id: str) -> bool:
        """Hand a live lease to no process: it stays held until its TTL (a repair handed to the
        manager's worker, which no worker process beats for). False when it is not live."""
        parked = bool(int(self._call(run_id, "park", lease_id)))
        if self._holder is not None:
            self._holder.drop(self, run_id, lease_id)
        return parked

    def refund_passes(self, run_id: str, prefixes: Sequence[str]) -> int:
        """Refund every live or waiting lease whose id starts with one of ``prefixes`` (each
        a cancelled pass's, :func:`pipeline.loop.stages.pass_lease_prefix` plus ``":"``), in one
        atomic step; returns how many were. A later commit of one still charges what its
        holder really spent (the tokens were spent)."""
        if not prefixes:
            return 0
        return int(self._call(run_id, "release", *prefixes))

    def spent(self, run_id: str) -> int:
        """Tokens committed so far in the run."""
        key = keys.run_key(run_id, keys.BUDGET, self._prefix)
        with store_errors(self._client):
            value = self._client.hget(key, "spent")
        return 0 if value is None else int(value)

    def usage(self, run_id: str) -> RepairUsage:
        """What the run's committed rounds used, and its spent tokens: one HMGET of the budget
        hash (a single key: one read, the run's slot)."""
        key = keys.run_key(run_id, keys.BUDGET, self._prefix)
        with store_errors(self._client):
            spent, rounds, growth, reply = self._client.hmget(
                key, "spent", "rounds", "growth", "reply"
            )
        return RepairUsage(
            rounds=int(rounds or 0),
            growth=int(growth or 0),
            reply=int(reply or 0),
            spent=int(spent or 0),
        )

    def snapshot(self, run_id: str) -> BudgetSnapshot:
        """Spent, held (by how many live leases) and overrun, in one atomic read."""
        spent, held, holders, overrun = self._call(run_id, "snapshot")
        return BudgetSnapshot(
            spent=int(spent), held=int(held), holders=int(holders), overrun=int(overrun)
        )

    def holds(self, run_id: str) -> dict[str, int]:
        """Live (uncommitted, unexpired) leases and the tokens each holds — for tests and status."""
        flat = self._call(run_id, "holds")
        return {text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 5)}

    def holders(self, run_id: str) -> dict[str, str]:
        """Live leases and the holder of each ("" for one no process holds) — for tests and
        status."""
        flat = self._call(run_id, "holds")
        return {text(flat[i]): text(flat[i + 4]) for i in range(0, len(flat), 5)}


# --- trace stream ----------------------------------------------------------------------------

TraceEntry = tuple[str, dict[str, Any]]
"""One trace stream entry: its stream id (resume point for ``iterate``) and the event."""

_EVENT_FIELD = keys.TRACE_EVENT_FIELD
_PAGE = 1000
_EVENT_MAX = 256 * 1024
"""Most bytes one packed trace event may unpack to (events are a few hundred bytes; a stage's
largest, bounded by the result bounds, stays far below): a reader never expands a stored event
past it."""
_SIG_FIELD = keys.TRACE_SIG_FIELD


# KEYS[1] the run's trace stream, KEYS[2] its ids of recent appends. ARGV: this append's id,
# the stream's MAXLEN (~), the run TTL (ms), how long an id is remembered (ms), then per event
# its packed body and its tag ("" without secrets). Appends the events once: the same id again
# (redis-py re-sent the call after losing its reply) appends nothing and answers 0.
_EMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('ZADD', KEYS[2], 'NX', now, ARGV[1]) == 0 then return 0 end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[4]))
redis.call('PEXPIRE', KEYS[2], ARGV[4])
for i = 5, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'EVENT_FIELD', ARGV[i])
  else
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'EVENT_FIELD', ARGV[i],
      'SIG_FIELD', ARGV[i + 1])
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
""".replace("EVENT_FIELD", _EVENT_FIELD).replace("SIG_FIELD", _SIG_FIELD)
EMIT_OPS_KEPT_MS = 60_000
"""How long an append's id is remembered: longer than redis-py's re-sends of one call take."""


class RedisTraceSink:
    """The run's single trace channel: one Redis stream per run, one JSON event per entry,
    stored packed (:func:`pipeline.store.packing.pack_event`: about a third of its JSON).

    ``emit`` appends with an approximate ``MAXLEN`` trim and refreshes the run TTL in the same
    MULTI/EXEC; ``read`` returns the whole trace; ``iterate`` follows it live (``XREAD BLOCK``).
    """

    def __init__(
        self,
        client: StoreClient,
        prefix: str | None = None,
        ttl_s: float | None = None,
        maxlen: int = keys.TRACE_MAXLEN,
        *,
        secrets: Callable[[], Sequence[bytes]] | None = None,
    ) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be ≥ 1, got {maxlen}")
        self._client = client
        self._prefix = resolve_prefix(prefix)
        self._ttl_ms = resolve_ttl_ms(ttl_s)
        self._maxlen = maxlen
        self._binary = not decodes_responses(client)
        self._secrets = secrets or (lambda: ())
        self._emit = client.register_script(_EMIT)

    def _key(self, run_id: str) -> str:
        return keys.run_key(run_id, keys.TRACE, self._prefix)

    def emit(self, run_id: str, event: Mapping[str, Any]) -> None:
        """Append one JSON-safe event; NaN or a non-JSON value raises ValueError or TypeError."""
        self.emit_encoded(run_id, (encode_event(event),))

    def emit_encoded(self, run_id: str, payloads: Sequence[str]) -> None:
        """Append already encoded events (:func:`encode_event`) in one round trip, once: the
        call carries an id (``_EMIT``), so redis-py re-sending it after a lost reply appends
        nothing twice."""
        if not payloads:
            return
        secrets = self._secrets()
        args: list[Any] = [uuid.uuid4().hex[:16], self._maxlen, self._ttl_ms, EMIT_OPS_KEPT_MS]
        for payload in payloads:
            args.append(pack_event(payload, binary=self._binary))
            if secrets:
                args.append(signing.trace_mac(run_id, payload.encode("utf-8"), secrets[0]))
            else:
                args.append("")
        run_keys = [self._key(run_id), keys.run_key(run_id, keys.TRACE_OPS, self._prefix)]
        with store_errors(self._client):
            self._emit(keys=run_keys, args=args)

    def emit_capped(self, run_id: str, event: Mapping[str, Any], kind: str, cap: int) -> int:
        """Append ``event`` unless the run already holds ``cap`` events of ``kind``; returns how
        many of ``kind`` came (this one included). The ``cap + 1``-th appends one
        ``{"type": "capped", "kind": kind, "cap": cap}`` event instead, and later ones are only
        counted (``trace:capped``, expiring with the run), so a sender that may name any run
        (an unverified message) adds at most ``cap + 1`` events to its trace."""
        counter = keys.run_key(run_id, keys.TRACE_CAPPED, self._prefix)
        with store_errors(self._client):
            pipe = self._client.pipeline(transaction=True)
            pipe.hincrby(counter, kind, 1)
            pipe.pexpire(counter, self._ttl_ms)
            count = int(pipe.execute()[0])
        if count <= cap:
            self.emit(run_id, event)
        elif count == cap + 1:
            note = f"more than {cap} {kind} events: the rest are counted, not traced"
            self.emit(run_id, {"type": "capped", "kind": kind, "cap": cap, "note": note})
        return count

    def capped_counts(self, run_id: str) -> dict[str, int]:
        """How many events of each capped kind came for the run (:meth:`emit_capped`)."""
        counter = keys.run_key(run_id, keys.TRACE_CAPPED, self._prefix)
        with store_errors(self._client):
            raw = self._client.hgetall(counter)
        return {text(k): int(text(v)) for k, v in raw.items()}

    def read(self, run_id: str) -> list[dict[str, Any]]:
        """Every event of the run still in the stream that reads (:meth:`read_checked`), oldest
        first."""
        return self.read_checked(run_id)[0]

    def read_checked(self, run_id: str) -> tuple[list[dict[str, Any]], int]:
        """The run's readable events, oldest first, and how many entries were skipped: with
        secrets, one without a valid tag for this run (planted by a Redis writer, copied from
        another run, written unsigned by an older worker); always, one that does not unpack
        within :data:`_EVENT_MAX` bytes or is not a JSON object. Skips are logged once per
        read, never raised: one bad entry never hides the rest of the trace."""
        key = self._key(run_id)
        events: list[dict[str, Any]] = []
        skipped = 0
        start = "-"
        while True:
            with store_errors(self._client):
                page: list[Any] = self._client.xrange(key, min=start, max="+", count=_PAGE) or []
            for _, fields in page:
                event = None if fields is None else self._decode(run_id, fields)
                if event is None:
                    skipped += 1
                else:
                    events.append(event)
            if len(page) < _PAGE:
                break
            start = "(" + text(page[-1][0])
        if skipped:
            log.warning(
                "run %s: skipped %d trace event(s) that are unsigned, altered, too large or "
                "unreadable",
                run_id,
                skipped,
            )
        return events, skipped

    def _decode(self, run_id: str, fields: Mapping[Any, Any]) -> dict[str, Any] | None:
        """One stream entry's event, or None when it does not read or (with secrets) verify."""
        payload = _event_payload(fields)
        if payload is None:
            return None
        secrets = self._secrets()
        if secrets:
            tag = fields.get(_SIG_FIELD, fields.get(_SIG_FIELD.encode()))
            if not signing.trace_mac_ok(run_id, payload.encode("utf-8"), tag, secrets):
                return None
        try:
            event = json.loads(payload)
        except (ValueError, RecursionError):
            return None
        return event if isinstance(event, dict) else None

    def iterate(
        self,
        run_id: str,
        block_ms: int = 1000,
        last_id: str = "0-0",
        idle_limit: int | None = None,
    ) -> Iterator[TraceEntry]:
        """Yield ``(entry id, event)`` after ``last_id`` as they arrive ("$": only new ones).

        Each wait blocks up to ``block_ms`` (keep it below the client's socket timeout); the
        generator ends after ``idle_limit`` consecutive empty waits, never when it is None.
        """
        if block_ms < 1:
            raise ValueError("block_ms must be ≥ 1 (0 would block forever)")
        timeout = connection_kwargs(self._client).get("socket_timeout")
        if timeout is not None and block_ms >= timeout * 1000:
            raise ValueError(
                f"block_ms={block_ms} must be below the client's socket_timeout ({timeout} s)"
            )
        key = self._key(run_id)
        idle = 0
        while True:
            with store_errors(self._client):
                reply = self._client.xread({key: last_id}, count=_PAGE, block=block_ms)
            entries = _stream_entries(reply)
            if not entries:
                idle += 1
                if idle_limit is not None and idle >= idle_limit:
                    return
                continue
            idle = 0
            for entry_id, fields in entries:
                last_id = text(entry_id)
                event = self._decode(run_id, fields)
                if event is not None:  # a bad entry is skipped, as read_checked does
                    yield last_id, event


def _stream_entries(reply: Any) -> list[Any]:
    """The entries of a one-stream XREAD reply, whichever shape redis-py parsed it into.

    RESP2 gives ``[[stream, entries]]``; RESP3 ``{stream: [entries]}``; the unified parser
    ``{stream: entries}``. Entries are ``(id, fields)`` tuples.
    """
    if not reply:
        return []
    value = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
    if value and isinstance(value[0], list):
        value = value[0]
    return [entry for entry in value if entry is not None]


def _event_payload(fields: Mapping[Any, Any]) -> str | None:
    """The JSON text of a stream entry's event, unpacked within :data:`_EVENT_MAX` bytes; None
    when the entry has no event or it does not unpack within the bound (a planted bomb)."""
    raw = fields.get(_EVENT_FIELD, fields.get(_EVENT_FIELD.encode()))
    return None if raw is None else unpack(raw, _EVENT_MAX)
