"""The provider-key attack's pieces: the operator's key, a loopback listener standing where
the local providers' default addresses would be, submissions naming a model, and critic
messages built without the client."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.loop.stages import LoopState
from pipeline.models import Submission
from pipeline.store import keys
from tests.fakes.openai_server import FakeOpenAIServer
from tests.support.hostile import SECRET, send_signed
from tests.support.workers import client_on

PROVIDER_VARS = (
    "CRITIQUE_LLM_API_KEY",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "CRITIQUE_MODEL",
    "CRITIQUE_CONFIG",
)
"""The variables that give a process a provider key or a critique configuration."""


def clear_provider_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset every :data:`PROVIDER_VARS` for one test (restored after it)."""
    for name in PROVIDER_VARS:
        monkeypatch.delenv(name, raising=False)


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


@contextlib.contextmanager
def keyed_env(url: str, **env: str) -> Iterator[dict[str, str]]:
    """The environment of a worker holding the operator's key, with ``env``; this process's
    client on the same database with the same environment."""
    with client_on(
        url, CRITIQUE_SECRET=SECRET, CRITIQUE_LLM_API_KEY=KEY, CRITIQUE_STALL_S="600", **env
    ) as full:
        yield full


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
