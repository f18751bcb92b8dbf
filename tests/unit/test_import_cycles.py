"""No import circles among the modules of ``pipeline`` and ``workers`` (read statically from the
source with ``ast``): the domain, and the Celery runtime with its commands, adapters and recovery.

An edge A → B means that importing A runs B: a module-level ``import``/``from … import`` of B, of
a submodule of B (a package's ``__init__`` runs first), or of a name B's package ``__init__``
defines. A submodule importing a sibling through its own package (``from pipeline.store import
keys`` inside ``pipeline.store``) depends on the sibling, not on the package being initialised.
``if TYPE_CHECKING:`` blocks are not imports. Edges cross the two packages (``workers`` imports
``pipeline``), so a circle through both is found too.

Neither module-level imports nor imports inside functions may form a cycle: a function-level
cycle is a circle the code merely postpones (it breaks as soon as someone hoists the import), so
none is tolerated, and there is no allow-list.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "workers")
"""The project's own packages, read as one graph."""

Graph = Mapping[str, set[str]]


def _modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file of ``packages``."""
    out: dict[str, Path] = {}
    for path in sorted(p for package in packages for p in (root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool) -> list[str]:
    """Fully qualified names an import statement asks for (a module, or ``package.name``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_pkg else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return [f"{base}.{alias.name}" for alias in node.names]


def _edges_of(name: str, module: str, known: Mapping[str, Path]) -> set[str]:
    """Known modules that importing ``name`` from ``module`` runs (see the module docstring)."""
    parts = name.split(".")
    chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    found = [m for m in chain if m in known]
    if not found:
        return set()
    deepest = found[-1]
    edges = {deepest} if deepest != module else set()
    for ancestor in found[:-1]:
        # A package whose __init__ runs on the way; it is already running for its own members.
        if not module.startswith(ancestor + "."):
            edges.add(ancestor)
    return edges


def import_graphs(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> tuple[Graph, Graph]:
    """(module-level edges, function-level edges) between the modules of ``packages``."""
    known = _modules(root, packages)
    top: dict[str, set[str]] = {m: set() for m in known}
    nested: dict[str, set[str]] = {m: set() for m in known}

    for module, path in known.items():
        is_pkg = path.name == "__init__.py"

        def visit(node: ast.AST, at_top: bool, module: str = module, is_pkg: bool = is_pkg) -> None:
            for child in ast.iter_child_nodes(node):
                if _is_type_checking(child):
                    continue
                if isinstance(child, ast.Import | ast.ImportFrom):
                    for name in _targets(child, module, is_pkg):
                        (top if at_top else nested)[module] |= _edges_of(name, module, known)
                inner = at_top and not isinstance(
                    child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
                )
                visit(child, inner)

        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), True)
    return top, nested


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterable[str]]] = []
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work.append((start, iter(sorted(graph.get(start, ())))))
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_cycle_finder_finds_a_planted_cycle() -> None:
    """The detector itself works: a → b → c → a is one cycle, the dangling d is none."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_circle_closed_inside_a_function_is_found(tmp_path: Path) -> None:
    """Read from source: ``a`` imports ``b`` at the top, ``b`` imports ``a`` inside a function
    (and ``c`` only under ``TYPE_CHECKING``): one circle, ``a`` and ``b``, and only when the
    function-level edges are counted."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import g\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg import c\n"
        "def g():\n    from pkg import a\n    return a\n"
    )
    (pkg / "c.py").write_text("import pkg.b\n")
    top, nested = import_graphs(tmp_path, ["pkg"])
    assert cycles(top) == []
    assert cycles({m: top[m] | nested[m] for m in top}) == [["pkg.a", "pkg.b"]]


def test_the_graph_sees_function_level_and_package_edges() -> None:
    """Known edges are read: pitfalls imports pattern memory's text rules (which import the
    injection scan) and (through ``pipeline.store.keys``) runs the store package's
    ``__init__``; the Redis blob store loads
    its Redis helpers inside a function; a store module reaching a sibling through its own
    package depends on the sibling only; ``workers`` modules are read, with their edges into
    ``pipeline`` and into ``workers.commands``, ``workers.recovery`` and ``workers.adapters``."""
    top, nested = import_graphs()
    assert {"pipeline.security.pattern_text", "pipeline.store", "pipeline.store.keys"} <= top[
        "pipeline.loop.pitfalls"
    ]
    assert "pipeline.security.injection" in top["pipeline.security.pattern_text"]
    assert "pipeline.store.redis_common" in nested["pipeline.store.blobs"]
    assert "pipeline.store.keys" in top["pipeline.store.blobs"]
    assert "pipeline.store" not in top["pipeline.store.blobs"]
    assert {"workers.app", "pipeline.loop.stages"} <= top["workers.tasks"]
    assert "workers.recovery.base" in top["workers.recovery.sweeper"]
    assert "workers.commands._common" in top["workers.commands.submit"]
    assert "workers.adapters.verdicts" in top["workers.adapters.langgraph"]


def test_no_module_level_import_cycles() -> None:
    """No two modules of pipeline or workers import each other, directly or around a circle, at
    import time."""
    top, _ = import_graphs()
    assert cycles(top) == []


@pytest.mark.parametrize(
    "pair",
    [
        # the compiled scanner is pipeline.text.compiled's
        ("pipeline.text.simhash", "pipeline.contract"),
        # the injection scan is pipeline.security.injection
        ("pipeline.loop.pitfalls", "pipeline.critics.llm"),
        ("workers.cli", "workers.commands._common"),  # the exit codes are workers.exit_codes
        ("workers.tasks", "workers.recovery.redriving"),  # continuation is workers.routing's
    ],
)
def test_former_circles_stay_broken(pair: tuple[str, str]) -> None:
    """The circles untangled by moving the shared piece out do not come back, even lazily."""
    top, nested = import_graphs()
    graph = {m: top[m] | nested[m] for m in top}
    assert not any(set(pair) <= set(c) for c in cycles(graph))


def test_no_function_level_import_cycles() -> None:
    """Counting imports inside functions too, no module of pipeline or workers is in a circle
    (no allow-list: a circle is broken by moving the shared piece, never tolerated)."""
    top, nested = import_graphs()
    graph = {m: top[m] | nested[m] for m in top}
    assert cycles(graph) == []


def _unexplained_nested_imports(path: Path) -> list[str]:
    """``file:line`` of each import of a project module inside a function of ``path`` with no
    ``# lazy:`` note among the comments and imports right above it (or on its line)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for fn in ast.walk(ast.parse("\n".join(lines), str(path))):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if not any(n.split(".")[0] in PACKAGES for n in names):
                continue
            at = node.lineno - 1
            explained = "# lazy:" in lines[at]
            while not explained and at > 0:
                at -= 1
                above = lines[at].strip()
                if not above.startswith(("#", "from ", "import ")) and above not in ("", "try:"):
                    break
                explained = above.startswith("# lazy:")
            if not explained:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_every_function_level_import_says_why_it_is_lazy() -> None:
    """An import of the project's own module inside a function carries a ``# lazy:`` note
    (what stays unloaded, and for whom); any other belongs at the top of the module, where the
    circle test sees it."""
    unexplained = [
        where
        for path in _modules(ROOT, PACKAGES).values()
        for where in _unexplained_nested_imports(path)
    ]
    assert unexplained == []
