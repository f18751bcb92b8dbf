"""Reads that ride through a store outage (workers/riding.py): retried with backoff while the
store says "not now", reported once with how long it was away, never retried for other errors,
and a followed stream resumed after its last entry."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pipeline.errors import StoreUnavailableError, SubmissionError
from workers import riding

AWAY = StoreUnavailableError("cannot reach Redis at redis://127.0.0.1:1/0", hint="start Redis")


def test_a_read_is_retried_until_the_store_answers() -> None:
    """Three failed reads, then the answer: the caller sees only the answer."""
    calls = []

    def read() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise AWAY
        return "result"

    assert riding.ride(read, deadline=time.monotonic() + 5) == "result"
    assert len(calls) == 4


def test_an_outage_past_the_deadline_is_one_error_saying_for_how_long() -> None:
    """The store's own line and hint, how long it was away, and why retrying stopped."""

    def read() -> str:
        raise AWAY

    began = time.monotonic()
    with pytest.raises(StoreUnavailableError) as caught:
        riding.ride(read, deadline=began + 0.3)
    assert 0.3 <= time.monotonic() - began < 1.5
    err = caught.value
    assert err.message.startswith("cannot reach Redis at redis://127.0.0.1:1/0; unreachable for 0.")
    assert "until the read's deadline" in err.message and err.hint == "start Redis"


def test_without_a_deadline_the_window_is_critique_outage_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read with no deadline of its own rides out CRITIQUE_OUTAGE_S (at least 1 s)."""
    monkeypatch.setenv("CRITIQUE_OUTAGE_S", "0.2")
    assert riding.outage_s() == 1.0
    monkeypatch.setenv("CRITIQUE_OUTAGE_S", "7.5")
    assert riding.outage_s() == 7.5
    monkeypatch.setenv("CRITIQUE_OUTAGE_S", "soon")
    assert riding.outage_s() == riding.DEFAULT_OUTAGE_S


def test_other_errors_are_raised_at_once() -> None:
    """A recorded failure or a bad record is no outage: never retried."""
    calls = []

    def read() -> str:
        calls.append(1)
        raise SubmissionError("refused by the worker")

    with pytest.raises(SubmissionError):
        riding.ride(read, deadline=time.monotonic() + 5)
    assert len(calls) == 1


def test_backoff_doubles_to_a_second_with_jitter_and_restarts_per_outage() -> None:
    """50 ms doubling to 1 s (each jittered down by at most half); a new outage starts at
    50 ms again and is counted as another episode."""
    now = [0.0]
    outage = riding.Outage(clock=lambda: now[0])
    pauses = [outage.failed(AWAY) for _ in range(8)]
    caps = [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert all(cap / 2 <= p <= cap for p, cap in zip(pauses, caps, strict=True))
    now[0] = 4.0
    assert outage.down_s == 4.0
    outage.ok()
    assert outage.down_s == 0.0 and outage.last is None
    assert outage.failed(AWAY) <= 0.05 and outage.episodes == 2


def test_a_followed_stream_resumes_after_its_last_entry() -> None:
    """An outage mid-stream: the stream is started again after the last entry yielded, so no
    entry comes twice and none is skipped."""
    starts: list[str] = []
    entries = [("1-0", "a"), ("2-0", "b"), ("3-0", "c")]

    def start(after: str) -> Iterator[tuple[str, str]]:
        starts.append(after)
        for entry_id, item in entries:
            if entry_id <= after:
                continue
            if len(starts) == 1 and entry_id == "3-0":
                raise AWAY
            yield entry_id, item

    assert [item for _, item in riding.ride_iter(start)] == ["a", "b", "c"]
    assert starts == ["0-0", "2-0"]
