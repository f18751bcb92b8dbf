"""A finished pass is announced on its run's ``done`` channel (issue 39: a short path to a
verdict), and the client's waits wake on the announcement instead of at their next poll. The
store writes here stand in for a gate (no worker: what is tested is the announcement and the
wait); a real Redis, its real pub/sub. An announcement is a hint only: it never becomes a
verdict, and a lost one costs a poll interval."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pipeline.models import CritiqueEnvelope, CritiqueResult, PassRef
from pipeline.store import keys
from pipeline.store.runs import announces
from tests.support.workers import client_on, worker_db_url

pytestmark = pytest.mark.integration

CONFIG: dict[str, Any] = {"enabled": True}
SLOW_BACKSTOP_S = 30.0
"""The backstop poll raised far above every bound below: a wait that returns sooner was woken
by the announcement, not by a poll."""


@pytest.fixture
def env(redis_url: str) -> Iterator[dict[str, str]]:
    with client_on(worker_db_url(redis_url)) as e:
        yield e


def _run_id() -> str:
    return f"done-{uuid.uuid4().hex[:8]}"


def _result(run_id: str, worker_id: str, pass_id: str) -> CritiqueResult:
    return CritiqueResult(
        run_id=run_id,
        worker_id=worker_id,
        status="accepted",
        stop_reason="accepted",
        output="ok",
        original_score=0.9,
        best_score=0.9,
        envelope=CritiqueEnvelope(worker_id=worker_id, score=0.9),
        pass_id=pass_id,
    )


def _later(seconds: float, action: Any) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_announces_matches_its_submission_only() -> None:
    """A pass member or a plain field names its submission; a worker id that merely starts
    the same does not match."""
    assert announces("1:w1:p9", 1, "w1")
    assert announces("1:w1", 1, "w1")
    assert not announces("1:w10:p9", 1, "w1")
    assert not announces("2:w1:p9", 1, "w1")


def test_a_result_and_a_failure_are_announced_and_a_repeat_is_not(env: dict[str, str]) -> None:
    """put_result with a pass (the script), without one (the pipeline) and put_failure each
    publish the member they wrote; a repeated put_result writes and announces nothing."""
    from workers import runtime

    runs = runtime.stores().runs
    run_id = _run_id()
    with runs.listen(run_id) as listener:
        assert listener.listening
        runs.begin_pass(run_id, 1, "w1", "p1")
        assert runs.put_result(_result(run_id, "w1", "p1"), pass_id="p1") is True
        assert listener.wait(5.0) == {(run_id, "1:w1:p1")}
        assert runs.put_result(_result(run_id, "w1", "p1"), pass_id="p1") is False
        assert listener.wait(0.3) == set()
        runs.put_result(_result(run_id, "w2", ""))
        assert listener.wait(5.0) == {(run_id, "1:w2")}
        runs.put_failure(
            run_id,
            PassRef(run_id, 1, "w3", "p3").member,
            stage="l0",
            error="E",
            reason="r",
            refused=False,
        )
        assert listener.wait(5.0) == {(run_id, "1:w3:p3")}


def test_a_wait_returns_on_the_announcement_not_at_its_next_poll(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the backstop poll at 30 s, a result stored 0.5 s into the wait is returned within
    a few seconds after three reads of the store: the announcement woke the wait."""
    from workers import client as client_mod
    from workers import runtime

    monkeypatch.setattr(client_mod, "BACKSTOP_POLL_S", SLOW_BACKSTOP_S)
    runs = runtime.stores().runs
    run_id = _run_id()
    runs.begin_pass(run_id, 1, "w1", "p1")
    handle = client_mod.Handle(run_id, 1, "w1", "task-1", "p1")
    client = client_mod.CritiqueClient(CONFIG)
    reads = []
    read = client._outcome
    monkeypatch.setattr(client, "_outcome", lambda h: reads.append(h) or read(h))
    _later(0.5, lambda: runs.put_result(_result(run_id, "w1", "p1"), pass_id="p1"))
    began = time.monotonic()
    got = client.wait(handle, timeout=20)
    assert got.pass_id == "p1" and got.status == "accepted"
    assert time.monotonic() - began < 10
    # Before the result: one read, then one once subscribed; then one on its announcement.
    assert len(reads) == 3


def test_a_forged_announcement_wakes_a_wait_but_is_no_verdict(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anyone who can publish can wake a wait: it reads the store, finds nothing and waits on
    until its timeout; bytes that are not UTF-8 on the channel do not break it."""
    from workers import client as client_mod
    from workers import runtime

    monkeypatch.setattr(client_mod, "BACKSTOP_POLL_S", SLOW_BACKSTOP_S)
    run_id = _run_id()
    runtime.stores().runs.begin_pass(run_id, 1, "w1", "p1")
    handle = client_mod.Handle(run_id, 1, "w1", "task-1", "p1")
    channel = keys.run_key(run_id, keys.DONE)
    publisher = redis.Redis.from_url(env["REDIS_URL"])
    for at, what in ((0.3, b"1:w1:p1"), (0.6, b"\xff\xfe\x00garbage"), (0.9, b"1:w1:p1")):
        _later(at, lambda what=what: publisher.publish(channel, what))
    with pytest.raises(client_mod.CritiqueTimeout):
        client_mod.CritiqueClient(CONFIG).wait(handle, timeout=1.5)
    publisher.close()


def test_a_wait_whose_subscription_is_killed_still_gets_its_result(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CLIENT KILL TYPE pubsub`` mid-wait (what a reconnect does to a subscription): the wait
    reads at once, subscribes again and returns the result stored after the kill, long before
    the 30 s backstop."""
    from workers import client as client_mod
    from workers import runtime

    monkeypatch.setattr(client_mod, "BACKSTOP_POLL_S", SLOW_BACKSTOP_S)
    runs = runtime.stores().runs
    run_id = _run_id()
    runs.begin_pass(run_id, 1, "w1", "p1")
    handle = client_mod.Handle(run_id, 1, "w1", "task-1", "p1")
    admin = redis.Redis.from_url(env["REDIS_URL"])
    _later(0.4, lambda: admin.client_kill_filter(_type="pubsub"))
    _later(1.0, lambda: runs.put_result(_result(run_id, "w1", "p1"), pass_id="p1"))
    began = time.monotonic()
    got = client_mod.CritiqueClient(CONFIG).wait(handle, timeout=20)
    assert got.pass_id == "p1"
    assert time.monotonic() - began < 10
    admin.close()


def test_as_completed_yields_each_announced_result_without_a_full_round(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three handles over two runs, results stored 0.3 s apart: each is yielded well before
    the 30 s backstop round, and once."""
    from workers import client as client_mod
    from workers import runtime

    monkeypatch.setattr(client_mod, "BACKSTOP_POLL_S", SLOW_BACKSTOP_S)
    runs = runtime.stores().runs
    a, b = _run_id(), _run_id()
    handles = []
    for run_id, worker in ((a, "w1"), (a, "w2"), (b, "w1")):
        runs.begin_pass(run_id, 1, worker, f"p-{worker}")
        handles.append(client_mod.Handle(run_id, 1, worker, "t", f"p-{worker}"))
    for i, h in enumerate(handles):
        _later(
            0.3 * (i + 1),
            lambda h=h: runs.put_result(
                _result(h.run_id, h.worker_id, h.pass_id), pass_id=h.pass_id
            ),
        )
    began = time.monotonic()
    got = list(client_mod.CritiqueClient(CONFIG).as_completed(handles, timeout=20))
    assert time.monotonic() - began < 10
    assert sorted((h.run_id, h.worker_id) for h, _ in got) == sorted(
        (h.run_id, h.worker_id) for h in handles
    )


def test_a_wait_for_a_verdict_already_stored_reads_once_and_subscribes_to_nothing(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manager waiting on handles in turn meets many that are done: each such wait is one
    read, no subscription."""
    from pipeline.store.runs import RedisRunStore
    from workers import client as client_mod
    from workers import runtime

    runs = runtime.stores().runs
    run_id = _run_id()
    runs.begin_pass(run_id, 1, "w1", "p1")
    runs.put_result(_result(run_id, "w1", "p1"), pass_id="p1")
    listens: list[tuple[str, ...]] = []
    listen = RedisRunStore.listen
    monkeypatch.setattr(
        RedisRunStore, "listen", lambda self, *r: listens.append(r) or listen(self, *r)
    )
    handle = client_mod.Handle(run_id, 1, "w1", "task-1", "p1")
    assert client_mod.CritiqueClient(CONFIG).wait(handle, timeout=5).pass_id == "p1"
    assert listens == []


def test_garbage_bytes_on_the_channel_neither_raise_nor_stop_a_wait(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes that are no UTF-8 published on the run's channel: the listener returns them as a
    member that matches no handle, and the wait still gets its result on the announcement."""
    from workers import client as client_mod
    from workers import runtime

    monkeypatch.setattr(client_mod, "BACKSTOP_POLL_S", SLOW_BACKSTOP_S)
    runs = runtime.stores().runs
    run_id = _run_id()
    channel = keys.run_key(run_id, keys.DONE)
    publisher = redis.Redis.from_url(env["REDIS_URL"])
    with runs.listen(run_id) as listener:
        publisher.publish(channel, b"\xff\xfe\x80")
        [(got_run, member)] = listener.wait(5.0)
        assert got_run == run_id and not announces(member, 1, "w1")
        assert listener.listening
    runs.begin_pass(run_id, 1, "w1", "p1")
    handle = client_mod.Handle(run_id, 1, "w1", "task-1", "p1")
    _later(0.3, lambda: publisher.publish(channel, b"\xc3\x28"))
    _later(0.6, lambda: runs.put_result(_result(run_id, "w1", "p1"), pass_id="p1"))
    began = time.monotonic()
    assert client_mod.CritiqueClient(CONFIG).wait(handle, timeout=20).pass_id == "p1"
    assert time.monotonic() - began < 10
    publisher.close()
