"""Helpers for the hostile-input suite: the deploy secret, an honest submission and the check
that a worker still serves one, and messages published as an attacker or a key holder would."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.models import CritiqueResult, Submission
from tests.support.workers import WorkerProcess, WorkerSpec

SECRET = "hostile-suite-secret-" + uuid.uuid4().hex
"""The deploy secret the workers and the honest client share (an attacker does not know it)."""


ENABLED = {"enabled": True}


HOSTILE_WORKER = WorkerSpec("hostile", env_fixture="hostile_env")
"""The hostile suite's worker: one process for each module that declares ``WORKER =
HOSTILE_WORKER``, on the workers' database with the deploy secret (``hostile_env``); its log is
kept for the assertions."""


@contextlib.contextmanager
def llm_worker_env(
    hostile_env: dict[str, str], api_base: str, allowed: str
) -> Iterator[dict[str, str]]:
    """The environment of a hostile-suite worker whose LLM transport the operator's environment
    sets (the fake's ``api_base``, short timeouts and retries), with ``allowed`` as its
    allowed_models: there and in this process's client, whose cached configurations are dropped
    on entry and exit."""
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
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CRITIQUE_ALLOWED_MODELS", allowed)
            runtime._configs.clear()
            runtime._contexts.clear()
            yield env
    finally:
        runtime._configs.clear()
        runtime._contexts.clear()


def log_of(worker: WorkerProcess) -> str:
    """What the worker has logged so far."""
    return Path(worker.log).read_text(encoding="utf-8", errors="replace") if worker.log else ""


def new_run_id(prefix: str = "hostile") -> str:
    """A fresh run id: ``<prefix>-<8 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


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
    from pipeline.security import signing
    from workers import runtime
    from workers.app import app

    task_id = task_id or uuid.uuid4().hex
    signed = runtime.sign(signing.address(msg, task_name, task_id))
    return app.send_task(task_name, args=(signed,), queue=queue, task_id=task_id)
