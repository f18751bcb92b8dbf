"""A key goes only to its own provider (issue 28, item 3), attacked through the client and raw
broker messages against a real worker and Redis.

Before, ``Submission(model="llamafile/x")`` (or ``ollama/…``, ``hosted_vllm/…``) made a worker
that holds ``CRITIQUE_LLM_API_KEY`` send ``Authorization: Bearer <key>`` to that provider's
local address. Here a loopback listener stands at that address (the providers' base variables
point at it, as their default addresses would) and counts every connection. A worker that
holds a key and lists no ``allowed_models`` refuses such a submission at submit and, with the
client bypassed, on the worker; the listener never gets a connection. With the operator's
``llm.api_base`` and ``allowed_models``, calls carry the key to that endpoint only.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.errors import RefusedOverrideError, SubmissionError
from pipeline.models import Submission
from pipeline.runner import LoopState, start
from pipeline.store import keys
from tests.fakes.openai_server import FakeOpenAIServer
from tests.support.hostile import SECRET, assert_still_serving, send_signed
from tests.support.workers import ACCEPTING_CRITIQUE, WorkerProcess, client_on

pytestmark = pytest.mark.integration

KEY = "sk-operator-" + uuid.uuid4().hex
"""The operator's CRITIQUE_LLM_API_KEY (what must never reach the listener)."""
LOCAL_MODELS = ("llamafile/x", "ollama/x", "hosted_vllm/x")
SERVED_MODEL = "openai/served-model"
"""The one model the operator of the second worker allows, served at its llm.api_base."""
LLM_CRITIC = {"enabled": True, "critic": "llm", "max_repair_attempts": 0}


class Listener:
    """A loopback HTTP server standing at the local providers' address; counts connections."""

    def __init__(self, server: FakeOpenAIServer) -> None:
        self.server = server
        self.connections = 0
        self._lock = threading.Lock()
        original = server._httpd.verify_request

        def counting(request: Any, address: Any) -> bool:
            with self._lock:
                self.connections += 1
            return bool(original(request, address))

        setattr(server._httpd, "verify_request", counting)  # noqa: B010 - an instance patch

    def provider_env(self) -> dict[str, str]:
        """The local providers' base variables, all pointing here."""
        return {
            "OLLAMA_API_BASE": self.server.url,
            "LLAMAFILE_API_BASE": self.server.api_base,
            "HOSTED_VLLM_API_BASE": self.server.api_base,
        }

    def assert_untouched(self) -> None:
        """No connection at all: so no request and no Authorization header ever arrived."""
        assert self.connections == 0
        assert self.server.requests == []


@pytest.fixture(scope="module")
def listener() -> Iterator[Listener]:
    """The local server an attacker would aim a submission's model at."""
    with FakeOpenAIServer() as server:
        yield Listener(server)


@pytest.fixture(scope="module")
def operator_llm() -> Iterator[FakeOpenAIServer]:
    """The operator's own endpoint (llm.api_base of the second worker), accepting every output."""
    with FakeOpenAIServer() as server:
        server.set_default(ACCEPTING_CRITIQUE)
        yield server


@contextlib.contextmanager
def keyed_worker(url: str, name: str, logs: Any, **env: str) -> Iterator[WorkerProcess]:
    """A worker holding the operator's key, with ``env``; this process's client on the same
    database with the same environment."""
    with client_on(
        url, CRITIQUE_SECRET=SECRET, CRITIQUE_LLM_API_KEY=KEY, CRITIQUE_STALL_S="600", **env
    ) as full:
        w = WorkerProcess(
            full["REDIS_URL"], concurrency=4, name=name, env=full, log=logs / f"{name}.log"
        ).start()
        try:
            yield w
        finally:
            w.stop()


def submission(model: str | None, run_id: str | None = None, worker_id: str = "w1") -> Submission:
    """A clean output the LLM critic would critique with ``model`` (the worker's model)."""
    return Submission(
        run_id=run_id or f"keys-{uuid.uuid4().hex[:10]}",
        worker_id=worker_id,
        task="Summarise the Q3 sales report.",
        output={"summary": "Sales rose 4% in Q3.", "confidence": 0.9},
        required_fields=("summary",),
        model=model,
    )


def raw_critic(state: LoopState, overrides: dict[str, Any]) -> Any:
    """A critique.critic message built without the client (so without its check), signed with
    the deploy secret, sent to the LLM queue; returns the AsyncResult."""
    from workers import runtime

    msg = runtime.encode(state.model_copy(update={"next": "critic"}), overrides)
    return send_signed(keys.TASK_CRITIC, msg, queue=keys.QUEUE_LLM)


def refused_reasons(run_id: str) -> list[str]:
    from workers.client import CritiqueClient

    return [e["reason"] for e in CritiqueClient().trace(run_id) if e.get("type") == "refused"]


@contextlib.contextmanager
def client_without_key() -> Iterator[None]:
    """This process's client without the key (so its own check lets a local model through)."""
    from workers import runtime

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CRITIQUE_LLM_API_KEY")
        runtime._configs.clear()
        try:
            yield
        finally:
            runtime._configs.clear()


class TestAKeyedWorkerWithoutAllowedModels:
    """The issue's attack: the worker holds the key, allowed_models is empty (the default)."""

    @pytest.fixture(scope="class")
    def attacked(
        self, hostile_url: str, listener: Listener, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[WorkerProcess]:
        logs = tmp_path_factory.mktemp("provider-keys")
        with keyed_worker(hostile_url, "keyed", logs, **listener.provider_env()) as w:
            yield w

    @pytest.fixture
    def worker(self, attacked: WorkerProcess, listener: Listener) -> Iterator[WorkerProcess]:
        """After every attack the listener got nothing and the worker still serves."""
        yield attacked
        listener.assert_untouched()
        assert_still_serving(attacked)

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


class TestTheOperatorsEndpoint:
    """The operator sets llm.api_base and allowed_models: the key goes there and nowhere else."""

    @pytest.fixture(scope="class")
    def operated(
        self,
        hostile_url: str,
        listener: Listener,
        operator_llm: FakeOpenAIServer,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Iterator[WorkerProcess]:
        logs = tmp_path_factory.mktemp("provider-keys")
        env = {
            **listener.provider_env(),
            "CRITIQUE_LLM__API_BASE": operator_llm.api_base,
            "CRITIQUE_ALLOWED_MODELS": SERVED_MODEL,
            "CRITIQUE_LLM__TIMEOUT_S": "5",
            "CRITIQUE_LLM__MAX_RETRIES": "0",
        }
        with keyed_worker(hostile_url, "operated", logs, **env) as w:
            yield w

    @pytest.fixture
    def worker(
        self, operated: WorkerProcess, listener: Listener, operator_llm: FakeOpenAIServer
    ) -> Iterator[WorkerProcess]:
        operator_llm.reset()
        operator_llm.set_default(ACCEPTING_CRITIQUE)
        yield operated
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
