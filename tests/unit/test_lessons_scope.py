"""Lessons are scoped (issue 33): a run's own by default, the fleet's only where the operator
sets ``CRITIQUE_LESSONS_SCOPE=fleet``, and then bounded per teaching run and labelled with
counts; no lesson names another run, and lessons.md shows stored text only as pattern memory
keeps it. The Redis store's side of the same rules: tests/integration/test_store_protocols.py."""

from __future__ import annotations

import pytest

from pipeline import settings
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.models import Lesson, ReusablePattern
from pipeline.pitfalls import MAX_RULE_CHARS, render_lessons
from pipeline.store import keys
from pipeline.store.base import MAX_LESSONS, MAX_LESSONS_PER_RUN
from pipeline.store.memory import MemoryPatternStore


def rp(n: int | str, category: str = "missing_data") -> ReusablePattern:
    return ReusablePattern(category=category, description="d", prevention_rule=f"rule {n}")


def flood(store: MemoryPatternStore, run_id: str, count: int, start: int = 0) -> None:
    """``count`` distinct patterns taught by ``run_id``, twenty per critique."""
    for n in range(start, start + count, 20):
        batch = [rp(i) for i in range(n, min(n + 20, start + count))]
        store.record(run_id, f"c{n}", 1, batch)


def test_the_scope_is_run_unless_the_environment_says_fleet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset or blank: run; 'fleet' (any case): fleet; anything else is a ConfigError naming
    the variable."""
    monkeypatch.delenv(settings.LESSONS_SCOPE.name, raising=False)
    assert keys.lessons_scope() == "run"
    monkeypatch.setenv(settings.LESSONS_SCOPE.name, " ")
    assert keys.lessons_scope() == "run"
    monkeypatch.setenv(settings.LESSONS_SCOPE.name, "Fleet")
    assert keys.lessons_scope() == "fleet"
    monkeypatch.setenv(settings.LESSONS_SCOPE.name, "tenant")
    with pytest.raises(ConfigError, match=settings.LESSONS_SCOPE.name):
        keys.lessons_scope()


def test_a_submission_configuration_cannot_name_a_lessons_scope() -> None:
    """The scope is no configuration field: overrides naming it are refused, so no submission
    can widen a run's lessons to the fleet's."""
    for overrides in ({"lessons_scope": "fleet"}, {"lessons": {"scope": "fleet"}}):
        with pytest.raises(ConfigError):
            load_config(env={}, overrides=overrides)


def test_run_scope_shows_a_run_only_its_own_patterns(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default a run's lessons are its own patterns (taught by this run, most frequent
    first); another run's flood is not among them, and without a run id there are none."""
    monkeypatch.delenv(settings.LESSONS_SCOPE.name, raising=False)
    store = MemoryPatternStore()
    store.record("honest", "c1", 1, [rp("a")])
    store.record("honest", "c2", 1, [rp("a"), rp("b")], pass_key="p2")
    flood(store, "attacker", 200)
    mine = store.lessons(run_id="honest")
    assert [(x.prevention_rule, x.runs, x.scope, x.this_run) for x in mine] == [
        ("rule a", 1, "run", True),
        ("rule b", 1, "run", True),
    ]
    assert store.lessons() == []
    assert len(store.lessons(1000, run_id="attacker")) == 200


def test_fleet_scope_lets_one_run_bring_at_most_its_share() -> None:
    """A run flooding 200 distinct patterns brings MAX_LESSONS_PER_RUN lessons (its first
    ones), never the other 150, and another run's recurring lesson stays and is marked as
    taught by the run that reads it."""
    store = MemoryPatternStore(lessons_scope="fleet")
    keep = rp("keep", "stale")
    store.record("honest1", "c1", 1, [keep])
    store.record("honest2", "c1", 1, [keep])
    flood(store, "attacker", 200)
    got = store.lessons(2 * MAX_LESSONS, min_runs=1)
    flooded = [x for x in got if x.category == "missing_data"]
    assert len(flooded) == MAX_LESSONS_PER_RUN == 50
    assert {x.prevention_rule for x in flooded} == {f"rule {i}" for i in range(50)}
    [kept] = store.lessons(run_id="honest2")
    assert (kept.prevention_rule, kept.runs, kept.this_run) == ("rule keep", 2, True)
    assert store.lessons(run_id="attacker")[0].this_run is False


def test_fleet_scope_many_runs_evict_the_least_seen_and_free_their_bringers_share() -> None:
    """Past MAX_LESSONS, a new lesson evicts the least seen (a recurring one stays); a run
    whose lessons were all evicted may bring new ones again, up to its share."""
    store = MemoryPatternStore(lessons_scope="fleet")
    keep = rp("keep", "stale")
    store.record("a", "k", 1, [keep])
    store.record("b", "k", 1, [keep])
    for r in range(MAX_LESSONS // MAX_LESSONS_PER_RUN):
        flood(store, f"flood{r}", MAX_LESSONS_PER_RUN, start=r * 1000)
    assert len(store.lessons(2 * MAX_LESSONS, min_runs=1)) == MAX_LESSONS
    assert [x.prevention_rule for x in store.lessons()] == ["rule keep"]
    # "a" brought "keep"; flood0's first ones were evicted: it brings again, to its share.
    flood(store, "flood0", 2 * MAX_LESSONS_PER_RUN, start=50_000)
    rules = {x.prevention_rule for x in store.lessons(2 * MAX_LESSONS, min_runs=1)}
    assert len(rules & {f"rule {i}" for i in range(50_000, 50_100)}) == MAX_LESSONS_PER_RUN
    assert "rule keep" in rules


def test_lessons_md_names_no_other_run_and_labels_counts() -> None:
    """A fleet lesson says how many runs taught it and whether this one did; the only run id
    in the file is the run's own; a run-scope lesson says it was taught by this run."""
    fleet = [
        Lesson(category="stale", runs=3, description="d", prevention_rule="r1", this_run=True),
        Lesson(category="format", runs=2, description="d", prevention_rule="r2"),
    ]
    md = render_lessons(fleet, run_id="mine-1", scope="fleet")
    assert "## 1. stale (seen in 3 runs, this one among them)" in md
    assert "## 2. format (seen in 2 runs)\n" in md
    assert "Run mine-1." in md and "never which" in md
    own = [Lesson(category="stale", runs=1, description="d", prevention_rule="r", scope="run")]
    md = render_lessons(own, run_id="mine-1", scope="run")
    assert "## 1. stale (taught by this run)" in md and "kept per run" in md


def test_lessons_md_shows_a_planted_row_only_as_pattern_memory_keeps_text() -> None:
    """A lesson holding what pattern memory never stores (a 5,000-character rule, line
    breaks that would start Markdown blocks, invisible characters) is shown cut, on one line,
    without them, and escaped."""
    planted = Lesson(
        category="x\n# Owned\u200b",
        runs=2,
        description="line1\n\n<script>alert(1)</script>",
        prevention_rule="A" * 5000,
    )
    md = render_lessons([planted], scope="fleet")
    assert "\n# Owned" not in md and "\u200b" not in md and "<script" not in md
    [rule] = [line for line in md.splitlines() if line.startswith("- **Rule:** ")]
    assert len(rule.removeprefix("- **Rule:** ")) == MAX_RULE_CHARS
    assert "## 1. x # Owned (seen in 2 runs)" in md


def test_an_archived_lesson_with_run_ids_reads_without_them() -> None:
    """A lesson archived before lessons were scoped (with first_run/last_run) still reads,
    and the ids are gone."""
    old = {
        "category": "stale",
        "runs": 2,
        "description": "d",
        "prevention_rule": "r",
        "first_run": "someone-else",
        "last_run": "another",
    }
    lesson = Lesson.model_validate(old)
    assert "someone-else" not in lesson.model_dump_json() and lesson.scope == "fleet"
