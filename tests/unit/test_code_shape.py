"""The code's shape, kept: no function in pipeline/ or workers/ is over 100 lines (a longer one
is several steps that want names of their own)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 100


def long_functions(paths: list[Path], limit: int = LIMIT) -> list[str]:
    """``path:name (N lines)`` for each function or method of ``paths`` longer than ``limit``."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                    found.append(f"{name}:{node.name} ({lines} lines)")
    return found


def test_a_long_function_is_reported(tmp_path: Path) -> None:
    """The check sees methods and nested functions, and counts the lines a function spans."""
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    source = tmp_path / "probe.py"
    source.write_text(f"class C:\n  def m(self):\n{body}\n\ndef short():\n    return 1\n")
    assert long_functions([source], limit=5) == ["probe.py:m (6 lines)"]


def test_no_function_in_pipeline_or_workers_is_over_100_lines() -> None:
    paths = sorted([*ROOT.glob("pipeline/**/*.py"), *ROOT.glob("workers/**/*.py")])
    assert paths, "no sources found"
    assert long_functions(paths) == []
