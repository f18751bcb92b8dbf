"""Configuration: defaults, the AWP workflow blocks, the environment, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import CritiqueConfig, load_config
from pipeline.errors import ConfigError
from pipeline.models import DEFAULT_DEFECT_CATEGORIES

WORKFLOW = """
name: demo
orchestration:
  engine: delegation_loop
  delegation_loop:
    critique:
      enabled: true
      mode: dedicated
      model: gpt-4o-mini
      max_repair_attempts: 3
      repair_budget_fraction: 0.2
      rubric:
        target_score: 7.5
        weights: {novelty: 2}
      budget:
        total_tokens: 100000
observability:
  output_contract:
    checks: [default]
    extra:
      - name: citation_keys_resolve
        implementation: my_workflow.contracts:CitationCheck
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "workflow.awp.yaml"
    p.write_text(text, encoding="utf-8")
    return p


def test_defaults_match_the_spec_table() -> None:
    """Every setting has its documented default."""
    c = load_config(env={})
    assert c.enabled is True  # on unless turned off explicitly
    assert c.mode == "inline"
    assert c.model is None
    assert c.max_repair_attempts == 2
    assert c.repair_budget_fraction == 0.15
    assert c.min_score_to_complete == 0.6
    assert c.pattern_memory is True
    assert c.defect_categories == DEFAULT_DEFECT_CATEGORIES
    assert c.output_contract.checks == ("default",)
    assert c.output_contract.extra == ()
    assert c.critic == "auto"
    assert (c.rubric.target_score, c.rubric.plateau_epsilon) == (8.0, 0.1)
    assert (c.rubric.plateau_window, c.rubric.max_rounds) == (2, 5)
    assert c.budget.total_tokens is None
    assert c.max_output_bytes == 16 * 1024 * 1024
    assert c.max_rejected_completions == 3


def test_workflow_blocks_are_read(tmp_path: Path) -> None:
    """Both AWP blocks (critique and observability.output_contract) land in one object."""
    c = load_config(write(tmp_path, WORKFLOW), env={})
    assert c.enabled and c.mode == "dedicated" and c.model == "gpt-4o-mini"
    assert c.max_repair_attempts == 3
    assert c.rubric.target_score == 7.5
    assert c.rubric.weight("novelty") == 2 and c.rubric.weight("clarity") == 1.0
    assert c.output_contract.extra[0].implementation == "my_workflow.contracts:CitationCheck"
    assert c.repair_token_cap == 20000


def test_unknown_key_in_workflow_names_the_key(tmp_path: Path) -> None:
    """An unknown key is an error that names it and lists what is allowed."""
    text = WORKFLOW.replace("max_repair_attempts: 3", "max_repair_atempts: 3")
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, text), env={})
    assert "max_repair_atempts" in str(exc.value)
    assert "max_repair_attempts" in str(exc.value)  # the allowed list


def test_unknown_nested_key_names_the_nested_block(tmp_path: Path) -> None:
    """A typo inside the rubric block names the dotted key and the rubric's fields."""
    text = WORKFLOW.replace("target_score: 7.5", "target: 7.5")
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, text), env={})
    assert exc.value.key is not None and exc.value.key.endswith("rubric.target")
    assert "plateau_window" in str(exc.value)


def test_bad_value_names_key_and_allowed_values(tmp_path: Path) -> None:
    """A bad enum value says which key and which values are allowed."""
    text = WORKFLOW.replace("mode: dedicated", "mode: sometimes")
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, text), env={})
    assert "mode" in str(exc.value) and "dedicated" in str(exc.value)


def test_out_of_range_fraction_is_rejected() -> None:
    """repair_budget_fraction must lie in [0, 1]."""
    with pytest.raises(ConfigError) as exc:
        load_config(env={}, overrides={"repair_budget_fraction": 1.5})
    assert "repair_budget_fraction" in str(exc.value)


def test_environment_overrides_file(tmp_path: Path) -> None:
    """CRITIQUE_* variables win over the file; nested fields use a double underscore."""
    env = {
        "CRITIQUE_MAX_REPAIR_ATTEMPTS": "5",
        "CRITIQUE_RUBRIC__PLATEAU_WINDOW": "3",
        "CRITIQUE_DEFECT_CATEGORIES": "missing_data, stale",
        "CRITIQUE_COMMAND": "ruff check --select E",
        "CRITIQUE_ENABLED": "false",
    }
    c = load_config(write(tmp_path, WORKFLOW), env=env)
    assert c.max_repair_attempts == 5
    assert c.rubric.plateau_window == 3
    assert c.rubric.target_score == 7.5  # nested merge keeps the file's sibling
    assert c.defect_categories == ("missing_data", "stale")
    assert c.command == ("ruff", "check", "--select", "E")
    assert c.enabled is False


def test_unknown_environment_variable_is_an_error() -> None:
    """A misspelt CRITIQUE_ variable is reported rather than silently ignored."""
    with pytest.raises(ConfigError) as exc:
        load_config(env={"CRITIQUE_MAX_REPAIRS": "3"})
    assert "CRITIQUE_MAX_REPAIRS" in str(exc.value)


def test_config_path_from_environment(tmp_path: Path) -> None:
    """CRITIQUE_CONFIG names the workflow file when no path is given."""
    p = write(tmp_path, WORKFLOW)
    assert load_config(env={"CRITIQUE_CONFIG": str(p)}).mode == "dedicated"


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    """An unreadable workflow file says which path."""
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "nope.yaml", env={})
    assert "nope.yaml" in str(exc.value)


def test_weights_for_unknown_dimensions_are_rejected() -> None:
    """Rubric weights may only name configured dimensions."""
    with pytest.raises(ConfigError) as exc:
        load_config(env={}, overrides={"rubric": {"weights": {"style": 1}}})
    assert "style" in str(exc.value)


def test_extension_implementation_must_be_module_colon_callable(tmp_path: Path) -> None:
    """An extra check's implementation has the module:Callable shape."""
    text = WORKFLOW.replace("my_workflow.contracts:CitationCheck", "my_workflow.contracts")
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, text), env={})
    assert "implementation" in str(exc.value)


def test_config_is_frozen() -> None:
    """Configuration values cannot be mutated after loading."""
    c = CritiqueConfig()
    with pytest.raises(ValueError):
        c.enabled = True  # type: ignore[misc]


def test_no_total_budget_means_no_cap() -> None:
    """Without budget.total_tokens the fraction cannot apply."""
    assert CritiqueConfig().repair_token_cap is None
