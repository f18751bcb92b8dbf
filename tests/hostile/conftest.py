"""Fixtures for the hostile-input suite: a real worker and Redis, attacked as a client would.

Every module here gets one worker process (threads pool) on a database of its own, started with
``CRITIQUE_SECRET`` set as every deploy sets it, and this process's client pointed at the same
database with the same secret. Tests attack through the client, the CLI, or raw broker messages
(:func:`send_raw`), then assert the refusal, its message, and that the worker is still alive and
an honest submission sent afterwards still gets its result (:func:`assert_still_serving`).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.models import CritiqueResult, Submission
from tests.integration.workers import WorkerProcess, client_on, worker_db_url

SECRET = "hostile-suite-secret-" + uuid.uuid4().hex
"""The deploy secret the workers and the honest client share (an attacker does not know it)."""
ENABLED = {"enabled": True}


@pytest.fixture(scope="module")
def hostile_url(redis_url: str) -> str:
    """The workers' database (the one below the test database)."""
    return worker_db_url(redis_url)


@pytest.fixture(scope="module")
def hostile_env(hostile_url: str) -> Iterator[dict[str, str]]:
    """This process's client pointed at the workers' database, with the deploy secret."""
    with client_on(
        hostile_url,
        CRITIQUE_SECRET=SECRET,
        CRITIQUE_LLM_API_KEY="sk-worker-secret-key",
        CRITIQUE_STALL_S="600",
        # The signing tests read finished passes' step records (the messages workers sent on).
        CRITIQUE_STEPS_GRACE_S="600",
    ) as env:
        yield env


@pytest.fixture(scope="module")
def hostile_worker(
    hostile_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """One worker process for the module; its log is kept for the assertions."""
    log = tmp_path_factory.mktemp("hostile-logs") / "worker.log"
    w = WorkerProcess(
        hostile_env["REDIS_URL"], concurrency=4, name="hostile", env=hostile_env, log=log
    ).start()
    yield w
    w.stop()


@contextlib.contextmanager
def llm_worker(
    hostile_env: dict[str, str], api_base: str, allowed: str, name: str, log: Path
) -> Iterator[WorkerProcess]:
    """A hostile-suite worker whose LLM transport the operator's environment sets (the fake's
    ``api_base``, short timeouts and retries), with ``allowed`` as its allowed_models: there and
    in this process's client, whose cached configurations are dropped on entry and exit."""
    from workers import runtime

    env = {
        **hostile_env,
        "CRITIQUE_ALLOWED_MODELS": allowed,
        "CRITIQUE_LLM__API_BASE": api_base,
        "CRITIQUE_LLM__TIMEOUT_S": "5",
        "CRITIQUE_LLM__MAX_RETRIES": "1",
        "CRITIQUE_LLM__BACKOFF_S": "0.01",
        "CRITIQUE_LLM__BACKOFF_MAX_S": "0.05",
    }
    w = WorkerProcess(env["REDIS_URL"], concurrency=4, name=name, env=env, log=log).start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CRITIQUE_ALLOWED_MODELS", allowed)
            runtime._configs.clear()
            runtime._contexts.clear()
            yield w
    finally:
        runtime._configs.clear()
        runtime._contexts.clear()
        w.stop()


def log_of(worker: WorkerProcess) -> str:
    """What the worker has logged so far."""
    return Path(worker.log).read_text(encoding="utf-8", errors="replace") if worker.log else ""


def honest_submission(run_id: str | None = None, worker_id: str = "honest") -> Submission:
    """A clean JSON output that the heuristic critic accepts at 1.0."""
    return Submission(
        run_id=run_id or f"honest-{uuid.uuid4().hex[:8]}",
        worker_id=worker_id,
        task="Summarise the Q3 sales report.",
        output={"summary": "Sales rose 4% in Q3.", "confidence": 0.9},
        required_fields=("summary",),
    )


def assert_still_serving(worker: WorkerProcess, timeout: float = 30.0) -> CritiqueResult:
    """The worker process is alive and an honest submission still gets its accepted result."""
    from workers.client import CritiqueClient

    assert worker.proc is not None and worker.proc.poll() is None, "the worker process died"
    client = CritiqueClient(ENABLED)
    result = client.wait(client.submit(honest_submission()), timeout=timeout)
    assert result.status == "accepted", result
    return result


def send_raw(task_name: str, *args: Any, queue: str = "critique.cpu") -> Any:
    """Publish a plain Celery message as an attacker with broker access would (no client code,
    no signature); returns the AsyncResult."""
    from workers.app import app

    return app.send_task(task_name, args=args, queue=queue)


def send_signed(
    task_name: str, msg: dict[str, Any], queue: str = "critique.cpu", task_id: str | None = None
) -> Any:
    """Publish ``msg`` as a holder of the deploy secret would without the client: addressed to
    the task (and a task id) it is sent as, and signed; returns the AsyncResult."""
    from pipeline import signing
    from workers import runtime
    from workers.app import app

    task_id = task_id or uuid.uuid4().hex
    signed = runtime.sign(signing.address(msg, task_name, task_id))
    return app.send_task(task_name, args=(signed,), queue=queue, task_id=task_id)
