"""LiteLLMCompleter through litellm's real client path, against the fake OpenAI server.

No Redis here; every backoff is in milliseconds and observed through the injected ``sleep``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline import settings
from pipeline.config import LLMConfig, load_config
from pipeline.errors import LLMPermanentError, LLMTransientError
from pipeline.llm.completion import (
    ChatMessage,
    LiteLLMCompleter,
    LLMRequest,
    classify,
    retry_after_s,
)
from tests.fakes.openai_server import (
    CRITIC,
    REPAIR,
    FakeLLMAdmin,
    FakeOpenAIServer,
    broken_body,
    empty,
    error,
    malformed,
    no_choices,
    reply,
    system_text,
    timeout,
    user_text,
)

ROOT = Path(__file__).resolve().parents[2]


def request(*, json_mode: bool = False, max_tokens: int | None = None) -> LLMRequest:
    return LLMRequest(
        model="openai/fake-critic",
        messages=(
            ChatMessage(role="system", content=f"{CRITIC}. Return JSON."),
            ChatMessage(role="user", content="<untrusted_output>hello</untrusted_output>"),
        ),
        json_mode=json_mode,
        max_tokens=max_tokens,
    )


class Sleeps(list[float]):
    """Records the delays the completer asked for instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def completer(
    fake: FakeOpenAIServer,
    sleeps: Sleeps | None = None,
    *,
    rng: Callable[[], float] = lambda: 1.0,
    **cfg: Any,
) -> LiteLLMCompleter:
    settings: dict[str, Any] = {
        "api_base": fake.api_base,
        "timeout_s": 5.0,
        "max_retries": 2,
        "backoff_s": 0.001,
        "backoff_max_s": 0.004,
    }
    settings.update(cfg)
    return LiteLLMCompleter(
        LLMConfig(**settings),
        sleep=sleeps if sleeps is not None else Sleeps(),
        rng=rng,
        api_key="sk-test",
    )


# --- success path ----------------------------------------------------------------------------


def test_success_reports_the_usage_the_server_reported(fake_llm: FakeOpenAIServer) -> None:
    """A plain reply comes back with the server's token counts, one call, no retries."""
    fake_llm.script(reply('{"score": 0.9}', prompt_tokens=17, completion_tokens=5))
    out = completer(fake_llm)(request())
    assert out.text == '{"score": 0.9}'
    assert (out.usage.tokens_in, out.usage.tokens_out) == (17, 5)
    assert out.usage.calls == 1 and out.retries == 0
    assert out.usage.cost == 0.0  # a model the offline cost map does not know costs 0.0
    served = fake_llm.sum_usage()
    assert (served["prompt_tokens"], served["completion_tokens"]) == (17, 5)


def test_known_model_is_priced_from_the_offline_cost_map(fake_llm: FakeOpenAIServer) -> None:
    """A model litellm's bundled cost map knows gets a positive cost for the reported tokens."""
    fake_llm.script(reply("{}", prompt_tokens=1000, completion_tokens=1000))
    known = LLMRequest(
        model="openai/gpt-4o-mini", messages=(ChatMessage(role="user", content="x"),)
    )
    out = completer(fake_llm)(known)
    assert 0.0 < out.usage.cost < 0.01


def test_the_cost_is_litellms_own_figure_for_the_response(fake_llm: FakeOpenAIServer) -> None:
    """The cost reported is what ``litellm.completion_cost`` says for the same response (taken
    from the price litellm already put on it, not computed a second time), for a known model."""
    import litellm

    responses: list[Any] = []

    def completion(**kwargs: Any) -> Any:
        responses.append(litellm.completion(**kwargs))
        return responses[-1]

    fake_llm.script(reply("{}", prompt_tokens=1000, completion_tokens=500))
    known = LLMRequest(
        model="openai/gpt-4o-mini", messages=(ChatMessage(role="user", content="x"),)
    )
    out = LiteLLMCompleter(
        LLMConfig(api_base=fake_llm.api_base, max_retries=0), completion=completion, api_key="k"
    )(known)
    [response] = responses
    assert out.usage.cost == pytest.approx(litellm.completion_cost(completion_response=response))
    assert out.usage.cost > 0.0


def test_litellm_logs_no_line_per_call(
    fake_llm: FakeOpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Loaded by the completer, litellm logs nothing below WARNING (it would log every call,
    with its parameters, at INFO in a worker that logs at INFO) and keeps no messages for
    logging callbacks."""
    import logging

    from pipeline.llm.providers import LITELLM_LOGGERS, load_litellm

    litellm = load_litellm()
    assert litellm.turn_off_message_logging is True
    fake_llm.script(reply("{}"))
    with caplog.at_level(logging.INFO):
        completer(fake_llm)(request())
    assert not [r for r in caplog.records if r.name in LITELLM_LOGGERS and r.levelno < 30]
    assert all(logging.getLogger(n).getEffectiveLevel() >= logging.WARNING for n in LITELLM_LOGGERS)


def test_request_carries_model_messages_settings_and_key(fake_llm: FakeOpenAIServer) -> None:
    """The HTTP request reaches api_base with the model, messages, temperature, max_tokens and
    the API key; no response_format unless json_mode."""
    completer(fake_llm, temperature=0.3, max_tokens=321)(request())
    (rec,) = fake_llm.requests
    body = rec["body"]
    assert rec["path"] == "/chat/completions"
    assert body["model"] == "fake-critic"
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert system_text(body).startswith(CRITIC)
    assert "<untrusted_output>hello</untrusted_output>" in user_text(body)
    assert body["temperature"] == 0.3
    assert body["max_tokens"] == 321
    assert "response_format" not in body
    assert rec["headers"]["authorization"] == "Bearer sk-test"


def test_json_mode_sends_response_format_and_request_max_tokens_wins(
    fake_llm: FakeOpenAIServer,
) -> None:
    """json_mode asks for a JSON object; a request's own max_tokens overrides the config's."""
    completer(fake_llm, max_tokens=999)(request(json_mode=True, max_tokens=64))
    body = fake_llm.completions[0]
    assert body["response_format"] == {"type": "json_object"}
    assert body["max_tokens"] == 64


def test_api_key_comes_from_the_environment(
    fake_llm: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an explicit key, CRITIQUE_LLM_API_KEY is sent as the bearer token to the
    operator's llm.api_base."""
    monkeypatch.setenv(settings.LLM_API_KEY.name, "sk-from-env")
    LiteLLMCompleter(LLMConfig(api_base=fake_llm.api_base))(request())
    assert fake_llm.requests[0]["headers"]["authorization"] == "Bearer sk-from-env"


@pytest.mark.parametrize("item", [empty(), no_choices()], ids=["empty", "no_choices"])
def test_empty_reply_is_returned_as_empty_text(
    fake_llm: FakeOpenAIServer, item: dict[str, Any]
) -> None:
    """An empty reply or one without choices is text "" (the caller decides), not an error."""
    fake_llm.script(item)
    out = completer(fake_llm)(request())
    assert out.text == ""
    assert out.usage.calls == 1
    assert len(fake_llm.requests) == 1


def test_malformed_content_is_returned_verbatim(fake_llm: FakeOpenAIServer) -> None:
    """Non-JSON content on a valid HTTP reply is the caller's problem: returned, not retried."""
    fake_llm.script(malformed("not json {"))
    out = completer(fake_llm)(request(json_mode=True))
    assert out.text == "not json {"
    assert len(fake_llm.requests) == 1


# --- transient failures ----------------------------------------------------------------------


def test_rate_limit_then_success_is_retried(fake_llm: FakeOpenAIServer) -> None:
    """A 429 is retried once: two HTTP calls, retries=1, usage of the successful reply only."""
    fake_llm.script(error(429), reply("ok", prompt_tokens=3, completion_tokens=1))
    sleeps = Sleeps()
    out = completer(fake_llm, sleeps)(request())
    assert out.text == "ok"
    assert out.retries == 1 and out.usage.calls == 2
    assert (out.usage.tokens_in, out.usage.tokens_out) == (3, 1)
    assert [r["status"] for r in fake_llm.requests] == [429, 200]
    assert len(sleeps) == 1


@pytest.mark.parametrize(("asked", "slept"), [("0.002", 0.002), ("30", 0.004)])
def test_retry_after_is_honoured_and_capped(
    fake_llm: FakeOpenAIServer, asked: str, slept: float
) -> None:
    """A 429's Retry-After sets the wait, capped at backoff_max_s (0.004 s here)."""
    fake_llm.script(error(429, retry_after=float(asked)), reply("ok"))
    sleeps = Sleeps()
    completer(fake_llm, sleeps, rng=lambda: 0.25)(request())
    assert sleeps == pytest.approx([slept])


@pytest.mark.parametrize("status", [500, 502, 503])
def test_server_errors_then_success_are_retried(fake_llm: FakeOpenAIServer, status: int) -> None:
    """5xx answers are transient: retried, then the success is returned."""
    fake_llm.script(error(status), reply("fine"))
    out = completer(fake_llm)(request())
    assert out.text == "fine"
    assert out.retries == 1 and out.usage.calls == 2
    assert [r["status"] for r in fake_llm.requests] == [status, 200]


def test_timeouts_exhaust_the_retries(fake_llm: FakeOpenAIServer) -> None:
    """Replies slower than timeout_s on every attempt end in LLMTransientError that names the
    attempts and the timeout; the server saw max_retries + 1 requests, none delivered."""
    fake_llm.script(*(timeout(1.5) for _ in range(3)))
    sleeps = Sleeps()
    with pytest.raises(LLMTransientError) as info:
        completer(fake_llm, sleeps, timeout_s=0.2, max_retries=2)(request())
    message = str(info.value)
    assert "after 3 attempts" in message
    assert "Timeout" in message
    assert "llm.max_retries" in message  # the hint
    assert len(fake_llm.requests) == 3
    assert len(sleeps) == 2
    assert fake_llm.sum_usage()["replies"] == 0


def test_broken_body_is_transient(fake_llm: FakeOpenAIServer) -> None:
    """A 200 whose body is not JSON is treated as a transient glitch: retried, then succeeds."""
    fake_llm.script(broken_body(), reply("recovered"))
    out = completer(fake_llm)(request())
    assert out.text == "recovered"
    assert out.retries == 1


def test_broken_body_every_time_ends_transient(fake_llm: FakeOpenAIServer) -> None:
    """Only broken bodies: LLMTransientError after 1 + max_retries attempts."""
    fake_llm.script(broken_body(), broken_body())
    with pytest.raises(LLMTransientError, match="after 2 attempts"):
        completer(fake_llm, max_retries=1)(request())
    assert len(fake_llm.requests) == 2


def test_backoff_doubles_is_capped_and_jittered(fake_llm: FakeOpenAIServer) -> None:
    """Delays are min(backoff_max_s, backoff_s·2^k) × rng(): 1, 2, 4→cap 3 ms, halved by rng."""
    fake_llm.script(*(error(500) for _ in range(4)))
    sleeps = Sleeps()
    with pytest.raises(LLMTransientError, match="after 4 attempts"):
        completer(
            fake_llm, sleeps, rng=lambda: 0.5, max_retries=3, backoff_s=0.001, backoff_max_s=0.003
        )(request())
    assert sleeps == pytest.approx([0.0005, 0.001, 0.0015])


def test_no_retries_configured_means_one_attempt(fake_llm: FakeOpenAIServer) -> None:
    """max_retries=0: the first 503 is final, reported as one attempt."""
    fake_llm.script(error(503))
    sleeps = Sleeps()
    with pytest.raises(LLMTransientError, match="after 1 attempt;"):
        completer(fake_llm, sleeps, max_retries=0)(request())
    assert sleeps == []


# --- permanent failures ----------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_client_errors_fail_at_once(fake_llm: FakeOpenAIServer, status: int) -> None:
    """Auth, permission, bad-request and unknown-model errors are permanent: one request, no
    sleep, a message with the provider's reason and a hint about key / model / api_base."""
    fake_llm.script(error(status, "nope from the provider"))
    sleeps = Sleeps()
    with pytest.raises(LLMPermanentError) as info:
        completer(fake_llm, sleeps)(request())
    message = str(info.value)
    assert "nope from the provider" in message
    assert "OPENAI_API_KEY" in message and "api_base" in message
    assert len(fake_llm.requests) == 1
    assert sleeps == []


# --- classification without HTTP -------------------------------------------------------------


def test_unknown_exceptions_propagate_unchanged() -> None:
    """A bug (not a provider failure) in the completion callable is neither retried nor
    wrapped."""
    calls: list[dict[str, Any]] = []

    def completion(**kwargs: Any) -> Any:
        calls.append(kwargs)
        raise KeyError("bug")

    c = LiteLLMCompleter(LLMConfig(), completion=completion, sleep=Sleeps())
    with pytest.raises(KeyError):
        c(request())
    assert len(calls) == 1
    assert calls[0]["num_retries"] == 0 and calls[0]["max_retries"] == 0


def test_builtin_timeouts_are_transient() -> None:
    """An injected completion's TimeoutError / ConnectionError is retried like litellm's."""
    outcomes: list[Any] = [TimeoutError("slow"), ConnectionResetError("reset"), {"choices": []}]

    def completion(**kwargs: Any) -> Any:
        out = outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    out = LiteLLMCompleter(LLMConfig(backoff_s=0), completion=completion, sleep=Sleeps())(request())
    assert out.text == "" and out.retries == 2 and out.usage.calls == 3
    assert classify(ValueError("x")) is None


def test_retry_after_parsing() -> None:
    """Retry-After in seconds, in milliseconds, as an HTTP date, or absent."""

    class Exc(Exception):
        def __init__(self, headers: dict[str, str] | None) -> None:
            self.headers = headers

    assert retry_after_s(Exc({"retry-after": "2"})) == 2.0
    assert retry_after_s(Exc({"retry-after-ms": "250"})) == 0.25
    date = "Wed, 21 Oct 2015 07:28:10 GMT"
    assert retry_after_s(Exc({"retry-after": date}), now=1445412480.0) == pytest.approx(10.0)
    assert retry_after_s(Exc({"retry-after": "soon"})) is None
    assert retry_after_s(Exc(None)) is None


def test_api_key_env_is_not_a_config_field() -> None:
    """CRITIQUE_LLM_API_KEY is accepted beside the nested CRITIQUE_LLM__* fields."""
    cfg = load_config(env={settings.LLM_API_KEY.name: "sk-x", "CRITIQUE_LLM__TIMEOUT_S": "0.5"})
    assert cfg.llm.timeout_s == 0.5


# --- the fake itself -------------------------------------------------------------------------


def test_fake_routes_by_system_marker(fake_llm: FakeOpenAIServer) -> None:
    """Queued items with a marker answer only matching requests; standing routes and the
    default answer the rest."""
    fake_llm.script(reply("repair #1", match=REPAIR))
    fake_llm.on(CRITIC, lambda req: f"critic saw {len(req['messages'])} messages")
    fake_llm.set_default("default")
    c = completer(fake_llm)
    repair = LLMRequest(
        model="openai/m",
        messages=(ChatMessage(role="system", content=f"{REPAIR} the output."),),
        purpose="repair",
    )
    other = LLMRequest(model="openai/m", messages=(ChatMessage(role="user", content="hi"),))
    assert c(request()).text == "critic saw 2 messages"
    assert c(repair).text == "repair #1"
    assert c(repair).text == "default"  # the queued repair item was consumed
    assert c(other).text == "default"
    assert len(fake_llm.requests_with(REPAIR)) == 2


def test_fake_scripted_over_http(fake_llm: FakeOpenAIServer) -> None:
    """POST /_script sets the script another process will be served; GET /_requests and
    /_usage report what was served; POST /_reset forgets it."""
    admin = FakeLLMAdmin(fake_llm.api_base)
    queued = admin.script(
        [
            {"status": 429, "retry_after": 0},
            {"reply": "via admin", "prompt_tokens": 11, "completion_tokens": 2},
            {"reply": "always", "match": CRITIC, "repeat": True},
        ]
    )
    assert queued == 2
    c = completer(fake_llm)
    assert c(request()).text == "via admin"
    assert c(request()).text == "always"
    assert c(request()).text == "always"
    assert [r["status"] for r in admin.requests()] == [429, 200, 200, 200]
    assert admin.usage()["prompt_tokens"] >= 11
    admin.reset()
    assert admin.requests() == []


def test_fake_rejects_bad_script_items(fake_llm: FakeOpenAIServer) -> None:
    """An unknown script key is a 400 naming it (typos fail loudly, not silently)."""
    admin = FakeLLMAdmin(fake_llm.url)
    with pytest.raises(urllib.error.HTTPError) as info:
        admin.script([{"replyy": "typo"}])
    assert info.value.code == 400
    assert "replyy" in json.loads(info.value.read())["error"]["message"]


def test_fake_runs_standalone() -> None:
    """``python -m tests.fakes.openai_server --port 0`` prints its api_base and serves it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.openai_server", "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        api_base = proc.stdout.readline().strip()
        assert api_base.startswith("http://127.0.0.1:") and api_base.endswith("/v1")
        FakeLLMAdmin(api_base).script([{"reply": "standalone"}])
        req = urllib.request.Request(
            f"{api_base}/chat/completions",
            data=json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            body = json.loads(resp.read())
        assert body["choices"][0]["message"]["content"] == "standalone"
        # unscripted counts are deterministic: len(text) // 4 of the prompt and of the reply
        usage = body["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (0, len("standalone") // 4)
    finally:
        proc.terminate()
        proc.wait(timeout=5)
    assert proc.returncode == 0
