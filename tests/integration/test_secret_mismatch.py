"""A mis-keyed resubmit (the manager's CRITIQUE_SECRET differs from the workers') is refused
by the client before it begins a pass, on a real Redis and a real worker: the run's finished
results stay finished instead of turning into passes no worker will ever run."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from pipeline.errors import ConfigError
from pipeline.models import Submission
from tests.integration.workers import WorkerProcess, client_on, worker_db_url

pytestmark = pytest.mark.integration

WORKERS_KEY = "w" * 64
MANAGERS_TYPO = "m" * 64


@pytest.fixture
def signed(redis_url: str) -> Iterator[str]:
    url = worker_db_url(redis_url)
    with client_on(url, CRITIQUE_SECRET=WORKERS_KEY):
        w = WorkerProcess(url, name="mismatch").start()
        try:
            yield url
        finally:
            w.stop()


def _subs() -> list[Submission]:
    return [
        Submission(
            run_id="mk",
            worker_id=f"w{i}",
            task="Summarise",
            output={"summary": "Sales rose 4%.", "findings": "Two stores."},
            required_fields=("summary", "findings"),
        )
        for i in range(3)
    ]


def test_a_mis_keyed_resubmit_is_refused_and_the_finished_results_stay(signed: str) -> None:
    from workers.client import CritiqueClient
    from workers.commands.status import load_snapshot

    client = CritiqueClient()
    done = client.wait_many(client.submit_many(_subs()), timeout=60)
    assert [r.status for r in done] == ["accepted"] * 3
    os.environ["CRITIQUE_SECRET"] = MANAGERS_TYPO
    try:
        with pytest.raises(ConfigError) as err:
            client.submit_many(_subs())
        text = str(err.value)
        assert "does not verify with this process's CRITIQUE_SECRET" in text
        assert "nothing was submitted" in text and "compare the manager's CRITIQUE_SECRET" in text
    finally:
        os.environ["CRITIQUE_SECRET"] = WORKERS_KEY
    snap = load_snapshot("mk")
    assert len(snap.results) == 3 and snap.pending == [] and snap.failed == []
    again = client.wait_many(client.submit_many(_subs()), timeout=60)  # the right key: fine
    assert [r.status for r in again] == ["accepted"] * 3
