"""A configured model whose provider key is missing is a configuration error (SPEC §5.2):
``critique worker`` and ``critique submit`` exit 2 naming the variable, and a worker's litellm
call refuses before anything is sent — never a silent heuristic fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import CritiqueConfig, LLMConfig
from pipeline.errors import ConfigError
from pipeline.llm import LiteLLMCompleter, LLMRequest
from pipeline.providers import check_keys, configured_models, llm_models, missing_keys
from tests.fakes.openai_server import FakeOpenAIServer
from workers.cli import main

PROVIDER_VARS = (
    "CRITIQUE_LLM_API_KEY",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "CRITIQUE_MODEL",
    "CRITIQUE_CONFIG",
)
SUB = {"run_id": "r1", "worker_id": "w1", "task": "Summarise.", "output": {"summary": "x"}}


@pytest.fixture(autouse=True)
def _no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without provider keys or critique settings."""
    for name in PROVIDER_VARS:
        monkeypatch.delenv(name, raising=False)


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
    """litellm names OPENAI_API_KEY for an openai model; the provider's own variable or
    CRITIQUE_LLM_API_KEY satisfies it."""
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


def test_the_completer_refuses_before_any_request(fake_llm: FakeOpenAIServer) -> None:
    """litellm's own completion with no key: ConfigError naming the variable, no HTTP request,
    no retries (before, the call was retried for seconds and the heuristic answered)."""
    completer = LiteLLMCompleter(LLMConfig(api_base=fake_llm.api_base, max_retries=3))
    request = LLMRequest(model="openai/gpt-4o-mini", messages=({"role": "user", "content": "hi"},))
    with pytest.raises(ConfigError) as info:
        completer(request)
    assert info.value.key == "OPENAI_API_KEY"
    assert fake_llm.requests == []


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
