"""A manager with no Celery and no Python client: entry messages built by hand as Celery
protocol-2 JSON, LPUSHed onto the queue's Redis list, verdicts read from the result backend's
``celery-task-meta-<id>`` key (what a manager in JavaScript or Go does, docs/entry.md)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import uuid
from typing import Any

import redis

from tests.support import wait_until

QUEUE = "critique.cpu"
"""The entry queue (kombu's Redis list for priority 0 has the queue's own name)."""


def canonical(body: dict[str, Any]) -> bytes:
    """The bytes an entry signature covers, as docs/entry.md defines them (every field but
    ``sig``, sorted keys, no whitespace, UTF-8 unescaped)."""
    rest = {k: v for k, v in body.items() if k != "sig"}
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def entry_body(
    submission: dict[str, Any],
    task_id: str,
    config: dict[str, Any] | None = None,
    key: str | None = None,
) -> dict[str, Any]:
    """An entry message addressed to ``critique.submit`` as ``task_id``, signed with ``key``
    (the managers' key) when given, with nothing but the standard library."""
    body: dict[str, Any] = {
        "v": 1,
        "submission": submission,
        "config": config or {},
        "task_name": "critique.submit",
        "task_id": task_id,
    }
    return body if key is None else sign(body, key)


def sign(body: dict[str, Any], key: str) -> dict[str, Any]:
    """``body`` with ``sig``: HMAC-SHA256 under ``key`` of its canonical JSON, in hex."""
    mac = hmac.new(key.encode(), canonical(body), hashlib.sha256).hexdigest()
    return {**body, "sig": "hmac-sha256:" + mac}


def protocol2(
    task: str,
    task_id: str,
    args: list[Any],
    queue: str = QUEUE,
    headers: dict[str, Any] | None = None,
) -> str:
    """The Celery protocol-2 JSON envelope kombu's Redis transport keeps in a queue's list;
    ``headers`` are more message headers (a manager's ``traceparent``)."""
    payload = json.dumps([args, {}, {"callbacks": None, "errbacks": None, "chain": None}])
    return json.dumps(
        {
            "body": base64.b64encode(payload.encode()).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {
                "lang": "js",
                "task": task,
                "id": task_id,
                "root_id": task_id,
                "parent_id": None,
                "group": None,
                "argsrepr": "(<entry message>,)",
                "kwargsrepr": "{}",
                "origin": "hand-built",
                "retries": 0,
                "eta": None,
                "expires": None,
                "timelimit": [None, None],
                "shadow": None,
                "ignore_result": False,
                **(headers or {}),
            },
            "properties": {
                "correlation_id": task_id,
                "reply_to": "",
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
    )


def push(
    r: redis.Redis,
    task: str,
    task_id: str,
    body: Any,
    queue: str = QUEUE,
    headers: dict[str, Any] | None = None,
) -> None:
    """LPUSH one hand-built task message onto ``queue`` (with more ``headers``)."""
    r.lpush(queue, protocol2(task, task_id, [body], queue, headers))


def task_meta(r: redis.Redis, task_id: str, timeout: float = 60.0) -> dict[str, Any]:
    """The result backend's record of ``task_id`` once it is ready (SUCCESS or FAILURE)."""

    def ready() -> dict[str, Any] | None:
        raw = r.get(f"celery-task-meta-{task_id}")
        doc = None if raw is None else json.loads(raw)
        return doc if doc and doc.get("status") in ("SUCCESS", "FAILURE") else None

    got: dict[str, Any] = wait_until(ready, timeout, what=f"the result of task {task_id}")
    return got
