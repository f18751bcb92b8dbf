"""Provider keys against a live HTTP endpoint: the completer refuses before any request, and
the product key reaches only the providers in its scope (the fake OpenAI-compatible server
counts what arrives); the rules themselves are in tests/unit/test_provider_keys.py."""

from __future__ import annotations

import pytest

from pipeline.config import (
    LLMConfig,
)
from pipeline.errors import ConfigError
from pipeline.llm.completion import LiteLLMCompleter, LLMRequest
from pipeline.llm.providers import missing_keys
from tests.fakes.openai_server import FakeOpenAIServer
from tests.support.provider_keys import clear_provider_env


@pytest.fixture(autouse=True)
def _no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without provider keys or critique settings."""
    clear_provider_env(monkeypatch)


def test_the_completer_refuses_before_any_request(fake_llm: FakeOpenAIServer) -> None:
    """litellm's own completion with no key: ConfigError naming the variable, no HTTP request,
    no retries (before, the call was retried for seconds and the heuristic answered)."""
    completer = LiteLLMCompleter(LLMConfig(api_base=fake_llm.api_base, max_retries=3))
    request = LLMRequest(model="openai/gpt-4o-mini", messages=({"role": "user", "content": "hi"},))
    with pytest.raises(ConfigError) as info:
        completer(request)
    assert info.value.key == "OPENAI_API_KEY"
    assert fake_llm.requests == []


def test_the_product_key_satisfies_only_in_scope_providers(
    fake_llm: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call outside the key's scope needs the provider's own variable: ConfigError naming
    it, before any request (so the key is never sent there); in scope, the call carries it."""
    monkeypatch.setenv("CRITIQUE_LLM_API_KEY", "sk-operator")
    assert missing_keys("anthropic/c", key_models=("openai/a",)) == ("ANTHROPIC_API_KEY",)
    assert missing_keys("anthropic/c", key_models=("anthropic/b",)) == ()
    assert missing_keys("anthropic/c") == ()  # no scope given: a client's estimate
    completer = LiteLLMCompleter(
        LLMConfig(api_base=fake_llm.api_base, max_retries=0), key_models=("openai/served",)
    )
    msg = ({"role": "user", "content": "hi"},)
    with pytest.raises(ConfigError) as info:
        completer(LLMRequest(model="anthropic/claude-3", messages=msg))
    assert info.value.key == "ANTHROPIC_API_KEY"
    assert fake_llm.requests == []
    completer(LLMRequest(model="openai/served", messages=msg))
    assert [r["headers"]["authorization"] for r in fake_llm.requests] == ["Bearer sk-operator"]
