"""What a worker process needs around the pure stages: the Redis client, the stores, the stage
context for a message's configuration, and the message codec.

A stage message is a small JSON dict::

    {"v": 1, "sid": "<pass id>", "config": {...}, "state": "<LoopState JSON>"}   # inline
    {"v": 1, "sid": "<pass id>", "config": {...}, "state_ref": "sha256:<hex>"}   # by reference

The state goes by reference (a content-addressed blob) once its JSON passes ``INLINE_LIMIT``,
so a 5 MB output never rides in a broker message.

With ``CRITIQUE_SECRET`` set, every message (stage messages and ``complete_gate`` requests)
also carries ``"sig": "hmac-sha256:<hex>"`` over all its other fields
(:mod:`pipeline.security.signing`), and :func:`decode` / :func:`decode_gate_request` refuse one that
is unsigned, altered or signed with another key (``ForgedMessageError``). A ``state_ref`` is covered
by the signature and the blob must hash to it, so neither the reference nor the bytes behind it can
be swapped.

Every message also names the Celery task it is addressed to, ``"task_name"`` and ``"task_id"``
(signed with the rest): the sender picks the next task's id before it signs, and a worker
refuses a message it receives as any other task or id (:func:`decode`'s ``task``/``task_id``),
so a signed message replayed under a victim's task id cannot act as that task.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import uuid
from typing import Any

from pydantic import Field

from pipeline import settings
from pipeline.config import CritiqueConfig, check_submission_overrides, load_config
from pipeline.errors import ForgedMessageError, SubmissionError, validation_problems
from pipeline.loop.stages import LoopState, StageContext
from pipeline.models import FileRef, Frozen
from pipeline.records.state_refs import compact_state, expand_state
from pipeline.security import signing
from pipeline.store.blobs import BlobCorruptError
from pipeline.store.critique_entries import RedisCritiqueCache
from pipeline.store.lru import LRU
from pipeline.store.metrics import FleetMetrics
from pipeline.store.redis_common import STORE_TIMEOUTS, StoreClient, store_client_from_url
from pipeline.store.urls import DEFAULT_REDIS_URL
from pipeline.store.urls import store_setting as store_setting_of
from pipeline.store.urls import store_url as store_url_of
from pipeline.text.escaping import one_line
from pipeline.wiring import (
    RedisStores,
    contract_l0,
    default_completer,
    make_context,
    rate_limited_completer,
    simhash_fixpoint,
)
from workers import telemetry

MESSAGE_VERSION = 1
INLINE_LIMIT = settings.integer(settings.INLINE_LIMIT)
"""Largest state JSON (bytes) carried inline in a message; larger goes to a blob."""


def redis_url() -> str:
    """``$REDIS_URL`` or the local default (``redis://``, ``rediss://``, ``unix://``, or
    ``sentinel://host:port;…/db`` with ``CRITIQUE_REDIS_MASTER``): the broker and the result
    backend unless ``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND`` say otherwise, and the
    store unless ``CRITIQUE_STORE_URL`` does (:func:`store_url`)."""
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def store_url() -> str:
    """The store's URL: ``$CRITIQUE_STORE_URL`` (which may also be a Redis Cluster,
    ``redis+cluster://host:port,host:port,…``), else :func:`redis_url`."""
    return store_url_of(os.environ)


def store_setting() -> str:
    """The setting the store's URL comes from (for messages): ``CRITIQUE_STORE_URL`` or
    ``REDIS_URL``."""
    return store_setting_of(os.environ)


def secrets() -> tuple[bytes, ...]:
    """The message-signing secrets in ``$CRITIQUE_SECRET`` (read at every call, so a test or
    ``critique demo`` may set it late); ``()`` when unset: messages go unsigned and unchecked."""
    return _parse_secrets(settings.raw(settings.SECRET))


@functools.lru_cache(maxsize=4)
def _parse_secrets(raw: str | None, env: str = settings.SECRET.name) -> tuple[bytes, ...]:
    return signing.parse_secrets(raw, env)


def entry_keys() -> tuple[tuple[str, bytes], ...]:
    """The ``(identity, key)`` pairs entry messages (``critique.submit``) verify with:
    ``$CRITIQUE_ENTRY_SECRET`` when set (the managers' keys, which sign nothing else; each
    ``name=key`` is the identity ``entry:<name>``, a bare key the unnamed ``entry``), else
    :func:`secrets`, each the identity ``fleet`` (one-secret setups); ``()`` when neither is
    set: entry messages go unchecked, and runs have no owner."""
    raw = settings.raw(settings.ENTRY_SECRET)
    if raw is not None and raw.strip():
        return _parse_entry_keys(raw)
    return tuple((signing.FLEET_IDENTITY, key) for key in secrets())


@functools.lru_cache(maxsize=4)
def _parse_entry_keys(raw: str) -> tuple[tuple[str, bytes], ...]:
    named = signing.parse_named_secrets(raw, settings.ENTRY_SECRET.name)
    return tuple((signing.entry_identity(name), key) for name, key in named)


def entry_secrets() -> tuple[bytes, ...]:
    """The keys of :func:`entry_keys`, without their identities."""
    return tuple(key for _, key in entry_keys())


def sign_entry(msg: dict[str, Any]) -> dict[str, Any]:
    """An entry message signed with the first of :func:`entry_secrets` (unchanged without)."""
    keys_ = entry_secrets()
    return signing.sign(msg, keys_) if keys_ else msg


def sign(msg: dict[str, Any]) -> dict[str, Any]:
    """``msg`` signed with the first ``CRITIQUE_SECRET`` (unchanged when it is unset)."""
    keys_ = secrets()
    return signing.sign(msg, keys_) if keys_ else msg


def verify(msg: dict[str, Any]) -> None:
    """Raise ``ForgedMessageError`` unless ``msg`` is validly signed (no-op without a secret)."""
    keys_ = secrets()
    if keys_:
        signing.verify(msg, keys_)


@functools.lru_cache(maxsize=1)
def client() -> StoreClient:
    """The process's client of the store (:func:`store_url`; bytes replies; safe to share
    between threads). With a ``sentinel://`` URL, a client of the current master (asked of the
    Sentinels on every reconnect, so a failover is a reconnect); with a ``redis+cluster://``
    one, a Redis Cluster client (it follows slot moves and failovers); with the same timeouts
    and health checks. A cluster client keeps redis-py's default retry, which may send a
    command, an ``EVALSHA`` too, again after a lost reply (a plain or Sentinel client built from
    a URL does not re-send): every store script is idempotent, keyed by pass, lease or the id
    of its call (tests/integration/test_resend_idempotent.py). ``ConfigError`` when
    ``CRITIQUE_REDIS_MASTER`` is missing or the URL is malformed; ``StoreUnavailableError``
    when a cluster cannot be reached (nothing is cached: the next call tries again)."""
    return store_client_from_url(
        store_url(),
        setting=store_setting(),
        **STORE_TIMEOUTS,
        health_check_interval=30,
    )


@functools.lru_cache(maxsize=1)
def metrics() -> FleetMetrics:
    """This process's buffer of fleet-metric increments (:mod:`pipeline.store.metrics`), on
    :func:`client`; a worker sends it within ``workers.tasks.METRICS_FLUSH_S`` of a task's end."""
    return FleetMetrics(client())


def forget_store() -> None:
    """Drop this process's store client and everything built on it (the stores, the fleet
    metrics buffer), so the next use connects to the store the environment names now (a
    command that started an embedded Redis, a test pointing the process elsewhere). Metrics
    still buffered go to the store they were counted for first (a flush never raises)."""
    if metrics.cache_info().currsize:
        metrics().flush()
    client.cache_clear()
    stores.cache_clear()
    metrics.cache_clear()


class _CountingCache:
    """The critique cache, counting hits in the fleet metrics (refused entries are counted by
    the cache itself, as ``cache_refused``)."""

    def __init__(self, inner: RedisCritiqueCache) -> None:
        self._inner = inner

    def get(self, key: str) -> str | None:
        got = self._inner.get(key)
        if got is not None:
            metrics().add("cache_hits")
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


Stores = RedisStores
"""The Redis stores of a process (built in :mod:`pipeline.wiring`)."""


@functools.lru_cache(maxsize=1)
def stores() -> RedisStores:
    """This process's Redis stores, on :func:`client`; the run store signs and verifies the
    records workers write with :func:`secrets` (read at each use)."""
    return RedisStores(client(), secrets=secrets)


CONFIG_CACHE_MAX = 256
"""Most configurations (and stage contexts) a process keeps besides its own: each distinct
overrides JSON a submission carries builds one (a context holds its critic, reviser and Layer-0
suite, ~30 KB), and submissions come from the broker, so the caches forget the least recently
used beyond this many (:class:`pipeline.store.lru.LRU`); an evicted one is rebuilt on its next
use."""
OWN_CONFIG_KEY = "{}"
"""The cache key of a process's own configuration (no overrides): pinned, never evicted."""

_config_lock = threading.Lock()
_configs: LRU[str, CritiqueConfig] = LRU(CONFIG_CACHE_MAX, pinned=(OWN_CONFIG_KEY,))


def config_for(overrides: dict[str, Any] | None) -> CritiqueConfig:
    """The configuration for a message: workflow file + environment + the message's overrides.

    The overrides come with a submission (the client's config, a stage message's ``config``),
    so they are checked first against this process's own configuration (workflow file +
    environment, no overrides): ``RefusedOverrideError`` for a worker-only field or a limit
    passed (docs/security.md, 'Who may set what'), before anything is built, imported or
    called. Only what passed is cached.
    """
    key = json.dumps(overrides or {}, sort_keys=True)
    with _config_lock:
        cfg = _configs.get(key)
        if cfg is None:
            if overrides:
                check_submission_overrides(overrides, _own_config_locked())
            cfg = load_config(overrides=overrides or None)
            _configs[key] = cfg
        return cfg


def own_config() -> CritiqueConfig:
    """This process's own configuration (workflow file + environment, no overrides): on a
    worker, the operator's, which every submission is checked against."""
    with _config_lock:
        return _own_config_locked()


def _own_config_locked() -> CritiqueConfig:
    own = _configs.get(OWN_CONFIG_KEY)
    if own is None:
        own = load_config()
        _configs[OWN_CONFIG_KEY] = own
    return own


_contexts: LRU[str, StageContext] = LRU(CONFIG_CACHE_MAX, pinned=(OWN_CONFIG_KEY,))


def cache_sizes() -> dict[str, int]:
    """How many configurations and stage contexts this process holds, the bound on each, and
    how many were evicted so far: what a worker's ``inspect stats`` reports (the sweeper
    bootstep's ``info``), so a test or an operator can see the caches stay bounded."""
    with _config_lock:
        return {
            "configs": len(_configs),
            "contexts": len(_contexts),
            "max": CONFIG_CACHE_MAX,
            "configs_evicted": _configs.evicted,
            "contexts_evicted": _contexts.evicted,
        }


def context_for(overrides: dict[str, Any] | None) -> StageContext:
    """The stage context for a configuration, wired to the Redis stores (one per configuration
    per process: the critic, reviser and Layer-0 suite are built once, by
    :func:`pipeline.wiring.make_context`). :func:`config_for` runs first, so refused overrides
    never reach ``make_context`` (which imports extension checks and callable repairers). Its
    model calls are counted in the fleet's GenAI metrics and traced
    (:class:`workers.telemetry.ObservedCompleter`)."""
    key = json.dumps(overrides or {}, sort_keys=True)
    with _config_lock:
        ctx = _contexts.get(key)
    if ctx is None:
        s = stores()
        config = config_for(overrides)
        ctx = make_context(
            config,
            complete=telemetry.ObservedCompleter(
                rate_limited_completer(config, client(), _progress_wait)
                or default_completer(config),
                _count,
            ),
            cache=_CountingCache(
                RedisCritiqueCache(
                    client(), secrets=secrets, on_refused=lambda _: metrics().add("cache_refused")
                )
            ),
            patterns=s.patterns,
            budget=s.budget,
            trace=s.trace,
            lease_ttl_s=settings.number(settings.LEASE_TTL_S),
            read_file=file_bytes,
            l0=contract_l0(config, file_bytes, eager=True),
            fixpoint=simhash_fixpoint(eager=True),
        )
        with _config_lock:
            ctx = _contexts.setdefault(key, ctx)
    return ctx


def _count(field: str, n: int) -> None:
    """Add ``n`` to a fleet counter (:func:`metrics`, as it is now)."""
    metrics().add(field, n)


def _progress_wait(model: str, seconds: float) -> None:
    """A ``task-progress`` event (Flower shows it) while a call waits for its rate-limit slot,
    and an event ``critique.rate_limit_wait`` on the call's span while tracing."""
    from celery import current_task

    telemetry.event("critique.rate_limit_wait", model=model, wait_s=round(seconds, 3))
    task = current_task
    if task is None or not getattr(task.request, "id", None):
        return
    with contextlib.suppress(Exception):  # best-effort: never fail the stage over an event
        task.send_event(
            "task-progress", waiting_for="llm.rate_limit", model=model, wait_s=round(seconds, 3)
        )


def new_pass_id() -> str:
    """A fresh pass id (one per submit of a submission)."""
    return uuid.uuid4().hex[:16]


def encode(
    state: LoopState,
    overrides: dict[str, Any] | None,
    pass_id: str | None = None,
    *,
    task: str = "",
    task_id: str = "",
) -> dict[str, Any]:
    """A message carrying ``state``: inline when small, else by blob reference.

    ``pass_id`` (sent as the message's ``sid``) identifies one submission's pass through the
    pipeline (docs/client.md, 'Passes': new for every ``submit``, kept by every stage after it),
    so a resubmission never replays an earlier pass's steps. Default: the state's ``pass_id``,
    else a fresh one (:func:`new_pass_id`).
    ``task`` and ``task_id``: the Celery task the message is addressed to (omitted when empty:
    with ``CRITIQUE_SECRET`` set no worker accepts such a message).
    """
    if state.pass_id and pass_id and pass_id != state.pass_id:
        raise ValueError(f"message sid {pass_id!r} is not the state's pass id {state.pass_id!r}")
    raw = state.model_dump_json()
    msg: dict[str, Any] = {
        "v": MESSAGE_VERSION,
        "sid": pass_id or state.pass_id or new_pass_id(),
        "config": overrides or {},
    }
    if len(raw) <= INLINE_LIMIT:
        msg["state"] = raw
    else:
        # Its large parts (submission, outputs, envelopes) by reference too: stored once per
        # pass, not once per stage (pipeline.records.state_refs.compact_state).
        # Only the live chain reads them: they expire with the live TTL (CRITIQUE_LIVE_TTL_S).
        blobs = stores().blobs

        def put(data: bytes) -> str:
            return blobs.put(data, live=True)

        msg["state_ref"] = put(compact_state(state, put))
    if task and task_id:
        msg = signing.address(msg, task, task_id)
    return sign(msg)


def address(msg: dict[str, Any], task: str, task_id: str) -> dict[str, Any]:
    """``msg`` addressed to the Celery task ``task`` running as ``task_id``: itself when it
    already is (or when there is no task to address: an output no chain consumes), else a copy
    re-signed. With ``CRITIQUE_SECRET`` set ``msg`` must verify first (``ForgedMessageError``),
    so a message read back from the store is never re-signed unless a key holder signed it."""
    if not (task and task_id) or signing.addressee(msg) == (task, task_id):
        return msg
    verify(msg)
    return sign(signing.address(msg, task, task_id))


def check_addressed(msg: dict[str, Any], task: str | None, task_id: str | None) -> None:
    """With ``CRITIQUE_SECRET`` set, raise ``ForgedMessageError`` unless the (verified) ``msg``
    is addressed to ``task`` running as ``task_id``; a no-op without the secret or a task."""
    if task is not None and secrets():
        signing.check_addressed(msg, task, task_id or "")


def decode(
    msg: Any, *, task: str | None = None, task_id: str | None = None
) -> tuple[LoopState, dict[str, Any]]:
    """The state and configuration overrides a message carries.

    With ``CRITIQUE_SECRET`` set the signature is checked first, before anything in the message
    is read or fetched: ``ForgedMessageError`` for an unsigned, altered or wrong-key message, or
    for a referenced blob whose bytes do not hash to the (signed) reference. Given the ``task``
    and ``task_id`` it arrived as (a worker's received message), a well-formed message not
    addressed to them is refused last (``ForgedMessageError``: :func:`check_addressed`).
    """
    if not isinstance(msg, dict):
        raise SubmissionError(
            f"not a critique stage message (expected a dict with v={MESSAGE_VERSION}, "
            f"got {type(msg).__name__})"
        )
    verify(msg)
    if msg.get("v") != MESSAGE_VERSION:
        raise SubmissionError(
            f"not a critique stage message (expected a dict with v={MESSAGE_VERSION})"
        )
    config = msg.get("config")
    if not isinstance(msg.get("sid", ""), str) or not isinstance(config, (dict, type(None))):
        raise SubmissionError("stage message: 'sid' must be a string and 'config' an object")
    doc: dict[str, Any] | None = None
    if isinstance(msg.get("state"), str):
        raw: str | bytes = msg["state"]
    elif isinstance(msg.get("state_ref"), str):
        try:
            raw = stores().blobs.get(msg["state_ref"])
            doc = expand_state(raw, stores().blobs.get)  # each part hash-checked too
        except ValueError as exc:
            raise SubmissionError(f"stage message carries a malformed state: {exc}") from None
        except BlobCorruptError as exc:
            raise ForgedMessageError(
                f"stage message's state blob does not hash to its reference: {exc.message}"
            ) from None
    else:
        raise SubmissionError("stage message carries neither a 'state' nor a 'state_ref' string")
    try:
        state = LoopState.model_validate_json(raw) if doc is None else LoopState.model_validate(doc)
    except ValueError as exc:
        raise SubmissionError(f"stage message carries a malformed state: {_errors(exc)}") from None
    check_addressed(msg, task, task_id)
    return state, dict(config or {})


def _errors(exc: ValueError) -> str:
    """A validation error in one line, without the input values (never echo a payload)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return validation_problems(exc, shown=5, whole="message")
    return one_line(exc, 200)


class GateRequest(Frozen):
    """A ``critique.complete_gate`` message, validated."""

    v: int = MESSAGE_VERSION
    request_id: str
    run_id: str
    iteration: int = 1
    final_result: str | dict[str, Any]
    task: str = ""
    files: tuple[FileRef, ...] = ()
    deliverable_expected: bool | None = None
    config: dict[str, Any] = Field(default_factory=dict)


_ENVELOPE = frozenset({signing.SIG_FIELD, signing.TASK_FIELD, signing.TASK_ID_FIELD})
"""Fields of a message that address and sign it, not part of what it asks for."""


def decode_gate_request(
    msg: Any, *, task: str | None = None, task_id: str | None = None
) -> GateRequest:
    """The completion-gate request a message carries (a clear error when it is malformed).

    With ``CRITIQUE_SECRET`` set, ``ForgedMessageError`` unless it is validly signed (and, given
    the ``task`` and ``task_id`` it arrived as, addressed to them: :func:`check_addressed`).
    """
    if not isinstance(msg, dict):
        raise SubmissionError(
            f"malformed complete_gate message: expected a dict, got {type(msg).__name__}"
        )
    verify(msg)
    try:
        req = GateRequest.model_validate({k: v for k, v in msg.items() if k not in _ENVELOPE})
    except ValueError as exc:
        raise SubmissionError(f"malformed complete_gate message: {_errors(exc)}") from None
    if req.v != MESSAGE_VERSION:
        raise SubmissionError(f"complete_gate message version {req.v}; expected {MESSAGE_VERSION}")
    check_addressed(msg, task, task_id)
    return req


def file_bytes(file: FileRef) -> bytes | None:
    """A file's bytes (the :data:`pipeline.records.files.FileReader` of this process, used by admit,
    Layer-0 and the gates): inline content, else its blob, else None. A missing or expired
    blob raises ``BlobMissingError`` (permanent); an unreachable Redis is transient."""
    if file.content is not None:
        return file.content.encode("utf-8")
    if file.blob is not None:
        return stores().blobs.get(file.blob)
    return None
