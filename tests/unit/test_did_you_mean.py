"""Errors that take their chance: one did-you-mean helper for environment variables (the
worker's own settings too), ``--set`` keys and workflow-file keys; a signature refusal names
the likely cause (the manager's and the workers' CRITIQUE_SECRET differ)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.errors import ConfigError, ForgedMessageError, did_you_mean
from pipeline.security import signing
from workers.cli import main


def test_did_you_mean_is_case_insensitive_and_answers_with_the_mapped_name() -> None:
    assert did_you_mean("max_repairs", ["max_repair_attempts", "model"]) == (
        "did you mean max_repair_attempts? "
    )
    assert did_you_mean("CONCURENCY", {"concurrency": "CRITIQUE_CONCURRENCY"}) == (
        "did you mean CRITIQUE_CONCURRENCY? "
    )
    assert did_you_mean("zzz", ["model"]) == ""


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("CRITIQUE_CONCURENCY", "CRITIQUE_CONCURRENCY"),
        ("CRITIQUE_PROCESES", "CRITIQUE_PROCESSES"),
        ("CRITIQUE_SECRT", "CRITIQUE_SECRET"),
        ("CRITIQUE_MAX_REPAIRS", "CRITIQUE_MAX_REPAIR_ATTEMPTS"),
    ],
)
def test_an_unknown_env_var_suggests_a_field_or_a_worker_setting(name: str, meant: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={name: "4"})
    assert f"unknown environment variable {name}; did you mean {meant}? " in str(err.value)


def test_a_set_key_typo_gets_the_same_suggestion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`critique submit --set max_repairs=3`: exit 2, nothing enqueued, the right key named."""
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # never reached
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"run_id": "r", "worker_id": "w", "task": "t", "output": "x"}))
    assert main(["submit", str(path), "--set", "max_repairs=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown configuration key 'critique.max_repairs'; " in err
    assert "did you mean critique.max_repair_attempts? " in err


def test_a_nested_key_typo_names_the_full_right_key() -> None:
    with pytest.raises(ConfigError, match=r"did you mean critique\.rubric\.target_score\? "):
        load_config(env={}, overrides={"rubric": {"target_scor": 8}})


def test_a_workflow_file_key_typo_gets_the_suggestion(tmp_path: Path) -> None:
    wf = tmp_path / "workflow.awp.yaml"
    wf.write_text("orchestration:\n  delegation_loop:\n    critique:\n      max_repairs: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(wf, env={})
    assert "did you mean orchestration.delegation_loop.critique.max_repair_attempts? " in str(
        err.value
    )


def test_a_bad_signature_says_to_compare_the_managers_secret_with_the_workers() -> None:
    msg = signing.sign({"v": 1, "sid": "s"}, (b"m" * 32,))
    with pytest.raises(ForgedMessageError) as err:
        signing.verify(msg, (b"w" * 32,))
    text = str(err.value)
    assert "compare the manager's CRITIQUE_SECRET with the workers'" in text
    assert text.count("CRITIQUE_SECRET") == 1  # the hint is not repeated after it
