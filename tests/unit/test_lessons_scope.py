"""Lessons are scoped (issue 33): a run's own by default, the fleet's only where the operator
sets ``CRITIQUE_LESSONS_SCOPE=fleet``, and then bounded per teaching run and labelled with
counts; no lesson names another run, and lessons.md shows stored text only as pattern memory
keeps it. The store's side of the same rules (lessons live in the Redis store alone):
tests/integration/test_store_protocols.py."""

from __future__ import annotations

import pytest

from pipeline import settings
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.loop.pitfalls import render_lessons
from pipeline.models import Lesson
from pipeline.security.pattern_text import MAX_RULE_CHARS
from pipeline.store import keys


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
