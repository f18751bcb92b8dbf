"""Scale-out by processes: the token-free pipeline and bare Celery chains of the same shape
through ``critique worker --processes P``, for each P.

    python bench/scale.py [--processes 1,2,4,8,16] [--n 400] [--concurrency 4] [--redis URL]
    python bench/scale.py --quick          # P = 1,2 and n = 100: a smoke run

For each P it starts one ``critique worker --processes P`` (P Celery nodes of ``--concurrency``
threads each, all on critique.cpu and critique.llm, the bench's no-op tasks loaded), counts the
tasks one chain of each kind of output runs, then sends N mixed submissions (half accepted at
once, half after one token-free repair: bench/pipeline.py's mix) through the real chain and N
bare chains of no-op tasks with the same lengths and first messages (default Celery tasks, each
storing its result: bench/pipeline.py's "bare"), and stops the worker (SIGTERM). Prints
outputs/s of each, their ratio, the speed-up over the smallest P of the run, the worker's CPU
per output and its resident memory (all processes). All N are enqueued at once from this one
client (``enq s``: how long that took; when it nears ``wall s`` the client, not the workers, is
the limit). With no --redis and no REDIS_URL it starts an embedded redis-server.

Beyond the machine's cores the extra processes only share the same CPUs (and Redis and this
client run on them too): the table then shows saturation, which is the expected result there.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pipeline import (  # noqa: E402
    CONFIG,
    BenchWorker,
    calibrate,
    lengths_of,
    run_bare,
    run_real,
    setup_redis,
    submissions,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--processes", default="1,2,4,8,16", help="comma-separated process counts")
    ap.add_argument("--n", type=int, default=400, help="outputs per measurement")
    ap.add_argument("--concurrency", type=int, default=4, help="threads per process")
    ap.add_argument("--redis", default=os.environ.get("REDIS_URL"))
    ap.add_argument("--quick", action="store_true", help="P = 1,2 and n = 100")
    args = ap.parse_args()
    counts = [1, 2] if args.quick else [int(p) for p in args.processes.split(",") if p.strip()]
    n = 100 if args.quick else args.n
    if not counts or min(counts) < 1 or n < 1:
        ap.error("--processes takes whole numbers >= 1, --n one >= 1")

    args.redis, server = setup_redis(args.redis)
    from workers import runtime
    from workers.client import CritiqueClient

    client = CritiqueClient(CONFIG)
    r = runtime.client()
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    print(f"N={n} outputs per measurement, {args.concurrency} threads per process, "
          f"{cpus} CPUs here, bench/pipeline.py's mix (half clean, half defective)")  # fmt: skip
    head = (
        f"{'procs':>5} {'tasks/out':>9} {'pipeline/s':>10} {'bare/s':>8} {'ratio':>6} "
        f"{'speed-up':>8} {'bare x':>7} {'enq s':>6} {'wall s':>7} {'cpu ms/out':>10} "
        f"{'rss MB':>7}"
    )
    print(head)
    base_real = base_bare = 0.0
    for procs in counts:
        worker = BenchWorker(procs, concurrency=args.concurrency)
        try:
            worker.start()
            run = f"scale-{uuid.uuid4().hex[:6]}-p{procs}"
            client.wait(client.submit(submissions(run + "-warm", 1)[0]), 60)  # warm-up
            per_kind = calibrate(client, worker)
            subs = submissions(run, n)
            lengths = lengths_of(subs, per_kind)
            timing: dict[str, float] = {}
            c0 = worker.cpu_s()
            real_s, _ = run_real(client, r, subs, timing=timing)
            c1 = worker.cpu_s()
            enq = timing["enqueue_s"]
            bare_s, _ = run_bare(subs, lengths)
            rss = worker.rss_mb()
        finally:
            worker.stop()
        real, bare = n / real_s, n / bare_s
        base_real = base_real or real
        base_bare = base_bare or bare
        print(f"{procs:>5} {sum(lengths.values()) / n:>9.1f} {real:>10.1f} {bare:>8.1f} "
              f"{real / bare:>6.2f} {real / base_real:>7.2f}x {bare / base_bare:>6.2f}x "
              f"{enq:>6.2f} {real_s:>7.2f} {(c1 - c0) * 1000 / n:>10.2f} {rss:>7.0f}",
              flush=True)  # fmt: skip
    if server is not None:
        server.stop()
    print("ratio = pipeline/bare outputs per second; speed-up / bare x: over the first row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
