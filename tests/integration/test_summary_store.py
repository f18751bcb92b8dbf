"""The gate's summary in Celery's result backend (issue 39: one round trip less per verdict):
the pass's first result store writes it without reading the key first; a repeat keeps the
SUCCESS stored before it, as Celery's ``store_result`` does. A real Redis backend."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.support.workers import client_on, worker_db_url

pytestmark = pytest.mark.integration


@pytest.fixture
def backend(redis_url: str) -> Iterator[object]:
    from workers.app import app

    with client_on(worker_db_url(redis_url)):
        app.backend  # noqa: B018  (built on the URL just set)
        yield app.backend


def _gets(url: str) -> int:
    stats = redis.Redis.from_url(url).info("commandstats")
    return int(stats.get("cmdstat_get", {}).get("calls", 0))


def test_the_first_store_writes_the_summary_without_reading_it(backend: object) -> None:
    """first=True: one write (no GET); ``AsyncResult`` of the task id returns the summary."""
    from workers.app import app
    from workers.steps import store_summary

    task_id = uuid.uuid4().hex
    url = str(app.conf.result_backend)
    before = _gets(url)
    store_summary(backend, task_id, {"status": "accepted"}, None, first=True)
    assert _gets(url) == before
    got = app.AsyncResult(task_id)
    assert (got.state, got.result) == ("SUCCESS", {"status": "accepted"})


def test_a_repeat_keeps_the_summary_stored_first(backend: object) -> None:
    """first=False (a redelivered gate): Celery's store_result reads the key and leaves a
    stored SUCCESS as it is; with none stored it writes."""
    from workers.app import app
    from workers.steps import store_summary

    task_id = uuid.uuid4().hex
    store_summary(backend, task_id, {"status": "accepted"}, None, first=True)
    store_summary(backend, task_id, {"status": "escalated"}, None, first=False)
    assert app.AsyncResult(task_id).result == {"status": "accepted"}
    other = uuid.uuid4().hex
    store_summary(backend, other, {"status": "repaired"}, None, first=False)
    assert app.AsyncResult(other).result == {"status": "repaired"}
