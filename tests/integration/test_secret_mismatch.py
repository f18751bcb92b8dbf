"""A mis-keyed resubmit (the manager's CRITIQUE_SECRET differs from the workers') is refused
by the client before it begins a pass, on a real Redis and a real worker: the run's finished
results stay finished instead of turning into passes no worker will ever run."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from pipeline.errors import ConfigError
from pipeline.models import Submission
from tests.support.workers import ROOT, WorkerStarter, client_on, worker_db_url, worker_env

pytestmark = pytest.mark.integration

WORKERS_KEY = "w" * 64
MANAGERS_TYPO = "m" * 64


@pytest.fixture
def signed(redis_url: str) -> Iterator[str]:
    """This process's client on the workers' database with the workers' key (flushed for each
    test); the test starts the worker that holds the same key."""
    url = worker_db_url(redis_url)
    with client_on(url, CRITIQUE_SECRET=WORKERS_KEY) as env:
        yield env["REDIS_URL"]


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


def test_a_mis_keyed_resubmit_is_refused_and_the_finished_results_stay(
    signed: str, start_worker: WorkerStarter
) -> None:
    from workers.client import CritiqueClient
    from workers.commands.status import load_snapshot

    start_worker("mismatch", worker_env(signed, CRITIQUE_SECRET=WORKERS_KEY))

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


def test_a_mis_keyed_submit_wait_says_the_worker_refused_it_and_why(
    signed: str, start_worker: WorkerStarter
) -> None:
    """A fresh run submitted with the wrong secret: --wait times out naming the refusal and
    the secret to compare, not "is a worker consuming …?"."""
    import json
    import subprocess
    import sys

    start_worker("mismatch", worker_env(signed, CRITIQUE_SECRET=WORKERS_KEY))
    line = json.dumps({"run_id": "fresh-mk", "worker_id": "w1", "task": "t", "output": "ok"})
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", "submit", "-", "--wait", "--timeout", "4"],
        input=line,
        capture_output=True,
        text=True,
        env=worker_env(signed, CRITIQUE_SECRET=MANAGERS_TYPO),
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert "a worker refused 1 message(s) claiming this run since the submit: " in done.stderr
    assert "bad signature" in done.stderr
    assert "compare the manager's CRITIQUE_SECRET with the workers'" in done.stderr
    assert "is a worker consuming" not in done.stderr
