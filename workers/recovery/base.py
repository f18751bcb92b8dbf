"""What the recovery mechanisms share: their settings, their timing constants, the snapshot of
the broker's unacknowledged messages, and the stores they read and write.

Settings come from the environment: ``CRITIQUE_STALL_S`` (seconds without progress before a
pass may be re-driven; default the task time limit + 30 s), ``CRITIQUE_SWEEP_S`` (seconds
between sweeps and probes; default 5, 0 turns sweeping off) and ``CRITIQUE_STALL_MAX_RESUMES``
(re-drives of one pass before the sweeper gives up on it; default 5).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from pipeline import settings
from pipeline.models import PassRef
from pipeline.store.pending import RedisPendingIndex
from pipeline.store.redis import RedisTraceSink
from pipeline.store.redis_common import StoreClient
from pipeline.store.runs import RedisRunStore
from workers import runtime

# The variables (CRITIQUE_STALL_S, CRITIQUE_SWEEP_S, CRITIQUE_STALL_MAX_RESUMES): pipeline.settings.
DEFAULT_SWEEP_S = settings.number(settings.SWEEP_S, {})
SWEEP_BATCH = 200
"""Most passes one sweep examines in full (reading their steps): a sweep stays short, the rest
waits for the next."""

LOST_MARGIN_S = 1.0
"""A pass becomes a suspect no sooner than this after its last step record: the stage that
records a step sends the next message right after it (and holds its own, unacknowledged,
until then)."""
LOST_GRACE_S = 3.0
"""How long a worker may take from popping a message off its queue to registering it in
kombu's ``unacked`` hash (the next thing kombu does): a message popped before a probe ran is
finished or in ``unacked`` this long after the probe ran. Also the slack on held reports."""


def stall_after_s() -> float:
    """Seconds without progress before a pass counts as stalled: ``$CRITIQUE_STALL_S``, else
    the task time limit + 30 s (a stage that runs can take up to its time limit)."""
    if settings.given(settings.STALL_S):
        return settings.number(settings.STALL_S)
    # lazy: workers.app configures Celery, logging and os.environ on import; importing
    # workers.recovery.base does not
    from workers.app import app

    return float(app.conf.task_time_limit or 600) + 30.0


def sweep_interval_s() -> float:
    """Seconds between two sweeps (and probes): ``$CRITIQUE_SWEEP_S``, default 5; 0 = off."""
    return settings.number(settings.SWEEP_S)


def max_resumes() -> int:
    """Re-drives of one pass before the sweeper gives up on it (``$CRITIQUE_STALL_MAX_RESUMES``)."""
    return settings.integer(settings.STALL_MAX_RESUMES)


@dataclass(frozen=True)
class Snapshot:
    """The pass ids of every message in the broker's ``unacked`` set, read between ``before``
    and ``after`` (wall clock)."""

    pass_ids: frozenset[str]
    before: float
    after: float


@dataclass(frozen=True)
class RecoveryStores:
    """The stores recovery reads and writes, over one Redis client."""

    runs: RedisRunStore
    trace: RedisTraceSink
    pending: RedisPendingIndex


@functools.lru_cache(maxsize=4)
def stores_on(client: StoreClient) -> RecoveryStores:
    """The recovery stores over ``client`` (one set per client); the run store verifies what
    workers recorded with ``CRITIQUE_SECRET`` (:func:`workers.runtime.secrets`)."""
    return RecoveryStores(
        RedisRunStore(client, secrets=runtime.secrets),
        RedisTraceSink(client, secrets=runtime.secrets),
        RedisPendingIndex(client),
    )


def default_stores() -> RecoveryStores:
    """The recovery stores over this process's Redis client (:func:`workers.runtime.client`)."""
    return stores_on(runtime.client())


def register(ref: PassRef) -> None:
    """Index a pass as pending from now (call before its chain is sent)."""
    default_stores().pending.add(ref.run_id, ref.member, time.time())
