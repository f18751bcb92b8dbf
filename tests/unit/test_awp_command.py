"""``critique awp``: without arguments, or without awp-agents installed, it says what to do and
exits 2 before anything starts."""

from __future__ import annotations

import sys

import pytest

from workers.cli import main


def test_no_awp_arguments_is_a_usage_error_that_shows_an_example(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`critique awp` alone: exit 2, one line with `critique awp run WORKFLOW_DIR`."""
    pytest.importorskip("awp", reason="awp-agents is not installed")
    assert main(["awp"]) == 2
    err = capsys.readouterr().err
    assert "critique awp run WORKFLOW_DIR" in err and err.count("\n") == 1


def test_without_awp_agents_it_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An environment without awp-agents: exit 2 naming the extra to install."""
    monkeypatch.setitem(sys.modules, "awp.cli", None)
    assert main(["awp", "run", "wf"]) == 2
    assert "pip install 'critique-pipeline[awp]'" in capsys.readouterr().err
