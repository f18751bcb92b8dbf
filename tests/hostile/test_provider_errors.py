"""A provider's error body never reaches a manager unredacted (issue 33): through a real signed
worker whose LLM endpoint (the fake OpenAI-compatible server) answers with an error body that
echoes the worker's API key, an Authorization header, a URL's password and a long prompt, the
failure the manager reads (``wait()``, ``critique status --json``), the fallback note on a
verdict and every result-backend record keep the error's type, its HTTP status and a short
provider message, and none of the secrets.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import redis

from pipeline.errors import SubmissionError
from pipeline.models import Submission
from pipeline.security.redaction import MAX_PROVIDER_MESSAGE
from tests.fakes.openai_server import CRITIC, FakeOpenAIServer, error
from tests.support.hostile import ENABLED
from tests.support.workers import ROOT, WorkerProcess, WorkerSpec

pytestmark = pytest.mark.integration

CRITIC_MODEL = "openai/critic-model"
LLM_MODELS = CRITIC_MODEL
"""The models a submission may name (the worker's allowed_models)."""
LLM_CRITIC = {**ENABLED, "critic": "llm", "model": CRITIC_MODEL, "max_repair_attempts": 0}

WORKER = WorkerSpec("provider-errors", env_fixture="llm_env")
"""One worker for the module, on `llm_env` (tests/hostile/conftest.py): it holds
CRITIQUE_LLM_API_KEY=sk-worker-secret-key and calls the module's fake server."""

WORKER_KEY = "sk-worker-secret-key"
PROXY_TOKEN = "eyJhbGciOiJIUzI1NiJ9proxy0token0with0digits0000"
URL_PASSWORD = "urlpass-7731"
PROMPT_WORDS = "CONFIDENTIAL-PROMPT-TEXT "
SECRETS = (WORKER_KEY, PROXY_TOKEN, URL_PASSWORD)
ECHOING_BODY = (
    f"Incorrect API key provided: {WORKER_KEY}. Request headers: "
    f"{{'Authorization': 'Bearer {WORKER_KEY}', 'X-Proxy-Token': '{PROXY_TOKEN}'}} "
    f"upstream https://svc:{URL_PASSWORD}@llm.internal/v1 prompt: " + PROMPT_WORDS * 40
)
"""What a misbehaving provider or proxy answers: the key, its headers, an upstream URL with a
password, and the prompt (someone else's output) at length."""


def _submission(run_id: str) -> Submission:
    return Submission(
        run_id=run_id,
        worker_id="w1",
        task="Summarise the Q3 sales report.",
        output={"summary": "Sales rose 4% in Q3.", "confidence": 0.9},
        required_fields=("summary",),
        model=CRITIC_MODEL,
    )


def _assert_redacted(text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{leaked} in {text!r}"
    assert text.count("CONFIDENTIAL-PROMPT-TEXT") <= MAX_PROVIDER_MESSAGE // len(PROMPT_WORDS)


def _result_backend_text(url: str) -> str:
    """Every Celery result-backend record in the workers' database (managers may GET any)."""
    r = redis.Redis.from_url(url, decode_responses=True)
    return "\n".join(str(r.get(k)) for k in r.scan_iter(match="celery-task-meta-*"))


def _status_json(env: dict[str, str], run_id: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "workers.cli", "status", run_id, "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return out.stdout + out.stderr


def test_a_401_echoing_the_key_fails_with_type_status_and_a_redacted_message(
    worker: WorkerProcess, module_llm: FakeOpenAIServer, llm_env: dict[str, str]
) -> None:
    """A permanent provider error: the failure names AuthenticationError and HTTP 401, its
    provider message is cut to MAX_PROVIDER_MESSAGE characters, and neither the failure, nor
    `critique status --json`, nor any result-backend record holds the key, the proxy token,
    the URL's password or the whole prompt."""
    from workers.client import CritiqueClient

    module_llm.reset()
    module_llm.on(CRITIC, error(401, ECHOING_BODY))
    run_id = f"provider-401-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(LLM_CRITIC)
    with pytest.raises(SubmissionError) as info:
        client.wait(client.submit(_submission(run_id)), timeout=60)
    reason = str(info.value)
    assert "AuthenticationError (HTTP 401)" in reason and "Incorrect API key provided" in reason
    _assert_redacted(reason)
    assert module_llm.requests_with(CRITIC), "the call reached the provider"
    status = _status_json(llm_env, run_id)
    assert "AuthenticationError (HTTP 401)" in status, status
    _assert_redacted(status)
    _assert_redacted(_result_backend_text(llm_env["REDIS_URL"]))


def test_a_5xx_echoing_the_key_leaves_a_redacted_fallback_note(
    worker: WorkerProcess, module_llm: FakeOpenAIServer, llm_env: dict[str, str]
) -> None:
    """A transient provider error ends in the heuristic fallback: the verdict's note keeps the
    error type and HTTP 500, and holds none of the secrets."""
    from workers.client import CritiqueClient

    module_llm.reset()
    module_llm.on(CRITIC, error(500, ECHOING_BODY))
    run_id = f"provider-500-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(LLM_CRITIC)
    result = client.wait(client.submit(_submission(run_id)), timeout=60)
    shown = json.dumps(result.model_dump(mode="json"))
    assert "(HTTP 500)" in shown and "heuristic used" in shown, shown[:2000]
    _assert_redacted(shown)
    _assert_redacted(_status_json(llm_env, run_id))
    _assert_redacted(_result_backend_text(llm_env["REDIS_URL"]))
