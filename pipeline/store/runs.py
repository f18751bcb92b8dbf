"""The run registry in Redis: what was submitted, and the final result of each submission.

``submitted`` and ``results`` are hashes keyed ``"<iteration>:<worker_id>"``. Each submit of a
submission starts a *pass* with a fresh pass id (``sid``, SPEC §4 "Passes"): the client records
it as the submission's latest pass (:meth:`RedisRunStore.begin_pass`, before the chain is
sent, clearing the previous pass's entry in ``results``), and the gate stores the pass's result
once (:meth:`RedisRunStore.put_result`): in ``results:pass`` under the pass, with its ``result``
trace event in the same script, and in ``results`` only while it is the latest pass. So
``results`` holds the latest pass's result (status, reports, the completion gate), and
``wait(handle)`` reads its own pass's. Every write refreshes the run TTL.

A pass (or a completion-gate request) that a worker failed for good gets a failure record in
``failures`` (:meth:`RedisRunStore.put_failure`): the one place a client learns that a pass
will have no result. Celery's result backend is not read for it: anyone who can write to the
broker can make a task id's state ``FAILURE``.

With secrets (``CRITIQUE_SECRET``, given as a callable), every result, failure and completion
decision is stored signed (:func:`pipeline.signing.sign_record`), and a reader trusts only a
record that verifies and names the run, submission and pass it is filed under; any other is
treated as absent and logged (once per record), never as a verdict. Without secrets records are
stored and read unsigned, as before.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from pipeline import signing
from pipeline.errors import ForgedMessageError
from pipeline.models import CritiqueResult
from pipeline.store import keys
from pipeline.store.redis_common import resolve_prefix, resolve_ttl_ms, store_errors, text

log = logging.getLogger(__name__)

RESULT_KIND = "result"
"""The record kind a pass's result is signed as."""
FAILURE_KIND = "failure"
"""The record kind a failure (of a pass or a completion-gate request) is signed as."""
COMPLETION_KIND = "completion"
"""The record kind a completion-gate decision is signed as."""
COMPLETE_GATE = "complete_gate"
"""What a completion-gate request's step id and failure member start with."""
_NOTED_MAX = 1024
"""Most unverifiable records (each is logged once), or runs indexed, remembered per store."""
_INDEX_EVERY_S = 60.0
"""A store puts a run on the archiver's index at most this often (see ``mark_submitted``)."""


@dataclass(frozen=True)
class Failure:
    """A worker's record that a submission pass (or a completion-gate request) failed for good
    and will have no result: the stage, the error's type and its one-line reason."""

    stage: str
    error: str
    reason: str
    refused: bool
    """The worker refused the submission or its configuration (not a stage that raised)."""
    task_id: str = ""
    at: float = 0.0


def completion_member(request_id: str) -> str:
    """The ``failures`` member (and ``steps`` field) of one completion-gate request."""
    return f"{COMPLETE_GATE}:{request_id}"


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
        self,
        client: redis.Redis,
        *,
        prefix: str | None = None,
        ttl_s: float | None = None,
        secrets: Callable[[], Sequence[bytes]] | None = None,
    ) -> None:
        self._r = client
        self._prefix = resolve_prefix(prefix)
        self._ttl_ms = resolve_ttl_ms(ttl_s)
        self._secrets = secrets or (lambda: ())
        self._noted: set[tuple[str, str, str]] = set()
        self._indexed: dict[str, float] = {}
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
        self._index_for_archive(run_id, doc["at"])

    def _index_for_archive(self, run_id: str, now: float) -> None:
        """Put the run on the archiver's index (``workers.archiving``) unless it is there: a
        new entry is looked at now; an entry the archiver scheduled keeps its time. Once per
        run per :data:`_INDEX_EVERY_S` (or a quarter of the run TTL) per store, not per
        submission: the archiver drops a run only after its keys expired."""
        if now - self._indexed.get(run_id, -math.inf) < min(_INDEX_EVERY_S, self._ttl_ms / 4000):
            return
        index = keys.shared_key(keys.ARCHIVE_RUNS, self._prefix)
        with store_errors(self._r):  # another cluster slot: not in the registry's transaction
            pipe = self._r.pipeline(transaction=False)
            pipe.zadd(index, {run_id: now}, nx=True)
            pipe.pexpire(index, self._ttl_ms)
            pipe.execute()
        if len(self._indexed) >= _NOTED_MAX:
            self._indexed.clear()
        self._indexed[run_id] = now

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
        raw = self._seal(RESULT_KIND, result.model_dump_json())
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
        """The latest pass's result, or None while it is not there yet (or not verifiable)."""
        field = member(iteration, worker_id)
        with store_errors(self._r):
            raw = self._r.hget(self._key(run_id, keys.RESULTS), field)
        return None if raw is None else self._result(raw, run_id, keys.RESULTS, field)

    def pass_result(
        self, run_id: str, iteration: int, worker_id: str, sid: str
    ) -> CritiqueResult | None:
        """The result of one pass (``sid``), or None while that pass has not finished (or its
        record is not verifiable)."""
        outcome = self.pass_outcome(run_id, iteration, worker_id, sid, failure=False)
        return outcome if isinstance(outcome, CritiqueResult) else None

    def pass_outcome(
        self, run_id: str, iteration: int, worker_id: str, sid: str, *, failure: bool = True
    ) -> CritiqueResult | Failure | None:
        """What one pass ended in, in one round trip: its result, else (with ``failure``) the
        failure a worker recorded for it, else None (still running, or nothing verifiable)."""
        field = pass_member(iteration, worker_id, sid)
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.hget(self._key(run_id, keys.PASS_RESULTS), field)
            if failure:
                pipe.hget(self._key(run_id, keys.FAILURES), field)
            got = pipe.execute()
        if got[0] is not None:
            result = self._result(got[0], run_id, keys.PASS_RESULTS, field, sid)
            if result is not None:
                return result
        if failure and got[1] is not None:
            return self._failure(got[1], run_id, field)
        return None

    def results(self, run_id: str, iteration: int | None = None) -> list[CritiqueResult]:
        """The run's results (of one iteration when given), ordered by iteration and worker;
        records that do not verify are left out."""
        with store_errors(self._r):
            raw = self._r.hgetall(self._key(run_id, keys.RESULTS))
        out = []
        for field, value in raw.items():
            result = self._result(value, run_id, keys.RESULTS, text(field))
            if result is not None and (iteration is None or result.iteration == iteration):
                out.append(result)
        return sorted(out, key=lambda r: (r.iteration, r.worker_id))

    def pass_results(self, run_id: str) -> list[CritiqueResult]:
        """Every pass result the run holds (``results:pass``: the latest passes' and superseded
        ones), ordered by iteration, worker and pass; records that do not verify are left out."""
        with store_errors(self._r):
            raw = self._r.hgetall(self._key(run_id, keys.PASS_RESULTS))
        out = []
        for field, value in raw.items():
            name = text(field)
            result = self._result(value, run_id, keys.PASS_RESULTS, name, name.split(":")[-1])
            if result is not None:
                out.append(result)
        return sorted(out, key=lambda r: (r.iteration, r.worker_id, r.pass_id))

    # -- failures -------------------------------------------------------------------------------
    def put_failure(
        self,
        run_id: str,
        field: str,
        *,
        stage: str,
        error: str,
        reason: str,
        refused: bool,
        task_id: str = "",
    ) -> bool:
        """Record that a pass (its :func:`pass_member`) or a completion-gate request (its
        :func:`completion_member`) failed for good; a worker calls it only for a failure it can
        attribute (a message that verified and was addressed to the failing task). The first
        record wins (a repeat writes nothing: False); the pass leaves the pending index."""
        doc = {
            "run_id": run_id,
            "member": field,
            "stage": stage,
            "error": error,
            "reason": reason,
            "refused": refused,
            "task_id": task_id,
            "at": time.time(),
        }
        raw = json.dumps(signing.sign_record(FAILURE_KIND, doc, self._secrets()))
        key = self._key(run_id, keys.FAILURES)
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=True)
            pipe.hsetnx(key, field, raw)
            pipe.pexpire(key, self._ttl_ms)
            pipe.zrem(self._key(run_id, keys.PENDING), field)
            got = pipe.execute()
        return bool(got[0])

    def failure(self, run_id: str, field: str) -> Failure | None:
        """The failure recorded for a pass member or completion member, if any verifies."""
        with store_errors(self._r):
            raw = self._r.hget(self._key(run_id, keys.FAILURES), field)
        return None if raw is None else self._failure(raw, run_id, field)

    def failures(self, run_id: str) -> dict[str, Failure]:
        """Every verifiable failure recorded in the run, by member."""
        with store_errors(self._r):
            raw = self._r.hgetall(self._key(run_id, keys.FAILURES))
        out = {}
        for field, value in raw.items():
            got = self._failure(value, run_id, text(field))
            if got is not None:
                out[text(field)] = got
        return out

    # -- completion-gate decisions --------------------------------------------------------------
    def record_completion(
        self, run_id: str, request_id: str, decision: dict[str, Any], events: Sequence[str] = ()
    ) -> dict[str, Any] | None:
        """Record a completion-gate request's decision (signed) with its trace ``events`` unless
        one is there already: None when this call recorded it, else the decision recorded
        first (``{}`` when that record does not verify)."""
        doc = {"run_id": run_id, "request_id": request_id, "decision": decision}
        raw = json.dumps(signing.sign_record(COMPLETION_KIND, doc, self._secrets()))
        step = completion_member(request_id)
        first = self.record_step(run_id, step, raw, events)
        if first is None:
            return None
        return self._completion(first, run_id, request_id) or {}

    def completion(self, run_id: str, request_id: str) -> dict[str, Any] | None:
        """The decision recorded for a completion-gate request, if it is there and verifies."""
        got = self.completion_outcome(run_id, request_id, failure=False)
        return got if isinstance(got, dict) else None

    def completion_outcome(
        self, run_id: str, request_id: str, *, failure: bool = True
    ) -> dict[str, Any] | Failure | None:
        """What a completion-gate request ended in, in one round trip: its decision (as
        recorded, a dict), else (with ``failure``) the failure a worker recorded, else None."""
        field = completion_member(request_id)
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.hget(self._key(run_id, keys.STEPS), field)
            if failure:
                pipe.hget(self._key(run_id, keys.FAILURES), field)
            got = pipe.execute()
        if got[0] is not None:
            decision = self._completion(text(got[0]), run_id, request_id)
            if decision is not None:
                return decision
        if failure and got[1] is not None:
            return self._failure(got[1], run_id, field)
        return None

    def completions(self, run_id: str) -> dict[str, dict[str, Any]]:
        """Every completion-gate decision recorded in the run that verifies: request id ->
        decision (a scan of the run's step records)."""
        out: dict[str, dict[str, Any]] = {}
        lead = f"{COMPLETE_GATE}:"
        with store_errors(self._r):
            rows = list(
                self._r.hscan_iter(self._key(run_id, keys.STEPS), match=f"{lead}*", count=1000)
            )
        for name, value in rows:
            request_id = text(name)[len(lead) :]
            decision = self._completion(text(value), run_id, request_id)
            if decision is not None:
                out[request_id] = decision
        return out

    # -- signed records -------------------------------------------------------------------------
    def _seal(self, kind: str, raw: str) -> str:
        """``raw`` (a JSON object) as stored: unchanged without secrets, else with its ``sig``."""
        secrets = self._secrets()
        if not secrets:
            return raw
        return json.dumps(signing.sign_record(kind, json.loads(raw), secrets), ensure_ascii=False)

    def _unseal(
        self, kind: str, raw: str | bytes, where: tuple[str, str, str]
    ) -> dict[str, Any] | None:
        """The record stored at ``where`` (run, hash, field) without its ``sig``, if it is a
        JSON object that verifies as ``kind`` (any, without secrets); else None, logged once."""
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            self._note(where, f"not a {kind} record")
            return None
        secrets = self._secrets()
        if secrets:
            try:
                signing.verify_record(kind, doc, secrets)
            except ForgedMessageError as exc:
                self._note(where, exc.message)
                return None
        doc.pop(signing.SIG_FIELD, None)
        return doc

    def _result(
        self, raw: str | bytes, run_id: str, hash_: str, field: str, sid: str | None = None
    ) -> CritiqueResult | None:
        """A stored result, if it verifies and belongs where it is filed: its run, submission
        (``field`` of ``results``) or pass (``field`` of ``results:pass``, ``sid``)."""
        where = (run_id, hash_, field)
        doc = self._unseal(RESULT_KIND, raw, where)
        if doc is None:
            return None
        try:
            result = CritiqueResult.model_validate(doc)
        except ValueError:
            self._note(where, "not a valid result")
            return None
        filed = member(result.iteration, result.worker_id)
        if sid is not None:
            filed = pass_member(result.iteration, result.worker_id, result.pass_id)
        if result.run_id != run_id or filed != field:
            self._note(where, "a result filed under another run, submission or pass")
            return None
        return result

    def _failure(self, raw: str | bytes, run_id: str, field: str) -> Failure | None:
        where = (run_id, keys.FAILURES, field)
        doc = self._unseal(FAILURE_KIND, raw, where)
        if doc is None:
            return None
        if doc.get("run_id") != run_id or doc.get("member") != field:
            self._note(where, "a failure filed under another run or pass")
            return None
        try:
            return Failure(
                stage=str(doc["stage"]),
                error=str(doc["error"]),
                reason=str(doc["reason"]),
                refused=bool(doc["refused"]),
                task_id=str(doc.get("task_id") or ""),
                at=float(doc.get("at") or 0.0),
            )
        except (KeyError, TypeError, ValueError):
            self._note(where, "not a valid failure record")
            return None

    def _completion(self, raw: str, run_id: str, request_id: str) -> dict[str, Any] | None:
        where = (run_id, keys.STEPS, completion_member(request_id))
        doc = self._unseal(COMPLETION_KIND, raw, where)
        if doc is None:
            return None
        decision = doc.get("decision")
        if doc.get("run_id") != run_id or doc.get("request_id") != request_id:
            self._note(where, "a decision filed under another run or request")
            return None
        if not isinstance(decision, dict):
            self._note(where, "not a valid decision record")
            return None
        return decision

    def _note(self, where: tuple[str, str, str], why: str) -> None:
        """Log (once per record place and reason) a stored record that is not trusted."""
        key = (where[0], f"{where[1]}/{where[2]}", why)
        if key in self._noted:
            return
        if len(self._noted) >= _NOTED_MAX:
            self._noted.clear()
        self._noted.add(key)
        log.warning(
            "ignored the %s record %r of run %s: %s (treated as absent)",
            where[1],
            where[2][:200],
            where[0],
            why,
        )

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
