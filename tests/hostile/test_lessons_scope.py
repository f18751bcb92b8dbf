"""Lessons are per run by default (issue 33): a run that floods 200 distinct patterns changes
nothing in another run's ``lessons.md``, which names no other run, and nothing is written to
the fleet's shared lessons keys. Through a real signed worker (``CRITIQUE_LESSONS_SCOPE``
unset); after each test the worker still serves an honest submission. Fleet scope:
test_lessons_fleet.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from pipeline.store import keys
from tests.hostile.lessons_flood import (
    FLOOD_PATTERNS,
    HONEST_RULE,
    flood,
    lessons_md,
    new_run,
    teach_honest,
)
from tests.support.hostile import HOSTILE_WORKER
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.integration

WORKER = HOSTILE_WORKER


def test_a_flooding_run_leaves_another_runs_lessons_unchanged(
    worker: WorkerProcess, hostile_url: str, tmp_path: Path
) -> None:
    """An honest run's lessons.md is its own pattern, taught by this run; after another run
    floods 200 distinct patterns it is byte for byte the same and holds no other run's id;
    the flooding run's own lessons.md holds its patterns (and not the honest run's id), and
    no shared lessons key exists."""
    honest, attacker = new_run("honest"), new_run("flooder")
    teach_honest(honest)
    before = lessons_md(honest, tmp_path / "before")
    assert "missing_data (taught by this run)" in before and HONEST_RULE in before
    flood(attacker)
    after = lessons_md(honest, tmp_path / "after")
    assert after == before and attacker not in after and "flood_" not in after
    own = lessons_md(attacker, tmp_path / "attacker")
    assert own.count("(taught by this run)") == FLOOD_PATTERNS and honest not in own
    r = redis.Redis.from_url(hostile_url)
    assert list(r.scan_iter(match=f"{keys.key_prefix()}:lessons:*")) == []
