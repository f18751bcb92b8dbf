"""Monitors never see a worker's output (issue 34): every ``critique.*`` message the client
publishes carries a summary (run, iteration, worker, pass, state size) as its ``argsrepr`` and
``kwargsrepr`` headers, which Flower and ``celery events`` show as the task's arguments, and
its ``task-sent`` event carries the same; the broker door admits such a message. Read back from
the real Redis queue, with no worker consuming it."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pipeline.security import message_checks
from pipeline.store import keys
from tests.support.workers import client_on, worker_db_url

pytestmark = pytest.mark.integration

SECRET_TEXT = "Q3 revenue rose 12 percent in the north region"


@pytest.fixture
def db_url(redis_url: str) -> Iterator[str]:
    url = worker_db_url(redis_url)
    with client_on(url, CRITIQUE_SECRET=""):
        yield url


def _queued(url: str) -> list[dict[str, Any]]:
    """Every message waiting in the product's queues, as kombu stored it."""
    r = redis.Redis.from_url(url)
    return [json.loads(raw) for q in keys.QUEUES for raw in r.lrange(q, 0, -1)]


@pytest.mark.parametrize("repeat", [1, 2000], ids=["inline", "by-reference"])
def test_a_submitted_message_shows_monitors_a_summary_never_the_output(
    db_url: str, repeat: int
) -> None:
    """The published message's argsrepr names run, iteration, worker, pass and the state's
    size (a large state: "by reference", its ids read from the blob's head); neither header
    holds any of the output; the door admits the message as it is."""
    from workers import door
    from workers.client import CritiqueClient

    run_id = f"sum-{uuid.uuid4().hex[:8]}"
    output = " ".join([SECRET_TEXT] * repeat)
    handle = CritiqueClient().submit(
        {"run_id": run_id, "iteration": 2, "worker_id": "north", "task": "t", "output": output}
    )
    (message,) = _queued(db_url)
    headers = message["headers"]
    assert headers["task"] == keys.TASK_L0
    shown = headers["argsrepr"] + headers["kwargsrepr"]
    assert "Q3 revenue" not in shown and "north region" not in shown
    assert headers["argsrepr"].startswith(
        f"(<run={run_id} it=2 worker=north pass={handle.pass_id[:16]} state="
    )
    assert ("state=by reference" in shown) == (repeat > 1)
    assert headers["kwargsrepr"] == "{}"
    raw = json.dumps(message).encode()
    got = message_checks.check_raw(raw, keys.QUEUE_CPU, door.policy(), time.time())
    assert isinstance(got, message_checks.Admitted), got


def test_the_task_sent_event_carries_the_summary_too(db_url: str) -> None:
    """The task-sent event (what Flower lists before any worker takes the task) is built from
    the same summary: its args never hold the stage message."""
    from workers.app import app

    msg = {"v": 1, "sid": "p" * 16, "state": json.dumps({"note": SECRET_TEXT})}
    message = app.amqp.as_task_v2("tid-1", keys.TASK_L0, [msg], {}, create_sent_event=True)
    headers, _, _, sent_event = message
    for shown in (headers["argsrepr"], sent_event["args"]):
        assert shown.startswith(f"(<pass={'p' * 16} state=") and SECRET_TEXT not in shown
    other = app.amqp.as_task_v2("tid-2", "other.task", [msg], {}, create_sent_event=True)
    assert SECRET_TEXT in other[0]["argsrepr"]  # only the product's tasks are summarised
