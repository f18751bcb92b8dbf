"""Cluster-wide LLM rate limits: one GCRA bucket pair per model in Redis.

Every worker process on every machine asks the same Lua script for a slot before each LLM
call, so a fleet stays under the provider's requests-per-minute and tokens-per-minute limits
(Celery's own ``rate_limit`` is per worker). The script keeps, per model, one hash
``<prefix>:ratelimit:<model>`` with the theoretical arrival time (TAT, ms, Redis's clock) of
each limit: ``rpm`` (cost 1 per call) and ``tpm`` (cost = the call's reserved tokens).

GCRA per limit, with rate ``r`` per ms and depth ``D`` ms (``burst_s``): ``tat = max(TAT, now)``;
the call fits when ``tat + cost/r - now <= max(D, cost/r)`` (a call bigger than the whole
depth goes through on a full bucket, then the bucket owes it). Both limits must fit; then both
TATs advance atomically, else nothing changes and the reply says how long to wait.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from pipeline.config import RateLimit
from pipeline.errors import LLMTransientError
from pipeline.store import keys
from pipeline.store.redis_common import StoreClient, store_errors

_GCRA = """
-- KEYS[1]: the model's hash (fields rpm, tpm: TAT in ms; ops: the ids of the latest grants)
-- ARGV: now_ms (or "" for Redis TIME), then per limit (rpm, tpm): interval_ms_per_unit,
--       depth_ms, cost; an interval of 0 means "no such limit"; ARGV[8]: this call's id.
-- Reply: {allowed (1/0), wait_ms as a string}. A call whose id is among the latest grants was
-- granted already (redis-py re-sent it after losing the reply): granted again, nothing taken.
local op = " " .. ARGV[8] .. " "
local ops = redis.call("HGET", KEYS[1], "ops") or " "
if string.find(ops, op, 1, true) then
  return {1, "0"}
end
local now
if ARGV[1] == "" then
  local t = redis.call("TIME")
  now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
else
  now = tonumber(ARGV[1])
end
local fields = {"rpm", "tpm"}
local new = {}
local wait = 0
local ttl = 0
for i, field in ipairs(fields) do
  local interval = tonumber(ARGV[2 + (i - 1) * 3])
  local depth = tonumber(ARGV[3 + (i - 1) * 3])
  local cost = tonumber(ARGV[4 + (i - 1) * 3])
  if interval > 0 and cost > 0 then
    local tat = tonumber(redis.call("HGET", KEYS[1], field) or "0") or 0
    if tat < now then tat = now end
    local step = cost * interval
    local allowance = depth
    if step > allowance then allowance = step end
    local ahead = tat + step - now
    if ahead > allowance then
      if ahead - allowance > wait then wait = ahead - allowance end
    else
      new[field] = tat + step
      if ahead > ttl then ttl = ahead end
    end
  end
end
if wait > 0 then
  return {0, string.format("%.3f", wait)}
end
for field, tat in pairs(new) do
  redis.call("HSET", KEYS[1], field, string.format("%.3f", tat))
end
ops = ops .. ARGV[8] .. " "
if #ops > OPS_KEPT_CHARS then
  ops = " " .. string.sub(ops, string.find(ops, " ", #ops - OPS_KEPT_CHARS + 1, true) + 1)
end
redis.call("HSET", KEYS[1], "ops", ops)
-- kept while a re-send may come (redis-py backs off up to 10 s), or while a TAT is ahead
redis.call("PEXPIRE", KEYS[1], math.max(math.ceil(ttl) + 1000, 30000))
return {1, "0"}
"""


_OPS_KEPT = 512
"""Grant ids each model's bucket remembers (16 hex characters each): a re-sent call is
recognised while fewer than this many grants came after it (seconds, at any real rate)."""
_GCRA = _GCRA.replace("OPS_KEPT_CHARS", str(_OPS_KEPT * 17))


class RedisRateLimiter:
    """Slots from the shared buckets: :meth:`try_acquire` once, :meth:`acquire` waiting."""

    def __init__(
        self,
        client: StoreClient,
        *,
        prefix: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._script = client.register_script(_GCRA)
        self._sleep = sleep
        self._clock = clock

    def key(self, model: str) -> str:
        return keys.ratelimit_key(model, self._prefix)

    def try_acquire(
        self, model: str, limit: RateLimit, tokens: int, now_ms: float | None = None
    ) -> float:
        """Take a slot for one call of ``tokens`` reserved tokens: 0.0 when taken, else the
        seconds to wait before it could be (nothing taken). ``now_ms`` replaces Redis's clock
        (tests)."""
        args: list[Any] = ["" if now_ms is None else f"{now_ms:.3f}"]
        for per_minute, cost in ((limit.rpm, 1), (limit.tpm, max(0, tokens))):
            if per_minute is None:
                args += [0, 0, 0]
            else:
                args += [60_000.0 / per_minute, limit.burst_s * 1000.0, cost]
        args.append(uuid.uuid4().hex[:16])  # this call's id: a re-send takes no second slot
        with store_errors(self._client):
            allowed, wait_ms = self._script(keys=[self.key(model)], args=args)
        if int(allowed):
            return 0.0
        return float(wait_ms.decode() if isinstance(wait_ms, bytes) else wait_ms) / 1000.0

    def acquire(
        self,
        model: str,
        limit: RateLimit,
        tokens: int,
        on_wait: Callable[[float], None] | None = None,
    ) -> float:
        """Wait for a slot (at most ``limit.max_wait_s``) and take it; the seconds waited.

        ``on_wait(seconds)`` is called before each sleep (a progress event). Past the deadline
        :class:`~pipeline.errors.LLMTransientError`."""
        began = self._clock()
        deadline = began + limit.max_wait_s
        while True:
            wait = self.try_acquire(model, limit, tokens)
            if wait <= 0:
                return self._clock() - began
            now = self._clock()
            if now + wait > deadline:
                raise LLMTransientError(
                    f"rate limit for {model!r}: no slot within {limit.max_wait_s:g} s "
                    f"(next in {wait:.1f} s)",
                    hint="raise llm.rate_limit (rpm/tpm) or max_wait_s, or run fewer workers",
                )
            if on_wait is not None:
                on_wait(wait)
            # a little jitter-free slack past the wait: the slot is free by then
            self._sleep(min(wait + 0.001, max(0.0, deadline - now)))

    def waiter(
        self,
        limit_for: Callable[[str], RateLimit | None],
        on_wait: Callable[[str, float], None] | None = None,
    ) -> Callable[[str, int], float]:
        """A callable for :class:`pipeline.llm.completion.LiteLLMCompleter`'s ``wait_for_slot``:
        ``(model, tokens) -> seconds waited``; models without a limit pass at once."""

        def wait_for_slot(model: str, tokens: int) -> float:
            limit = limit_for(model)
            if limit is None or (limit.rpm is None and limit.tpm is None):
                return 0.0
            report = None if on_wait is None else (lambda s: on_wait(model, s))
            return self.acquire(model, limit, tokens, report)

        return wait_for_slot
