"""Time to verdict: one token-free output at a time through the fleet, against a bare Celery
round trip on the same Redis, in the same run (issue 39).

    python bench/verdict.py [--n 200] [--warmup 20] [--rounds 3] [--poll-ms 1] [--redis URL]

A manager that submits one output and awaits its verdict before it submits the next: per output
``t0 = perf_counter(); handle = client.submit(sub); result = client.wait(handle); t1``, through
:class:`workers.client.CritiqueClient` as users call it. Sides, each N outputs (round trips)
one at a time after a warm-up (not counted):

* **fleet**: one ``critique worker --processes 1 -P threads -c 4`` (bench/pipeline.py's
  BenchWorker), the heuristic critic (no model, no token), outputs that pass Layer-0 and that
  the critic accepts (each a little different, so no two are the same text); the statuses are
  printed, so the reader sees what ran.
* **fleet-pollNms** (``--poll-ms``, 0: left out): the same, awaited by reading the pass's
  outcome every N ms (``client.outcome``, what ``wait`` reads) instead of ``wait``, which
  sleeps 10 ms doubling to 250 ms between its reads. Not part of the goal: it shows how much of
  the fleet's time is ``wait``'s poll interval.
* **bare**: ``critique.bench.noop`` (bench/noop_tasks.py) with an empty message,
  ``apply_async(...).get()`` (the result backend's pub/sub: no polling), on a plain
  ``celery -A workers.app worker -P threads -c 4 -I bench.noop_tasks`` in the environment
  ``critique worker`` gives its processes (task events off), consuming a queue of its own
  (``bench.verdict``) so that neither worker takes the other's messages. Both workers run for
  the whole bench; the idle one only waits on its queue.

Each round runs every side (in odd rounds fleet first, in even rounds bare first), each after
``--warmup`` outputs of its own. Per side and round: p50, p90, p99 and mean in ms; the summary
is the median over rounds of each figure, and the ratio fleet/bare is the median over rounds of
the per-round ratios (p50 and p99).

Where the fleet's time goes (mean per output, median of rounds): ``submit`` (until it
returns: checks, store writes, the publish), then until the worker stored the verdict, then
until ``wait`` saw it (its poll). When the verdict was stored is read after each output's
timing, from the run's trace stream: the gate appends its ``result`` event in the same script
that stores the verdict, and a stream entry's id is the Redis server's clock in whole
milliseconds (the same machine's clock as ``time.time()`` here; the mean of the split is
corrected by half a millisecond for the truncation); the worker's part is split at Layer-0's
``stage`` event (since a clean output's Layer-0 step is held and its event written with the
result, the split says "with the result" when the two land together). Tasks per output are
the worker's own count (``inspect stats``); Redis commands per output are the server's
``INFO commandstats`` over the timed outputs: every client (the bench, both workers), commands
run inside Lua scripts included, so they are not round trips (``evalsha`` counts the scripts),
the bench's own reads of the trace left out.

The header names the versions measured and the commit (``+dirty``: uncommitted changes); the
goal (issue 39) is printed at the end. With no ``--redis`` a redis-server of the bench's own is
started; a database given with ``--redis`` is flushed first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._provenance import git_commit  # noqa: E402
from bench._redis import add_redis_option, redis_url  # noqa: E402
from bench.llm import dist_version, redis_server_version  # noqa: E402
from bench.pipeline import CONFIG, BenchWorker, pct, setup_redis  # noqa: E402

GOAL = "goal (issue 39): p50 <= 2x, p99 <= 4x the bare round trip"
GOAL_P50, GOAL_P99 = 2.0, 4.0
VERSIONED = ("celery", "kombu", "redis", "pydantic")
"""Distributions whose versions the header prints (``redis`` is redis-py)."""
FLEET_CONFIG: dict[str, Any] = {**CONFIG, "critic": "heuristic"}
"""bench/pipeline.py's configuration, the heuristic critic named rather than left to ``auto``
(which picks it too when no model resolves)."""
BARE_QUEUE = "bench.verdict"
"""The bare worker's queue (the no-op's default queue would be critique.cpu: the fleet's)."""
CONCURRENCY = 4
TASK = "Summarise the Q3 sales report."


def output(i: int) -> dict[str, Any]:
    """A clean output (bench/pipeline.py's ``clean`` kind), a little different for each ``i``."""
    return {
        "summary": f"Sales rose {i % 9 + 1}.{i % 10}% in Q3 (report {i}).",
        "findings": f"Region {i % 7 + 1} grew most; the others held steady.",
        "confidence": 0.9,
    }


def submission(run_id: str, i: int) -> Any:
    from pipeline.models import Submission

    return Submission(
        run_id=run_id, worker_id=f"w{i:05d}", task=TASK, output=output(i),
        required_fields=("summary", "findings"),
    )  # fmt: skip


def versions_line(url: str) -> str:
    """Python, the libraries on the measured path, the Redis server and the commit."""
    libs = ", ".join(
        f"{'redis-py' if name == 'redis' else name} {dist_version(name)}" for name in VERSIONED
    )
    return (
        f"versions: Python {sys.version.split()[0]}, {libs}, "
        f"redis-server {redis_server_version(url)}; commit {git_commit()}"
    )


def bare_worker() -> BenchWorker:
    """A plain ``celery -A workers.app worker`` (threads x 4) with the bench's no-op tasks, in
    the environment ``critique worker`` gives its processes, consuming :data:`BARE_QUEUE`."""
    from workers.commands.worker import worker_environment

    env = dict(os.environ)
    worker_environment(env)  # task events off unless set, as `critique worker` has them
    extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
    w = BenchWorker(1, pool="threads", concurrency=CONCURRENCY, extra_env=extra)
    w.argv = [
        sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-Q", BARE_QUEUE,
        "-P", "threads", "-c", str(CONCURRENCY), "-n", f"{w.name}@%h", "-l", "WARNING",
        "-I", "bench.noop_tasks", "--without-gossip", "--without-mingle",
    ]  # fmt: skip
    return w


@dataclass
class Side:
    """One side of one round: each output's time to verdict and, for the fleet, its split."""

    name: str
    times: list[float] = field(default_factory=list)
    submit: list[float] = field(default_factory=list)
    """Until ``submit`` (bare: ``apply_async``) returned."""
    worker: list[float] = field(default_factory=list)
    """From there until the verdict was stored (fleet, from the trace stream)."""
    seen: list[float] = field(default_factory=list)
    """From the verdict stored until the wait saw it (fleet)."""
    l0: list[float] = field(default_factory=list)
    """From ``submit`` returned until Layer-0 recorded its step (fleet)."""
    commandstats: Counter[str] = field(default_factory=Counter)
    """Calls per Redis command over the timed outputs (every client)."""
    statuses: Counter[str] = field(default_factory=Counter)
    tasks: int = 0
    commands: int = 0
    """Commands the Redis server processed over the timed outputs (workers and bench alike)."""
    slow: int = 0
    """Bare round trips whose pub/sub wait timed out (the result read directly instead)."""

    def figures(self) -> dict[str, float]:
        ms = [t * 1000 for t in self.times]
        return {
            "p50": pct(ms, 0.50),
            "p90": pct(ms, 0.90),
            "p99": pct(ms, 0.99),
            "mean": statistics.fmean(ms),
        }


def pass_times(r: Any, run_id: str, worker_id: str, after: float) -> dict[str, float]:
    """When ``worker_id``'s pass (its only one, begun after ``after``) recorded Layer-0's step
    (``l0``: its first ``stage`` event) and stored its verdict (``result``: the gate's event),
    from the ids of those events in the run's trace stream (ms, truncated; + 0.5 ms), as
    ``time.time()``. One XREVRANGE, after the output's timing."""
    from pipeline.store.keys import TRACE, run_key
    from workers import runtime

    sink = runtime.stores().trace
    key = run_key(run_id, TRACE)
    times: dict[str, float] = {}
    for entry_id, fields in r.xrevrange(key, "+", f"{int(after * 1000)}-0", count=20):
        event = sink._decode(run_id, fields)  # unpacks (and with a secret, checks) an entry
        if not event or event.get("worker_id") != worker_id:
            continue
        at = int(entry_id.split(b"-")[0]) / 1000 + 0.0005
        if event.get("type") == "result":
            times["result"] = at
        elif event.get("type") == "stage" and event.get("stage") == "l0":
            times["l0"] = at  # newest first: the last one seen is the first
    return times


def run_fleet(
    client: Any, r: Any, worker: BenchWorker, args: argparse.Namespace, name: str, poll_s: float
) -> Side:
    """Warm-up, then N outputs one at a time: ``submit``, then ``wait`` (``poll_s`` 0) or a read
    of the pass's outcome every ``poll_s``."""
    from pipeline.errors import SubmissionError

    def await_verdict(handle: Any) -> Any:
        if not poll_s:
            return client.wait(handle, 60)
        deadline = time.monotonic() + 60
        while (got := client.outcome(handle)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no verdict for {handle.worker_id} after 60 s")
            time.sleep(poll_s)
        if isinstance(got, SubmissionError):
            raise got
        return got

    side = Side(name)
    run_id = f"verdict-{uuid.uuid4().hex[:8]}"
    for i in range(args.warmup):
        await_verdict(client.submit(submission(run_id + "-warm", i)))
    done0 = settled(worker.tasks_done)
    calls0 = command_calls(r)
    for i in range(args.n):
        sub = submission(run_id, i)
        t0 = time.perf_counter()
        handle = client.submit(sub)
        t_sub, wall_sub = time.perf_counter(), time.time()
        result = await_verdict(handle)
        t1, wall1 = time.perf_counter(), time.time()
        side.times.append(t1 - t0)
        side.submit.append(t_sub - t0)
        side.statuses[result.status] += 1
        times = pass_times(r, run_id, sub.worker_id, wall_sub - 1.0)
        if "result" in times:
            side.worker.append(max(0.0, times["result"] - wall_sub))
            side.seen.append(max(0.0, wall1 - times["result"]))
        if "l0" in times:
            side.l0.append(max(0.0, times["l0"] - wall_sub))
    side.commandstats = calls_since(r, calls0, Counter(xrevrange=args.n))
    side.commands = side.commandstats.total()
    side.tasks = settled(worker.tasks_done) - done0
    return side


def run_bare(r: Any, args: argparse.Namespace) -> Side:
    """Warm-up, then N round trips of the no-op one at a time: ``apply_async`` then ``get``."""
    from celery.exceptions import TimeoutError as CeleryTimeout

    from bench.noop_tasks import noop

    def trip() -> tuple[float, float]:
        t0 = time.perf_counter()
        ar = noop.apply_async(args=[{}], queue=BARE_QUEUE)
        t_sub = time.perf_counter()
        try:
            ar.get(timeout=5)
        except CeleryTimeout:
            # Pub/sub missed it (bench/pipeline.py saw that on chains): read it, count it.
            side.slow += 1
            deadline = time.monotonic() + 55
            while not ar.ready():
                if time.monotonic() > deadline:
                    raise TimeoutError("no bare result after 60 s") from None
                time.sleep(0.01)
        t1 = time.perf_counter()
        side.statuses[ar.state] += 1
        return t_sub - t0, t1 - t0

    side = Side("bare")
    for _ in range(args.warmup):
        trip()
    side.slow = 0
    side.statuses.clear()
    calls0 = command_calls(r)
    for _ in range(args.n):
        sub, total = trip()
        side.submit.append(sub)
        side.times.append(total)
    side.commandstats = calls_since(r, calls0, Counter())
    side.commands = side.commandstats.total()
    side.tasks = args.n
    return side


def command_calls(r: Any) -> Counter[str]:
    """Calls so far per Redis command (``INFO commandstats``, all clients)."""
    stats = r.info("commandstats")
    return Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()})


def calls_since(r: Any, before: Counter[str], ours: Counter[str]) -> Counter[str]:
    """Calls per command since ``before`` (a :func:`command_calls`), less this bench's own
    reads (``ours``) and the ``INFO`` that took ``before``."""
    delta = command_calls(r)
    delta.subtract(before)
    delta.subtract(ours + Counter(info=1))
    return +delta


def settled(count: Callable[[], int], quiet_s: float = 0.3) -> int:
    """``count()`` once it stopped moving (the gate's count lands just after its verdict)."""
    last, now = -1, count()
    while now != last:
        time.sleep(quiet_s)
        last, now = now, count()
    return now


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="timed outputs (round trips) per side")
    ap.add_argument("--warmup", type=int, default=20, help="untimed ones before them, per side")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every side; the median")
    ap.add_argument(
        "--poll-ms", type=float, default=1.0,
        help="the fleet side awaited by reading the outcome every N ms (0: no such side)",
    )  # fmt: skip
    add_redis_option(ap)
    args = ap.parse_args()
    if args.n < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error("--n and --rounds must be at least 1, --warmup at least 0")

    given = args.redis
    url, _ = setup_redis(redis_url(given))  # the env the client and the workers read
    import redis

    if given:
        redis.Redis.from_url(url).flushdb()
    from workers import runtime
    from workers.client import CritiqueClient

    fleet = BenchWorker(1, pool="threads", concurrency=CONCURRENCY)
    bare = bare_worker()
    tight = f"fleet-poll{args.poll_ms:g}ms" if args.poll_ms > 0 else ""
    names = ["fleet", *([tight] if tight else []), "bare"]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"time to verdict, one output at a time: N={args.n} per side after {args.warmup} "
          f"warm-up, {args.rounds} round(s); fleet: `critique worker --processes 1 -P threads "
          f"-c {CONCURRENCY}`, heuristic critic; bare: critique.bench.noop on `celery -A "
          f"workers.app worker -P threads -c {CONCURRENCY}`; {os.cpu_count()} CPUs, "
          f"load average {load}")  # fmt: skip
    print(versions_line(url))
    rows: dict[str, list[Side]] = {name: [] for name in names}
    try:
        fleet.start()
        bare.start()
        client = CritiqueClient(FLEET_CONFIG)
        r = runtime.client()
        print(f"{'round':>5} {'side':<16} {'n':>5} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} "
              f"{'mean ms':>7} {'submit':>7} {'worker':>7} {'seen':>7} {'tasks':>5} {'cmds':>5}  "
              f"statuses")  # fmt: skip
        for rnd in range(1, args.rounds + 1):
            order = names if rnd % 2 else names[::-1]  # who goes first alternates
            for name in order:
                if name == "bare":
                    side = run_bare(r, args)
                else:
                    poll_s = args.poll_ms / 1000 if name == tight else 0.0
                    side = run_fleet(client, r, fleet, args, name, poll_s)
                rows[name].append(side)
                f = side.figures()
                split = [
                    f"{statistics.fmean(v) * 1000:7.2f}" if v else f"{'-':>7}"
                    for v in (side.submit, side.worker, side.seen)
                ]
                slow = f" ({side.slow} pub/sub waits timed out)" if side.slow else ""
                print(f"{rnd:>5} {name:<16} {len(side.times):>5} {f['p50']:7.2f} "
                      f"{f['p90']:7.2f} {f['p99']:7.2f} {f['mean']:7.2f} {' '.join(split)} "
                      f"{side.tasks / args.n:5.1f} {side.commands / args.n:5.1f}  "
                      f"{dict(side.statuses)}{slow}",
                      flush=True)  # fmt: skip
    finally:
        fleet.stop()
        bare.stop()

    print(
        "(submit / worker / seen: mean ms until submit returned / then until the verdict "
        "was stored / then until the wait saw it; tasks and cmds (Redis commands, every client, "
        "inside scripts too) per output)"
    )
    print(f"\nmedian of {args.rounds} round(s), {args.n} per side and round:")
    print(f"{'side':<16} {'n':>5} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'mean ms':>7} "
          f"{'p50 x bare':>10} {'p99 x bare':>10}")  # fmt: skip
    ratios: dict[str, tuple[float, float]] = {}
    for name in names:
        figs = [s.figures() for s in rows[name]]
        m = {k: med([f[k] for f in figs]) for k in ("p50", "p90", "p99", "mean")}
        base = [s.figures() for s in rows["bare"]]
        r50 = med([f["p50"] / b["p50"] for f, b in zip(figs, base, strict=True)])
        r99 = med([f["p99"] / b["p99"] for f, b in zip(figs, base, strict=True)])
        ratios[name] = (r50, r99)
        print(f"{name:<16} {args.n:>5} {m['p50']:7.2f} {m['p90']:7.2f} {m['p99']:7.2f} "
              f"{m['mean']:7.2f} {r50:9.2f}x {r99:9.2f}x")  # fmt: skip

    def mean_ms(name: str, attr: str) -> float:
        """The side's mean of ``attr`` per output, ms, median of rounds."""
        return med([statistics.fmean(v) * 1000 for s in rows[name] if (v := getattr(s, attr))])

    def split_of(name: str) -> str:
        tasks = med([s.tasks / args.n for s in rows[name]])
        l0, worker = mean_ms(name, "l0"), mean_ms(name, "worker")
        if worker - l0 < 0.05:  # Layer-0's event was written with the result
            parts = f"then {worker:.2f} ms until the verdict was stored (Layer-0's event with it)"
        else:
            parts = (f"then {l0:.2f} ms until Layer-0 recorded its step and {worker - l0:.2f} "
                     "ms more until the verdict was stored")  # fmt: skip
        seen = mean_ms(name, "seen")
        return (f"submit {mean_ms(name, 'submit'):.2f} ms; {parts} (worker {worker:.2f} ms, "
                f"{tasks:.1f} tasks); then {seen:.2f} ms until it was seen")  # fmt: skip

    def commands_of(name: str, top: int = 10) -> str:
        calls: Counter[str] = sum((s.commandstats for s in rows[name]), Counter())
        per = args.n * len(rows[name])
        shown = ", ".join(f"{cmd} {n / per:.1f}" for cmd, n in calls.most_common(top))
        return f"{calls.total() / per:.1f}: {shown}"

    print(f"\nwhere the fleet's time goes (mean per output, median of rounds): {split_of('fleet')}")
    if tight:
        print(f"  awaited every {args.poll_ms:g} ms instead of by wait: {split_of(tight)}")
    print(f"  bare: apply_async returned after {mean_ms('bare', 'submit'):.2f} ms, the result "
          f"came {mean_ms('bare', 'times') - mean_ms('bare', 'submit'):.2f} ms later")  # fmt: skip
    print("Redis commands per output, the most called (every client, inside Lua scripts too, "
          "all rounds; the bench's trace reads left out):")  # fmt: skip
    for name in names:
        print(f"  {name:<16} {commands_of(name)}")
    statuses: Counter[str] = Counter()
    for name in names:
        if name != "bare":
            for s in rows[name]:
                statuses.update(s.statuses)
    print(f"fleet statuses (all sides, rounds, timed outputs): {dict(statuses)}")
    r50, r99 = ratios["fleet"]
    met = "met" if r50 <= GOAL_P50 and r99 <= GOAL_P99 else "not met"
    print(f"\nfleet/bare: p50 {r50:.2f}x, p99 {r99:.2f}x ({met})")
    print(GOAL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
