"""A configured model whose provider key is missing is a configuration error:
``critique worker`` and ``critique submit`` exit 2 naming the variable, and a worker's litellm
call refuses before anything is sent — never a silent heuristic fallback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import (
    CritiqueConfig,
    LLMConfig,
    check_submission_model,
    check_submission_overrides,
)
from pipeline.errors import ConfigError, RefusedOverrideError
from pipeline.llm.completion import LiteLLMCompleter, LLMRequest
from pipeline.llm.providers import check_keys, configured_models, llm_models, missing_keys
from pipeline.security.model_policy import (
    AMBIENT_PROVIDERS,
    HOSTED_PROVIDERS,
    LOCAL_PROVIDERS,
    carries_address,
    held_keys,
    is_key_var,
    model_refusal,
)
from tests.support.provider_keys import clear_provider_env
from workers.cli import main
from workers.commands.worker import unlisted_models_warning

SUB = {"run_id": "r1", "worker_id": "w1", "task": "Summarise.", "output": {"summary": "x"}}


@pytest.fixture(autouse=True)
def _no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without provider keys or critique settings."""
    clear_provider_env(monkeypatch)


def _config(**fields: object) -> CritiqueConfig:
    return CritiqueConfig.model_validate({"enabled": True, **fields})


def test_models_a_submission_would_call() -> None:
    """Token-free configurations call nothing; an LLM critic calls its model, the inline
    repair the worker's model, a paired critic its adjudicator too."""
    assert llm_models(_config(critic="heuristic"), "openai/a") == ()
    assert llm_models(_config(critic="rubric"), "openai/a") == ()
    assert llm_models(_config(), None) == ()
    assert llm_models(_config(), "openai/a") == ("openai/a",)
    assert llm_models(_config(model="anthropic/c"), "openai/a") == ("anthropic/c", "openai/a")
    assert llm_models(_config(critic="heuristic", repairer="llm", model="openai/m"), None) == (
        "openai/m",
    )
    paired = _config(model="openai/m", paired_critic=True, paired_model="anthropic/p")
    assert llm_models(paired, None) == ("openai/m", "anthropic/p")
    assert configured_models(_config(model="a/b", allowed_models=["a/b", "c/d"])) == ("a/b", "c/d")


def test_missing_key_is_named_and_the_product_key_serves_any_provider(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """litellm names OPENAI_API_KEY for an openai model; the provider's own variable or, with
    no key scope given (a client's estimate), CRITIQUE_LLM_API_KEY satisfies it."""
    assert missing_keys("openai/gpt-4o-mini") == ("OPENAI_API_KEY",)
    with pytest.raises(ConfigError) as info:
        check_keys(["openai/gpt-4o-mini"], where="this test")
    assert info.value.key == "OPENAI_API_KEY"
    assert "'openai/gpt-4o-mini' needs OPENAI_API_KEY" in str(info.value)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-provider")
    assert missing_keys("openai/gpt-4o-mini") == ()
    monkeypatch.delenv("OPENAI_API_KEY")
    monkeypatch.setenv("CRITIQUE_LLM_API_KEY", "sk-product")
    assert missing_keys("anthropic/claude-3-5-haiku") == ()


def test_worker_exits_2_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`critique worker` on an LLM queue with CRITIQUE_MODEL and no key exits 2 naming
    OPENAI_API_KEY; a critique.cpu worker calls no model and starts; a key lets it start."""
    monkeypatch.setenv("CRITIQUE_MODEL", "openai/gpt-4o-mini")
    assert main(["worker", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "needs OPENAI_API_KEY" in err and "critique worker:" in err
    assert main(["worker", "-Q", "critique.cpu", "--dry-run"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("CRITIQUE_LLM_API_KEY", "sk-product")
    assert main(["worker", "--dry-run"]) == 0


def test_submit_exits_2_naming_the_variable_before_touching_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--set model=openai/gpt-4o-mini` without OPENAI_API_KEY is refused at submit (exit 2,
    nothing enqueued: Redis is not even reached); --no-key-check defers to the workers."""
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    path = tmp_path / "sub.json"
    path.write_text(json.dumps(SUB), "utf-8")
    assert main(["submit", str(path), "--set", "model=openai/gpt-4o-mini"]) == 2
    err = capsys.readouterr().err
    assert "needs OPENAI_API_KEY" in err and "--no-key-check" in err
    with_model = tmp_path / "model.json"
    with_model.write_text(json.dumps({**SUB, "model": "openai/gpt-4o-mini"}), "utf-8")
    assert main(["submit", str(with_model)]) == 2  # the worker's own model, inline critic
    assert "needs OPENAI_API_KEY" in capsys.readouterr().err
    assert main(["submit", str(with_model), "--set", "critic=heuristic"]) == 3  # no model call
    assert main(["submit", str(path), "--set", "model=openai/gpt-4o-mini", "--no-key-check"]) == 3
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"CRITIQUE_MAX_REPAIRS": "3"}, "CRITIQUE_MAX_REPAIRS; did you mean CRITIQUE_MAX_REPAIR"),
        ({"CRITIQUE_CONFIG": "{missing}"}, "cannot read workflow file"),
        ({"CRITIQUE_CONFIG": "{bad_key}"}, "critique.max_repairs"),
    ],
)
def test_configuration_errors_stop_worker_submit_and_demo(
    env: dict[str, str],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A typo'd variable or an invalid CRITIQUE_CONFIG: `critique worker` exits 2 at start,
    `critique submit` exits 2 before enqueuing, `critique demo` exits 2 (not 1) before it
    starts anything — each naming the key."""
    bad = tmp_path / "workflow.awp.yaml"
    bad.write_text(
        "orchestration:\n  delegation_loop:\n    critique:\n      max_repairs: 3\n", "utf-8"
    )
    files = {"{missing}": str(tmp_path / "nope.yaml"), "{bad_key}": str(bad)}
    for name, value in env.items():
        monkeypatch.setenv(name, files.get(value, value))
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    sub = tmp_path / "sub.json"
    sub.write_text(json.dumps(SUB), "utf-8")
    for argv in (["worker", "--dry-run"], ["submit", str(sub)], ["demo", "--quiet"]):
        assert main(argv) == 2, argv
        assert named in capsys.readouterr().err, argv


# -- a key goes only to its own provider (issue 28, item 3) -----------------------------------

KEY = {"CRITIQUE_LLM_API_KEY": "sk-operator"}
LOCAL_MODELS = ("llamafile/x", "ollama/x", "ollama_chat/x", "hosted_vllm/x", "lm_studio/x")


def _refusal(model: str, env: dict[str, str], **worker: object) -> str | None:
    cfg = _config(**worker)
    return model_refusal(model, allowed=cfg.allowed_models, api_base=cfg.llm.api_base, env=env)


def test_key_variables_are_recognised_by_name_and_value() -> None:
    """CRITIQUE_LLM_API_KEY and provider credentials count as held keys when non-empty; other
    CRITIQUE_ variables (the HMAC secret) and plain settings do not."""
    for name in ("CRITIQUE_LLM_API_KEY", "OPENAI_API_KEY", "HF_TOKEN", "AWS_ACCESS_KEY_ID",
                 "WATSONX_APIKEY", "GOOGLE_APPLICATION_CREDENTIALS"):  # fmt: skip
        assert is_key_var(name), name
    for name in ("CRITIQUE_SECRET", "OLLAMA_API_BASE", "AZURE_API_VERSION", "PATH"):
        assert not is_key_var(name), name
    env = {"OPENAI_API_KEY": "sk", "CRITIQUE_LLM_API_KEY": "k", "HF_TOKEN": "", "HOME": "/h"}
    assert held_keys(env) == ("CRITIQUE_LLM_API_KEY", "OPENAI_API_KEY")


@pytest.mark.parametrize("model", ["openai/gpt-4o", *LOCAL_MODELS, "bedrock/x"])
def test_a_worker_holding_a_key_allows_only_allowed_models(model: str) -> None:
    """With any key set and allowed_models empty every submitted model is refused, naming the
    variable and CRITIQUE_ALLOWED_MODELS; listing it lets it through (even a local one)."""
    for env in (KEY, {"ANTHROPIC_API_KEY": "sk-ant"}):
        reason = _refusal(model, env)
        assert reason is not None and "allowed_models, which is empty" in reason
        assert next(iter(env)) in reason and "CRITIQUE_ALLOWED_MODELS" in reason
    assert _refusal(model, KEY, allowed_models=[model]) is None
    assert "is not in the worker's allowed_models ['a/b']" in (
        _refusal(model, KEY, allowed_models=["a/b"]) or ""
    )


@pytest.mark.parametrize("model", LOCAL_MODELS)
def test_local_providers_need_an_endpoint_the_operator_configured(model: str) -> None:
    """Keyless, a local server's model is refused unless llm.api_base or the provider's own
    base variable is set (or it is listed); the reason names both settings."""
    reason = _refusal(model, {})
    provider = model.split("/")[0]
    assert reason is not None and f"is served by {provider!r}" in reason
    assert "llm.api_base" in reason and "CRITIQUE_ALLOWED_MODELS" in reason
    assert all(var in reason for var in LOCAL_PROVIDERS[provider])
    assert _refusal(model, {}, llm={"api_base": "http://10.0.0.5:8000/v1"}) is None
    for var in LOCAL_PROVIDERS[provider]:
        assert _refusal(model, {var: "http://10.0.0.5:8000"}) is None
    assert _refusal(model, {}, allowed_models=[model]) is None


@pytest.mark.parametrize("model", ["bedrock/x", "vertex_ai/x", "github_copilot/x", "vllm/x"])
def test_ambient_credential_providers_are_refused_even_with_an_endpoint(model: str) -> None:
    """Providers that sign in with the worker's own credentials (or run in it) are refused
    unless listed, llm.api_base or not."""
    for worker in ({}, {"llm": {"api_base": "http://10.0.0.5/v1"}}):
        reason = _refusal(model, {}, **worker)
        assert reason is not None and "signs in with the worker's own credentials" in reason
    assert _refusal(model, {}, allowed_models=[model]) is None


@pytest.mark.parametrize(
    "model",
    [
        "huggingface/https://evil.example/v1",
        "openai/http://169.254.169.254/latest",
        "openai//evil.example/v1",
        "openai/../../admin",
        "openai/x?api_base=http://evil",
        "openai/x y",
        "openai/x\n",
    ],
)
def test_a_model_name_never_carries_an_address(model: str) -> None:
    """A scheme, '//', '..' or a character outside a model name's is refused, whatever the
    endpoint (litellm's huggingface takes 'huggingface/https://host' as the URL to call)."""
    assert carries_address(model)
    for worker in ({}, {"llm": {"api_base": "http://10.0.0.5/v1"}}):
        assert "carries an address" in (_refusal(model, {}, **worker) or "")


@pytest.mark.parametrize("model", ["evil/model", "gpt-4o", "anthropic.claude-v2", "OLLAMA/x"])
def test_unknown_or_missing_providers_are_refused(model: str) -> None:
    """Without a hosted provider's prefix litellm guesses (an unprefixed Bedrock id goes
    through the worker's AWS credentials): refused, saying to use 'provider/model'."""
    reason = _refusal(model, {})
    assert reason is not None and "use 'provider/model'" in reason


def test_hosted_models_pass_on_a_keyless_worker() -> None:
    """The default that stays open: a keyless worker lets a submission name a hosted model."""
    for model in ("openai/gpt-4o-mini", "anthropic/claude-3-5-haiku", "groq/llama3:8b"):
        assert _refusal(model, {}) is None


def test_the_refusals_name_the_field_in_one_line() -> None:
    """The client's and the worker's checks raise RefusedOverrideError naming the field."""
    worker = _config()
    with pytest.raises(RefusedOverrideError) as info:
        check_submission_model("llamafile/x", worker, env=KEY)
    assert info.value.key == "submission.model" and "\n" not in str(info.value)
    assert str(info.value).startswith("submission's model 'llamafile/x' is not in the worker's")
    for field in ("model", "paired_model"):
        with pytest.raises(RefusedOverrideError) as info:
            check_submission_overrides({field: "ollama/x"}, worker, env={})
        assert info.value.key == field
        assert str(info.value).startswith(f"submission may not set {field!r}: model 'ollama/x'")
    check_submission_overrides({"critic": "llm"}, worker, env=KEY)  # names no model: fine


def test_the_product_key_goes_only_to_the_configured_providers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CRITIQUE_LLM_API_KEY rides along only with calls to the configured models' providers;
    without key_models only to the operator's llm.api_base; an explicit api_key always."""
    monkeypatch.setenv("CRITIQUE_LLM_API_KEY", "sk-operator")

    def key(completer: LiteLLMCompleter, model: str) -> object:
        req = LLMRequest(model=model, messages=({"role": "user", "content": "hi"},))
        return completer.kwargs_for(req).get("api_key")

    scoped = LiteLLMCompleter(LLMConfig(), key_models=("openai/gpt-4o", "anthropic/c"))
    assert key(scoped, "openai/gpt-4o-mini") == "sk-operator"
    assert key(scoped, "anthropic/claude-3") == "sk-operator"
    for model in ("ollama/x", "llamafile/x", "gpt-4o", "huggingface/https://evil/v1"):
        assert key(scoped, model) is None, model
    assert key(LiteLLMCompleter(LLMConfig()), "openai/gpt-4o") is None
    assert key(LiteLLMCompleter(LLMConfig(api_base="http://h/v1")), "x/y") == "sk-operator"
    assert key(LiteLLMCompleter(LLMConfig(), api_key="sk-own"), "ollama/x") == "sk-own"


def test_worker_warns_when_it_holds_a_key_and_lists_no_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`critique worker` warns at start that a keyed worker without allowed_models refuses
    every submission naming a model, and says what to set."""
    import os

    for name in [n for n in os.environ if is_key_var(n)]:
        monkeypatch.delenv(name)
    assert unlisted_models_warning(()) is None
    monkeypatch.setenv("OPENAI_API_KEY", "sk-provider")
    warning = unlisted_models_warning(())
    assert warning is not None and "(OPENAI_API_KEY)" in warning
    assert "CRITIQUE_ALLOWED_MODELS" in warning
    assert unlisted_models_warning(("openai/gpt-4o",)) is None


# -- the tables against litellm's own provider list --------------------------------------------


def _litellm() -> Any:
    from pipeline.llm.providers import load_litellm

    return load_litellm()


def _default_host(litellm: Any, provider: str) -> str | None:
    from urllib.parse import urlsplit

    try:
        base = litellm.get_llm_provider(model=f"{provider}/x")[3]
    except Exception:  # a provider that needs more than a name to resolve
        return None
    return urlsplit(base).hostname if isinstance(base, str) else None


def _is_local(host: str) -> bool:
    import ipaddress

    if host in ("localhost", "host.docker.internal") or host.endswith(".local"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private or address.is_link_local


def test_the_provider_tables_agree_with_litellm() -> None:
    """Every hosted provider is one litellm knows and its default endpoint is not on the
    worker's machine; every provider whose default endpoint is local is in LOCAL_PROVIDERS;
    the three tables are disjoint."""
    litellm = _litellm()
    known = {getattr(p, "value", p) for p in litellm.provider_list}
    assert known >= HOSTED_PROVIDERS, sorted(HOSTED_PROVIDERS - known)
    assert not HOSTED_PROVIDERS & set(LOCAL_PROVIDERS)
    assert not HOSTED_PROVIDERS & AMBIENT_PROVIDERS
    assert not set(LOCAL_PROVIDERS) & AMBIENT_PROVIDERS
    local = set()
    for provider in sorted(known - AMBIENT_PROVIDERS):  # ambient ones may sign in to resolve
        host = _default_host(litellm, provider)
        if host is not None and _is_local(host):
            local.add(provider)
    assert local <= set(LOCAL_PROVIDERS), sorted(local - set(LOCAL_PROVIDERS))
    assert {"ollama", "llamafile"} <= local  # the probe itself works
    for provider in HOSTED_PROVIDERS:
        host = _default_host(litellm, provider)
        assert host is None or not _is_local(host), (provider, host)


def test_every_key_variable_litellm_names_counts_as_a_held_key() -> None:
    """The credential variables litellm's environment check names for any provider are all
    recognised by is_key_var (so holding one turns on the allowed_models rule)."""
    litellm = _litellm()
    settings = ("_API_BASE", "_BASE_URL", "_API_VERSION", "_PROJECT", "_LOCATION", "_REGION_NAME")
    named: set[str] = set()
    for p in litellm.provider_list:
        provider = getattr(p, "value", p)
        if provider in AMBIENT_PROVIDERS:
            continue
        try:
            info = litellm.validate_environment(model=f"{provider}/x")
        except Exception:
            continue
        named.update(str(k) for k in info.get("missing_keys") or ())
    keys = {n for n in named if not n.endswith(settings)}
    assert {"OPENAI_API_KEY", "ANTHROPIC_API_KEY", "HUGGINGFACE_API_KEY"} <= keys
    assert [n for n in sorted(keys) if not is_key_var(n)] == []
