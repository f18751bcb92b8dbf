"""Error text a manager reads keeps no secret (issue 33): pipeline.security.redaction hides the
worker's own keys, key shapes, credentials and URL passwords, and a failed LLM call is reported as
its type, HTTP status and a short scrubbed provider message, raised without the provider's exception
chained (Celery stores a stage's traceback where managers can read it)."""

from __future__ import annotations

import traceback

import pytest

from pipeline.config import LLMConfig
from pipeline.errors import LLMPermanentError, LLMTransientError
from pipeline.llm.completion import ChatMessage, LiteLLMCompleter, LLMRequest
from pipeline.security.redaction import MAX_PROVIDER_MESSAGE, provider_error, scrub, scrub_provider


class ProviderError(Exception):
    """A provider library's HTTP error: a status code and the body as its text."""

    def __init__(self, text: str, status_code: int | None = None) -> None:
        super().__init__(text)
        self.status_code = status_code


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        ("Incorrect API key provided: sk-proj-Abc123def456", "sk-proj-Abc123def456"),
        ("headers {'Authorization': 'Bearer tok.en-123456'}", "tok.en-123456"),
        ("upstream https://svc:hunter22@llm.internal/v1", "hunter22"),
        ("hf_abcdefghijkl and AKIAIOSFODNN7EXAMPLE", "hf_abcdefghijkl"),
        ("AKIAIOSFODNN7EXAMPLE in use", "AKIAIOSFODNN7EXAMPLE"),
        ("google key AIzaSyA-1234567890abcdefghijklmno", "AIzaSyA-1234567890abcdefghijklmno"),
    ],
)
def test_scrub_hides_key_shapes_credentials_and_url_passwords(text: str, hidden: str) -> None:
    """Each well-known key shape, Authorization credential and URL password becomes ***."""
    assert hidden not in scrub(text) and "***" in scrub(text)


def test_scrub_hides_the_workers_own_configured_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The values of the worker's key variables and signing secrets are hidden, whatever
    their shape; short values and ordinary words are left alone."""
    monkeypatch.setenv("CRITIQUE_LLM_API_KEY", "plain-custom-key")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "another-custom-one")
    monkeypatch.setenv("CRITIQUE_SECRET", "new-signing-secret,old-signing-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "short")
    text = "plain-custom-key another-custom-one old-signing-secret short words"
    assert scrub(text) == "*** *** *** short words"


def test_scrub_leaves_ids_digests_and_names_alone() -> None:
    """The light pass (failure reasons of every kind) keeps run ids, digests, model names and
    field names as written."""
    text = (
        "run task-42 w1: file a.py sha256 "
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 mismatch; "
        "model anthropic/claude-3-5-sonnet-20241022; set 'llm.api_key': worker-only"
    )
    assert scrub(text) == text


def test_scrub_provider_also_hides_assigned_values_and_long_tokens() -> None:
    """In a provider's own text, a key=value credential and a long mixed token are hidden too,
    while a model name stays readable."""
    text = (
        '{"api_key": "custom", "x-api-key": abc} req 0123456789abcdef0123456789abcdef '
        "model openai/gpt-4o-mini-2024-07-18"
    )
    out = scrub_provider(text)
    assert "custom" not in out and "abc}" not in out and "0123456789abcdef" not in out
    assert "openai/gpt-4o-mini-2024-07-18" in out


def test_provider_error_keeps_type_and_status_and_caps_the_message() -> None:
    """``Type (HTTP n): message``, the message scrubbed and cut to MAX_PROVIDER_MESSAGE."""
    out = provider_error(ProviderError("key sk-live-123456789 " + "prompt " * 200, 401))
    assert out.startswith("ProviderError (HTTP 401): key *** prompt")
    assert len(out) <= len("ProviderError (HTTP 401): ") + MAX_PROVIDER_MESSAGE
    assert out.endswith("...")
    assert provider_error(ProviderError("")) == "ProviderError"


CALL_KEY = "custom-key-value-1"
"""The key the call carried (a name in the test's source, so a traceback's source lines do not
quote it)."""


def _completer(raised: BaseException, key: str) -> LiteLLMCompleter:
    def completion(**kwargs: object) -> object:
        raise raised

    config = LLMConfig(max_retries=0, backoff_s=0.0)
    return LiteLLMCompleter(config, completion=completion, api_key=key, sleep=lambda s: None)


def _request() -> LLMRequest:
    return LLMRequest(
        model="openai/m", messages=(ChatMessage(role="user", content="hi"),), purpose="critic"
    )


@pytest.mark.parametrize(
    ("raised", "wanted"),
    [
        (LLMPermanentError("bad key custom-key-value-1 Bearer abcdefgh1234"), LLMPermanentError),
        (
            TimeoutError("timed out for custom-key-value-1 at https://u:pw12345@h/v1"),
            LLMTransientError,
        ),
    ],
)
def test_a_failed_call_is_reported_without_the_key_and_without_the_chain(
    raised: BaseException, wanted: type[Exception]
) -> None:
    """The call's own key, a Bearer credential and a URL password appear nowhere in the raised
    error or its formatted traceback (what Celery would store), and the provider's exception is
    not chained onto it."""
    with pytest.raises(wanted) as info:
        _completer(raised, CALL_KEY)(_request())
    shown = "".join(traceback.format_exception(info.value))
    for secret in ("custom-key-value-1", "abcdefgh1234", "pw12345"):
        assert secret not in shown
    assert info.value.__suppress_context__ and info.value.__cause__ is None
    assert type(raised).__name__ in str(info.value)
