"""``critique.submit`` through a real worker that holds ``CRITIQUE_SECRET`` alone (a one-secret
setup): entry messages built by hand, as in test_entry.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.support.entry import (
    WORKER_KEY,
    hand_built,
    refusal,
)
from tests.support.rawcelery import entry_body, push, task_meta
from tests.support.submissions import CONFIG
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    """This process's client and the worker with CRITIQUE_SECRET alone."""
    with client_on(worker_db_url(redis_url), CRITIQUE_SECRET=WORKER_KEY) as e:
        yield e


WORKER = WorkerSpec("entryone", concurrency=2)


@pytest.fixture(scope="module")
def one_secret(env: dict[str, str], worker: WorkerProcess) -> Iterator[redis.Redis]:
    """A client of the Redis of the module's worker (CRITIQUE_SECRET alone)."""
    client = redis.Redis.from_url(env["REDIS_URL"])
    yield client
    client.close()


class TestOneSecret:
    def test_an_entry_signed_with_critique_secret_is_accepted(
        self, one_secret: redis.Redis
    ) -> None:
        """Without CRITIQUE_ENTRY_SECRET, entry messages sign with CRITIQUE_SECRET (setups
        from before the split keep working) and unsigned ones are still refused."""
        run_id = f"one-{uuid.uuid4().hex[:8]}"
        task_id = str(uuid.uuid4())
        body = entry_body(hand_built(run_id), task_id, CONFIG, WORKER_KEY)
        push(one_secret, "critique.submit", task_id, body)
        meta = task_meta(one_secret, task_id)
        assert (meta["status"], meta["result"]["status"]) == ("SUCCESS", "accepted"), meta
        unsigned_id = str(uuid.uuid4())
        push(
            one_secret, "critique.submit", unsigned_id, entry_body(hand_built(run_id), unsigned_id)
        )
        assert refusal(task_meta(one_secret, unsigned_id))[0] == "ForgedMessageError"
