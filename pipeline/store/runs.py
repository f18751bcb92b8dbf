"""The run registry in Redis: what was submitted, and the final result of each submission.

``submitted`` and ``passes`` are hashes keyed ``"<iteration>:<worker_id>"``. Each submit of a
submission starts a *pass* with a fresh pass id (``pass_id``; see docs/client.md, "Passes:
submitting the same submission again"): the client records it as the submission's latest
pass, pending, with its first message (:meth:`RedisRunStore.open_pass`, one script before the
chain is sent; withdrawn if the send fails), and the gate stores the
pass's result once (:meth:`RedisRunStore.put_result`), in ``results:pass`` under the pass,
with its ``result`` trace event in the same script. A
submission's result (status, reports, the completion gate) is its latest pass's: the one
``passes`` names, so a resubmission hides the previous pass's result until its own lands, and
``wait(handle)`` reads its own pass's. Each result is stored once; ``results`` holds only what
a gate without a pass wrote (a chain sent without the client). Every write refreshes the run
TTL.

Bounded Redis: what only the live chain needs goes when the pass's result lands, in the same
script. A pass's step records live in a hash of their own (:func:`keys.pass_steps_key`), its
first message in ``messages`` under the pass; both are deleted with the result's write (the
steps kept ``CRITIQUE_STEPS_GRACE_S`` longer where an operator asks, for inspection), and
expire ``CRITIQUE_LIVE_TTL_S`` after their last write if no result ever comes. A step of a
finished pass delivered late (a redelivery, a duplicate chain) records nothing:
:meth:`RedisRunStore.record_step` and :meth:`RedisRunStore.step_output` raise
:class:`PassFinished`, and the task ends its chain there. Results are stored packed (zlib,
:func:`pipeline.store.packing.pack_record`) once sealed, trace events with the
event dictionary (:func:`pipeline.store.packing.pack_event`).

A pass (or a completion-gate request) that a worker failed for good gets a failure record in
``failures`` (:meth:`RedisRunStore.put_failure`): the one place a client learns that a pass
will have no result. Celery's result backend is not read for it: anyone who can write to the
broker can make a task id's state ``FAILURE``.

With secrets (``CRITIQUE_SECRET``, given as a callable), every result, failure and completion
decision is stored signed (:func:`pipeline.security.signing.sign_record`), and a reader trusts only
a record that verifies and names the run, submission and pass it is filed under; any other is
treated as absent and logged (once per record), never as a verdict. Without secrets records are
stored and read unsigned, as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.cluster

from pipeline.errors import ForgedMessageError, SubmissionError
from pipeline.models import CritiqueResult, PassRef, Submission
from pipeline.security import signing
from pipeline.store import keys
from pipeline.store.packing import pack_event, pack_record, unpack
from pipeline.store.redis_common import (
    StoreClient,
    decodes_responses,
    replicated,
    resolve_prefix,
    resolve_ttl_ms,
    store_errors,
    text,
)

log = logging.getLogger(__name__)

RESULT_KIND = "result"
"""The record kind a pass's result is signed as."""
FAILURE_KIND = "failure"
"""The record kind a failure (of a pass or a completion-gate request) is signed as."""
COMPLETION_KIND = "completion"
PARKED_KIND = "parked"  # a pass's state kept for its worker's repaired output (repairer: worker)
"""The record kind a completion-gate decision is signed as."""
COMPLETE_GATE = "complete_gate"
"""What a completion-gate request's step id and failure member start with."""
_NOTED_MAX = 1024
"""Most unverifiable records (each is logged once), or runs indexed, remembered per store."""
_INDEX_EVERY_S = 60.0
"""A store puts a run on the archiver's index at most this often (see ``mark_submitted``)."""


class EntryIdTaken(SubmissionError):
    """An entry task id that another submission's entry message claimed first (fleet-wide):
    the refusal writes nothing under the id, which holds, or will hold, that submission's
    verdict."""


class RunOwnedError(SubmissionError):
    """A submission into a run that another identity opened (another manager's key, or the
    workers' key against a manager's run): refused before any pass record is written, naming
    the run only."""


class PassFinished(Exception):
    """The pass a step belongs to has its result already: the step records nothing and its
    chain ends (a late redelivery or a duplicate chain of a finished pass)."""


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


@dataclass(frozen=True)
class StepRecord:
    """One chain step's record as :meth:`RedisRunStore.record_steps` writes it: the step id
    (:func:`keys.step_id`), the output it hands on (JSON) and its encoded trace events."""

    step: str
    output: str
    events: tuple[str, ...] = ()


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


# A Lua function both scripts below start with: append ``count`` encoded trace events whose
# arguments start at ARGV[at] (per event its packed form and its tag, '' unsigned; the field
# 'sig' is keys.TRACE_SIG_FIELD) to the stream ``stream``, trimmed to about ``maxlen``, each
# event under the field ``field``.
_APPEND_EVENTS = """
local function append_events(stream, maxlen, field, at, count)
  for e = at, at + 2 * count - 2, 2 do
    if ARGV[e + 1] == '' then
      redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', field, ARGV[e])
    else
      redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', field, ARGV[e], 'sig', ARGV[e + 1])
    end
  end
end
"""


# KEYS[1] the step-record hash (the pass's own, or the run's for a completion gate), KEYS[2]
# trace stream, KEYS[3] pending sorted set, KEYS[4] results:pass; ARGV: TTL of KEYS[1] (ms),
# stream maxlen, event field, the pass's member ("" for none), now (s), TTL of the trace (ms),
# then per step, in the loop's order: its id, its output, its number of events N, then per
# event its packed form and its tag ('' unsigned). Each step is recorded in turn (its output
# and events) while it is the first record of its step; at the first step recorded already the
# script stops (the steps after it were made from an output that does not stand) and returns
# {its position (1-based), the output recorded first}. Returns nil when every step was
# recorded, "" when the pass has its result already (nothing is written).
# A first record is the pass's progress: its pending score (if it is still pending, XX) moves
# to now, which is what the stall sweeper (workers.recovery) measures.
_RECORD_STEPS = (
    _APPEND_EVENTS
    + """
if ARGV[4] ~= '' and redis.call('HEXISTS', KEYS[4], ARGV[4]) == 1 then
  return ''
end
local i, n, wrote, traced, stood = 7, 0, false, false, false
while i <= #ARGV do
  n = n + 1
  local count = tonumber(ARGV[i + 2])
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 0 then
    stood = {n, redis.call('HGET', KEYS[1], ARGV[i])}
    break
  end
  wrote = true
  traced = traced or count > 0
  append_events(KEYS[2], ARGV[2], ARGV[3], i + 3, count)
  i = i + 3 + 2 * count
end
if traced then redis.call('PEXPIRE', KEYS[2], ARGV[6]) end
if wrote then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  if ARGV[4] ~= '' then
    redis.call('ZADD', KEYS[3], 'XX', ARGV[5], ARGV[4])
  end
end
return stood
"""
)


# KEYS[1] results:pass, KEYS[2] passes, KEYS[3] pending, KEYS[4] trace, KEYS[5] the pass's
# step records, KEYS[6] messages, KEYS[7] suspects, KEYS[8] resumes. ARGV: submission field,
# pass field (= the pending member), pass id, the packed result, TTL (ms), stream maxlen,
# event field, the steps' grace (ms: 0 deletes them now), the run's ``done`` channel, then per
# group of encoded events, in order: the id of the step they are the events of ("" for the
# result's own), their number N, then per event its packed form and its tag ('' unsigned).
# The first gate of a pass stores its result (and records the pass as the submission's latest
# when none was: a chain sent without the client), appends its events (a step's only while no
# record of that step is there: a step some delivery recorded was traced with its record, and
# a step record is never written once the result is), releases what only the live chain
# needed: the pass's step records, its first message and the sweeper's notes on it, and
# announces the pass on the channel (returns 1); a repeat writes nothing (returns 0).
_PUT_RESULT = (
    _APPEND_EVENTS
    + """
if redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[4]) == 0 then
  return 0
end
redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[3])
redis.call('ZREM', KEYS[3], ARGV[2])
local i = 10
while i <= #ARGV do
  local count = tonumber(ARGV[i + 1])
  if ARGV[i] == '' or redis.call('HEXISTS', KEYS[5], ARGV[i]) == 0 then
    append_events(KEYS[4], ARGV[6], ARGV[7], i + 2, count)
  end
  i = i + 2 + 2 * count
end
if tonumber(ARGV[8]) > 0 then
  redis.call('PEXPIRE', KEYS[5], ARGV[8])
else
  redis.call('DEL', KEYS[5])
end
redis.call('HDEL', KEYS[6], ARGV[2])
redis.call('HDEL', KEYS[7], ARGV[2])
redis.call('HDEL', KEYS[8], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('PEXPIRE', KEYS[4], ARGV[5])
redis.call('PUBLISH', ARGV[9], ARGV[2])
return 1
"""
)

# KEYS[1] submitted, KEYS[2] messages, KEYS[3] results:pass, KEYS[4] failures. ARGV: submission
# field, the record (JSON), TTL (ms), pass field ("" for none), the first message ("" for
# none), live TTL (ms). The message is kept only while the pass has neither a result nor a
# failure: a fast pass may finish before its client records it.
_MARK_SUBMITTED = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if ARGV[4] ~= '' and ARGV[5] ~= ''
    and redis.call('HEXISTS', KEYS[3], ARGV[4]) == 0
    and redis.call('HEXISTS', KEYS[4], ARGV[4]) == 0 then
  redis.call('HSET', KEYS[2], ARGV[4], ARGV[5])
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
end
return 1
"""

# KEYS[1] the entry task id's fleet-wide claim. ARGV: the claim (JSON), TTL (ms). Returns the
# claim that stands (the first one) and 1 when this call made it.
_CLAIM_ENTRY = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {ARGV[1], 1}
end
return {redis.call('GET', KEYS[1]), 0}
"""

# KEYS[1] the run's owner. ARGV: the identity opening or entering the run, TTL (ms). Returns the
# owner that stands; its TTL is refreshed only by the owner itself.
_CLAIM_OWNER = """
local owner = redis.call('GET', KEYS[1])
if not owner then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
if owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return owner
"""

# KEYS[1] passes, KEYS[2] results, KEYS[3] the run's pending index, KEYS[4] submitted,
# KEYS[5] messages, and (not in a Redis Cluster, where it is another slot) KEYS[6] the shared
# index of runs with pending passes. ARGV: submission field, pass id, TTL (ms), the pass's
# pending member, now (s), run id, the submission record (JSON), the packed first message,
# the live TTL (ms). begin_pass, the pass pending from now (workers.recovery), and
# mark_submitted with its first message, in one step.
_OPEN_PASS = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[7])
redis.call('PEXPIRE', KEYS[4], ARGV[3])
redis.call('HSET', KEYS[5], ARGV[4], ARGV[8])
redis.call('PEXPIRE', KEYS[5], ARGV[9])
if #KEYS > 5 then
  redis.call('ZADD', KEYS[6], ARGV[5], ARGV[6])
  redis.call('PEXPIRE', KEYS[6], ARGV[3])
end
return 1
"""

# KEYS[1] submitted, KEYS[2] messages. ARGV: submission field, the pass's member, its pass id.
# A pass whose first message could not be sent: its submission record (while it is still this
# pass's) and first message go, so nothing re-drives it.
_WITHDRAW = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw then
  local ok, doc = pcall(cjson.decode, raw)
  if ok and type(doc) == 'table' and doc['sid'] == ARGV[3] then
    redis.call('HDEL', KEYS[1], ARGV[1])
  end
end
redis.call('HDEL', KEYS[2], ARGV[2])
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


def _step_order(step: str, pass_field: str) -> tuple[int, int, int] | None:
    """A step id of pass ``pass_field`` (:func:`keys.parse_step_id`) → a sort key in the loop's
    order; None for another pass's step or a malformed one."""
    parsed = keys.parse_step_id(step)
    if parsed is None or parsed.pass_member != pass_field or parsed.stage not in _STAGE_RANK:
        return None
    return parsed.round, parsed.attempt, _STAGE_RANK[parsed.stage]


def _pass_of_step(step: str) -> str:
    """The pass member a chain step id belongs to (``""`` for a step outside a pass, such as a
    completion gate's): ``"<iteration>:<worker>:<sid>"`` of ``"…:<round>:<attempt>:<stage>"``."""
    parsed = keys.parse_step_id(step)
    return "" if parsed is None else parsed.pass_member


def _entry_claim(raw: Any) -> dict[str, Any] | None:
    """A stored entry claim as a dict; None for anything else (written by no worker)."""
    try:
        doc = json.loads(text(raw))
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class DoneListener:
    """Announcements of finished passes (pub/sub on each run's ``done`` channel): a waiter
    sleeps in :meth:`wait` and wakes as soon as a result or failure lands, instead of at its
    next poll. A hint, never a verdict: it says only when to read the store (anyone who can
    publish can wake a waiter for nothing). At most once: an announcement lost to a reconnect
    or a failover costs the waiter the poll interval it keeps as a backstop. A Redis Cluster
    store, or a subscription that fails, listens to nothing (:attr:`listening` false) and
    :meth:`wait` just sleeps."""

    def __init__(self, client: StoreClient, channels: Mapping[str, str]) -> None:
        """``channels``: channel name → the run id it announces."""
        self._runs = dict(channels)
        self._pubsub: Any = None
        if isinstance(client, redis.cluster.RedisCluster) or not channels:
            return
        pubsub = client.pubsub()  # type: ignore[no-untyped-call]
        try:
            pubsub.subscribe(*channels)
            # Redis confirms each subscription: from here on every announcement reaches it.
            confirmed, deadline = 0, time.monotonic() + 5.0
            while confirmed < len(self._runs):
                if time.monotonic() >= deadline:
                    raise redis.exceptions.TimeoutError("SUBSCRIBE was not confirmed in 5 s")
                msg = pubsub.get_message(timeout=deadline - time.monotonic())
                if msg is not None and msg.get("type") == "subscribe":
                    confirmed += 1
        except (redis.exceptions.RedisError, OSError):
            pubsub.close()
            return
        self._pubsub = pubsub

    @property
    def listening(self) -> bool:
        """Subscribed and not broken: a wake-up can come before the timeout."""
        return self._pubsub is not None

    def wait(self, timeout: float) -> set[tuple[str, str]]:
        """``(run_id, member)`` of each pass announced within ``timeout`` s: returns at the
        first, with whatever else had come; empty on timeout. A lost subscription stops
        listening (it sleeps out the timeout); the caller's reads see the outage."""
        if self._pubsub is None:
            time.sleep(max(0.0, timeout))
            return set()
        got: set[tuple[str, str]] = set()
        try:
            msg = self._pubsub.get_message(timeout=max(0.0, timeout))
            while msg is not None:
                if msg.get("type") == "message":
                    run_id = self._runs.get(_lenient_text(msg["channel"]))
                    if run_id is not None:  # anyone may publish: bytes that are no member
                        got.add((run_id, _lenient_text(msg["data"])))  # match no handle
                msg = self._pubsub.get_message(timeout=0.0)
        except (redis.exceptions.RedisError, OSError, UnicodeDecodeError):
            # UnicodeDecodeError: a decoding client met garbage bytes mid-reply; its
            # connection's state is unknown, so the wait polls from here.
            self.close()
        return got

    def close(self) -> None:
        """Unsubscribe and give the connection back (idempotent)."""
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                pubsub.close()

    def __enter__(self) -> DoneListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lenient_text(value: bytes | str) -> str:
    """A pub/sub field as ``str``; bytes that are not UTF-8 are replaced, never raised."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def announces(member: str, iteration: int, worker_id: str) -> bool:
    """Whether an announced ``member`` (a pass member, or a submission field for a result
    written without a pass) is about submission (``iteration``, ``worker_id``)."""
    field = PassRef.field_of(iteration, worker_id)
    return member == field or member.startswith(field + ":")


class RedisRunStore:
    """Submissions and results of runs."""

    def __init__(
        self,
        client: StoreClient,
        *,
        prefix: str | None = None,
        ttl_s: float | None = None,
        secrets: Callable[[], Sequence[bytes]] | None = None,
        live_ttl_s: float | None = None,
        steps_grace_s: float | None = None,
    ) -> None:
        self._r = client
        self._prefix = resolve_prefix(prefix)
        self._ttl_ms = resolve_ttl_ms(ttl_s)
        live = keys.live_ttl_s() if live_ttl_s is None else live_ttl_s
        self._live_ttl_ms = min(self._ttl_ms, resolve_ttl_ms(live))
        grace = keys.steps_grace_s() if steps_grace_s is None else steps_grace_s
        self._grace_ms = max(0, int(grace * 1000))
        self._binary = not decodes_responses(client)
        self._secrets = secrets or (lambda: ())
        self._noted: set[tuple[str, str, str]] = set()
        self._indexed: dict[str, float] = {}
        self._record_steps = client.register_script(_RECORD_STEPS)
        self._count_once = client.register_script(_COUNT_ONCE)
        self._put_result = client.register_script(_PUT_RESULT)
        self._begin_pass = client.register_script(_BEGIN_PASS)
        self._open_pass = client.register_script(_OPEN_PASS)
        self._withdraw = client.register_script(_WITHDRAW)
        self._claim_entry = client.register_script(_CLAIM_ENTRY)
        self._claim_owner = client.register_script(_CLAIM_OWNER)
        self._mark_submitted = client.register_script(_MARK_SUBMITTED)

    @property
    def keeps_steps(self) -> bool:
        """Whether a pass's step records outlive its result (``CRITIQUE_STEPS_GRACE_S``, for
        inspection): then every step is recorded as it runs (none is held for the next
        record, ``workers.steps``)."""
        return self._grace_ms > 0

    def _key(self, run_id: str, suffix: str) -> str:
        return keys.run_key(run_id, suffix, self._prefix)

    def _announce(self, pipe: Any, run_id: str, field: str) -> None:
        """Publish ``field`` on the run's ``done`` channel in ``pipe`` (a Redis Cluster pipeline
        cannot route a keyless command: its waiters poll)."""
        if not isinstance(self._r, redis.cluster.RedisCluster):
            pipe.publish(self._key(run_id, keys.DONE), field)

    def listen(self, *run_ids: str) -> DoneListener:
        """A listener for the finished passes of ``run_ids`` (:class:`DoneListener`),
        subscribed before this returns: a pass that finishes after it is announced to it."""
        return DoneListener(self._r, {self._key(r, keys.DONE): r for r in run_ids})

    def _packed(self, run_id: str, events: Sequence[str]) -> list[bytes | str]:
        """Encoded trace events as the scripts take them: per event its packed form
        (:func:`pack_event`) and its tag (:func:`pipeline.security.signing.trace_mac`, ``""``
        without secrets), so a reader with the secret trusts only events a key holder wrote."""
        secrets = self._secrets()
        out: list[bytes | str] = []
        for e in events:
            tag = signing.trace_mac(run_id, e.encode("utf-8"), secrets[0]) if secrets else ""
            out += [pack_event(e, binary=self._binary), tag]
        return out

    def _grouped(self, run_id: str, steps: Sequence[StepRecord], *, outputs: bool) -> list[Any]:
        """Steps as the scripts take them: per step its id, its output (with ``outputs``), its
        number of events, then the events (:meth:`_packed`)."""
        out: list[Any] = []
        for s in steps:
            out += [s.step, *([s.output] if outputs else []), len(s.events)]
            out += self._packed(run_id, s.events)
        return out

    def _steps_key(self, run_id: str, pass_field: str) -> str:
        """The step records of one pass; the run's ``steps`` hash for a step outside a pass
        (a completion gate's)."""
        if not pass_field:
            return self._key(run_id, keys.STEPS)
        return keys.pass_steps_key(run_id, pass_field, self._prefix)

    def mark_submitted(
        self,
        run_id: str,
        iteration: int,
        worker_id: str,
        task_id: str,
        signature: str,
        *,
        pass_id: str = "",
        message: dict[str, Any] | None = None,
    ) -> None:
        """Record that a submission entered the pipeline (for status, the redundancy guard and
        ``resume``: the pass id ``pass_id`` and the first stage ``message``). The message serves
        only the live chain (a re-drive starts from it): it is kept under the pass in
        ``messages``, with the live-chain TTL, and deleted when the pass's result lands."""
        doc: dict[str, Any] = {"task_id": task_id, "signature": signature, "at": time.time()}
        if pass_id:
            doc["sid"] = pass_id
        elif message is not None:
            doc["message"] = message  # no pass to file it under (not the client's path)
        with store_errors(self._r):
            self._mark_submitted(
                keys=[
                    self._key(run_id, s)
                    for s in (keys.SUBMITTED, keys.MESSAGES, keys.PASS_RESULTS, keys.FAILURES)
                ],
                args=[
                    PassRef.field_of(iteration, worker_id),
                    json.dumps(doc),
                    self._ttl_ms,
                    PassRef(run_id, iteration, worker_id, pass_id).member if pass_id else "",
                    pack_record(json.dumps(message), binary=self._binary)
                    if pass_id and message is not None
                    else "",
                    self._live_ttl_ms,
                ],
            )
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
        """One submission's ``mark_submitted`` record (the latest pass's), or None; with its
        first ``message`` while that pass is live (until its result lands)."""
        with store_errors(self._r):
            field = PassRef.field_of(iteration, worker_id)
            raw = self._r.hget(self._key(run_id, keys.SUBMITTED), field)
            if raw is None:
                return None
            doc = dict(json.loads(text(raw)))
            pass_id = str(doc.get("sid") or "")
            if pass_id:
                message = self._r.hget(
                    self._key(run_id, keys.MESSAGES), PassRef.member_of(field, pass_id)
                )
                unpacked = None if message is None else unpack(message)
                if unpacked is not None:
                    doc["message"] = json.loads(unpacked)
        return doc

    def latest_step(
        self, run_id: str, iteration: int, worker_id: str, pass_id: str
    ) -> tuple[str, str] | None:
        """The last recorded step of one submission pass: ``(step id, output)``, or None.

        Steps are ordered by (round, attempt, stage): l0 < critic < decide < repair within a
        round and attempt, which is the order the loop runs them in. Reads the pass's whole
        step-record hash: meant for recovery and status, not for every stage. None too once
        the pass has its result (its steps are released then).
        """
        field = PassRef(run_id, iteration, worker_id, pass_id).member
        best: tuple[tuple[int, int, int], str, str] | None = None
        with store_errors(self._r):
            rows = self._r.hgetall(self._steps_key(run_id, field))
        for name, output in rows.items():
            step = text(name)
            order = _step_order(step, field)
            if order is not None and (best is None or order > best[0]):
                best = (order, step, text(output))
        return None if best is None else (best[1], best[2])

    def submitted(self, run_id: str) -> dict[str, dict[str, Any]]:
        """Every submission of the run: field -> {task_id, signature, at}."""
        with store_errors(self._r):
            raw = self._r.hgetall(self._key(run_id, keys.SUBMITTED))
        return {text(k): json.loads(text(v)) for k, v in raw.items()}

    def begin_pass(self, run_id: str, iteration: int, worker_id: str, pass_id: str) -> None:
        """Record ``pass_id`` as the submission's latest pass (call before its chain is sent): the
        previous pass's result leaves ``results`` (it stays under its own pass), and only this
        pass's gate will write there."""
        field = PassRef.field_of(iteration, worker_id)
        with store_errors(self._r):
            self._begin_pass(
                keys=[self._key(run_id, keys.PASSES), self._key(run_id, keys.RESULTS)],
                args=[field, pass_id, self._ttl_ms],
            )

    def open_submission(
        self, sub: Submission, pass_id: str, *, task_id: str, message: dict[str, Any]
    ) -> None:
        """:meth:`open_pass` for pass ``pass_id`` of ``sub``, signed by its subtask signature: what
        the client and the entry task write before they send a pass's first ``message``."""
        self.open_pass(
            PassRef.of(sub, pass_id),
            task_id=task_id,
            signature=sub.subtask_signature,
            message=message,
        )

    def open_pass(
        self, ref: PassRef, *, task_id: str, signature: str, message: dict[str, Any]
    ) -> None:
        """What a submit writes before its first message is sent, in one script (two in a
        Redis Cluster, where the index of runs with pending passes is another slot):
        :meth:`begin_pass`, the pass pending from now in the stall sweeper's index
        (``workers.recovery``; :class:`pipeline.store.pending.RedisPendingIndex`), and
        :meth:`mark_submitted`'s record with the first ``message`` (sent under ``task_id``),
        from which a lost pass is re-driven. A send that fails calls :meth:`withdraw`."""
        now = time.time()
        run_id, pass_id = ref.run_id, ref.pass_id
        doc = {"task_id": task_id, "signature": signature, "at": now, "sid": pass_id}
        runs_index = keys.shared_key(keys.PENDING_RUNS, self._prefix)
        script_keys = [
            self._key(run_id, s)
            for s in (keys.PASSES, keys.RESULTS, keys.PENDING, keys.SUBMITTED, keys.MESSAGES)
        ]
        clustered = isinstance(self._r, redis.cluster.RedisCluster)
        if not clustered:
            script_keys.append(runs_index)
        args: list[Any] = [
            ref.field,
            pass_id,
            self._ttl_ms,
            ref.member,
            repr(now),
            run_id,
            json.dumps(doc),
            pack_record(json.dumps(message), binary=self._binary),
            self._live_ttl_ms,
        ]
        with store_errors(self._r):
            self._open_pass(keys=script_keys, args=args)
            if clustered:
                pipe = self._r.pipeline(transaction=False)
                pipe.zadd(runs_index, {run_id: now})
                pipe.pexpire(runs_index, self._ttl_ms)
                pipe.execute()
        self._index_for_archive(run_id, now)

    def withdraw(self, ref: PassRef) -> None:
        """Undo :meth:`open_pass`'s record of a pass whose first message was not sent: its
        submission record (while it is that pass's) and first message go, so the sweeper never
        re-drives it; like a pass whose submit died before recording it, it leaves the pending
        index after the sweeper's grace."""
        with store_errors(self._r):
            self._withdraw(
                keys=[self._key(ref.run_id, s) for s in (keys.SUBMITTED, keys.MESSAGES)],
                args=[ref.field, ref.member, ref.pass_id],
            )

    def claim_entry(
        self, run_id: str, iteration: int, worker_id: str, entry_id: str, pass_id: str
    ) -> tuple[str, bool]:
        """The pass the entry task ``entry_id`` (``critique.submit``) runs: ``pass_id`` and True
        when this call is the first to claim the id, else the pass id an earlier delivery of
        the same entry message claimed and False; so a redelivered entry message never starts a
        second pass. The claim is fleet-wide (one key per task id, :func:`keys.entry_claim_key`,
        kept for the run TTL): an id another submission claimed, in this run or any other, is
        :class:`EntryIdTaken`, so no pass of another run ever stores its summary under the
        victim's id (Celery never overwrites a ``SUCCESS``)."""
        wanted = {"run_id": run_id, "iteration": iteration, "worker_id": worker_id}
        doc = json.dumps({**wanted, "pass_id": pass_id}, sort_keys=True)
        with store_errors(self._r):
            got, first = self._claim_entry(
                keys=[keys.entry_claim_key(entry_id, self._prefix)], args=[doc, self._ttl_ms]
            )
        claim = _entry_claim(got)
        if claim is None or {k: claim.get(k) for k in wanted} != wanted:
            same_run = claim is not None and claim.get("run_id") == run_id
            whose = f"another submission of run {run_id}" if same_run else "another run's entry"
            raise EntryIdTaken(
                f"entry task id {entry_id[:64]!r} already started {whose}: send each "
                "submission under a fresh task id"
            )
        return str(claim.get("pass_id") or ""), bool(int(first))

    def entry_claim(self, entry_id: str) -> dict[str, Any] | None:
        """Who claimed the entry task id ``entry_id``: ``{run_id, iteration, worker_id,
        pass_id}`` of the entry message that first ran under it, or None (never claimed, or
        expired)."""
        with store_errors(self._r):
            got = self._r.get(keys.entry_claim_key(entry_id, self._prefix))
        return None if got is None else _entry_claim(got)

    def claim_owner(self, run_id: str, identity: str) -> str:
        """Bind the run to ``identity`` (the key that signed its first entry, or ``fleet`` for
        the Python client's path) unless it is bound already; returns the owner that stands
        (``identity`` when it is this call's, or the run's own). Kept for the run TTL,
        refreshed by its owner's every entry."""
        with store_errors(self._r):
            got = self._claim_owner(
                keys=[self._key(run_id, keys.OWNER)], args=[identity, self._ttl_ms]
            )
        return text(got)

    def enter_run(self, run_id: str, identity: str) -> None:
        """:meth:`claim_owner`, raising :class:`RunOwnedError` ("run R belongs to another
        manager") unless the run is ``identity``'s."""
        if self.claim_owner(run_id, identity) != identity:
            raise RunOwnedError(f"run {run_id} belongs to another manager")

    def latest_pass(self, run_id: str, iteration: int, worker_id: str) -> str | None:
        """The submission's latest pass id, or None (never submitted through the client)."""
        with store_errors(self._r):
            raw = self._r.hget(
                self._key(run_id, keys.PASSES), PassRef.field_of(iteration, worker_id)
            )
        return None if raw is None else text(raw)

    def put_result(
        self,
        result: CritiqueResult,
        *,
        pass_id: str | None = None,
        events: Sequence[str] = (),
        steps: Sequence[StepRecord] = (),
    ) -> bool:
        """Store a submission pass's final result once, with its trace ``events`` (encoded).

        With its pass id ``pass_id``: one atomic script stores it (packed) under the pass, points
        ``results`` at it while it is the latest pass, takes the pass off the pending index (it
        can no longer stall), appends the events and deletes the pass's step records and first
        message (only the live chain needed them); a repeated call (a re-run gate) writes
        nothing and returns False. ``steps``: steps of the pass that the caller ran and did not
        record (their outputs are not written), whose events go before ``events``, each step's
        only while no record of it is there: a step another delivery recorded (one that ran it
        too, then failed, say) was traced with that record, so it is traced once. Without
        ``pass_id``: ``results`` is written (idempotently) with the events (no ``steps``).
        """
        if steps and not pass_id:
            raise ValueError("the steps of a result without a pass id have no records to check")
        if pass_id and result.pass_id != pass_id:
            if result.pass_id:
                raise ValueError(f"result of pass {result.pass_id!r} put as pass {pass_id!r}")
            result = result.model_copy(update={"pass_id": pass_id})  # filed under its pass
        field = PassRef.field_of(result.iteration, result.worker_id)
        raw = pack_record(self._seal(RESULT_KIND, result.model_dump_json()), binary=self._binary)
        if not pass_id:
            key = self._key(result.run_id, keys.RESULTS)
            trace = self._key(result.run_id, keys.TRACE)
            with store_errors(self._r):
                pipe = self._r.pipeline(transaction=True)
                pipe.hset(key, field, raw)
                pipe.pexpire(key, self._ttl_ms)
                packed = self._packed(result.run_id, events)
                for event, tag in zip(packed[::2], packed[1::2], strict=True):
                    fields: dict[Any, Any] = {keys.TRACE_EVENT_FIELD: event}
                    if tag:
                        fields[keys.TRACE_SIG_FIELD] = tag
                    pipe.xadd(trace, fields, maxlen=keys.TRACE_MAXLEN, approximate=True)
                if events:
                    pipe.pexpire(trace, self._ttl_ms)
                self._announce(pipe, result.run_id, field)
                pipe.execute()
            return True
        pass_field = PassRef.member_of(field, pass_id)
        script_keys = [
            self._key(result.run_id, s)
            for s in (keys.PASS_RESULTS, keys.PASSES, keys.PENDING, keys.TRACE)
        ]
        script_keys.append(self._steps_key(result.run_id, pass_field))
        script_keys.extend(
            self._key(result.run_id, s) for s in (keys.MESSAGES, keys.SUSPECTS, keys.RESUMES)
        )
        with store_errors(self._r):
            got = replicated(  # on the replicas CRITIQUE_STORE_REPLICAS asks for
                self._r,
                self._put_result,
                script_keys,
                [
                    field,
                    pass_field,
                    pass_id,
                    raw,
                    self._ttl_ms,
                    keys.TRACE_MAXLEN,
                    keys.TRACE_EVENT_FIELD,
                    self._grace_ms,
                    self._key(result.run_id, keys.DONE),
                    *self._grouped(
                        result.run_id, [*steps, StepRecord("", "", tuple(events))], outputs=False
                    ),
                ],
            )
        return bool(int(got))

    def result(self, run_id: str, iteration: int, worker_id: str) -> CritiqueResult | None:
        """The latest pass's result, or None while it is not there yet (or not verifiable)."""
        field = PassRef.field_of(iteration, worker_id)
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.hget(self._key(run_id, keys.PASSES), field)
            pipe.hget(self._key(run_id, keys.RESULTS), field)
            got = pipe.execute()
        return self._latest(run_id, {field: got[0]}, {field: got[1]}).get(field)

    def _latest(
        self, run_id: str, passes: dict[Any, Any], unpassed: dict[Any, Any]
    ) -> dict[str, CritiqueResult]:
        """The latest pass's result of each submission field: the one ``passes`` names (read
        from ``results:pass`` in one round trip), else a record in ``results`` (written by a
        gate without a pass); what does not verify is left out."""
        named = {text(f): text(pass_id) for f, pass_id in passes.items() if pass_id is not None}
        wanted = [(f, PassRef.member_of(f, pass_id)) for f, pass_id in named.items()]
        out: dict[str, CritiqueResult] = {}
        if wanted:
            with store_errors(self._r):
                got = self._r.hmget(self._key(run_id, keys.PASS_RESULTS), [w[1] for w in wanted])
            for (field, pass_field), raw in zip(wanted, got, strict=True):
                if raw is None:
                    continue
                result = self._result(raw, run_id, keys.PASS_RESULTS, pass_field, by_pass=True)
                if result is not None:
                    out[field] = result
        for name, raw in unpassed.items():
            field = text(name)
            if raw is None or field in named:
                continue
            result = self._result(raw, run_id, keys.RESULTS, field)
            if result is not None:
                out[field] = result
        return out

    def pass_finished(self, run_id: str, iteration: int, worker_id: str, pass_id: str) -> bool:
        """Whether the pass has its result stored (it finished, or was cancelled): one cheap
        lookup, what a stage in flight asks before its next model call."""
        field = PassRef(run_id, iteration, worker_id, pass_id).member
        with store_errors(self._r):
            return bool(self._r.hexists(self._key(run_id, keys.PASS_RESULTS), field))

    def open_passes(self, run_id: str) -> tuple[list[str], list[str]]:
        """The run's passes as a cancel sees them: ``(open, finished)`` pass members. Each
        submission's latest pass and every pass still on the pending index (a superseded pass
        may still run) is open unless it has a result or a recorded failure; those that have
        one are finished. Two round trips, whatever the run's size."""
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.hgetall(self._key(run_id, keys.PASSES))
            pipe.zrange(self._key(run_id, keys.PENDING), 0, -1)
            latest, pending = pipe.execute()
            members = [PassRef.member_of(text(f), text(p)) for f, p in latest.items()]
            members = list(dict.fromkeys([*members, *(text(m) for m in pending)]))
            if not members:
                return [], []
            pipe = self._r.pipeline(transaction=False)
            pipe.hmget(self._key(run_id, keys.PASS_RESULTS), members)
            pipe.hmget(self._key(run_id, keys.FAILURES), members)
            results, failures = pipe.execute()
        open_: list[str] = []
        finished: list[str] = []
        for m, result, failure in zip(members, results, failures, strict=True):
            (open_ if result is None and failure is None else finished).append(m)
        return open_, finished

    def pass_result(
        self, run_id: str, iteration: int, worker_id: str, pass_id: str
    ) -> CritiqueResult | None:
        """The result of one pass (``pass_id``), or None while that pass has not finished (or its
        record is not verifiable)."""
        outcome = self.pass_outcome(run_id, iteration, worker_id, pass_id, failure=False)
        return outcome if isinstance(outcome, CritiqueResult) else None

    def pass_outcome(
        self, run_id: str, iteration: int, worker_id: str, pass_id: str, *, failure: bool = True
    ) -> CritiqueResult | Failure | None:
        """What one pass ended in, in one round trip: its result, else (with ``failure``) the
        failure a worker recorded for it, else None (still running, or nothing verifiable)."""
        field = PassRef(run_id, iteration, worker_id, pass_id).member
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.hget(self._key(run_id, keys.PASS_RESULTS), field)
            if failure:
                pipe.hget(self._key(run_id, keys.FAILURES), field)
            got = pipe.execute()
        return self.decode_outcome(run_id, field, got[0], got[1] if failure else None)

    def decode_outcome(
        self,
        run_id: str,
        field: str,
        raw_result: bytes | str | None,
        raw_failure: bytes | str | None,
    ) -> CritiqueResult | Failure | None:
        """What a pass ended in, from its raw ``results:pass`` and ``failures`` fields (read by
        anyone, e.g. an asyncio client): the result if it verifies, else the failure, else None.
        No I/O."""
        if raw_result is not None:
            result = self._result(raw_result, run_id, keys.PASS_RESULTS, field, by_pass=True)
            if result is not None:
                return result
        if raw_failure is not None:
            return self._failure(raw_failure, run_id, field)
        return None

    def key(self, run_id: str, suffix: str) -> str:
        """The key of one of a run's records (``keys.PASS_RESULTS``, ``keys.FAILURES``…)."""
        return self._key(run_id, suffix)

    def results(self, run_id: str, iteration: int | None = None) -> list[CritiqueResult]:
        """The run's results (of one iteration when given), ordered by iteration and worker;
        records that do not verify are left out."""
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.hgetall(self._key(run_id, keys.PASSES))
            pipe.hgetall(self._key(run_id, keys.RESULTS))
            passes, unpassed = pipe.execute()
        got = self._latest(run_id, passes, unpassed).values()
        out = [r for r in got if iteration is None or r.iteration == iteration]
        return sorted(out, key=lambda r: (r.iteration, r.worker_id))

    def unverifiable(self, run_id: str, fields: Sequence[str]) -> list[str]:
        """The submission fields (of ``fields``) whose latest result is stored but whose
        signature does not verify with this process's secrets: written by workers with another
        ``CRITIQUE_SECRET`` (or none), or altered. A client checks this before it begins a new
        pass, so a resubmit that no worker will accept does not supersede a finished result.
        Three round trips at most for the whole batch; ``[]`` without secrets."""
        secrets = self._secrets()
        if not fields or not secrets:
            return []
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.hmget(self._key(run_id, keys.PASSES), list(fields))
            pipe.hmget(self._key(run_id, keys.RESULTS), list(fields))
            pass_ids, unpassed = pipe.execute()
            named = [
                (f, PassRef.member_of(f, text(pass_id)))
                for f, pass_id in zip(fields, pass_ids, strict=True)
                if pass_id
            ]
            raws = (
                self._r.hmget(self._key(run_id, keys.PASS_RESULTS), [m for _, m in named])
                if named
                else []
            )
        stored = [(f, raw) for (f, _), raw in zip(named, raws, strict=True) if raw is not None]
        stored += [
            (f, raw)
            for f, pass_id, raw in zip(fields, pass_ids, unpassed, strict=True)
            if not pass_id and raw is not None
        ]
        out = []
        for field, raw in stored:
            unpacked = unpack(raw)
            try:
                doc = json.loads(unpacked) if unpacked is not None else None
            except ValueError:
                doc = None
            if not isinstance(doc, dict):
                continue  # unreadable for another reason: not a secret mismatch
            try:
                signing.verify_record(RESULT_KIND, doc, secrets)
            except ForgedMessageError:
                out.append(field)
        return out

    def pass_results(self, run_id: str) -> list[CritiqueResult]:
        """Every pass result the run holds (``results:pass``: the latest passes' and superseded
        ones), ordered by iteration, worker and pass; records that do not verify are left out."""
        with store_errors(self._r):
            raw = self._r.hgetall(self._key(run_id, keys.PASS_RESULTS))
        out = []
        for field, value in raw.items():
            result = self._result(value, run_id, keys.PASS_RESULTS, text(field), by_pass=True)
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
        """Record that a pass (its :attr:`PassRef.member`) or a completion-gate request (its
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
            self._announce(pipe, run_id, field)
            got = pipe.execute()
        return bool(got[0])

    def clear_failure(self, run_id: str, field: str) -> bool:
        """Forget the failure recorded for a pass member (``critique resume --failed`` before
        it re-drives the pass): the pass is pending again, and a new failure can be recorded.
        False when there was none."""
        with store_errors(self._r):
            return bool(self._r.hdel(self._key(run_id, keys.FAILURES), field))

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
    def park(self, run_id: str, pass_id: str, state_json: str, ttl_s: float) -> None:
        """Keep a pass's state (the runner's ``LoopState`` as JSON, signed and packed) for
        ``ttl_s`` seconds: the worker's repaired output (``repair_of``) resumes it."""
        raw = pack_record(self._seal(PARKED_KIND, state_json), binary=self._binary)
        key = self._key(run_id, f"{keys.PARKED}:{pass_id}")
        self._r.set(key, raw, px=max(1, int(ttl_s * 1000)))

    def parked(self, run_id: str, pass_id: str) -> dict[str, Any] | None:
        """The state :meth:`park` kept for ``pass_id`` of ``run_id`` (a JSON object), if it is
        there, verifies, and is that pass's; else None."""
        raw = self._r.get(self._key(run_id, f"{keys.PARKED}:{pass_id}"))
        if raw is None:
            return None
        where = (run_id, keys.PARKED, pass_id)
        unpacked = unpack(raw)
        doc = None if unpacked is None else self._unseal(PARKED_KIND, unpacked, where)
        if doc is None:
            return None
        sub = doc.get("submission")
        if (
            doc.get("pass_id") != pass_id
            or not isinstance(sub, dict)
            or sub.get("run_id") != run_id
        ):
            self._note(where, "a parked state filed under another run or pass")
            return None
        return doc

    def unpark(self, run_id: str, pass_id: str) -> bool:
        """Forget a parked state (released or cancelled); True when there was one."""
        return bool(self._r.delete(self._key(run_id, f"{keys.PARKED}:{pass_id}")))

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
        self, raw: str | bytes, run_id: str, hash_: str, field: str, *, by_pass: bool = False
    ) -> CritiqueResult | None:
        """A stored result, if it verifies and belongs where it is filed: its run, submission
        (``field`` of ``results``) or, ``by_pass``, pass (``field`` of ``results:pass``)."""
        where = (run_id, hash_, field)
        unpacked = unpack(raw)
        if unpacked is None:
            self._note(where, "a packed record that does not unpack")
            return None
        doc = self._unseal(RESULT_KIND, unpacked, where)
        if doc is None:
            return None
        try:
            result = CritiqueResult.model_validate(doc)
        except ValueError:
            self._note(where, "not a valid result")
            return None
        ref = PassRef(run_id, result.iteration, result.worker_id, result.pass_id)
        filed = ref.member if by_pass else ref.field
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
        """The recorded output of a chain step, if the step already completed once; raises
        :class:`PassFinished` when the step's pass has its result (its records are gone: a
        late delivery must not run the stage again)."""
        pass_field = _pass_of_step(step)
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.hget(self._steps_key(run_id, pass_field), step)
            if pass_field:
                pipe.hexists(self._key(run_id, keys.PASS_RESULTS), pass_field)
            got = pipe.execute()
        if pass_field and got[1]:
            raise PassFinished(f"pass {pass_field} of run {run_id} has its result")
        return None if got[0] is None else text(got[0])

    def record_step(
        self, run_id: str, step: str, output: str, events: Sequence[str] = ()
    ) -> str | None:
        """Record a step's output unless one is there already, with the step's trace events.

        One atomic script: when this is the first record of ``step``, the output is stored and
        ``events`` (encoded trace payloads) are appended to the run's stream, and None is
        returned; otherwise nothing is written and the output recorded first is returned. A
        step of a pass that has its result already writes nothing and raises
        :class:`PassFinished`. A pass's steps expire with the live-chain TTL (a completion
        gate's decision, outside any pass, with the run's).
        """
        stood = self.record_steps(run_id, [StepRecord(step, output, tuple(events))])
        return None if stood is None else stood[1]

    def record_steps(self, run_id: str, steps: Sequence[StepRecord]) -> tuple[int, str] | None:
        """Record consecutive steps of one pass (in the loop's order) in one atomic script, as
        :meth:`record_step` records one: each step's output and events are written while it is
        the first record of its step. At the first step recorded already nothing more is
        written (the steps after it were made from an output that does not stand) and its
        position in ``steps`` and the output recorded first are returned; None when every step
        was recorded. :class:`PassFinished` (nothing written) when the pass has its result."""
        if not steps:
            return None
        pass_field = _pass_of_step(steps[0].step)
        if any(_pass_of_step(s.step) != pass_field for s in steps):
            raise ValueError(f"steps of more than one pass recorded together: {steps!r}")
        args: list[Any] = [
            self._live_ttl_ms if pass_field else self._ttl_ms,
            keys.TRACE_MAXLEN,
            keys.TRACE_EVENT_FIELD,
            pass_field,
            repr(time.time()),
            self._ttl_ms,
            *self._grouped(run_id, steps, outputs=True),
        ]
        with store_errors(self._r):
            got = self._record_steps(
                keys=[
                    self._steps_key(run_id, pass_field),
                    self._key(run_id, keys.TRACE),
                    self._key(run_id, keys.PENDING),
                    self._key(run_id, keys.PASS_RESULTS),
                ],
                args=args,
            )
        if got is None:
            return None
        if not isinstance(got, list):  # "": the pass has its result
            raise PassFinished(f"pass {pass_field} of run {run_id} has its result")
        return int(got[0]) - 1, text(got[1])

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
