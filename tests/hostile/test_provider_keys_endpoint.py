"""A key goes only to its own provider (issue 28, item 3), second half: the operator sets
``llm.api_base`` and ``allowed_models``, and calls carry the key to that endpoint only, never
to the loopback listener standing where the local providers' default addresses would be (the
first half, a keyed worker without allowed_models, is test_provider_keys.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from pipeline.errors import RefusedOverrideError
from pipeline.loop.stages import start
from tests.fakes.openai_server import FakeOpenAIServer
from tests.support.provider_keys import (
    KEY,
    LLM_CRITIC,
    SERVED_MODEL,
    Listener,
    keyed_env,
    raw_critic,
    submission,
)
from tests.support.workers import ACCEPTING_CRITIQUE, WorkerProcess, WorkerSpec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def operator_llm() -> Iterator[FakeOpenAIServer]:
    """The operator's own endpoint (llm.api_base of the second worker), accepting every output."""
    with FakeOpenAIServer() as server:
        server.set_default(ACCEPTING_CRITIQUE)
        yield server


@pytest.fixture(scope="module")
def env(
    hostile_url: str, listener: Listener, operator_llm: FakeOpenAIServer
) -> Iterator[dict[str, str]]:
    """The worker holds the operator's key, calls the operator's endpoint and allows its one
    model; the local providers' variables point at the listener."""
    with keyed_env(
        hostile_url,
        **listener.provider_env(),
        CRITIQUE_LLM__API_BASE=operator_llm.api_base,
        CRITIQUE_ALLOWED_MODELS=SERVED_MODEL,
        CRITIQUE_LLM__TIMEOUT_S="5",
        CRITIQUE_LLM__MAX_RETRIES="0",
    ) as e:
        yield e


WORKER = WorkerSpec("operated")


class TestTheOperatorsEndpoint:
    """The operator sets llm.api_base and allowed_models: the key goes there and nowhere else."""

    @pytest.fixture(autouse=True)
    def operator_llm_only(
        self, listener: Listener, operator_llm: FakeOpenAIServer
    ) -> Iterator[None]:
        """Each test starts with the operator's endpoint accepting; after it the attacker's
        listener got nothing."""
        operator_llm.reset()
        operator_llm.set_default(ACCEPTING_CRITIQUE)
        yield
        listener.assert_untouched()

    def test_an_allowed_model_carries_the_key_to_the_operators_endpoint(
        self, worker: WorkerProcess, operator_llm: FakeOpenAIServer
    ) -> None:
        """A submission naming the allowed model is critiqued by it: every call reaches the
        operator's llm.api_base with the operator's key, and no other address is touched."""
        from workers.client import CritiqueClient

        client = CritiqueClient(LLM_CRITIC)
        result = client.wait(client.submit(submission(SERVED_MODEL)), timeout=60)
        assert result.status == "accepted"
        assert result.envelope.critic == f"llm:{SERVED_MODEL}"
        calls = operator_llm.requests
        assert calls and {c["headers"].get("authorization") for c in calls} == {f"Bearer {KEY}"}

    def test_another_model_never_reaches_the_endpoint(
        self, worker: WorkerProcess, operator_llm: FakeOpenAIServer
    ) -> None:
        """A model outside allowed_models — a local one too — is refused by the client and,
        bypassed, by the worker: the operator's endpoint gets no call for it."""
        from workers.client import CritiqueClient

        with pytest.raises(RefusedOverrideError, match="is not in the worker's allowed_models"):
            CritiqueClient(LLM_CRITIC).submit(submission("ollama/x"))
        run_id = f"keys-{uuid.uuid4().hex[:10]}"
        with pytest.raises(RefusedOverrideError, match="'openai/gpt-4o' is not in the worker's"):
            raw_critic(start(submission("openai/gpt-4o", run_id)), LLM_CRITIC).get(timeout=30)
        assert operator_llm.requests == []
