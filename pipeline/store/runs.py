"""The run registry in Redis: what was submitted, and the final result of each submission.

``submitted`` and ``results`` are hashes keyed ``"<iteration>:<worker_id>"``. Each submit of a
submission starts a *pass* with a fresh pass id (``sid``, SPEC §4 "Passes"): the client records
it as the submission's latest pass (:meth:`RedisRunStore.begin_pass`, before the chain is
sent, clearing the previous pass's entry in ``results``), and the gate stores the pass's result
once (:meth:`RedisRunStore.put_result`): in ``results:pass`` under the pass, with its ``result``
trace event in the same script, and in ``results`` only while it is the latest pass. So
``results`` holds the latest pass's result (status, reports, the completion gate), and
``wait(handle)`` reads its own pass's. Every write refreshes the run TTL.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import redis

from pipeline.models import CritiqueResult
from pipeline.store import keys
from pipeline.store.redis_common import resolve_prefix, resolve_ttl_ms, store_errors, text

# KEYS[1] completions hash; ARGV[1] the request's field; ARGV[2] TTL (ms).
_COUNT_ONCE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], 1) == 1 then
  redis.call('HINCRBY', KEYS[1], 'rejected', 1)
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return tonumber(redis.call('HGET', KEYS[1], 'rejected') or '0')
"""


# KEYS[1] steps hash, KEYS[2] trace stream, KEYS[3] pending sorted set; ARGV: step, output,
# TTL (ms), stream maxlen, event field, the pass's pending member ("" for none), now (s), then
# the encoded events. Returns nil when this call recorded the step, else the output recorded
# first. A first record is the pass's progress: its pending score (if it is still pending, XX)
# moves to now, which is what the stall sweeper (workers.recovery) measures.
_RECORD_STEP = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return redis.call('HGET', KEYS[1], ARGV[1])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if ARGV[6] ~= '' then
  redis.call('ZADD', KEYS[3], 'XX', ARGV[7], ARGV[6])
end
if #ARGV > 7 then
  for i = 8, #ARGV do
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', ARGV[5], ARGV[i])
  end
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return false
"""


# KEYS[1] results, KEYS[2] results:pass, KEYS[3] passes, KEYS[4] pending, KEYS[5] trace.
# ARGV: submission field, pass field (= the pending member), pass id, result JSON, TTL (ms),
# stream maxlen, event field, then the encoded events. The first gate of a pass stores its
# result and appends its events (returns 1); a repeat writes nothing (returns 0). ``results``
# takes it only while it is the latest pass (or no pass was recorded: a chain sent without the
# client).
_PUT_RESULT = """
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[4]) == 0 then
  return 0
end
local latest = redis.call('HGET', KEYS[3], ARGV[1])
if (not latest) or latest == ARGV[3] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[4])
end
redis.call('ZREM', KEYS[4], ARGV[2])
for i = 8, #ARGV do
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[6], '*', ARGV[7], ARGV[i])
end
for i = 1, 5 do
  if i ~= 4 then redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
end
return 1
"""

# KEYS[1] passes, KEYS[2] results. ARGV: submission field, pass id, TTL (ms).
_BEGIN_PASS = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


_STAGE_RANK = {"l0": 0, "critic": 1, "decide": 2, "repair": 3}


def _step_order(rest: str) -> tuple[int, int, int] | None:
    """``"<round>:<attempt>:<stage>"`` → a sort key in the loop's order; None if malformed."""
    parts = rest.split(":")
    if len(parts) != 3 or parts[2] not in _STAGE_RANK:
        return None
    try:
        return int(parts[0]), int(parts[1]), _STAGE_RANK[parts[2]]
    except ValueError:
        return None


def member(iteration: int, worker_id: str) -> str:
    """The hash field of one submission."""
    return f"{iteration}:{worker_id}"


def pass_member(iteration: int, worker_id: str, sid: str) -> str:
    """The ``pending`` sorted-set member of one submission pass."""
    return f"{iteration}:{worker_id}:{sid}"


def _pass_of_step(step: str) -> str:
    """The pass member a chain step id belongs to (``""`` for a step outside a pass, such as a
    completion gate's): ``"<iteration>:<worker>:<sid>"`` of ``"…:<round>:<attempt>:<stage>"``."""
    parts = step.split(":")
    return ":".join(parts[:3]) if len(parts) == 6 else ""


class RedisRunStore:
    """Submissions and results of runs."""

    def __init__(
        self, client: redis.Redis, *, prefix: str | None = None, ttl_s: float | None = None
    ) -> None:
        self._r = client
        self._prefix = resolve_prefix(prefix)
        self._ttl_ms = resolve_ttl_ms(ttl_s)
        self._record_step = client.register_script(_RECORD_STEP)
        self._count_once = client.register_script(_COUNT_ONCE)
        self._put_result = client.register_script(_PUT_RESULT)
        self._begin_pass = client.register_script(_BEGIN_PASS)

    def _key(self, run_id: str, suffix: str) -> str:
        return keys.run_key(run_id, suffix, self._prefix)

    def _hset(self, run_id: str, suffix: str, field: str, value: str) -> None:
        key = self._key(run_id, suffix)
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=True)
            pipe.hset(key, field, value)
            pipe.pexpire(key, self._ttl_ms)
            pipe.execute()

    def mark_submitted(
        self,
        run_id: str,
        iteration: int,
        worker_id: str,
        task_id: str,
        signature: str,
        *,
        sid: str = "",
        message: dict[str, Any] | None = None,
    ) -> None:
        """Record that a submission entered the pipeline (for status, the redundancy guard and
        ``resume``: the pass id ``sid`` and the first stage ``message``)."""
        doc: dict[str, Any] = {"task_id": task_id, "signature": signature, "at": time.time()}
        if sid:
            doc["sid"] = sid
        if message is not None:
            doc["message"] = message
        self._hset(run_id, keys.SUBMITTED, member(iteration, worker_id), json.dumps(doc))

    def submission(self, run_id: str, iteration: int, worker_id: str) -> dict[str, Any] | None:
        """One submission's ``mark_submitted`` record (the latest pass's), or None."""
        with store_errors(self._r):
            raw = self._r.hget(self._key(run_id, keys.SUBMITTED), member(iteration, worker_id))
        return None if raw is None else dict(json.loads(text(raw)))

    def latest_step(
        self, run_id: str, iteration: int, worker_id: str, sid: str
    ) -> tuple[str, str] | None:
        """The last recorded step of one submission pass: ``(step id, output)``, or None.

        Steps are ordered by (round, attempt, stage): l0 < critic < decide < repair within a
        round and attempt, which is the order the loop runs them in. A scan of the run's steps
        hash: meant for recovery and status, not for every stage.
        """
        key = self._key(run_id, keys.STEPS)
        prefix = f"{iteration}:{worker_id}:{sid}:"
        best: tuple[tuple[int, int, int], str] | None = None
        with store_errors(self._r):
            for raw in self._r.hscan_iter(key, match=f"{prefix}*", count=1000):
                step = text(raw[0] if isinstance(raw, tuple) else raw)
                order = _step_order(step[len(prefix) :])
                if order is not None and (best is None or order > best[0]):
                    best = (order, step)
            if best is None:
                return None
            output = self._r.hget(key, best[1])
        return None if output is None else (best[1], text(output))

    def submitted(self, run_id: str) -> dict[str, dict[str, Any]]:
        """Every submission of the run: field -> {task_id, signature, at}."""
        with store_errors(self._r):
            raw = self._r.hgetall(self._key(run_id, keys.SUBMITTED))
        return {text(k): json.loads(text(v)) for k, v in raw.items()}

    def begin_pass(self, run_id: str, iteration: int, worker_id: str, sid: str) -> None:
        """Record ``sid`` as the submission's latest pass (call before its chain is sent): the
        previous pass's result leaves ``results`` (it stays under its own pass), and only this
        pass's gate will write there."""
        field = member(iteration, worker_id)
        with store_errors(self._r):
            self._begin_pass(
                keys=[self._key(run_id, keys.PASSES), self._key(run_id, keys.RESULTS)],
                args=[field, sid, self._ttl_ms],
            )

    def latest_pass(self, run_id: str, iteration: int, worker_id: str) -> str | None:
        """The submission's latest pass id, or None (never submitted through the client)."""
        with store_errors(self._r):
            raw = self._r.hget(self._key(run_id, keys.PASSES), member(iteration, worker_id))
        return None if raw is None else text(raw)

    def put_result(
        self, result: CritiqueResult, *, sid: str | None = None, events: Sequence[str] = ()
    ) -> bool:
        """Store a submission pass's final result once, with its trace ``events`` (encoded).

        With its pass id ``sid``: one atomic script stores it under the pass, in ``results``
        while it is the latest pass, takes the pass off the pending index (it can no longer
        stall) and appends the events; a repeated call (a re-run gate) writes nothing and
        returns False. Without ``sid``: ``results`` is written (idempotently) with the events.
        """
        field = member(result.iteration, result.worker_id)
        raw = result.model_dump_json()
        if not sid:
            key = self._key(result.run_id, keys.RESULTS)
            trace = self._key(result.run_id, keys.TRACE)
            with store_errors(self._r):
                pipe = self._r.pipeline(transaction=True)
                pipe.hset(key, field, raw)
                pipe.pexpire(key, self._ttl_ms)
                for payload in events:
                    pipe.xadd(
                        trace,
                        {keys.TRACE_EVENT_FIELD: payload},
                        maxlen=keys.TRACE_MAXLEN,
                        approximate=True,
                    )
                if events:
                    pipe.pexpire(trace, self._ttl_ms)
                pipe.execute()
            return True
        script_keys = [
            self._key(result.run_id, s)
            for s in (keys.RESULTS, keys.PASS_RESULTS, keys.PASSES, keys.PENDING, keys.TRACE)
        ]
        with store_errors(self._r):
            got = self._put_result(
                keys=script_keys,
                args=[
                    field,
                    pass_member(result.iteration, result.worker_id, sid),
                    sid,
                    raw,
                    self._ttl_ms,
                    keys.TRACE_MAXLEN,
                    keys.TRACE_EVENT_FIELD,
                    *events,
                ],
            )
        return bool(int(got))

    def result(self, run_id: str, iteration: int, worker_id: str) -> CritiqueResult | None:
        """The latest pass's result, or None while it is not there yet."""
        with store_errors(self._r):
            raw = self._r.hget(self._key(run_id, keys.RESULTS), member(iteration, worker_id))
        return None if raw is None else CritiqueResult.model_validate_json(raw)

    def pass_result(
        self, run_id: str, iteration: int, worker_id: str, sid: str
    ) -> CritiqueResult | None:
        """The result of one pass (``sid``), or None while that pass has not finished."""
        with store_errors(self._r):
            raw = self._r.hget(
                self._key(run_id, keys.PASS_RESULTS), pass_member(iteration, worker_id, sid)
            )
        return None if raw is None else CritiqueResult.model_validate_json(raw)

    def results(self, run_id: str, iteration: int | None = None) -> list[CritiqueResult]:
        """The run's results (of one iteration when given), ordered by iteration and worker."""
        with store_errors(self._r):
            raw = self._r.hgetall(self._key(run_id, keys.RESULTS))
        out = [CritiqueResult.model_validate_json(v) for v in raw.values()]
        if iteration is not None:
            out = [r for r in out if r.iteration == iteration]
        return sorted(out, key=lambda r: (r.iteration, r.worker_id))

    def step_output(self, run_id: str, step: str) -> str | None:
        """The recorded output of a chain step, if the step already completed once."""
        with store_errors(self._r):
            raw = self._r.hget(self._key(run_id, keys.STEPS), step)
        return None if raw is None else text(raw)

    def record_step(
        self, run_id: str, step: str, output: str, events: Sequence[str] = ()
    ) -> str | None:
        """Record a step's output unless one is there already, with the step's trace events.

        One atomic script: when this is the first record of ``step``, the output is stored and
        ``events`` (encoded trace payloads) are appended to the run's stream, and None is
        returned; otherwise nothing is written and the output recorded first is returned.
        """
        steps = self._key(run_id, keys.STEPS)
        trace = self._key(run_id, keys.TRACE)
        pending = self._key(run_id, keys.PENDING)
        with store_errors(self._r):
            got = self._record_step(
                keys=[steps, trace, pending],
                args=[
                    step,
                    output,
                    self._ttl_ms,
                    keys.TRACE_MAXLEN,
                    keys.TRACE_EVENT_FIELD,
                    _pass_of_step(step),
                    repr(time.time()),
                    *events,
                ],
            )
        return None if got is None else text(got)

    def count_rejection_once(self, run_id: str, request_id: str) -> int:
        """Count one completion-gate rejection for ``request_id`` unless it was counted already
        (a redelivered gate task counts nothing); returns the count after it."""
        key = self._key(run_id, keys.COMPLETIONS)
        with store_errors(self._r):
            got = self._count_once(keys=[key], args=[f"req:{request_id}", self._ttl_ms])
        return int(got)

    def rejections(self, run_id: str) -> int:
        """Completion-gate rejections so far."""
        with store_errors(self._r):
            raw = self._r.hget(self._key(run_id, keys.COMPLETIONS), "rejected")
        return 0 if raw is None else int(raw)
