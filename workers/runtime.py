"""What a worker process needs around the pure stages: the Redis client, the stores, the stage
context for a message's configuration, and the message codec.

A stage message is a small JSON dict::

    {"v": 1, "sid": "<pass id>", "config": {...}, "state": "<LoopState JSON>"}   # inline
    {"v": 1, "sid": "<pass id>", "config": {...}, "state_ref": "sha256:<hex>"}   # by reference

The state goes by reference (a content-addressed blob) once its JSON passes ``INLINE_LIMIT``,
so a 5 MB output never rides in a broker message.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import uuid
from typing import Any

import redis
from pydantic import Field

from pipeline.config import CritiqueConfig, load_config
from pipeline.errors import SubmissionError
from pipeline.models import FileRef, Frozen
from pipeline.runner import LoopState, StageContext, make_context
from pipeline.store.blobs import RedisBlobStore
from pipeline.store.redis import RedisBudgetLedger, RedisPatternStore, RedisTraceSink
from pipeline.store.runs import RedisRunStore

MESSAGE_VERSION = 1
INLINE_LIMIT = int(os.environ.get("CRITIQUE_INLINE_LIMIT", str(16 * 1024)))
"""Largest state JSON (bytes) carried inline in a message; larger goes to a blob."""


def redis_url() -> str:
    """The store's URL: ``$REDIS_URL`` or the local default."""
    return os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


@functools.lru_cache(maxsize=1)
def client() -> redis.Redis:
    """The process's Redis client (bytes replies; safe to share between threads)."""
    return redis.Redis.from_url(
        redis_url(), socket_connect_timeout=5, socket_timeout=30, health_check_interval=30
    )


class Stores:
    """The Redis stores of this process."""

    def __init__(self, r: redis.Redis) -> None:
        self.patterns = RedisPatternStore(r)
        self.budget = RedisBudgetLedger(r)
        self.trace = RedisTraceSink(r)
        self.blobs = RedisBlobStore(r)
        self.runs = RedisRunStore(r)


@functools.lru_cache(maxsize=1)
def stores() -> Stores:
    return Stores(client())


_config_lock = threading.Lock()
_configs: dict[str, CritiqueConfig] = {}


def config_for(overrides: dict[str, Any] | None) -> CritiqueConfig:
    """The configuration for a message: workflow file + environment + the message's overrides."""
    key = json.dumps(overrides or {}, sort_keys=True)
    with _config_lock:
        cfg = _configs.get(key)
        if cfg is None:
            cfg = load_config(overrides=overrides or None)
            _configs[key] = cfg
        return cfg


_contexts: dict[str, StageContext] = {}


def context_for(overrides: dict[str, Any] | None) -> StageContext:
    """The stage context for a configuration, wired to the Redis stores (one per configuration
    per process: the critic, reviser and Layer-0 suite are built once)."""
    key = json.dumps(overrides or {}, sort_keys=True)
    with _config_lock:
        ctx = _contexts.get(key)
    if ctx is None:
        s = stores()
        ctx = make_context(
            config_for(overrides),
            patterns=s.patterns,
            budget=s.budget,
            trace=s.trace,
            lease_ttl_s=float(os.environ.get("CRITIQUE_LEASE_TTL_S", "900")),
        )
        ctx.l0_fn()
        ctx.fixpoint_fn()
        with _config_lock:
            ctx = _contexts.setdefault(key, ctx)
    return ctx


def encode(
    state: LoopState, overrides: dict[str, Any] | None, sid: str | None = None
) -> dict[str, Any]:
    """A message carrying ``state``: inline when small, else by blob reference.

    ``sid`` identifies one submission's pass through the pipeline (new for every ``submit``,
    kept by every stage after it), so a resubmission never replays an earlier pass's steps.
    """
    raw = state.model_dump_json()
    msg: dict[str, Any] = {
        "v": MESSAGE_VERSION,
        "sid": sid or uuid.uuid4().hex[:16],
        "config": overrides or {},
    }
    if len(raw) <= INLINE_LIMIT:
        msg["state"] = raw
    else:
        msg["state_ref"] = stores().blobs.put(raw.encode("utf-8"))
    return msg


def decode(msg: Any) -> tuple[LoopState, dict[str, Any]]:
    """The state and configuration overrides a message carries."""
    if not isinstance(msg, dict) or msg.get("v") != MESSAGE_VERSION:
        raise SubmissionError(
            f"not a critique stage message (expected a dict with v={MESSAGE_VERSION})"
        )
    if "state" in msg:
        raw: str | bytes = msg["state"]
    elif "state_ref" in msg:
        raw = stores().blobs.get(msg["state_ref"])
    else:
        raise SubmissionError("stage message carries neither 'state' nor 'state_ref'")
    return LoopState.model_validate_json(raw), dict(msg.get("config") or {})


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


def decode_gate_request(msg: Any) -> GateRequest:
    """The completion-gate request a message carries (a clear error when it is malformed)."""
    try:
        req = GateRequest.model_validate(msg)
    except Exception as exc:
        raise SubmissionError(f"malformed complete_gate message: {exc}") from exc
    if req.v != MESSAGE_VERSION:
        raise SubmissionError(f"complete_gate message version {req.v}; expected {MESSAGE_VERSION}")
    return req


def file_bytes(file: FileRef) -> bytes | None:
    """A file's bytes for the gates' file validator: inline content, else its blob, else None."""
    if file.content is not None:
        return file.content.encode("utf-8")
    if file.blob is not None:
        return stores().blobs.get(file.blob)
    return None
