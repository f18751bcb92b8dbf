"""Helpers for the fault suites: stored results polled without re-driving, the report of what
is missing, and the checks of a run against the broker-free reference."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from typing import Any

from pipeline.errors import StoreUnavailableError
from pipeline.models import CritiqueResult, Submission
from pipeline.store import keys
from pipeline.store.pending import RedisPendingIndex
from tests.support.submissions import CONFIG, KINDS, make_sub, reference
from tests.support.workers import WorkerProcess
from workers.client import Handle


def run_results(run_id: str) -> dict[str, CritiqueResult] | None:
    """The run's stored results by ``"<iteration>:<worker_id>"``; None while Redis is away."""
    from workers import runtime

    try:
        got = runtime.stores().runs.results(run_id)
    except StoreUnavailableError:
        return None
    return {f"{r.iteration}:{r.worker_id}": r for r in got}


def wait_for_results(run_id: str, n: int, timeout: float) -> dict[str, CritiqueResult]:
    """Poll the results (never ``wait``: no client re-drives anything) until ``n`` are there."""
    deadline = time.monotonic() + timeout
    got: dict[str, CritiqueResult] = {}
    while time.monotonic() < deadline:
        got = run_results(run_id) or got
        if len(got) >= n:
            return got
        time.sleep(0.25)
    return got


def missing_report(run_id: str, subs: list[Submission], results: dict[str, CritiqueResult]) -> str:
    """Why submissions have no result, for the failure message: each one's pending-index
    entry, the steps recorded for the run, and the queues' drain probes (what the sweeper
    decides on), so a failure can be explained after its Redis is gone."""
    import redis as redis_lib

    from workers import runtime

    missing = [s.worker_id for s in subs if f"{s.iteration}:{s.worker_id}" not in results]
    lines = [f"{len(missing)} submissions have no result: {missing[:10]}"]
    try:
        r = redis_lib.Redis.from_url(runtime.redis_url(), decode_responses=True)
        pending = r.zrange(keys.run_key(run_id, keys.PENDING), 0, -1, withscores=True)
        steps = [  # the live passes' step records (a finished pass's are released)
            step
            for key in r.scan_iter(keys.pass_steps_key(run_id, "*"), count=1000)
            for step in r.hkeys(key)
        ]
        for wid in missing[:10]:
            lines.append(f"  {wid}: pending {[p for p in pending if wid in p[0]]}")
            lines.append(f"  {wid}: steps {sorted(k for k in steps if wid in k)}")
        for key in r.scan_iter(keys.shared_key(keys.PROBE) + "*"):
            kind = r.type(key)
            value = r.hgetall(key) if kind == "hash" else r.zrange(key, -5, -1)
            lines.append(f"  {key}: {value}")
        lines.append(f"  now {r.time()}")
    except Exception as exc:  # a diagnostic must not hide the assertion
        lines.append(f"  (diagnostics unavailable: {exc!r})")
    return "\n".join(lines)


def fault_submissions(run_id: str, n: int) -> list[Submission]:
    return [make_sub(run_id, f"w{i:03d}", 1, KINDS[i % len(KINDS)]) for i in range(n)]


def check_run(
    run_id: str,
    subs: list[Submission],
    results: dict[str, CritiqueResult],
    workers: list[WorkerProcess],
    pids: list[int],
    *,
    transport: str = "workers.recovery.transport:RedisTransport://",
) -> list[dict[str, Any]]:
    """Every submission ended with its reference result (none failed, none missing), every
    worker process is the one that started (its banner names ``transport``, by default the
    guarded Redis one; no "Unrecoverable error"), each submission has exactly one ``result``
    trace event, nothing is left pending. Returns the run's ``resume`` events (all by the
    sweeper: no client waited)."""
    from workers import runtime
    from workers.client import CritiqueClient

    assert len(results) == len(subs), missing_report(run_id, subs, results)
    want, _ = reference(subs, CONFIG)
    for key, ref in want.items():
        got = results[key]
        assert (got.status, got.stop_reason) == (ref.status, ref.stop_reason), key
    assert "failed" not in Counter(r.status for r in results.values())

    for w, pid in zip(workers, pids, strict=True):
        assert w.proc is not None and w.proc.poll() is None, "a worker process exited"
        assert w.proc.pid == pid
        log = w.log.read_text(errors="replace") if w.log else ""
        assert f"transport:   {transport}" in log  # (on Redis: the guarded one)
        assert "Unrecoverable error" not in log

    events = list(CritiqueClient(CONFIG).trace(run_id))
    gates = Counter((e["iteration"], e["worker_id"]) for e in events if e["type"] == "result")
    assert len(gates) == len(subs)
    resumes = [e for e in events if e["type"] == "resume"]
    assert {e["by"] for e in resumes} <= {"sweeper"}
    repeated = {k: v for k, v in gates.items() if v > 1}
    assert not repeated, repeated
    assert RedisPendingIndex(runtime.client()).count(run_id) == 0
    return resumes


def pattern_counts(run_id: str, subs: list[Submission]) -> tuple[dict[Any, int], dict[Any, int]]:
    """The run's stored pattern counts and the broker-free reference's, by (category, rule)."""
    from workers import runtime

    stored = runtime.stores().patterns.top(run_id, 1000)
    _, ref = reference(subs, CONFIG)
    return (
        {(p.category, p.prevention_rule): p.frequency for p in stored},
        {(p.category, p.prevention_rule): p.frequency for p in ref.top(run_id, 1000)},
    )


DEDUPE_SKIP = {"resume", "stalled", "refused"}
"""Trace events that may repeat by design (each re-drive writes one ``resume``)."""


def event_key(e: dict[str, Any]) -> tuple[Any, ...]:
    """What makes a trace event unique within a run (its timing fields aside)."""
    return (
        e["type"],
        e.get("stage"),
        e.get("iteration"),
        e.get("worker_id"),
        e.get("pass_id"),
        e.get("round"),
        e.get("attempt"),
        e.get("l0_check"),
        e.get("violating_path"),
        e.get("note"),
    )


class _Notices(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(f"{threading.current_thread().name}: {record.getMessage()}")


class Waiters:
    """A manager waiting on every handle through whatever the test does to Redis: one by one
    with ``CritiqueClient.wait`` (a thread), and all at once with ``AsyncCritiqueClient`` (an
    event loop in another thread). Records each verdict by worker id, each error in words, and
    when each kind of wait had returned for every handle."""

    def __init__(self, handles: list[Handle], timeout: float) -> None:
        self.handles = handles
        self.timeout = timeout
        self.sync: dict[str, CritiqueResult] = {}
        self.asynchronous: dict[str, CritiqueResult] = {}
        self.errors: list[str] = []
        self.sync_done: float | None = None
        self.async_done: float | None = None
        self.outages: list[str] = []
        """The "retrying" notices the waits logged (workers.riding): the outages they rode."""
        self._notices = _Notices(self.outages)
        self._threads = [
            threading.Thread(target=self._sync, name="sync-waits", daemon=True),
            threading.Thread(target=self._async, name="async-waits", daemon=True),
        ]

    def start(self) -> Waiters:
        logging.getLogger("workers.riding").addHandler(self._notices)
        for t in self._threads:
            t.start()
        return self

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        logging.getLogger("workers.riding").removeHandler(self._notices)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"still waiting after {timeout} s: {alive}"

    def _sync(self) -> None:
        from workers.client import CritiqueClient

        client = CritiqueClient(CONFIG)
        for h in self.handles:
            try:
                self.sync[h.worker_id] = client.wait(h, timeout=self.timeout)
            except Exception as exc:  # every kind is a finding: recorded, not raised
                self.errors.append(f"sync wait {h.worker_id}: {type(exc).__name__}: {exc}")
        self.sync_done = time.monotonic()

    def _async(self) -> None:
        from workers.aclient import AsyncCritiqueClient

        async def main() -> list[Any]:
            async with AsyncCritiqueClient(CONFIG) as client:
                waits = (client.wait(h, timeout=self.timeout) for h in self.handles)
                return list(await asyncio.gather(*waits, return_exceptions=True))

        for h, got in zip(self.handles, asyncio.run(main()), strict=True):
            if isinstance(got, CritiqueResult):
                self.asynchronous[h.worker_id] = got
            else:
                self.errors.append(f"async wait {h.worker_id}: {type(got).__name__}: {got}")
        self.async_done = time.monotonic()


def redriven_once_after_a_loss(
    worker: WorkerProcess,
    handle: Handle,
    sub: Submission,
    lost: str,
    sla_s: float,
) -> float:
    """The check both brokers' lost-message tests share, once the pass's message is gone
    (``first``: the submit's own; ``next``: the one its l0 stage sent, the stage run here
    alone): start ``worker``, wait for the result, and check it is the reference one, reached
    by one sweeper re-drive (reason ``lost``) from the stage after the last recorded step, with
    nothing left pending, within ``sla_s`` of the worker's start. Returns those seconds."""
    from workers import runtime, tasks
    from workers.client import CritiqueClient

    run_id = sub.run_id
    if lost == "next":
        first = (runtime.stores().runs.submission(run_id, 1, sub.worker_id) or {})["message"]
        tasks._stage(tasks.l0, first, "l0")  # the stage alone: its task would go on
    worker.start(timeout=60)
    started = time.monotonic()
    client = CritiqueClient(CONFIG)
    deadline = started + sla_s + 15
    while (result := client.result(handle)) is None and time.monotonic() < deadline:
        time.sleep(0.25)
    took = time.monotonic() - started
    assert result is not None, "the sweeper did not re-drive the lost chain"
    assert took <= sla_s, f"re-driven and finished {took:.1f} s after the worker started"
    want = reference([sub], CONFIG)[0][f"1:{sub.worker_id}"]
    assert (result.status, result.stop_reason) == (want.status, want.stop_reason)
    resumes = [e for e in client.trace(run_id) if e["type"] == "resume"]
    stage, step = ("l0", None) if lost == "first" else ("critic", "l0")
    assert [
        (e["by"], e["reason"], e["stage"], (e["after_step"] or ":").rsplit(":", 1)[1] or None)
        for e in resumes
    ] == [("sweeper", "lost", stage, step)]
    assert RedisPendingIndex(runtime.client()).count(run_id) == 0
    return took
