"""A key goes only to its own provider (issue 28, item 3), attacked through the client and raw
broker messages against a real worker and Redis.

Before, ``Submission(model="llamafile/x")`` (or ``ollama/…``, ``hosted_vllm/…``) made a worker
that holds ``CRITIQUE_LLM_API_KEY`` send ``Authorization: Bearer <key>`` to that provider's
local address. Here a loopback listener stands at that address (the providers' base variables
point at it, as their default addresses would) and counts every connection. A worker that
holds a key and lists no ``allowed_models`` refuses such a submission at submit and, with the
client bypassed, on the worker; the listener never gets a connection. With the operator's
``llm.api_base`` and ``allowed_models``, calls carry the key to that endpoint only
(test_provider_keys_endpoint.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from pipeline.errors import RefusedOverrideError, SubmissionError
from pipeline.loop.stages import start
from tests.support.provider_keys import (
    LLM_CRITIC,
    LOCAL_MODELS,
    Listener,
    client_without_key,
    keyed_env,
    raw_critic,
    refused_reasons,
    submission,
)
from tests.support.workers import WorkerProcess, WorkerSpec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(hostile_url: str, listener: Listener) -> Iterator[dict[str, str]]:
    """The worker holds the operator's key; the local providers' variables point at the
    listener; allowed_models is left empty."""
    with keyed_env(hostile_url, **listener.provider_env()) as e:
        yield e


WORKER = WorkerSpec("keyed")


class TestAKeyedWorkerWithoutAllowedModels:
    """The issue's attack: the worker holds the key, allowed_models is empty (the default)."""

    @pytest.fixture(autouse=True)
    def untouched(self, listener: Listener) -> Iterator[None]:
        """After every attack the listener got nothing (that the worker still serves is
        checked by tests/hostile/conftest.py, after this)."""
        yield
        listener.assert_untouched()

    @pytest.mark.parametrize("model", LOCAL_MODELS)
    def test_the_client_refuses_a_local_model(self, worker: WorkerProcess, model: str) -> None:
        """Submission.model and a model override naming a local provider are refused at
        submit, in one line naming the field, the key variable and what to set."""
        from workers.client import CritiqueClient

        with pytest.raises(RefusedOverrideError) as info:
            CritiqueClient(LLM_CRITIC).submit(submission(model))
        message = str(info.value)
        assert info.value.key == "submission.model" and "\n" not in message
        assert f"submission's model {model!r} is not in the worker's allowed_models" in message
        assert "(CRITIQUE_LLM_API_KEY)" in message and "CRITIQUE_ALLOWED_MODELS" in message
        with pytest.raises(RefusedOverrideError) as info:
            CritiqueClient({**LLM_CRITIC, "model": model})
        assert info.value.key == "model"

    @pytest.mark.parametrize("model", LOCAL_MODELS)
    def test_the_worker_refuses_it_when_the_client_is_bypassed(
        self, worker: WorkerProcess, model: str
    ) -> None:
        """Signed critic messages on the LLM queue, whose submission names the local model or
        whose config names it as the critic's, are refused before any call, and traced."""
        run_id = f"keys-{uuid.uuid4().hex[:10]}"
        with pytest.raises(RefusedOverrideError, match=f"submission's model '{model}'"):
            raw_critic(start(submission(model, run_id)), LLM_CRITIC).get(timeout=30)
        with pytest.raises(RefusedOverrideError, match="submission may not set 'model'"):
            overrides = {**LLM_CRITIC, "model": model}
            raw_critic(start(submission(None, run_id, "w2")), overrides).get(timeout=30)
        reasons = refused_reasons(run_id)
        assert len(reasons) == 2
        assert all("while an API key is set (CRITIQUE_LLM_API_KEY)" in r for r in reasons)

    def test_wait_reports_the_workers_refusal(self, worker: WorkerProcess) -> None:
        """A client that holds no key lets ollama/x through (its endpoint is configured); the
        worker, which holds one, refuses it and wait() says why in one line."""
        from workers.client import CritiqueClient

        with client_without_key():
            client = CritiqueClient(LLM_CRITIC)
            handle = client.submit(submission("ollama/x"))
        with pytest.raises(SubmissionError) as info:
            client.wait(handle, timeout=30)
        message = str(info.value)
        assert "\n" not in message
        assert (
            "was refused by the worker: submission's model 'ollama/x' is not in the worker's "
            "allowed_models, which is empty while an API key is set (CRITIQUE_LLM_API_KEY)"
        ) in message
