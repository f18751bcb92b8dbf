"""The proof that a chain is lost and the orphan rule (``workers.recovery``): the pure rules on
their own, then the broker view they read, on a private Redis through kombu's own transport
(and what the RabbitMQ census keeps in the store); and the threads pool that no longer leaves a
request held forever."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.support.servers import RedisServer
from workers.recovery.base import LOST_GRACE_S, LOST_MARGIN_S, Snapshot
from workers.recovery.redriving import drained_for_proof, judge
from workers.recovery.sweeper import orphans
from workers.recovery.transport import HeldReport, RedisBroker

PASS = "1:w1:sid1"
Q = "critique.cpu"


def _snap(at: float, *pass_ids: str) -> Snapshot:
    return Snapshot(frozenset(pass_ids), at, at + 0.01)


def test_a_pass_with_an_unacknowledged_message_is_alive() -> None:
    """A message of the pass (matched by its pass id) among the unacknowledged ones: alive,
    however old its progress and whatever was suspected before."""
    assert judge(PASS, 100.0, (100.0, 110.0), _snap(500.0, "sid1")) == "alive"


def test_a_pass_is_suspected_then_confirmed_only_with_the_same_progress() -> None:
    """No message seen: too young within the margin; then a suspect (recorded with the
    snapshot's end); a second look at least the grace later with the same progress asks to
    confirm; sooner it waits; a pass that progressed since is a new suspect."""
    assert judge(PASS, 100.0, None, _snap(100.0 + LOST_MARGIN_S / 2)) == "young"
    assert judge(PASS, 100.0, None, _snap(105.0, "other")) == "suspect"
    assert judge(PASS, 100.0, (100.0, 105.0), _snap(105.0 + LOST_GRACE_S / 2)) == "wait"
    assert judge(PASS, 100.0, (100.0, 105.0), _snap(105.0 + LOST_GRACE_S)) == "confirm"
    assert judge(PASS, 120.0, (100.0, 105.0), _snap(130.0)) == "suspect"


def test_the_queue_proves_only_once_drained_past_the_suspicion_a_grace_ago(
    redis_server: RedisServer,
) -> None:
    """drained_for_proof: never on a queue without probes; a probe sent before the suspicion
    proves nothing; one sent after it proves once it ran at least the grace before the read."""
    from pipeline.store.pending import RedisPendingIndex
    from workers.recovery.redriving import DrainView

    pending = RedisPendingIndex(redis.Redis.from_url(redis_server.url(0)))
    assert not drained_for_proof(DrainView(pending), Q, 100.0, 200.0)
    pending.probe_due(Q, 99.0, 1, 3)
    pending.probe_done(Q, 99.0, 99.5)
    assert not drained_for_proof(DrainView(pending), Q, 100.0, 200.0)
    pending.probe_due(Q, 101.0, 1, 3)
    pending.probe_done(Q, 101.0, 150.0)
    assert not drained_for_proof(DrainView(pending), Q, 100.0, 150.0 + LOST_GRACE_S / 2)
    assert drained_for_proof(DrainView(pending), Q, 100.0, 150.0 + LOST_GRACE_S)


def _report(at: float, *tags: str, every: float = 1.0) -> HeldReport:
    return HeldReport(at, every, frozenset(tags))


def test_an_orphan_is_a_message_no_live_worker_reported_after_its_delivery() -> None:
    """orphans: a message held by a live worker is none; one a live worker reported without
    (a grace after its delivery) is one; one delivered after the oldest live report (minus the
    grace) is not yet; a dead worker's report holds nothing; with no live report, nothing."""
    now = 1000.0
    unacked = {"held": 900.0, "dropped": 900.0, "fresh": 998.0, "dead": 900.0}
    reports = {
        "a": _report(999.0, "held"),
        "b": _report(999.5),
        "gone": _report(now - 3 * 1.0 - LOST_GRACE_S - 1, "dead"),
    }
    assert orphans(unacked, reports, now) == {"dropped": 900.0, "dead": 900.0}
    assert orphans(unacked, {"gone": reports["gone"]}, now) == {}
    assert orphans(unacked, {}, now) == {}


def test_a_worker_report_lives_three_intervals_and_the_grace() -> None:
    """HeldReport.live: three missed reports plus the grace, no longer."""
    rep = _report(100.0, every=5.0)
    assert rep.live(100.0 + 15.0 + LOST_GRACE_S)
    assert not rep.live(100.0 + 15.0 + LOST_GRACE_S + 0.01)


@pytest.fixture
def channel(redis_server: RedisServer) -> Iterator[Any]:
    """A kombu channel on the private Redis through the workers' guarded transport."""
    from kombu import Connection

    import workers.tasks  # noqa: F401  (registers the stage tasks the door admits)
    from workers.recovery.transport import RedisTransport

    conn = Connection(redis_server.url(0), transport=RedisTransport)
    try:
        yield conn.channel()
    finally:
        conn.release()


def _take_unacked(channel: Any, body: Any, task: str = "critique.l0") -> Any:
    """Push ``body`` (``[args, kwargs, embed]``) as a Celery protocol-2 message of ``task`` onto
    :data:`Q` and take it without acking, as a worker does (through the door, which admits
    only well-formed messages of the product's tasks; kombu writes it to ``unacked``)."""
    import uuid

    from tests.support.rawcelery import protocol2

    channel.client.lpush(Q, protocol2(task, uuid.uuid4().hex, body[0], queue=Q))
    message = channel.basic_get(Q, no_ack=False)
    assert message is not None
    return message


def test_the_broker_view_finds_the_pass_of_an_unacknowledged_message_and_restores_it(
    channel: Any, redis_server: RedisServer
) -> None:
    """RedisBroker reads kombu's unacked index (tag, delivery time) and the pass id of a
    stage message in it; restore puts the message back at the head of its queue, marked
    redelivered, and out of ``unacked``; a second restore of the same tag pushes nothing."""
    message = _take_unacked(channel, [[{"v": 1, "sid": "sid1", "state": "{}"}], {}, {}])
    broker = RedisBroker(channel.connection.client, channel)
    tag = str(message.delivery_tag)
    unacked = broker.unacked()
    assert list(unacked) == [tag] and abs(unacked[tag] - time.time()) < 60
    assert broker.snapshot().pass_ids == {"sid1"}
    broker.restore(tag)
    broker.restore(tag)
    r = redis.Redis.from_url(redis_server.url(0))
    assert r.llen(Q) == 1 and broker.unacked() == {}
    assert broker.snapshot().pass_ids == frozenset()
    payload = json.loads(r.lindex(Q, 0) or b"{}")
    assert payload["properties"]["delivery_info"]["redelivered"] is True


def test_the_broker_view_ignores_messages_that_are_not_stage_messages(channel: Any) -> None:
    """A probe's arguments (no pass id) and an unreadable body give no pass id."""
    _take_unacked(channel, [["critique.cpu", 1.0], {}, {}], task="critique.probe")
    assert RedisBroker(channel.connection.client, channel).snapshot().pass_ids == frozenset()


def test_workers_report_what_they_hold_and_gone_ones_are_forgotten(
    channel: Any, redis_server: RedisServer
) -> None:
    """report/reports/withdraw round-trip beside kombu's keys (under its unacked key's name);
    a report ten minutes old is deleted when read; a malformed one too."""
    broker = RedisBroker(channel.connection.client, channel)
    now = time.time()
    broker.report("w1", now, 1.0, frozenset({"t1"}))
    broker.report("w2", now - 700.0, 1.0, frozenset())
    r = redis.Redis.from_url(redis_server.url(0))
    r.hset("unacked.critique.holders", "junk", "not json")
    assert broker.reports(now) == {"w1": HeldReport(now, 1.0, frozenset({"t1"}))}
    assert set(r.hkeys("unacked.critique.holders")) == {b"w1"}
    broker.withdraw("w1")
    assert broker.reports(now) == {}


def test_the_census_store_keeps_reports_and_quiet_queues_per_vhost(
    redis_server: RedisServer,
) -> None:
    """RabbitMQ's census in the store (``CensusStore``): reports round-trip (a stopped one too),
    a report ten minutes old and a malformed one are deleted when read, each census's quiet
    queues are found again by its exact time (none for a time never recorded), another vhost's
    reports are apart, and every key shares one hash tag (one cluster slot)."""
    from workers.recovery.census import CensusStore, ConsumerReport, broker_id

    r = redis.Redis.from_url(redis_server.url(0))
    store = CensusStore(r, broker_id("/critique"))
    now = time.time()
    rep = ConsumerReport(now, 5.0, now - 9.0, now - 8.0, frozenset({Q}), frozenset({"sid1"}))
    gone = ConsumerReport(now, 5.0, now - 9.0, None, frozenset({Q}), stopped=True)
    store.report("w1", rep)
    store.report("w2", gone)
    store.report("old", ConsumerReport(now - 700.0, 5.0, now - 800.0, None))
    key = next(k.decode() for k in r.keys("*reports"))
    r.hset(key, "junk", "not json")
    assert store.reports(now) == {"w1": rep, "w2": gone}
    assert set(r.hkeys(key)) == {b"w1", b"w2"}
    assert CensusStore(r, broker_id("/other")).reports(now) == {}
    store.record_quiet(now, [Q, "critique.llm"])
    store.record_quiet(now + 0.5, [])
    assert store.quiet_at(now) == {Q, "critique.llm"}
    assert store.quiet_at(now + 0.5) == frozenset()
    assert store.quiet_at(now + 0.25) == frozenset()
    tags = {k.decode().split("{")[1].split("}")[0] for k in r.keys("critique:amqp:*")}
    assert tags == {broker_id("/critique")}


def test_an_orphan_is_restored_on_the_second_tick_that_finds_it(channel: Any) -> None:
    """SweeperThread.restore_orphans: a message no live worker holds is restored only when two
    ticks in a row found it (an acknowledgement in flight is never taken for an orphan), and a
    message held by a live worker never is."""
    from workers.recovery.sweeper import SweeperThread

    orphan = str(_take_unacked(channel, [[{"sid": "a"}], {}, {}]).delivery_tag)
    held = str(_take_unacked(channel, [[{"sid": "b"}], {}, {}]).delivery_tag)
    broker = RedisBroker(channel.connection.client, channel)
    thread = SweeperThread([Q], 1.0, "test")
    later = time.time() + LOST_GRACE_S + 1
    broker.report("other", later, 1.0, frozenset({held}))
    assert thread.restore_orphans(broker, later) == 0
    assert set(broker.unacked()) == {orphan, held}
    assert thread.restore_orphans(broker, later + 0.5) == 1
    assert set(broker.unacked()) == {held}


def test_a_worker_reports_the_delivery_tags_of_the_requests_it_holds() -> None:
    """held_tags reads Celery's worker state: every request it tracks, by its message's
    delivery tag."""
    from types import SimpleNamespace

    from celery.worker import state

    from workers.recovery.sweeper import held_tags

    request = SimpleNamespace(message=SimpleNamespace(delivery_tag="tag-1"))
    state.requests["task-1"] = request
    try:
        assert "tag-1" in held_tags()
    finally:
        state.requests.pop("task-1", None)
    assert "tag-1" not in held_tags()


def test_the_threads_pool_ends_a_request_whose_error_escaped_the_task_body() -> None:
    """ThreadPool (``-P threads``): an error raised outside a task's body (a result-backend
    write during a Redis outage) reaches the request's error callback as a lost worker (so the
    message is requeued), where Celery's threads pool dropped it and the request stayed held;
    a target that returns still reaches the success callback."""
    import threading

    from billiard.exceptions import WorkerLostError

    from workers.recovery.transport import ThreadPool

    got: list[Any] = []
    done = threading.Event()

    def record(kind: str) -> Any:
        def callback(value: Any) -> None:
            got.append((kind, value))
            done.set()

        return callback

    def broken() -> None:
        raise redis.exceptions.ConnectionError("Connection closed by server.")

    pool = ThreadPool(limit=1)
    pool.start()
    try:
        pool.apply_async(broken, callback=record("ok"), error_callback=record("error"))
        assert done.wait(10)
        done.clear()
        pool.apply_async(lambda: "value", callback=record("ok"), error_callback=record("error"))
        assert done.wait(10)
    finally:
        pool.stop()
    (kind, info), second = got
    exc = getattr(info.exception, "exc", info.exception)  # as Request.on_failure unwraps it
    assert kind == "error" and isinstance(exc, WorkerLostError)
    assert "Connection closed by server" in str(exc)
    assert second == ("ok", "value")
