"""``llm.rate_limit``: one limit for every model or one per model; worker-only."""

from __future__ import annotations

import pytest

from pipeline.config import CritiqueConfig, check_submission_overrides, load_config
from pipeline.errors import ConfigError, RefusedOverrideError


def test_one_limit_for_every_model_from_the_environment() -> None:
    cfg = load_config(env={"CRITIQUE_LLM__RATE_LIMIT": '{"rpm": 120}'})
    limit = cfg.llm.rate_limit_for("openai/anything")
    assert limit is not None and (limit.rpm, limit.tpm, limit.burst_s) == (120, None, 1.0)


def test_per_model_limits_with_a_star_default() -> None:
    cfg = CritiqueConfig.model_validate(
        {"llm": {"rate_limit": {"openai/a": {"rpm": 60, "tpm": 1000}, "*": {"rpm": 5}}}}
    )
    a, other = cfg.llm.rate_limit_for("openai/a"), cfg.llm.rate_limit_for("openai/b")
    assert a is not None and (a.rpm, a.tpm) == (60, 1000)
    assert other is not None and other.rpm == 5
    only_a = CritiqueConfig.model_validate({"llm": {"rate_limit": {"openai/a": {"rpm": 1}}}})
    assert only_a.llm.rate_limit_for("openai/b") is None
    assert CritiqueConfig().llm.rate_limit_for("x") is None


def test_bad_limits_are_configuration_errors() -> None:
    with pytest.raises(ConfigError):
        load_config(env={"CRITIQUE_LLM__RATE_LIMIT": '{"rpm": 0}'})


def test_a_submission_may_not_set_a_rate_limit() -> None:
    with pytest.raises(RefusedOverrideError):
        check_submission_overrides({"llm": {"rate_limit": {"rpm": 10**6}}}, CritiqueConfig())
