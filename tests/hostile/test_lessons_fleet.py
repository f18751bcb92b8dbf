"""Fleet-wide lessons, where the operator opts in (``CRITIQUE_LESSONS_SCOPE=fleet`` on the
worker), through a real signed worker (issue 33): a run that floods 200 distinct patterns
brings at most its share (MAX_LESSONS_PER_RUN) of the fleet's lessons and changes nothing in
another run's ``lessons.md``, where a shared lesson says how many runs taught it and never
which. After each test the worker still serves an honest submission."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import redis

from pipeline import settings
from pipeline.store import keys
from pipeline.store.base import MAX_LESSONS, MAX_LESSONS_PER_RUN
from tests.hostile.lessons_flood import HONEST_RULE, flood, lessons_md, new_run, teach_honest
from tests.support.hostile import HOSTILE_WORKER
from tests.support.workers import WorkerProcess, WorkerSpec

pytestmark = pytest.mark.integration

WORKER = WorkerSpec(
    "hostile-fleet",
    env_fixture=HOSTILE_WORKER.env_fixture,
    more_env={settings.LESSONS_SCOPE.name: "fleet"},
)
"""The hostile suite's worker, with the operator's consent to fleet-wide lessons."""


def test_a_flooding_run_holds_at_most_its_share_and_names_no_run(
    worker: WorkerProcess, hostile_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two honest runs teach one pattern: the first's lessons.md shows it seen in 2 runs, this
    one among them, with no other run's id. A third run floods 200 distinct patterns: the
    fleet keeps 50 of them, counted against that run's share, and the honest run's lessons.md
    is byte for byte the same, holding neither the flooding run's id nor its text."""
    from workers import runtime

    monkeypatch.setenv(settings.LESSONS_SCOPE.name, "fleet")  # `critique report`, as the operator's
    first, second, attacker = new_run("honest"), new_run("honest"), new_run("flooder")
    teach_honest(first)
    teach_honest(second)
    before = lessons_md(first, tmp_path / "before")
    assert "missing_data (seen in 2 runs, this one among them)" in before
    assert HONEST_RULE in before and second not in before
    flood(attacker)
    fleet = runtime.stores().patterns.lessons(2 * MAX_LESSONS, min_runs=1)
    flooded = [x for x in fleet if "flood_" in x.prevention_rule]
    assert len(flooded) == MAX_LESSONS_PER_RUN
    assert [x.runs for x in fleet if x.prevention_rule == HONEST_RULE] == [2]
    held = redis.Redis.from_url(hostile_url).hgetall(
        keys.shared_key(keys.LESSONS_HELD, keys.key_prefix())
    )
    assert held[hashlib.sha1(attacker.encode()).hexdigest().encode()] == b"50"
    after = lessons_md(first, tmp_path / "after")
    assert after == before and attacker not in after and "flood_" not in after
    own = lessons_md(attacker, tmp_path / "attacker")
    assert first not in own and second not in own
