"""Facts about the source tree's layout that more than one layout test reads."""

from __future__ import annotations

REDIS_STORE_MODULES = frozenset(
    {
        "pipeline.store.archive_index",
        "pipeline.store.critique_entries",
        "pipeline.store.fleet",
        "pipeline.store.metrics",
        "pipeline.store.pending",
        "pipeline.store.ratelimit",
        "pipeline.store.redis",
        "pipeline.store.redis_common",
        "pipeline.store.runs",
    }
)
"""The Redis halves of the store: the only modules of pipeline/ that may import redis."""
