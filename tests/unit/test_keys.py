"""Key layout: one prefix, a {run_id} hash tag per run, env overrides, stable queue/task names."""

from __future__ import annotations

from fnmatch import fnmatchcase

import pytest
from redis.crc import key_slot

from pipeline import settings
from pipeline.errors import ConfigError
from pipeline.store import keys


def test_run_keys_carry_prefix_and_hash_tag() -> None:
    """A run key is <prefix>:{<run_id>}:<suffix>."""
    assert keys.run_key("run-1", keys.PATTERNS_FREQ, "critique") == "critique:{run-1}:patterns:freq"
    assert keys.run_key("run-1", keys.TRACE, "p") == "p:{run-1}:trace"


def test_a_run_lives_in_one_cluster_slot() -> None:
    """Every key of a run hashes to the same Redis Cluster slot (so Lua may touch them together)."""
    slots = {
        key_slot(keys.run_key("run-42", s, "critique").encode()) for s in keys.RUN_KEY_SUFFIXES
    }
    assert len(slots) == 1
    assert slots != {key_slot(keys.run_key("run-43", keys.TRACE, "critique").encode())}


def test_run_key_suffixes_are_distinct() -> None:
    """No two run structures share a key."""
    assert len(set(keys.RUN_KEY_SUFFIXES)) == len(keys.RUN_KEY_SUFFIXES)


def test_run_ids_that_would_break_the_hash_tag_are_refused() -> None:
    """Braces, spaces or an empty run id never reach a key."""
    for bad in ["a}b", "{x}", "", "a b", "../x"]:
        with pytest.raises(ValueError):
            keys.run_key(bad, keys.TRACE, "critique")


def test_prefix_defaults_and_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefix is "critique" unless CRITIQUE_KEY_PREFIX says otherwise."""
    monkeypatch.delenv(settings.KEY_PREFIX.name, raising=False)
    assert keys.key_prefix() == "critique"
    assert keys.run_key("r1", keys.BUDGET) == "critique:{r1}:budget"
    monkeypatch.setenv(settings.KEY_PREFIX.name, "staging")
    assert keys.run_key("r1", keys.BUDGET) == "staging:{r1}:budget"
    assert keys.blob_key("ab" * 32) == f"staging:blob:{'ab' * 32}"


@pytest.mark.parametrize("bad", ["a{b", "x*", "with space", "q?"])
def test_bad_prefix_is_a_config_error(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    """A prefix that would break hash tags or SCAN patterns is refused, naming the env var."""
    monkeypatch.setenv(settings.KEY_PREFIX.name, bad)
    with pytest.raises(ConfigError) as err:
        keys.key_prefix()
    assert err.value.key == settings.KEY_PREFIX.name


def test_run_ttl_defaults_to_seven_days(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CRITIQUE_RUN_TTL_S a run's keys live 7 days; the env var overrides it."""
    monkeypatch.delenv(settings.RUN_TTL_S.name, raising=False)
    assert keys.run_ttl_s() == 7 * 24 * 3600
    monkeypatch.setenv(settings.RUN_TTL_S.name, "60")
    assert keys.run_ttl_s() == 60


@pytest.mark.parametrize("bad", ["0", "-5", "soon", "1.5"])
def test_bad_run_ttl_is_a_config_error(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    """A TTL that is not a positive integer of seconds is refused, naming the env var."""
    monkeypatch.setenv(settings.RUN_TTL_S.name, bad)
    with pytest.raises(ConfigError) as err:
        keys.run_ttl_s()
    assert err.value.key == settings.RUN_TTL_S.name


def test_scan_pattern_matches_only_that_run() -> None:
    """The SCAN pattern for a run covers its keys and not another run's."""
    pattern = keys.run_key_pattern("r1", "critique")
    assert fnmatchcase(keys.run_key("r1", keys.TRACE, "critique"), pattern)
    assert not fnmatchcase(keys.run_key("r10", keys.TRACE, "critique"), pattern)


def test_queue_and_task_names_are_stable() -> None:
    """Managers in any language enqueue by these names (docs/entry.md); they must not drift."""
    assert (keys.QUEUE_CPU, keys.QUEUE_LLM) == ("critique.cpu", "critique.llm")
    assert [
        keys.TASK_L0,
        keys.TASK_CRITIC,
        keys.TASK_DECIDE,
        keys.TASK_REPAIR,
        keys.TASK_GATE,
        keys.TASK_COMPLETE_GATE,
    ] == [
        "critique.l0",
        "critique.critic",
        "critique.decide",
        "critique.repair",
        "critique.gate",
        "critique.complete_gate",
    ]
