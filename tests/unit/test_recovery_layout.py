"""The recovery package, split by mechanism: the dotted paths Celery is given resolve to the
mechanism modules, the package re-exports nothing (each name has one address), the sweeper's
queue cache keeps its rule (tests/unit/test_code_shape.py keeps every function short). Pure: no
Redis, no worker."""

from __future__ import annotations

import ast
from pathlib import Path

from kombu.utils.imports import symbol_by_name

import workers.recovery as recovery
from workers.recovery.redriving import QueueCache
from workers.recovery.sweeper import Sweeper

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_re_exports_nothing() -> None:
    """``workers/recovery/__init__.py`` is its docstring: every name is imported from the
    mechanism module that defines it, so a name has one address."""
    tree = ast.parse((ROOT / "workers" / "recovery" / "__init__.py").read_text(encoding="utf-8"))
    assert [type(node) for node in tree.body] == [ast.Expr]
    assert recovery.__doc__


def test_the_dotted_paths_celery_is_given_resolve_to_the_mechanism_modules() -> None:
    """The transport, consumer, pool and bootstep paths in celeryconfig and workers.app load
    the classes of ``workers.recovery.transport`` and ``workers.recovery.sweeper``."""
    from celery import concurrency

    import celeryconfig
    from workers import app

    paths = {
        app.GUARDED_TRANSPORT: "workers.recovery.transport",
        app.GUARDED_SENTINEL_TRANSPORT: "workers.recovery.transport",
        celeryconfig.worker_consumer: "workers.recovery.transport",
        concurrency.ALIASES["threads"]: "workers.recovery.transport",
        "workers.recovery.sweeper:Sweeper": "workers.recovery.sweeper",
    }
    for path, module in paths.items():
        assert path.startswith(module + ":"), path
        assert symbol_by_name(path).__module__ == module, path
    assert "workers.recovery.sweeper:Sweeper" in app.app.steps["worker"]


def test_the_sweeper_bootstep_and_the_probe_task_keep_their_names() -> None:
    """The bootstep's name in the worker's blueprint and the probe task's name are those of
    the single module the package replaced (``critique.probe``, from keys.py)."""
    from pipeline.store import keys
    from workers.app import app

    assert Sweeper.name == "workers.recovery.Sweeper"
    app.loader.import_default_modules()
    assert app.tasks[keys.TASK_PROBE].name == keys.TASK_PROBE


def test_the_queue_cache_answers_only_for_the_progress_it_was_told() -> None:
    """A pass's queue is known at the last progress it was remembered with, not at another."""
    cache = QueueCache()
    cache.remember("run", "1:w1:sid", 10.0, "critique.llm")
    assert cache.get("run", "1:w1:sid", 10.0) == "critique.llm"
    assert cache.get("run", "1:w1:sid", 11.0) is None
    assert cache.get("other", "1:w1:sid", 10.0) is None


def test_the_queue_cache_empties_when_it_reaches_its_limit() -> None:
    """At its limit the cache starts over (a bound on the sweeper's memory), keeping the newest."""
    cache = QueueCache(limit=2)
    cache.remember("run", "a", 1.0, "q")
    cache.remember("run", "b", 1.0, "q")
    cache.remember("run", "c", 1.0, "q")
    assert len(cache) == 1 and cache.get("run", "c", 1.0) == "q"
