"""What every framework adapter shares (workers/adapters/verdicts.py), without any framework:
ids the fleet accepts, the mode's configuration, outputs to submissions and back, which
candidate the fleet kept, and one asyncio client per event loop."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pydantic
import pytest

from pipeline.errors import ConfigError
from pipeline.models import CritiqueEnvelope, CritiqueResult
from workers.aclient import AsyncCritiqueClient
from workers.adapters import verdicts


class Report(pydantic.BaseModel):
    summary: str
    rows: int


@dataclasses.dataclass
class Note:
    text: str


def _result(output: Any, status: str = "accepted") -> CritiqueResult:
    return CritiqueResult(
        run_id="r1",
        worker_id="w1",
        status=status,
        stop_reason="accepted",
        output=output,
        original_score=0.9,
        best_score=0.9,
        envelope=CritiqueEnvelope(worker_id="w1", score=0.9, summary="ok"),
    )


def test_ids_are_made_safe_for_the_fleet() -> None:
    """Names with other characters become fleet ids; nothing left gives the fallback; ≤ 128."""
    assert verdicts.identifier("awp-2026-12-06_00:00:39 x", "r") == "awp-2026-12-06_00-00-39-x"
    assert verdicts.identifier("../..", "fallback") == "fallback"
    assert verdicts.identifier("a..b", "f") == "a.b"
    assert len(verdicts.identifier("w" * 300, "w")) == 128


def test_verdict_mode_asks_the_worker_to_repair_and_repair_mode_refuses_it() -> None:
    """Verdict mode adds ``repairer: worker`` (without touching the caller's dict); repair mode
    with it, or an unknown mode, is a ValueError that names the fix."""
    given = {"budget": {"total_tokens": 1000}}
    assert verdicts.door_config("verdict", given) == {**given, "repairer": "worker"}
    assert "repairer" not in given
    assert verdicts.door_config("repair", None) == {}
    with pytest.raises(ValueError, match="mode='verdict'"):
        verdicts.door_config("repair", {"repairer": "worker"})
    with pytest.raises(ValueError, match="'verdict'"):
        verdicts.door_config("fix", None)


def test_outputs_become_payloads_and_come_back_in_their_own_type() -> None:
    """Text stays text; a Pydantic model or dataclass is submitted as its JSON object and the
    fleet's output (object or JSON text) is parsed back into the worker's class."""
    assert verdicts.as_payload("plain") == "plain"
    assert verdicts.as_payload(Report(summary="s", rows=2)) == {"summary": "s", "rows": 2}
    assert verdicts.as_payload(Note("n")) == {"text": "n"}
    assert verdicts.as_payload([1, 2]) == "[1, 2]"
    assert verdicts.as_output({"summary": "t", "rows": 3}, Report(summary="s", rows=2)) == Report(
        summary="t", rows=3
    )
    assert verdicts.as_output('{"text": "m"}', Note("n")) == Note("m")
    assert verdicts.as_output({"a": 1}, "text") == '{"a": 1}'
    assert verdicts.as_text(Report(summary="s", rows=2)) == '{"summary": "s", "rows": 2}'


def test_the_kept_candidate_is_the_workers_own_object_or_none_when_the_fleet_changed_it() -> None:
    """Keep-best names one of the submitted candidates; a repaired output matches none."""
    first, second = Report(summary="a", rows=1), Report(summary="b", rows=2)
    assert verdicts.kept_candidate(_result({"rows": 1, "summary": "a"}), [first, second]) is first
    assert verdicts.kept_candidate(_result({"summary": "c", "rows": 3}), [first, second]) is None
    assert verdicts.kept_candidate(_result("x"), []) is None


def test_an_error_is_told_in_its_first_line() -> None:
    """The first line of an error's text, or its class name when it has none."""
    assert verdicts.first_line(RuntimeError("redis down\ntrace")) == "redis down"
    assert verdicts.first_line(TimeoutError()) == "TimeoutError"


def test_each_event_loop_gets_its_own_client_and_a_given_one_is_always_used() -> None:
    """A client's connections belong to one loop: two loops, two clients; the first is made
    at construction (a bad configuration fails there); a given client is used everywhere."""
    clients = verdicts.LoopClients({}, None)

    async def take() -> Any:
        client = clients.get()
        assert clients.get() is client
        await clients.aclose()
        return client

    assert asyncio.run(take()) is not asyncio.run(take())
    with pytest.raises(ConfigError, match="max_repair_attempts"):
        verdicts.LoopClients({"max_repair_attempts": "many"}, None)
    given = AsyncCritiqueClient({})

    async def take_given() -> Any:
        return verdicts.LoopClients({}, given).get()

    assert asyncio.run(take_given()) is given


def test_kept_verdicts_hold_the_latest_and_drop_the_oldest() -> None:
    """A verdict kept again moves to the newest; past the limit the oldest goes; a verdict
    without a result is never checked."""
    kept = verdicts.KeptVerdicts(2)
    kept.keep("a", verdicts.Verdict("accepted", "ok", _result("x")))
    kept.keep("b", verdicts.Verdict("unchecked", "fleet down"))
    kept.keep("a", verdicts.Verdict("repaired", "ok", _result("y")))
    kept.keep("c", verdicts.Verdict("accepted", "ok", _result("z")))
    assert list(kept) == ["a", "c"]
    assert kept["a"].status == "repaired" and kept["a"].checked
    assert not verdicts.Verdict("unchecked", "fleet down").checked
