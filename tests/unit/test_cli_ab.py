"""``critique ab``'s usage errors and exit codes, in-process, before any Redis or model is
reached (the end-to-end runs are in tests/integration/test_command_critic.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.ab_models import write_inputs
from workers.cli import main


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    return write_inputs(tmp_path / "inputs.jsonl")


def test_ab_is_listed_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "ab" in capsys.readouterr().out


def test_a_bad_input_line_is_one_error_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 and one line on stderr: ``file:line: what``."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"input_id": "a", "task": "t", "kind": "json"}\n{"input_id": "b"}\n')
    code = main(["ab", str(path), "--out", str(tmp_path / "out"), "--model", "m"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"critique ab: {path}:2: field 'task': Field required"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reps", "0"], "--reps must be ≥ 1"),
        (["--parallel", "0"], "--parallel must be ≥ 1"),
        (["--timeout", "0"], "--timeout must be > 0"),
        ([], "the worker model is not set"),
    ],
)
def test_usage_errors_exit_2(
    inputs: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    """Bad numbers, and no worker model (neither --model nor model configured)."""
    monkeypatch.delenv("CRITIQUE_MODEL", raising=False)
    monkeypatch.delenv("CRITIQUE_CONFIG", raising=False)
    model = ["--model", "m"] if argv else []
    code = main(["ab", str(inputs), "--out", str(tmp_path / "o"), *model, *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["ab", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path), "--model", "m"])
    assert code == 2 and "cannot read" in capsys.readouterr().err


def test_redis_unreachable_exits_3(
    inputs: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With REDIS_URL naming a server that is not there: exit 3, nothing generated."""
    from workers import runtime

    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    runtime.client.cache_clear()
    runtime.stores.cache_clear()
    try:
        code = main(["ab", str(inputs), "--out", str(tmp_path / "o"), "--model", "m"])
    finally:
        runtime.client.cache_clear()
        runtime.stores.cache_clear()
    assert code == 3
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in capsys.readouterr().err
    assert not (tmp_path / "o" / "ab.csv").exists()
