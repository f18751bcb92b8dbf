"""pipeline/'s rooms keep what their package docstrings promise (docs/development.md, 'The
layout'): five modules at the top, every room a package that holds a docstring and nothing
else, the import rules each room's docstring states, and a layout tree that names every module.

Imports are read from the source with ``ast``, at module level and inside functions alike;
``if TYPE_CHECKING:`` blocks are annotations, not imports, and are skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.layout import REDIS_STORE_MODULES

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "pipeline"

TOP_MODULES = {"config", "errors", "models", "settings", "wiring"}
"""The modules that stay at the top: the foundations every room imports, and the composition
root that imports every room."""

ROOMS = {"contract", "critics", "llm", "loop", "records", "security", "store", "text"}

REDIS_STORE = REDIS_STORE_MODULES

ALLOWED: dict[str, set[str]] = {
    "text": set(),
    "security": {
        "pipeline.errors",
        "pipeline.models",
        "pipeline.settings",
        "pipeline.text",
        "pipeline.records.archive_file",
    },
    "llm": {
        "pipeline.config",
        "pipeline.errors",
        "pipeline.models",
        "pipeline.settings",
        "pipeline.security",
    },
}
"""Rooms that may import only these (and their own modules), as their docstrings say."""

FORBIDDEN: dict[str, set[str]] = {
    "records": {"pipeline.llm", "pipeline.store", "pipeline.wiring"},
    "loop": {"pipeline.wiring", *REDIS_STORE},
}
"""What a room's docstring says it must not import."""


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path) -> set[str]:
    """Every ``pipeline`` name a module imports (``pkg.mod`` or ``pkg.mod.name``), anywhere in
    it but under ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.update(f"{child.module}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return {name for name in found if name.startswith("pipeline.")}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def room_modules(room: str) -> list[Path]:
    return sorted((PIPELINE / room).rglob("*.py"))


def test_the_top_holds_the_foundations_the_wiring_and_the_rooms() -> None:
    """A new top-level module or package is a choice the layout (and this list) records."""
    modules = {p.stem for p in PIPELINE.glob("*.py")} - {"__init__"}
    packages = {p.parent.name for p in PIPELINE.glob("*/__init__.py")}
    assert modules == TOP_MODULES
    assert packages == ROOMS


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_a_room_package_holds_a_docstring_and_nothing_else(room: str) -> None:
    """Each room says what it holds in one docstring and re-exports nothing (no imports, no
    names in its ``__init__``)."""
    tree = ast.parse((PIPELINE / room / "__init__.py").read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), f"pipeline/{room}/__init__.py has no docstring"
    if room == "contract":
        return  # a room before the rooms: its __init__ is the suite's own module
    assert len(tree.body) == 1, f"pipeline/{room}/__init__.py holds more than its docstring"


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_lower_room_imports_only_what_its_docstring_allows(room: str) -> None:
    """text imports no other part of pipeline; security only the foundations, text and the
    archive directory's path; llm only the foundations and security."""
    allowed = {*ALLOWED[room], f"pipeline.{room}"}
    stray = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in room_modules(room)
        for name in imports_of(path)
        if not any(_within(name, ok) for ok in allowed)
    }
    assert stray == set()


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_a_room_imports_nothing_its_docstring_forbids(room: str) -> None:
    """records never reaches the LLM calls, the store or the wiring; the loop never a Redis
    store module or the wiring (the composition root hands it what it uses)."""
    stray = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in room_modules(room)
        for name in imports_of(path)
        if any(_within(name, bad) for bad in FORBIDDEN[room])
    }
    assert stray == set()


@pytest.mark.parametrize("room", sorted(ROOMS - {"loop"}))
def test_no_room_but_the_loop_imports_the_loop(room: str) -> None:
    """The loop is the top floor: it may use every other room, and no other room uses it (but
    for type annotations), so no two rooms lean on each other through it. What a lower room
    and the loop share lives in the lower room (or in the foundations), never in the loop."""
    stray = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in room_modules(room)
        for name in imports_of(path)
        if _within(name, "pipeline.loop")
    }
    assert stray == set()


def test_nothing_in_pipeline_imports_the_wiring() -> None:
    """The composition root imports every room; no room imports it."""
    users = {
        str(path.relative_to(ROOT))
        for path in PIPELINE.rglob("*.py")
        if path.name != "wiring.py"
        and any(_within(name, "pipeline.wiring") for name in imports_of(path))
    }
    assert users == set()


def test_the_layout_trees_name_every_module() -> None:
    """docs/development.md's trees have a line for every module of pipeline/ (and the C
    scanner) and of workers/, so a module added or moved is drawn where it is."""
    page = (ROOT / "docs/development.md").read_text(encoding="utf-8")
    tree = page[page.index("## The layout") : page.index("## Layering")]
    drawn = {word for line in tree.splitlines() for word in line.replace(",", " ").split()}
    files = {p.name for p in PIPELINE.rglob("*.py") if p.name != "__init__.py"}
    files |= {p.name for p in PIPELINE.rglob("*.c")}
    files |= {f"{room}/" for room in ROOMS}
    workers = ROOT / "workers"
    files |= {p.name for p in workers.rglob("*.py") if p.name != "__init__.py"}
    files |= {f"{p.name}/" for p in workers.iterdir() if (p / "__init__.py").exists()}
    assert sorted(files - drawn) == []
