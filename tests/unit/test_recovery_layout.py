"""The recovery package after its split by mechanism: every name and dotted path the rest of the
code and Celery use still resolves from ``workers.recovery``, the sweeper's queue cache keeps
its rule (tests/unit/test_code_shape.py keeps every function short). Pure: no Redis, no worker."""

from __future__ import annotations

import pytest
from kombu.utils.imports import symbol_by_name

import workers.recovery as recovery

NAMES_USED_ELSEWHERE = (
    "FINISHED",
    "LOST_GRACE_S",
    "LOST_MARGIN_S",
    "Consumer",
    "DrainView",
    "HeldReport",
    "RedisBroker",
    "RedisTransport",
    "SentinelTransport",
    "Snapshot",
    "Sweeper",
    "SweeperThread",
    "ThreadPool",
    "default_stores",
    "drained_for_proof",
    "held_tags",
    "is_stalled",
    "judge",
    "orphans",
    "redrive",
    "redrive_if_stalled",
    "register",
    "stall_after_s",
    "sweep_interval_s",
)
"""What workers/, tests/ and bench/ import from ``workers.recovery`` by name."""


@pytest.mark.parametrize("name", NAMES_USED_ELSEWHERE)
def test_every_name_other_modules_import_is_still_exported_by_the_package(name: str) -> None:
    """``from workers.recovery import <name>`` keeps working, and the name is in ``__all__``."""
    assert hasattr(recovery, name)
    assert name in recovery.__all__


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
        "workers.recovery:Sweeper": "workers.recovery.sweeper",
    }
    for path, module in paths.items():
        assert symbol_by_name(path).__module__ == module, path
    assert symbol_by_name("workers.recovery.RedisTransport") is recovery.RedisTransport


def test_the_sweeper_bootstep_and_the_probe_task_keep_their_names() -> None:
    """The bootstep's name in the worker's blueprint and the probe task's name are those of
    the single module the package replaced (``critique.probe``, from keys.py)."""
    from pipeline.store import keys
    from workers.app import app

    assert recovery.Sweeper.name == "workers.recovery.Sweeper"
    app.loader.import_default_modules()
    assert app.tasks[keys.TASK_PROBE].name == keys.TASK_PROBE


def test_the_queue_cache_answers_only_for_the_progress_it_was_told() -> None:
    """A pass's queue is known at the last progress it was remembered with, not at another."""
    cache = recovery.QueueCache()
    cache.remember("run", "1:w1:sid", 10.0, "critique.llm")
    assert cache.get("run", "1:w1:sid", 10.0) == "critique.llm"
    assert cache.get("run", "1:w1:sid", 11.0) is None
    assert cache.get("other", "1:w1:sid", 10.0) is None


def test_the_queue_cache_empties_when_it_reaches_its_limit() -> None:
    """At its limit the cache starts over (a bound on the sweeper's memory), keeping the newest."""
    cache = recovery.QueueCache(limit=2)
    cache.remember("run", "a", 1.0, "q")
    cache.remember("run", "b", 1.0, "q")
    cache.remember("run", "c", 1.0, "q")
    assert len(cache) == 1 and cache.get("run", "c", 1.0) == "q"


@pytest.mark.parametrize("module", ["base", "redriving", "sweeper", "transport"])
def test_no_exported_name_shadows_a_mechanism_module(module: str) -> None:
    """``workers.recovery.<module>`` is the module itself (a re-exported function of the same
    name would hide it from ``import workers.recovery.<module> as m`` and from patch paths)."""
    import importlib
    import types

    loaded = importlib.import_module(f"workers.recovery.{module}")
    assert isinstance(getattr(recovery, module), types.ModuleType)
    assert getattr(recovery, module) is loaded
