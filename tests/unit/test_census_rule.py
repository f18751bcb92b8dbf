"""The lost-chain proof on RabbitMQ (``workers.recovery.census``): the census rule on its own, and
the worker's side of it (what it reports, and since when its consumer holds its messages
steadily). Pure: no broker, no Redis, no worker."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from workers.recovery.base import LOST_GRACE_S, LOST_MARGIN_S
from workers.recovery.census import Census, ConsumerReport, QueueCount, judge_census
from workers.recovery.transport import ConsumerState

PASS = "1:w1:sid1"
Q = "critique.cpu"
G = LOST_GRACE_S


def _rep(
    at: float,
    *held: str,
    since: float | None = 0.0,
    started: float = 0.0,
    every: float = 5.0,
    queues: tuple[str, ...] = (Q,),
    stopped: bool = False,
) -> ConsumerReport:
    return ConsumerReport(
        at, every, started, since, frozenset(queues), frozenset(held), stopped=stopped
    )


def _census(
    at: float, reports: dict[str, ConsumerReport], ready: int = 0, consumers: int | None = None
) -> Census:
    if consumers is None:
        consumers = sum(1 for r in reports.values() if r.live(at) and r.consumes(Q))
    return Census(reports, {Q: QueueCount(ready, consumers)}, at)


# --- quiet queues -------------------------------------------------------------------------------


def test_a_queue_is_quiet_only_with_nothing_ready_and_every_consumer_accounted_for() -> None:
    """Quiet: nothing ready and as many consumers as live workers say they have. A backlog
    (ready messages), a consumer no live report accounts for (a worker of an older version, a
    dead host's connection RabbitMQ has not closed yet), or a consumer fewer (a worker whose
    connection RabbitMQ closed before it noticed) is not; nor is a queue that does not exist."""
    reps = {"a": _rep(100.0), "b": _rep(99.0)}
    assert _census(100.0, reps).quiet() == {Q}
    assert _census(100.0, reps, ready=1).quiet() == frozenset()
    assert _census(100.0, reps, consumers=3).quiet() == frozenset()
    assert _census(100.0, reps, consumers=1).quiet() == frozenset()
    assert Census(reps, {}, 100.0).quiet() == frozenset()


def test_only_live_connected_workers_account_for_a_consumer() -> None:
    """A worker whose consumer is away (``since`` None: reconnecting), one that stopped, one
    silent past three intervals and a grace, and one that does not consume the queue account
    for no consumer; a dead worker's held passes are held by nobody."""
    reps = {
        "reconnecting": _rep(100.0, since=None),
        "stopped": _rep(100.0, stopped=True),
        "silent": _rep(100.0 - 3 * 5.0 - G - 0.1, "sid1"),
        "elsewhere": _rep(100.0, queues=("critique.llm",)),
    }
    census = _census(100.0, reps, consumers=0)
    assert census.quiet() == {Q}
    assert census.held() == frozenset()
    assert _census(100.0, reps, consumers=1).quiet() == frozenset()


# --- the rule -------------------------------------------------------------------------------------


def test_a_pass_a_live_worker_holds_is_alive_whatever_else_holds() -> None:
    """A live report naming the pass id: alive, however old its progress, busy or quiet the
    queue, and whatever was suspected before."""
    reps = {"a": _rep(500.0, "sid1"), "b": _rep(500.0)}
    for ready in (0, 5):
        census = _census(500.0, reps, ready=ready)
        assert judge_census(PASS, 10.0, (10.0, 100.0), census) == "alive"


def test_nothing_is_said_of_a_pass_younger_than_the_reports() -> None:
    """Progress within the margin, or a live report made less than the grace after the
    progress (a stage that recorded then and still publishes its successor holds its own
    message, which that report may predate): young, never a suspect."""
    reps = {"a": _rep(200.0)}
    assert judge_census(PASS, 200.0 - LOST_MARGIN_S / 2, None, _census(200.0, reps)) == "young"
    reps = {"a": _rep(110.0), "b": _rep(100.0 + G / 2)}
    assert judge_census(PASS, 100.0, None, _census(110.0, reps)) == "young"
    reps = {"a": _rep(110.0), "b": _rep(100.0 + G)}
    assert judge_census(PASS, 100.0, None, _census(110.0, reps)) == "suspect"


def test_a_pass_is_suspected_only_while_a_queue_is_quiet() -> None:
    """Held by nobody, but the queue has ready messages (a backlog) or an unaccounted consumer:
    no suspicion (nothing kept). With a quiet queue: a suspect, recorded with the census time."""
    reps = {"a": _rep(200.0)}
    assert judge_census(PASS, 100.0, None, _census(200.0, reps, ready=3)) == "young"
    assert judge_census(PASS, 100.0, None, _census(200.0, reps, consumers=2)) == "young"
    assert judge_census(PASS, 100.0, None, _census(200.0, reps)) == "suspect"


def test_a_suspect_is_confirmed_once_every_consumer_reported_steadily_past_it() -> None:
    """Suspected at t=200: confirmed at a later census once every worker that may have been
    consuming at t reported again at least the grace after t, steady (connected, nothing
    requeued) since at least the grace before t; before those reports it waits, even with a
    busy queue now (the suspicion holds: nothing was anywhere at t)."""
    prior = (100.0, 200.0)
    early = {"a": _rep(200.0 + G / 2, since=150.0), "b": _rep(200.0 + G, since=150.0)}
    assert judge_census(PASS, 100.0, prior, _census(205.0, early, ready=4)) == "wait"
    later = {"a": _rep(200.0 + G, since=200.0 - G), "b": _rep(204.0, since=10.0)}
    assert judge_census(PASS, 100.0, prior, _census(205.0, later, ready=4)) == "confirm"


def test_a_suspicion_is_worth_nothing_once_a_consumer_moved_messages_across_it() -> None:
    """A worker that reconnected or requeued a message after the grace before t (its ``since``
    later), one whose consumer is away now, one that stopped, or one that went silent since
    (it may have held the message; RabbitMQ may have moved it): that suspicion is never
    confirmed; the pass is suspected afresh at this census if a queue is quiet, else dropped."""
    prior = (100.0, 200.0)
    for bad in (
        _rep(210.0, since=200.0 - G / 2),
        _rep(210.0, since=None),
        _rep(210.0, stopped=True),
        _rep(199.0),  # live at t, silent now
    ):
        reps = {"a": _rep(210.0), "b": bad}
        census = _census(199.0 + 3 * 5.0 + G + 1.0, reps)
        assert judge_census(PASS, 100.0, prior, census) == "suspect", bad
        busy = _census(199.0 + 3 * 5.0 + G + 1.0, reps, ready=1)
        assert judge_census(PASS, 100.0, prior, busy) == "young", bad


def test_workers_that_could_not_consume_at_the_suspicion_do_not_matter() -> None:
    """A worker that first reported after t (it reports before it consumes: no consumer at t),
    one that stopped before t, and one silent for longer than its liveness before t are not
    asked to have been steady across t."""
    prior = (100.0, 200.0)
    reps = {
        "a": _rep(210.0, since=150.0),
        "new": _rep(210.0, since=208.0, started=201.0),
        "stopped": _rep(190.0, stopped=True),
        "dead": _rep(200.0 - 3 * 5.0 - G - 1.0),
    }
    assert judge_census(PASS, 100.0, prior, _census(210.0, reps)) == "confirm"


def test_a_pass_that_progressed_is_a_new_suspect() -> None:
    """A suspicion is about one last progress: a pass that progressed since is judged afresh."""
    reps = {"a": _rep(300.0, since=10.0)}
    assert judge_census(PASS, 250.0, (100.0, 200.0), _census(300.0, reps)) == "suspect"


# --- the rule against a backlog, step by step --------------------------------------------------


def _drain(
    n: int, prefetch: int, take_every: float, every: float, offset: float, census_every: float
) -> tuple[list[str], int]:
    """A queue of ``n`` messages (passes s0…s{n-1}, progress 0) drained by one worker that
    holds ``prefetch`` at a time and finishes one every ``take_every`` s (it then leaves the
    pending index). The worker reports every ``every`` s from ``offset``; another worker's
    sweeper takes a census every ``census_every`` s from 0, reading the last report and the queue's
    counts at that moment, so a message delivered after the report and before the census is
    neither ready nor reported. Returns the passes a census confirmed, and how many suspicions
    were recorded (the rule had something to look at)."""
    report: ConsumerReport | None = None
    prior: dict[str, tuple[float, float]] = {}
    confirmed: list[str] = []
    suspected = 0
    step = 0.01
    for k in itertools.count():
        now = round(k * step, 6)
        done = int(now // take_every)
        if done >= n:
            return confirmed, suspected
        held = [f"s{i}" for i in range(done, min(n, done + prefetch))]
        if now >= offset and abs((now - offset) % every) < step / 2:
            report = _rep(now, *held, since=-10.0, every=every)
        if report is None or abs(now % census_every) >= step / 2:
            continue
        ready = max(0, n - done - prefetch)
        census = Census({"w": report}, {Q: QueueCount(ready, 1)}, now)
        for i in range(done, n):
            member = f"1:w1:s{i}"
            verdict = judge_census(member, 0.0, prior.get(member), census)
            if verdict == "confirm":
                confirmed.append(member)
            elif verdict == "suspect":
                suspected += 1
                prior[member] = (0.0, census.at)
            elif verdict != "wait":
                prior.pop(member, None)
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("prefetch", "take_every", "every", "offset", "census_every"),
    [
        (1, 0.7, 0.5, 0.2, 0.5),
        (4, 0.3, 0.5, 0.45, 0.5),
        (1, 3.1, 5.0, 1.0, 5.0),
        (2, 9.0, 5.0, 4.0, 5.0),
        (1, 5.5, 5.0, 4.0, 1.0),  # censuses (another worker's sweeps) between two reports
    ],
)
def test_a_draining_backlog_is_never_taken_for_lost(
    prefetch: int, take_every: float, every: float, offset: float, census_every: float
) -> None:
    """Every message of a backlog is either ready (its queue is never quiet then) or in the
    worker's hands (and in its next report): a message delivered between a report and a census
    may be suspected, but no census confirms one, however the worker's pace and its reports fall
    against the censuses."""
    confirmed, _ = _drain(12, prefetch, take_every, every, offset, census_every)
    assert confirmed == []


def test_the_backlog_model_does_suspect_messages_between_a_report_and_a_census() -> None:
    """The model above is not vacuous: with the worker's reports just before the censuses, the
    last messages, taken in between, are suspected at least once."""
    _, suspected = _drain(12, 1, 3.1, 5.0, 4.0, 5.0)
    assert suspected > 0


# --- what a worker reports ------------------------------------------------------------------


def test_a_report_reads_back_as_written() -> None:
    rep = _rep(12.5, "sid1", "sid2", since=3.25, started=1.0, queues=(Q, "critique.llm"))
    assert ConsumerReport.loads(rep.dumps()) == rep
    stopped = _rep(13.0, since=None, stopped=True)
    assert ConsumerReport.loads(stopped.dumps()) == stopped


def test_the_consumer_is_steady_from_its_start_until_a_requeue_or_its_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``since``: None until the consumer starts; its start time; moved by a requeue (never
    while it is away); None again once its connection is gone."""
    import workers.recovery.transport as transport

    clock = iter([10.0, 20.0, 30.0])
    monkeypatch.setattr(transport.time, "time", lambda: next(clock))
    state = ConsumerState()
    assert state.since is None
    state.requeued()
    assert state.since is None
    state.connected()
    assert state.since == 10.0
    state.requeued()
    assert state.since == 20.0
    state.closed()
    assert state.since is None


def test_a_consumer_that_ended_says_so_to_every_callback_even_if_one_fails() -> None:
    """The worker's consumer shut down (its connection closed for good): ``since`` is None and
    every registered callback runs (the sweeper's "stopped" report), a failing one logged."""
    state = ConsumerState()
    state.connected()
    called: list[str] = []

    def fails() -> None:
        called.append("fails")
        raise RuntimeError("the store is away")

    state.on_end(fails)
    state.on_end(lambda: called.append("reports"))
    state.ended()
    assert state.since is None
    assert called == ["fails", "reports"]


class _Message:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def reject(self, requeue: bool = False) -> None:
        self.calls.append(("reject", requeue, transport_since()))

    def requeue(self) -> None:
        self.calls.append(("requeue", transport_since()))


def transport_since() -> float | None:
    from workers.recovery.transport import CONSUMING

    return CONSUMING.since


def test_a_requeue_moves_the_consumers_since_before_the_message_goes_back() -> None:
    """Celery's ``reject(requeue=True)`` (a lost pool child, a time limit) and ``requeue()``
    move ``since`` first; a reject without requeue (the message is dropped) does not."""
    from workers.recovery.transport import CONSUMING, _watch_requeues

    CONSUMING.connected()
    start = CONSUMING.since
    assert start is not None
    message = _Message()
    _watch_requeues(message)
    message.reject()
    assert message.calls == [("reject", False, start)]
    message.reject(requeue=True)
    moved = message.calls[-1][2]
    assert moved is not None and moved >= start
    message.requeue()
    assert message.calls[-1][0] == "requeue" and message.calls[-1][1] >= moved
    CONSUMING.closed()
