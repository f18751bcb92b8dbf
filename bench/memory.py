"""Worker memory over many outputs: RSS after 1,000 outputs against RSS after 10,000.

    python bench/memory.py [--n 10000] [--every 1000] [--wave 500] [--processes auto] [--redis URL]
    python bench/memory.py --trace        # one process, tracemalloc: where the growth is

Starts one ``critique worker`` (``--processes`` as given, default auto: what a user gets;
``--concurrency`` threads each, the bench's no-op tasks loaded) and sends N token-free outputs
through the real chain (bench/pipeline.py's mix: half clean, half defective; heuristic critic,
deterministic repair) in waves of ``--wave`` outputs, each wave a run of its own whose keys are
deleted once its results are in (so Redis stays small; the worker is what is measured). After
every ``--every`` outputs it prints the worker's resident memory (VmRSS of the command and every
process under it), and at the end the ratio RSS(N) / RSS(first checkpoint). Goal: <= 1.1x
from 10,000 to 100,000 outputs (``--n 100000 --every 10000``, about 25 min on 2 cores).

``--trace`` (one process) starts tracemalloc inside the worker at the first checkpoint and, at
the end, prints the allocation sites still alive since then (largest first; each folded to its
innermost frame in pipeline/ or workers/, else its innermost frame) and the object types whose
live count grew most: the growth, if there is one. tracemalloc slows the worker down a lot; use
a smaller --n with it. With no --redis and no REDIS_URL it starts an embedded redis-server.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pipeline import CONFIG, BenchWorker, setup_redis, submissions  # noqa: E402


def _wave(client: Any, r: Any, run_id: str, n: int, first: int) -> None:
    """Submit ``n`` outputs as run ``run_id``, wait for all results, delete the run's keys."""
    from pipeline.store.keys import PASS_RESULTS, run_key, run_key_pattern

    subs = submissions(run_id, first + n)[first:]
    handles = [client.submit(s) for s in subs]
    rkey = run_key(run_id, PASS_RESULTS)  # one field per finished pass
    deadline = time.monotonic() + 600
    while r.hlen(rkey) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"run {run_id}: {r.hlen(rkey)} of {n} results after 600 s")
        time.sleep(0.05)
    keys = list(r.scan_iter(match=run_key_pattern(run_id), count=1000))
    keys += [f"celery-task-meta-{h.task_id}" for h in handles]  # the gates' Celery results
    if keys:
        r.delete(*keys)


def _heap(action: str, timeout: float) -> dict[str, Any]:
    """Run bench/noop_tasks.py's ``heap`` task in the (single) worker process."""
    from workers.app import app

    result = app.send_task("critique.bench.heap", (action,), queue="critique.cpu")
    return dict(result.get(timeout=timeout))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=10_000, help="outputs in all")
    ap.add_argument("--every", type=int, default=1_000, help="outputs between RSS readings")
    ap.add_argument("--wave", type=int, default=500, help="outputs submitted at a time")
    ap.add_argument("--processes", default="auto", help="`critique worker --processes`")
    ap.add_argument("--concurrency", type=int, default=4, help="threads per process")
    ap.add_argument("--redis", default=os.environ.get("REDIS_URL"))
    ap.add_argument("--trace", action="store_true", help="one process, tracemalloc: the growth")
    args = ap.parse_args()
    if args.every % args.wave and args.wave % args.every:
        ap.error("--every must be a multiple of --wave (or the other way round)")
    wave = min(args.wave, args.every)

    args.redis, server = setup_redis(args.redis)
    from workers import runtime
    from workers.client import CritiqueClient

    procs = "1" if args.trace else args.processes
    worker = BenchWorker(procs, concurrency=args.concurrency)
    client = CritiqueClient(CONFIG)
    r = runtime.client()
    base = f"mem-{uuid.uuid4().hex[:6]}"
    readings: list[tuple[int, float]] = []
    heap0: dict[str, Any] = {}
    try:
        worker.start()
        client.wait(client.submit(submissions(base + "-warm", 1)[0]), 60)  # warm-up
        print(f"N={args.n} outputs through one `critique worker --processes {procs}` "
              f"({len(worker.nodes)} process(es) x {args.concurrency} threads), waves of "
              f"{wave}; RSS = VmRSS of the command and all its processes")  # fmt: skip
        print(f"{'outputs':>8} {'elapsed s':>9} {'outputs/s':>9} {'rss MB':>8} {'vs first':>8}")
        t0 = time.perf_counter()
        done = 0
        while done < args.n:
            size = min(wave, args.n - done)
            _wave(client, r, f"{base}-{done // wave}", size, done)
            done += size
            if done % args.every == 0 or done == args.n:
                time.sleep(0.5)  # let the last acks and result writes settle
                rss = worker.rss_mb()
                readings.append((done, rss))
                elapsed = time.perf_counter() - t0
                print(f"{done:>8} {elapsed:>9.1f} {done / elapsed:>9.1f} {rss:>8.1f} "
                      f"{rss / readings[0][1]:>7.2f}x", flush=True)  # fmt: skip
                if args.trace and len(readings) == 1:
                    heap0 = _heap("start", 60)
        first, last = readings[0], readings[-1]
        print(f"RSS after {last[0]} outputs / after {first[0]}: {last[1]:.1f} / "
              f"{first[1]:.1f} MB = {last[1] / first[1]:.2f}x (goal <= 1.10x)")  # fmt: skip
        if args.trace:
            report = _heap("report", 300)
            print(f"\nstill allocated since output {first[0]} (tracemalloc, "
                  f"{report['traced_kib']:.0f} KiB in all), largest sites:")  # fmt: skip
            for row in report["sites"]:
                print(f"  {row['kib']:9.1f} KiB {row['blocks']:>8} blocks  {row['site']}")
            grew = {
                t: c - heap0["types"].get(t, 0)
                for t, c in report["types"].items()
                if c - heap0["types"].get(t, 0) > 0
            }
            print("live objects that grew most, by type:")
            for t, d in sorted(grew.items(), key=lambda kv: -kv[1])[:15]:
                print(f"  {d:>+9}  {t}  ({report['types'][t]} now)")
    finally:
        worker.stop()
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
