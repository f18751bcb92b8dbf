"""What a task message must look like before a worker's broker client or Celery reads it.

Anyone who can push to a queue (a manager with the ``critique-manager`` Redis user, a broker
writer) hands kombu and Celery bytes they parse inside the worker's consumer, where an error is
not a task failure but the end of the worker process (``LPUSH critique.cpu x`` did that). So a
worker checks every message first, here, in plain code that never raises on any input: a
message is admitted only as a well-formed Celery protocol-2 message of a task the worker runs,
with JSON-native values, a bounded nesting, a body of ``[args, kwargs, embed]`` that fits the
task, no chord, callbacks only to the product's tasks on the product's queues, and an
``eta`` / ``expires`` within the product's own delays. Anything else is a :class:`Refusal` with
a reason from :data:`REASONS` (a bounded metric label), a short detail without the payload, and
what could be read of its task name and id (escaped, cut short).

Two entry points: :func:`check_raw` for the bytes a Redis queue holds (the transport's door,
which also rewrites the delivery tag and the delivery info: a sender's own could overwrite
another message's ``unacked`` record or route a restore to any key), and :func:`check_message`
for a message any broker delivered (Celery's consumer, RabbitMQ included). No I/O here; the
worker side (dead-letter list, metric, log) is :mod:`workers.door`.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipeline.models import MAX_OUTPUT_DEPTH

REASONS = ("encoding", "json", "depth", "envelope", "headers", "task", "body", "eta", "raised")
"""Why a message was moved aside: not UTF-8; not JSON; nested deeper than :data:`MAX_DEPTH`;
the envelope's shape or types (content type, properties, base64 body); a header's type or
value; a task the worker does not run (Celery's built-ins included); the body ``[args, kwargs,
embed]`` (arity, chord, a callback elsewhere); an ``eta`` or ``expires`` beyond the bound; or
the consumer's own handling raised (:func:`workers.door.guard_consumer`)."""

MAX_DEPTH = MAX_OUTPUT_DEPTH + 64
"""Deepest nesting a message may have: an output's own bound plus the state, the message and
the protocol around it. A message that parses deeper is refused before anything walks it
recursively (kombu's ``dumps`` into ``unacked``, Celery's ``saferepr``)."""

MAX_CALLBACKS = 64
"""Most signatures in one of the embed's ``callbacks``, ``errbacks`` or ``chain``."""

MAX_ID = 128
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
"""A task id: what Celery and the product make (UUIDs, hex) and what docs/entry.md asks for."""

MAX_TEXT = 64 * 1024
"""Longest free-text header (``argsrepr``, ``kwargsrepr``, ``origin``…): they are logged."""

MAX_EXTRA_HEADERS = 32
KNOWN_HEADERS = frozenset(
    {
        "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
        "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin",
        "ignore_result", "replaced_task_nesting", "stamped_headers", "stamps", "utc",
    }
)  # fmt: skip
"""Celery protocol-2 headers, each checked for its type (:func:`_check_headers`)."""

RESERVED_HEADERS = frozenset(
    {
        "args", "kwargs", "callbacks", "errbacks", "chain", "chord", "children", "groups",
        "called_directly", "correlation_id", "delivery_info", "headers", "hostname",
        "is_eager", "logfile", "loglevel", "properties", "reply_to", "soft_time_limit",
        "taskset", "time_limit", "meth", "link", "link_error",
    }
)  # fmt: skip
"""Names Celery reads from a task's request (``celery.app.task.Context``) other than the
known headers: a header of that name would set them (a ``chain`` header runs tasks after this
one, ``is_eager`` skips result writes), so a message carrying one is refused. Any other extra
header is kept only with a scalar value."""

_EMBED_KEYS = frozenset({"callbacks", "errbacks", "chain", "chord"})


@dataclass(frozen=True)
class Policy:
    """What a worker admits: ``tasks`` (name -> the fewest and most positional arguments),
    ``queues`` (where a callback may be sent), ``max_delay_s`` (latest ``eta``, from now),
    ``max_expires_s`` (latest ``expires``, from now), ``max_timelimit_s`` (the largest time
    limit a message may ask for: the worker's own)."""

    tasks: Mapping[str, tuple[int, int]]
    queues: frozenset[str]
    max_delay_s: float
    max_expires_s: float
    max_timelimit_s: float


@dataclass(frozen=True)
class Refusal:
    """A message not admitted: ``reason`` (one of :data:`REASONS`), ``detail`` (one short line
    of ours, never the payload), and the task name and id when they could be read (escaped and
    cut to :data:`MAX_ID`), for the dead-letter entry and a failure record."""

    reason: str
    detail: str
    task: str | None = None
    task_id: str | None = None


@dataclass
class Admitted:
    """A Redis queue's message that passed :func:`check_raw`: the envelope kombu is given (its
    delivery tag and delivery info rewritten)."""

    payload: dict[str, Any]
    task: str
    task_id: str


class _Refused(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def excerpt(raw: bytes | str, limit: int = 160) -> str:
    """The first ``limit`` bytes of ``raw`` as printable ASCII (backslash escapes), for a
    dead-letter entry: never the whole payload, never a control character."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    text = data[:limit].decode("ascii", "backslashreplace")
    out = "".join(c if " " <= c <= "~" else repr(c)[1:-1] for c in text)
    return out + ("..." if len(data) > limit else "")


def safe_name(value: Any) -> str | None:
    """``value`` as a task name or id fit for a log line or a record: a string, escaped to
    printable ASCII and cut to :data:`MAX_ID`; None for anything else."""
    if not isinstance(value, str) or not value:
        return None
    return excerpt(value, MAX_ID)


def valid_task_id(value: Any) -> bool:
    """Whether ``value`` is a task id a worker admits (1-128 letters, digits or ``._:@-``)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def _loads(text: str | bytes) -> Any:
    """Plain JSON (no kombu object hook: ``{"__type__": …}`` stays a dict and is refused by
    :func:`_walk`), with NaN and infinities refused; too deep to parse is ``depth``."""

    def constant(name: str) -> Any:
        raise _Refused("json", f"{name} is not JSON")

    try:
        return json.loads(text, parse_constant=constant)
    except RecursionError:
        raise _Refused("depth", "nested too deep to parse") from None
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError of bytes
        if isinstance(exc, UnicodeDecodeError):
            raise _Refused("encoding", "not UTF-8") from None
        raise _Refused("json", f"not JSON ({type(exc).__name__} at {_pos(exc)})") from None


def _pos(exc: ValueError) -> str:
    return f"offset {getattr(exc, 'pos', '?')}"


def _walk(value: Any, what: str) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` and kombu's typed objects
    (``{"__type__", "__value__"}``, which kombu's decoder turns into bytes, dates, UUIDs)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if "__type__" in node and "__value__" in node:
                raise _Refused(what, "a kombu typed object ({'__type__': …})")
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth >= MAX_DEPTH:
            raise _Refused("depth", f"nested more than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _text(value: Any, *, limit: int = MAX_TEXT) -> bool:
    return isinstance(value, str) and len(value) <= limit


def _opt_text(value: Any, *, limit: int = MAX_TEXT) -> bool:
    return value is None or _text(value, limit=limit)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _when(value: Any, name: str, now: float, latest_s: float) -> None:
    """An ``eta`` or ``expires``: absent, or an ISO-8601 time no later than ``now + latest_s``
    (a time without a zone reads as UTC)."""
    if value is None or value == "":
        return
    if not _text(value, limit=64):
        raise _Refused("eta", f"{name} is not an ISO-8601 time string")
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise _Refused("eta", f"{name} is not an ISO-8601 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    try:
        at = when.timestamp()
    except (OverflowError, ValueError, OSError):
        raise _Refused("eta", f"{name} is out of range") from None
    if at > now + latest_s:
        raise _Refused("eta", f"{name} is {at - now:.0f} s away (the most: {latest_s:.0f} s)")


def _check_headers(headers: Any, policy: Policy, now: float) -> tuple[str, str]:
    """The protocol-2 headers: the task's name (one the worker runs) and id, and every other
    header's type; returns ``(task, id)``."""
    if not isinstance(headers, dict):
        raise _Refused("envelope", "headers are not an object")
    task: Any = headers.get("task")
    task_id: Any = headers.get("id")
    if not _text(task, limit=MAX_ID) or not _text(task_id, limit=MAX_ID):
        raise _Refused("headers", "no task name or id (strings of at most 128 characters)")
    if not _ID.fullmatch(task_id):
        raise _Refused("headers", "the task id is not 1-128 letters, digits or ._:@-")
    if task not in policy.tasks:
        raise _Refused("task", "not a task this worker runs")
    for name in ("lang", "shadow", "argsrepr", "kwargsrepr", "origin", "root_id", "parent_id"):
        if not _opt_text(headers.get(name)):
            raise _Refused("headers", f"{name} is not a string")
    for name in ("group", "group_index", "stamped_headers"):
        if headers.get(name) is not None:
            raise _Refused("headers", f"{name} is set (no group runs here)")
    if headers.get("stamps") not in (None, {}):
        raise _Refused("headers", "stamps are set")
    for name in ("ignore_result", "utc"):
        if headers.get(name) is not None and not isinstance(headers.get(name), bool):
            raise _Refused("headers", f"{name} is not a boolean")
    for name in ("retries", "replaced_task_nesting"):
        value = headers.get(name)
        if value is not None and not (_is_int(value) and 0 <= value <= 1000):
            raise _Refused("headers", f"{name} is not a whole number 0-1000")
    _check_timelimit(headers.get("timelimit"), policy)
    _when(headers.get("eta"), "eta", now, policy.max_delay_s)
    _when(headers.get("expires"), "expires", now, policy.max_expires_s)
    extra = [k for k in headers if k not in KNOWN_HEADERS]
    if len(extra) > MAX_EXTRA_HEADERS:
        raise _Refused("headers", f"more than {MAX_EXTRA_HEADERS} extra headers")
    for name in extra:
        if name in RESERVED_HEADERS or not _text(name, limit=64):
            raise _Refused("headers", f"header {safe_name(name)!r} is not allowed")
        value = headers[name]
        if not (value is None or isinstance(value, bool) or _is_number(value) or _text(value)):
            raise _Refused("headers", f"header {safe_name(name)!r} is not a scalar")
    return task, task_id


def _check_timelimit(value: Any, policy: Policy) -> None:
    """``[soft, hard]``, each absent or a positive number no larger than the worker's own."""
    if value is None:
        return
    if not isinstance(value, list) or len(value) != 2:
        raise _Refused("headers", "timelimit is not [soft, hard]")
    for limit in value:
        if limit is None:
            continue
        if not _is_number(limit) or not 0 < limit <= policy.max_timelimit_s:
            raise _Refused("headers", f"timelimit is not within (0, {policy.max_timelimit_s:g}]")


def _check_body(body: Any, task: str, policy: Policy) -> None:
    """``[args, kwargs, embed]``: positional arguments the task takes, no keyword arguments,
    no chord, and callbacks, errbacks and chain links that are plain signatures of tasks the
    worker runs, sent to the product's queues (so a callback can neither run a built-in task
    nor create a key elsewhere: what it sends meets this check again on its queue)."""
    if not isinstance(body, list) or len(body) != 3:
        raise _Refused("body", "the body is not [args, kwargs, embed]")
    args, kwargs, embed = body
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise _Refused("body", "args are not a list, or kwargs not an object")
    low, high = policy.tasks[task]
    if not low <= len(args) <= high or kwargs:
        raise _Refused("body", f"{len(args)} arguments, {len(kwargs)} keyword arguments")
    if not isinstance(embed, dict) or not set(embed) <= _EMBED_KEYS:
        raise _Refused("body", "embed is not {callbacks, errbacks, chain, chord}")
    if embed.get("chord") is not None:
        raise _Refused("body", "a chord (no chord runs here)")
    for name in ("callbacks", "errbacks", "chain"):
        links = embed.get(name)
        if links is None:
            continue
        if not isinstance(links, list) or len(links) > MAX_CALLBACKS:
            raise _Refused("body", f"{name} is not a list of at most {MAX_CALLBACKS}")
        for sig in links:
            _check_signature(sig, name, policy)


def _check_signature(sig: Any, where: str, policy: Policy) -> None:
    if not isinstance(sig, dict) or sig.get("task") not in policy.tasks:
        raise _Refused("body", f"{where} names a task this worker does not run")
    if sig.get("subtask_type") is not None:
        raise _Refused("body", f"{where} holds a group or chord")
    options = sig.get("options") or {}
    if not isinstance(options, dict):
        raise _Refused("body", f"{where} options are not an object")
    for name in ("queue", "exchange", "routing_key"):
        value = options.get(name)
        if value not in (None, "") and value not in policy.queues:
            raise _Refused("body", f"{where} routes to a queue that is not the product's")


def _check_properties(props: Any) -> None:
    if not isinstance(props, dict):
        raise _Refused("envelope", "properties are not an object")
    if props.get("body_encoding") != "base64":
        raise _Refused("envelope", "the body encoding is not base64")
    priority = props.get("priority")
    if priority is not None and not (_is_int(priority) and 0 <= priority <= 255):
        raise _Refused("envelope", "priority is not 0-255")
    for name in ("correlation_id", "reply_to"):
        if not _opt_text(props.get(name), limit=1024):
            raise _Refused("envelope", f"{name} is not a string")
    info = props.get("delivery_info")
    if info is not None and not isinstance(info, dict):
        raise _Refused("envelope", "delivery_info is not an object")


def _content(content_type: Any, content_encoding: Any) -> None:
    if content_type != "application/json" or content_encoding != "utf-8":
        raise _Refused("envelope", "not application/json in utf-8")


def _decode_body(raw: bytes) -> Any:
    """The body's JSON (strict UTF-8), walked for depth and typed objects."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Refused("encoding", "the body is not UTF-8") from None
    body = _loads(text)
    _walk(body, "body")
    return body


def check_raw(item: bytes | str, queue: str, policy: Policy, now: float) -> Admitted | Refusal:
    """The door of a Redis queue: ``item`` as popped from ``queue``'s list, checked whole
    (envelope, headers, body). An admitted envelope gets a fresh delivery tag and the delivery
    info of the queue it came from, whatever the sender wrote there."""
    head: dict[str, Any] = {}
    try:
        text = item.decode("utf-8") if isinstance(item, bytes) else item
    except UnicodeDecodeError:
        return Refusal("encoding", "not UTF-8")
    try:
        payload = _loads(text)
        if not isinstance(payload, dict):
            raise _Refused("envelope", f"a JSON {type(payload).__name__}, not an object")
        headers = payload.get("headers")
        if isinstance(headers, dict):
            head = headers
        _walk(payload, "envelope")
        _content(payload.get("content-type"), payload.get("content-encoding"))
        props: Any = payload.get("properties")
        _check_properties(props)
        body_text = payload.get("body")
        if not isinstance(body_text, str):
            raise _Refused("envelope", "the body is not a base64 string")
        try:
            raw_body = base64.b64decode(body_text, validate=True)
        except (binascii.Error, ValueError):
            raise _Refused("envelope", "the body is not base64") from None
        task, task_id = _check_headers(headers, policy, now)
        _check_body(_decode_body(raw_body), task, policy)
    except _Refused as refused:
        return Refusal(refused.reason, refused.detail, safe_name(head.get("task")),
                       safe_name(head.get("id")))  # fmt: skip
    info = props.get("delivery_info") or {}
    props["delivery_tag"] = str(uuid.uuid4())
    props["delivery_info"] = {"exchange": "", "routing_key": queue}
    if info.get("redelivered") is True:
        props["delivery_info"]["redelivered"] = True
    return Admitted(payload, task, task_id)


def check_message(
    headers: Any,
    body: Any,
    content_type: Any,
    content_encoding: Any,
    policy: Policy,
    now: float,
) -> Refusal | None:
    """The door of Celery's consumer, for a message any broker delivered (``body``: its bytes
    as the broker decoded them); None when it may be handled."""
    head = headers if isinstance(headers, dict) else {}
    try:
        _content(content_type, content_encoding)
        if isinstance(body, str):
            body = body.encode("utf-8", "surrogatepass")
        if not isinstance(body, bytes | bytearray | memoryview):
            raise _Refused("envelope", "the body is not bytes")
        _walk(headers, "headers")
        task, _ = _check_headers(headers, policy, now)
        _check_body(_decode_body(bytes(body)), task, policy)
    except _Refused as refused:
        return Refusal(refused.reason, refused.detail, safe_name(head.get("task")),
                       safe_name(head.get("id")))  # fmt: skip
    return None


def check_fanout(payload: Any) -> Refusal | None:
    """A control or event message (Redis pub/sub) kombu can build and decode: an object whose
    properties hold a string delivery tag, with a JSON body (base64) of a bounded depth; None
    when it may be delivered. What it asks for is Celery's to judge (its remote-control
    handler logs and drops a command it cannot run)."""
    try:
        if not isinstance(payload, dict):
            raise _Refused("envelope", "a control message that is not an object")
        _walk(payload, "envelope")
        props = payload.get("properties")
        if not isinstance(props, dict) or not _text(props.get("delivery_tag"), limit=256):
            raise _Refused("envelope", "a control message without a delivery tag")
        if not isinstance(props.get("delivery_info") or {}, dict):
            raise _Refused("envelope", "delivery_info is not an object")
        if not isinstance(payload.get("headers") or {}, dict):
            raise _Refused("envelope", "headers are not an object")
        _content(payload.get("content-type"), payload.get("content-encoding"))
        body = payload.get("body")
        if props.get("body_encoding") != "base64" or not isinstance(body, str):
            raise _Refused("envelope", "the body is not base64")
        try:
            raw = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise _Refused("envelope", "the body is not base64") from None
        _decode_body(raw)
    except _Refused as refused:
        return Refusal(refused.reason, refused.detail)
    return None
