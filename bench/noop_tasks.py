"""Bench-only Celery task: a stage that does no work (the bare-chain baseline)."""

from __future__ import annotations

from typing import Any

from workers.app import app


@app.task(name="critique.bench.noop")
def noop(msg: dict[str, Any]) -> dict[str, Any]:
    """Return the message unchanged."""
    return msg


@app.task(name="critique.bench.noop_nr", ignore_result=True, store_errors_even_if_ignored=True)
def noop_nr(msg: dict[str, Any]) -> dict[str, Any]:
    """The same, storing no result (as the pipeline's stage tasks; the last one stores)."""
    return msg


@app.task(name="critique.bench.heap")
def heap(action: str, top: int = 15) -> dict[str, Any]:
    """Look inside the worker process that runs it (bench/memory.py --trace; one process):
    ``start`` starts tracemalloc (25 frames) and returns the live objects' counts by type;
    ``report`` returns the same counts and the ``top`` allocation sites (by size, tracebacks
    folded to their innermost frame in this project or, failing that, anywhere) that are
    still alive since ``start``."""
    import gc
    import tracemalloc
    from collections import Counter

    gc.collect()
    types = Counter(type(o).__qualname__ for o in gc.get_objects())
    if action == "start":
        tracemalloc.start(25)
        return {"types": dict(types)}
    snapshot = tracemalloc.take_snapshot().filter_traces(
        (tracemalloc.Filter(False, tracemalloc.__file__),)
    )
    sites: Counter[str] = Counter()
    blocks: Counter[str] = Counter()
    for stat in snapshot.statistics("traceback"):
        frames = list(stat.traceback)[::-1]  # most recent call first (stored oldest first)
        ours = [f for f in frames if "/pipeline/" in f.filename or "/workers/" in f.filename]
        where = ours[0] if ours else frames[0]
        site = f"{where.filename.rsplit('/site-packages/', 1)[-1]}:{where.lineno}"
        sites[site] += stat.size
        blocks[site] += stat.count
    rows = [
        {"site": site, "kib": size / 1024, "blocks": blocks[site]}
        for site, size in sites.most_common(top)
    ]
    return {"types": dict(types), "sites": rows, "traced_kib": sum(sites.values()) / 1024}
