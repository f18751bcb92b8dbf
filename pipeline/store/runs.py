"""The run registry in Redis: what was submitted, and the final result of each submission.

``submitted`` and ``results`` are hashes keyed ``"<iteration>:<worker_id>"``; writes are
idempotent (a redelivered gate task rewrites the same field with the same value). Every write
refreshes the run TTL.
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

    def put_result(self, result: CritiqueResult, *, sid: str | None = None) -> None:
        """Store a submission's final result (idempotent); with its pass id ``sid``, the pass
        leaves the pending index in the same transaction (it can no longer stall)."""
        if not sid:
            self._hset(
                result.run_id,
                keys.RESULTS,
                member(result.iteration, result.worker_id),
                result.model_dump_json(),
            )
            return
        key = self._key(result.run_id, keys.RESULTS)
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=True)
            pipe.hset(key, member(result.iteration, result.worker_id), result.model_dump_json())
            pipe.pexpire(key, self._ttl_ms)
            pipe.zrem(
                self._key(result.run_id, keys.PENDING),
                pass_member(result.iteration, result.worker_id, sid),
            )
            pipe.execute()

    def result(self, run_id: str, iteration: int, worker_id: str) -> CritiqueResult | None:
        """One result, or None while it is not there yet."""
        with store_errors(self._r):
            raw = self._r.hget(self._key(run_id, keys.RESULTS), member(iteration, worker_id))
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

    def count_rejection(self, run_id: str) -> int:
        """Add one completion-gate rejection; returns the count before this one."""
        key = self._key(run_id, keys.COMPLETIONS)
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=True)
            pipe.hincrby(key, "rejected", 1)
            pipe.pexpire(key, self._ttl_ms)
            after, _ = pipe.execute()
        return int(after) - 1

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
