"""The tasks a submission costs, through a real worker: the loop's stages run inside the tasks
(an accepted output is one task, and so is its first repair round), the id the client sent the
submission under holds the summary in Celery's result backend."""

from __future__ import annotations

import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pipeline.store import keys
from tests.support import wait_until
from tests.support.submissions import CONFIG, make_sub
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url

NODE = f"shape@{socket.gethostname()}"


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    with client_on(worker_db_url(redis_url)) as e:
        yield e


WORKER = WorkerSpec("shape", concurrency=2, more_env={"CRITIQUE_TASK_EVENTS": "0"})
"""Task events off until a monitor asks, as ``critique worker`` starts its nodes."""


def _tasks_run() -> Counter[str]:
    """Tasks the module's worker has run, by name (the sweeper's probes left out)."""
    from workers.app import app

    stats = app.control.inspect(destination=[NODE], timeout=2.0).stats() or {}
    total = (stats.get(NODE) or {}).get("total") or {}
    return Counter({k: int(v) for k, v in total.items() if k != "critique.probe"})


def _settled_count(before: Counter[str], expected: Counter[str]) -> Counter[str]:
    """The worker's task counts since ``before``, once they reach ``expected`` (or time out)."""
    got: list[Counter[str]] = []

    def reached() -> bool:
        got.append(_tasks_run() - before)
        return got[-1] == expected

    wait_until(reached, 20, what=f"the worker to count {dict(expected)}")
    return got[-1]


@pytest.mark.parametrize(
    ("kind", "status", "attempts"), [("clean", "accepted", 0), ("looping", "repaired", 1)]
)
def test_an_output_and_its_first_repair_round_cost_one_task(
    worker: WorkerProcess, kind: str, status: str, attempts: int
) -> None:
    """A clean output runs as one task (Layer-0, critic, decide and gate in critique.l0), and
    so does one repaired in one round (the repair and its re-check run in that task too: its
    queue is the one the task came from); that id's Celery result is the gate's summary of the
    stored result."""
    from celery.result import AsyncResult

    from workers.app import app
    from workers.client import CritiqueClient

    client = CritiqueClient(CONFIG)
    before = _tasks_run()
    handle = client.submit(make_sub(f"shape-{uuid.uuid4().hex[:8]}", "w1", 1, kind))
    result = client.wait(handle, timeout=60)
    assert result.status == status
    assert len(result.attempts) == attempts
    # The store's result comes first, the backend's a moment later: wait for it.
    stored = AsyncResult(handle.task_id, app=app)
    summary = stored.get(timeout=10)
    assert stored.state == "SUCCESS", stored.state
    assert (summary["worker_id"], summary["status"], summary["best_score"]) == (
        "w1",
        result.status,
        result.best_score,
    )
    tasks = Counter({keys.TASK_L0: 1})
    assert _settled_count(before, tasks) == tasks


def test_a_started_worker_has_frozen_what_it_loaded(worker: WorkerProcess) -> None:
    """Once the worker is ready, the objects its start created (its modules) are out of the
    cyclic GC's reach (gc.freeze): the full collections walk only what tasks allocate."""
    from workers.app import app

    stats = app.control.inspect(destination=[NODE], timeout=5.0).stats() or {}
    assert (stats.get(NODE) or {}).get("critique_gc_frozen", 0) > 10_000


def _store_scripts(
    redis_url: str, run_id: str, scripts: list[Any], submit: Callable[[], object]
) -> Counter[str]:
    """The Lua scripts (by sha) the server ran for ``run_id`` while ``submit`` ran, as the
    server's MONITOR saw them (every client: the test's and the worker's). ``scripts`` are
    loaded first: a first call of a script the server lacks shows twice (redis-py loads it
    and calls again)."""
    import redis

    end = f"monitor-end-{uuid.uuid4().hex}"
    seen: Counter[str] = Counter()
    with redis.Redis.from_url(redis_url) as r, r.monitor() as monitor:
        for script in scripts:
            r.script_load(script)
        submit()
        r.echo(end)
        while True:
            got = monitor.next_command()
            command = str(got["command"])
            if end in command:
                return seen
            parts = command.split(" ")
            if parts[0].upper() == "EVALSHA" and run_id in command:
                seen[parts[1]] += 1


@pytest.mark.parametrize(("kind", "records"), [("clean", 0), ("looping", 1)])
def test_steps_that_cost_nothing_to_rerun_are_written_with_the_next_record(
    worker: WorkerProcess, redis_url: str, kind: str, records: int
) -> None:
    """Token-free steps whose next stage runs in the same task are written with that stage's
    record (one script), and when the pass ends in the task, only their trace events, with the
    result: a clean output's one task runs no step-record script at all (its result's script
    only), one repaired in one round by the token-free reviser one (the repair's, with every
    step before it: the repair runs in the same task and reserves no budget); every stage's
    trace events are still written once, in order."""
    from pipeline.store.runs import RedisRunStore
    from workers import runtime
    from workers.client import CritiqueClient

    client = CritiqueClient(CONFIG)
    runs = runtime.stores().runs
    assert isinstance(runs, RedisRunStore)
    record, result = runs._record_steps, runs._put_result
    sub = make_sub(f"held-{uuid.uuid4().hex[:8]}", "w1", 1, kind)
    got: list[str] = []
    scripts = _store_scripts(
        worker_db_url(redis_url),
        sub.run_id,
        [record.script, result.script],
        lambda: got.append(client.wait(client.submit(sub), timeout=60).status),
    )
    assert got == ["accepted" if kind == "clean" else "repaired"]
    assert (scripts[record.sha], scripts[result.sha]) == (records, 1), scripts
    l0 = [("stage", "l0"), ("gate", "l0")] if kind == "looping" else [("stage", "l0")]
    first = [*l0, ("stage", "critic"), ("round", "decide")]  # a defect: Layer-0's gate event
    again = [("stage", "repair"), ("stage", "l0"), ("stage", "critic"), ("round", "decide")]
    expected = [*first, *(again if kind == "looping" else []), ("result", "gate")]
    assert [(e["type"], e.get("stage")) for e in client.trace(sub.run_id)] == expected


def _progress_events(submit: Callable[[], object]) -> list[dict[str, Any]]:
    """The task-progress events the broker carried while ``submit`` ran (and 1 s after)."""
    import threading

    from workers.app import app

    got: list[dict[str, Any]] = []
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"task-progress": got.append})
        thread = threading.Thread(
            target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False),
            daemon=True,
        )
        thread.start()
        time.sleep(1.0)  # the receiver's queue is bound
        submit()
        time.sleep(1.0)
        receiver.should_stop = True
        thread.join(timeout=5)
    return got


def test_a_repair_sends_task_progress_only_while_task_events_are_on(worker: WorkerProcess) -> None:
    """With task events off (no monitor asked), a repair sends no task-progress event (Celery's
    send_event publishes whatever the worker's setting); once a monitor turns them on
    (Flower's enable_events), it does."""
    from workers.app import app
    from workers.client import CritiqueClient

    client = CritiqueClient(CONFIG)

    def repaired() -> None:
        sub = make_sub(f"progress-{uuid.uuid4().hex[:8]}", "w1", 1, "looping")
        assert client.wait(client.submit(sub), timeout=60).status == "repaired"

    assert _progress_events(repaired) == []
    app.control.enable_events(destination=[NODE])
    try:
        assert len(_progress_events(repaired)) == 1
    finally:
        app.control.disable_events(destination=[NODE])
