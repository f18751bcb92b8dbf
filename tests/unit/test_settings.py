"""pipeline.settings: one declaration per non-field ``CRITIQUE_*`` variable, documented once."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from pipeline import settings
from pipeline.config import ENV_NON_FIELDS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
ROW = re.compile(r"^\| `(CRITIQUE_[A-Z0-9_]+)` \| (`[^`]*`|—) \| (\w+) \| .+ \|$")


def _documented() -> dict[str, str | None]:
    """The table under "Deployment settings": name -> default (None for —)."""
    text = DOC.read_text(encoding="utf-8").split("## Deployment settings", 1)[1]
    rows = {}
    for line in text.splitlines():
        if m := ROW.match(line):
            default = None if m[2] == "—" else m[2].strip("`")
            rows[m[1]] = default
    return rows


def test_the_documented_table_lists_every_setting_with_its_default() -> None:
    documented = _documented()
    declared = {s.name: s.default for s in settings.ALL}
    assert documented == declared


def test_each_name_is_declared_once_and_the_config_check_knows_them() -> None:
    names = [s.name for s in settings.ALL]
    assert len(names) == len(set(names))
    assert ENV_NON_FIELDS == settings.NAMES == set(names)


def test_the_module_imports_only_the_standard_library() -> None:
    tree = ast.parse(Path(settings.__file__).read_text(encoding="utf-8"))
    imported = {
        (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}


def test_accessors_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.SWEEP_S.name, raising=False)
    assert settings.number(settings.SWEEP_S) == 5.0
    monkeypatch.setenv(settings.SWEEP_S.name, "-3")
    assert settings.number(settings.SWEEP_S) == 0.0  # raised to its floor
    monkeypatch.setenv(settings.STALL_MAX_RESUMES.name, " ")
    assert settings.integer(settings.STALL_MAX_RESUMES) == 5  # blank: the default
    monkeypatch.setenv(settings.STALL_MAX_RESUMES.name, "many")
    with pytest.raises(ValueError):
        settings.integer(settings.STALL_MAX_RESUMES)
    assert settings.flag(settings.TASK_EVENTS, {}) is True
    assert settings.flag(settings.TASK_EVENTS, {settings.TASK_EVENTS.name: " Off "}) is False
    assert settings.value(settings.LOG_LEVEL, {settings.LOG_LEVEL.name: ""}) == ""
    assert settings.given(settings.KEY_PREFIX, {settings.KEY_PREFIX.name: " x "}) == "x"
    with pytest.raises(LookupError):
        settings.value(settings.CONFIG, {})
