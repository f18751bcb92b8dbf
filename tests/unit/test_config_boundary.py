"""The configuration trust boundary (who may set what), as pure functions and at the
client's front door: a submission may set policy, never a field that reaches a network address,
a secret or code, and never more than the worker allows. No Redis needed."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import (
    POLICY,
    WORKER_ONLY,
    CritiqueConfig,
    LLMConfig,
    check_submission_model,
    check_submission_overrides,
    load_config,
)
from pipeline.errors import ConfigError, RefusedOverrideError, SubmissionError

SIDE_EFFECT = "tests.hostile.sideeffect"
WORKER = CritiqueConfig()


def refusal(overrides: dict[str, Any], worker: CritiqueConfig = WORKER) -> RefusedOverrideError:
    with pytest.raises(RefusedOverrideError) as info:
        check_submission_overrides(overrides, worker)
    return info.value


# -- the declared split -----------------------------------------------------------------------


def test_every_field_is_declared_worker_only_or_policy_exactly_once() -> None:
    """Each configuration field (output_contract's two) is in exactly one of the two lists."""
    declared = [w.path for w in WORKER_ONLY] + sorted(POLICY)
    assert len(declared) == len(set(declared))
    fields = {f for f in CritiqueConfig.model_fields if f != "output_contract"}
    fields |= {"output_contract.checks", "output_contract.extra"}
    assert set(declared) == fields


def test_the_worker_only_list_names_what_the_spec_names() -> None:
    """llm (with llm.rate_limit), command, command_timeout_s, output_contract.extra, repairer,
    allowed_models, cache."""
    assert {w.path for w in WORKER_ONLY} == {
        "llm",
        "cache",
        "command",
        "command_timeout_s",
        "output_contract.extra",
        "repairer",
        "allowed_models",
    }


# -- worker-only fields are refused, named ----------------------------------------------------

WORKER_ONLY_CASES: list[tuple[str, dict[str, Any]]] = [
    *[(f"llm.{name}", {"llm": {name: 1}}) for name in LLMConfig.model_fields],
    ("llm.api_base", {"critic": "llm", "llm": {"api_base": "http://attacker.example/v1"}}),
    ("llm", {"llm": {}}),
    ("llm", {"llm": None}),
    ("command", {"command": ["sh", "-c", "id"]}),
    ("command_timeout_s", {"command_timeout_s": 1}),
    (
        "output_contract.extra",
        {"output_contract": {"extra": [{"name": "x", "implementation": "os:getpid"}]}},
    ),
    ("output_contract.extra", {"output_contract": {"checks": ["default"], "extra": []}}),
    ("repairer", {"repairer": "os:getcwd"}),
    ("repairer", {"repairer": f"{SIDE_EFFECT}:repair"}),
    ("allowed_models", {"allowed_models": ["evil/model"]}),
    ("allowed_models", {"allowed_models": []}),
]


@pytest.mark.parametrize(("field", "overrides"), WORKER_ONLY_CASES)
def test_a_worker_only_field_is_refused_naming_it(field: str, overrides: dict[str, Any]) -> None:
    """Every worker-only field (every llm.* one included) is refused; the message names the
    dotted field, says it is worker-only and where the operator sets it."""
    exc = refusal(overrides)
    assert exc.key == field
    assert isinstance(exc, SubmissionError)
    msg = str(exc)
    assert f"submission may not set {field!r}" in msg
    assert "worker-only" in msg and "network address, a secret or code" in msg
    assert "worker's workflow file" in msg
    assert "\n" not in msg


def test_the_refusal_points_at_the_environment_variable() -> None:
    """The refusal says which CRITIQUE_ variable the operator would use instead."""
    assert "CRITIQUE_LLM__API_BASE" in str(refusal({"llm": {"api_base": "http://x/v1"}}))


def test_a_worker_only_field_is_refused_even_when_equal_to_the_workers() -> None:
    """Presence is refused, not just a different value (no oracle for the worker's settings)."""
    worker = CritiqueConfig(llm=LLMConfig(api_base="http://127.0.0.1:1/v1"))
    assert refusal({"llm": {"api_base": "http://127.0.0.1:1/v1"}}, worker).key == "llm.api_base"


def test_the_check_imports_nothing_it_names() -> None:
    """A refused module:Callable is never imported by the check."""
    sys.modules.pop(SIDE_EFFECT, None)
    refusal(
        {"output_contract": {"extra": [{"name": "x", "implementation": f"{SIDE_EFFECT}:check"}]}}
    )
    refusal({"repairer": f"{SIDE_EFFECT}:repair"})
    assert SIDE_EFFECT not in sys.modules


def test_replacing_the_output_contract_block_whole_is_refused() -> None:
    """output_contract holds a worker-only field, so only its policy fields may be set."""
    assert refusal({"output_contract": None}).key == "output_contract"


# -- policy fields are accepted ----------------------------------------------------------------

POLICY_CASES: list[dict[str, Any]] = [
    {"enabled": True},
    {"mode": "dedicated", "model": "openai/gpt-4o-mini"},
    {"critic": "heuristic"},
    {"critic": "rubric"},
    {"critic": "llm"},
    {"model": "openai/gpt-4o-mini"},
    {"paired_critic": True, "paired_model": "openai/gpt-4o"},
    {"max_repair_attempts": 0},
    {"max_repair_attempts": 2},
    {"repair_budget_fraction": 0.5},
    {"min_score_to_complete": 0.0},
    {"max_rejected_completions": 10},
    {"pattern_memory": False},
    {"defect_categories": ["missing_data", "wrong_format"]},
    {"rubric": {"target_score": 9.0, "max_rounds": 3, "weights": {"clarity": 2}}},
    {"budget": {"total_tokens": 200_000}},
    {"max_output_bytes": 1024},
    {"output_contract": {"checks": ["default"]}},
    {"output_contract": {"checks": ["no_placeholder", "json_valid_if_claimed"]}},
    {"output_contract": {"checks": []}},
    {"repairer": "auto"},
    {"repairer": "llm"},
    {"repairer": "deterministic"},
    {},
]


@pytest.mark.parametrize("overrides", POLICY_CASES, ids=lambda o: json.dumps(o)[:60])
def test_a_policy_field_is_accepted(overrides: dict[str, Any]) -> None:
    """Every policy field (and the named repairer strategies) passes the check and loads."""
    check_submission_overrides(overrides, WORKER)
    load_config(env={}, overrides=overrides)


def test_a_bad_policy_value_is_a_config_error_naming_it() -> None:
    """A value the configuration cannot take is a ConfigError naming the key, not a refusal."""
    with pytest.raises(ConfigError) as info:
        check_submission_overrides({"repair_budget_fraction": 3}, WORKER)
    assert not isinstance(info.value, RefusedOverrideError)
    assert info.value.key == "critique.repair_budget_fraction"


def test_an_unknown_key_is_left_to_the_configuration_error() -> None:
    """A key that is no field at all gets load_config's 'unknown configuration key' error."""
    with pytest.raises(ConfigError, match=r"unknown configuration key 'critique\.nope'"):
        check_submission_overrides({"nope": 1}, WORKER)


def test_an_unknown_output_contract_check_is_refused() -> None:
    """output_contract.checks may name built-ins only."""
    exc = refusal({"output_contract": {"checks": ["os:getpid"]}})
    assert exc.key == "output_contract.checks"
    assert "not a built-in check" in str(exc)


# -- limits: at most the worker's ------------------------------------------------------------


def test_max_repair_attempts_above_the_workers_is_refused() -> None:
    """max_repair_attempts 5 over a worker's 2 is refused with both numbers."""
    exc = refusal({"max_repair_attempts": 5})
    assert exc.key == "max_repair_attempts"
    assert "max_repair_attempts 5 exceeds the worker's 2" in str(exc)


def test_max_repair_attempts_given_as_text_is_still_limited() -> None:
    """A value pydantic would coerce ("5") cannot slip past the limit."""
    assert refusal({"max_repair_attempts": "5"}).key == "max_repair_attempts"


def test_max_repair_attempts_up_to_the_workers_own_is_accepted() -> None:
    """A worker configured for 4 accepts 4 and 3."""
    worker = CritiqueConfig(max_repair_attempts=4)
    check_submission_overrides({"max_repair_attempts": 4}, worker)
    check_submission_overrides({"max_repair_attempts": 3}, worker)


def test_the_budget_wait_may_only_be_lowered() -> None:
    """A submission may wait less for held budget tokens (0: refuse at once), never longer
    than the worker lets it; the total stays its policy."""
    worker = CritiqueConfig(budget={"wait_s": 30})
    exc = refusal({"budget": {"wait_s": 31}}, worker)
    assert exc.key == "budget.wait_s" and "may only be lowered" in str(exc)
    check_submission_overrides({"budget": {"wait_s": 0, "total_tokens": 1000}}, worker)
    check_submission_overrides({"budget": {"total_tokens": 1000}}, worker)


def test_max_output_bytes_may_only_be_lowered() -> None:
    """Raising max_output_bytes over the worker's is refused; lowering it is fine."""
    worker = CritiqueConfig(max_output_bytes=1000)
    exc = refusal({"max_output_bytes": 1001}, worker)
    assert exc.key == "max_output_bytes"
    assert "max_output_bytes may only be lowered" in str(exc)
    check_submission_overrides({"max_output_bytes": 999}, worker)
    check_submission_overrides({"max_output_bytes": 1000}, worker)


# -- allowed_models -----------------------------------------------------------------------------

ALLOWING = CritiqueConfig(allowed_models=("openai/gpt-4o-mini", "openai/gpt-4o"))


@pytest.mark.parametrize("field", ["model", "paired_model"])
def test_a_model_outside_allowed_models_is_refused(field: str) -> None:
    """model / paired_model must be one of the worker's allowed_models when it sets them."""
    exc = refusal({field: "evil/expensive-model"}, ALLOWING)
    assert exc.key == field
    assert (
        "model 'evil/expensive-model' is not in the worker's allowed_models "
        "['openai/gpt-4o-mini', 'openai/gpt-4o']"
    ) in str(exc)


def test_a_model_in_allowed_models_is_accepted() -> None:
    """An allowed model (and an allowed adjudicator) passes."""
    check_submission_overrides(
        {"model": "openai/gpt-4o-mini", "paired_critic": True, "paired_model": "openai/gpt-4o"},
        ALLOWING,
    )


def test_empty_allowed_models_on_a_keyless_worker_allows_a_hosted_model() -> None:
    """The default (no allowed_models) on a worker that holds no API key lets a submission
    choose a hosted provider's model (tests/unit/test_provider_keys.py pins the rest)."""
    check_submission_overrides({"model": "openai/anything-at-all"}, WORKER, env={})
    check_submission_model("anthropic/anything-at-all", WORKER, env={})


def test_the_submissions_own_model_must_be_allowed() -> None:
    """Submission.model (the worker's model, which the inline critic and repairer call) is
    refused outside allowed_models; None and an allowed one pass."""
    with pytest.raises(RefusedOverrideError) as info:
        check_submission_model("evil/model", ALLOWING)
    assert info.value.key == "submission.model"
    assert "'evil/model' is not in the worker's allowed_models" in str(info.value)
    check_submission_model(None, ALLOWING)
    check_submission_model("openai/gpt-4o", ALLOWING)


def test_allowed_models_reads_a_comma_separated_environment_variable() -> None:
    """CRITIQUE_ALLOWED_MODELS may be a JSON list or comma-separated names."""
    env = {"CRITIQUE_ALLOWED_MODELS": "openai/gpt-4o-mini, openai/gpt-4o"}
    assert load_config(env=env).allowed_models == ("openai/gpt-4o-mini", "openai/gpt-4o")
    env = {"CRITIQUE_ALLOWED_MODELS": '["a/b"]'}
    assert load_config(env=env).allowed_models == ("a/b",)


def test_load_config_overrides_stay_trusted_for_operator_use() -> None:
    """load_config(overrides=...) itself still takes worker-only fields (operator side)."""
    c = load_config(env={}, overrides={"llm": {"api_base": "http://127.0.0.1:9/v1"}})
    assert c.llm.api_base == "http://127.0.0.1:9/v1"


# -- the process boundary: workers.runtime and the client -------------------------------------


@pytest.fixture()
def fresh_runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """workers.runtime with empty configuration caches and no CRITIQUE_ configuration."""
    from workers import runtime

    for name in list(os.environ):
        if name.startswith("CRITIQUE_") and name != "CRITIQUE_TEST_REDIS_URL":
            monkeypatch.delenv(name)
    runtime._configs.clear()
    runtime._contexts.clear()
    yield runtime
    runtime._configs.clear()
    runtime._contexts.clear()


def test_config_for_refuses_before_building_anything(
    fresh_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runtime.context_for never reaches make_context (which imports extension checks and
    callable repairers) for refused overrides, and nothing refused is cached."""
    runtime = fresh_runtime

    def never(*a: Any, **k: Any) -> Any:
        raise AssertionError("make_context was called for a refused configuration")

    monkeypatch.setattr(runtime, "make_context", never)
    sys.modules.pop(SIDE_EFFECT, None)
    bad = {"output_contract": {"extra": [{"name": "x", "implementation": f"{SIDE_EFFECT}:check"}]}}
    with pytest.raises(RefusedOverrideError, match=r"'output_contract\.extra'"):
        runtime.context_for(bad)
    with pytest.raises(RefusedOverrideError, match="'repairer'"):
        runtime.config_for({"repairer": f"{SIDE_EFFECT}:repair"})
    assert SIDE_EFFECT not in sys.modules
    assert set(runtime._configs) <= {"{}"}


def test_config_for_checks_against_this_process_environment(
    fresh_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limits come from the process's own configuration (file + CRITIQUE_ environment)."""
    runtime = fresh_runtime
    monkeypatch.setenv("CRITIQUE_MAX_REPAIR_ATTEMPTS", "1")
    with pytest.raises(RefusedOverrideError, match="max_repair_attempts 2 exceeds the worker's 1"):
        runtime.config_for({"max_repair_attempts": 2})
    assert runtime.config_for({"max_repair_attempts": 1}).max_repair_attempts == 1
    assert runtime.own_config().max_repair_attempts == 1


def test_the_client_refuses_a_worker_only_field_at_construction(fresh_runtime: Any) -> None:
    """CritiqueClient(config) fails before anything is enqueued, naming the field."""
    from workers.client import CritiqueClient

    with pytest.raises(RefusedOverrideError, match=r"'llm\.api_base'"):
        CritiqueClient({"critic": "llm", "llm": {"api_base": "http://127.0.0.1:9/v1"}})


def test_the_client_refuses_a_submission_model_outside_allowed_models(
    fresh_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """submit_many refuses a Submission.model the process's allowed_models excludes, before
    it touches the broker."""
    from pipeline.models import Submission
    from workers.client import CritiqueClient

    monkeypatch.setenv("CRITIQUE_ALLOWED_MODELS", "openai/gpt-4o-mini")
    client = CritiqueClient({"enabled": True})
    sub = Submission(run_id="r1", worker_id="w1", task="t", output="o", model="evil/model")
    with pytest.raises(RefusedOverrideError, match="'evil/model' is not in the worker's"):
        client.submit(sub)


def test_wait_reports_a_refusal_in_one_clean_line() -> None:
    """A chain that failed on a refusal reads 'was refused by the worker: <reason>' (no repr,
    no hint, one line); other failures keep their type."""
    from workers.client import _failure_reason

    exc = RefusedOverrideError("submission may not set 'llm.api_base': worker-only", key="x")
    assert _failure_reason(exc) == (
        "was refused by the worker: submission may not set 'llm.api_base': worker-only"
    )
    assert (
        _failure_reason(RuntimeError("boom\nsecond line"))
        == "failed: RuntimeError: boom second line"
    )


def test_critique_submit_set_worker_only_exits_2_in_one_line(
    fresh_runtime: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`critique submit --set llm.api_base=…` exits 2 before enqueuing, one line naming it."""
    from workers.cli import main

    sub = tmp_path / "s.json"
    sub.write_text(json.dumps({"run_id": "r1", "worker_id": "w1", "task": "t", "output": "o"}))
    code = main(["submit", str(sub), "--set", "llm.api_base=http://127.0.0.1:9/v1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err
    assert "critique submit: submission may not set 'llm.api_base'" in err
