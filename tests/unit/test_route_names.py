"""Every queue and task name the Celery app routes by comes from ``pipeline.store.keys``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import celeryconfig
from pipeline.store import keys
from workers import app as app_module

ROOT = Path(__file__).resolve().parents[2]
QUEUES = set(keys.QUEUES)
TASKS = {getattr(keys, n) for n in dir(keys) if n.startswith("TASK_")}
NAMES = QUEUES | TASKS
WIRING = (
    "celeryconfig.py",
    "workers/app.py",
    "workers/tasks.py",
    "workers/steps.py",
    "workers/routing.py",
)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string nodes that are docstrings (of the module, a class or a function, or
    the attribute docstring after an assignment): prose, not names in use."""
    out: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                out.add(id(stmt.value))
    return out


def test_routes_and_the_default_queue_name_known_tasks_and_queues() -> None:
    """celeryconfig routes only keys' task names, each to one of keys' queues, and its
    default queue is the CPU queue."""
    assert set(celeryconfig.task_routes) <= TASKS
    assert {route["queue"] for route in celeryconfig.task_routes.values()} <= QUEUES
    assert celeryconfig.task_default_queue == keys.QUEUE_CPU


def test_the_llm_queues_are_keys_queues() -> None:
    """The queues a worker loads litellm for are keys' LLM and dedicated-critic queues."""
    assert set(app_module.LLM_QUEUES) == {keys.QUEUE_LLM, keys.QUEUE_CRITIC}


@pytest.mark.parametrize("path", WIRING)
def test_no_queue_or_task_name_is_spelled_out_again(path: str) -> None:
    """The modules that wire the Celery app name queues and tasks only through keys' constants:
    no string literal outside a docstring equals a queue or task name."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"), path)
    prose = _docstrings(tree)
    spelled = [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in prose
        and node.value in NAMES
    ]
    assert spelled == []
