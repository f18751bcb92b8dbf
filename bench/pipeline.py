"""Throughput of the real chain against bare Celery chains of the same length.

    python bench/pipeline.py [--n 300] [--concurrency 4] [--pool threads] [--redis URL]

Starts one worker process (the same for both runs), sends N mixed submissions (clean and
defective JSON worker results; heuristic critic, deterministic repair) through the real chain,
then N bare chains of no-op tasks with exactly the lengths the real chains had (4 stages plus 4
per repair) carrying the same first message, and prints throughput, the ratio, and p50/p95
latency per output. With no --redis and no REDIS_URL it starts an embedded redis-server.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("clean", "missing", "broken", "clean")


def make_output(kind: str) -> dict[str, Any]:
    if kind == "clean":
        return {
            "summary": "Sales rose 4% in Q3.",
            "findings": "North grew most.",
            "confidence": 0.9,
        }
    if kind == "missing":
        return {"summary": "Sales rose 4% in Q3.", "confidence": 0.8}
    return {"summary": "Sales rose.", "findings": "North grew.", "error": "tool timed out"}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pool", default="threads", choices=["threads", "prefork", "solo"])
    ap.add_argument("--redis", default=os.environ.get("REDIS_URL"))
    args = ap.parse_args()

    server = None
    if not args.redis:
        from workers.embedded import EmbeddedRedis

        server = EmbeddedRedis().start()
        args.redis = server.url
    os.environ.update(
        REDIS_URL=args.redis,
        CELERY_BROKER_URL=args.redis,
        CELERY_RESULT_BACKEND=args.redis,
        LITELLM_LOCAL_MODEL_COST_MAP="True",
    )
    from celery import chain

    from bench.noop_tasks import noop
    from pipeline.models import Submission
    from pipeline.runner import start
    from workers import runtime
    from workers.client import CritiqueClient

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-I", "bench.noop_tasks",
         "-Q", "critique.cpu,critique.llm", "-P", args.pool, "-c", str(args.concurrency),
         "--without-gossip", "--without-mingle", "-l", "WARNING"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(3)
        config = {"enabled": True, "budget": {"total_tokens": 10_000_000}}
        client = CritiqueClient(config)
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        subs = [
            Submission(
                run_id=run_id, worker_id=f"w{i:04d}", task="Summarise the Q3 sales report.",
                output=make_output(KINDS[i % len(KINDS)]), required_fields=("summary", "findings"),
            )
            for i in range(args.n)
        ]  # fmt: skip
        # warm-up
        client.wait(client.submit(subs[0].model_copy(update={"run_id": run_id + "w"})), 60)

        t0 = time.perf_counter()
        sent: dict[str, float] = {}
        handles = []
        for s in subs:
            sent[s.worker_id] = time.perf_counter()
            handles.append(client.submit(s))
        latencies: list[float] = []
        pending = {h.worker_id for h in handles}
        rkey = f"critique:{{{run_id}}}:results"
        r = runtime.client()
        while pending:
            done = {k.decode().split(":", 1)[1] for k in r.hkeys(rkey)} & pending
            now = time.perf_counter()
            for wid in done:
                latencies.append(now - sent[wid])
            pending -= done
            time.sleep(0.02)
        real_s = time.perf_counter() - t0
        results = client.results(run_id)
        lengths = {r.worker_id: 4 + 4 * len(r.attempts) for r in results}

        msgs = {s.worker_id: runtime.encode(start(s), config) for s in subs}
        t0 = time.perf_counter()
        bare: list[tuple[float, Any]] = []
        for s in subs:
            n = lengths[s.worker_id]
            sig = chain(noop.s(msgs[s.worker_id]), *[noop.s() for _ in range(n - 1)])
            bare.append((time.perf_counter(), sig.apply_async()))
        bare_lat = []
        for started, ar in bare:
            ar.get(timeout=300)
            bare_lat.append(time.perf_counter() - started)
        bare_s = time.perf_counter() - t0

        stages = sum(lengths.values())
        print(f"N={args.n} submissions, {stages} stage tasks, pool={args.pool} "
              f"concurrency={args.concurrency}, one worker process")  # fmt: skip
        print(f"{'chain':<8} {'wall s':>8} {'outputs/s':>10} {'p50 ms':>8} {'p95 ms':>8}")
        for name, wall, lat in (("real", real_s, latencies), ("bare", bare_s, bare_lat)):
            print(f"{name:<8} {wall:8.2f} {args.n / wall:10.1f} "
                  f"{pct(lat, 0.5) * 1000:8.0f} {pct(lat, 0.95) * 1000:8.0f}")  # fmt: skip
        print(f"throughput ratio real/bare: {bare_s / real_s:.2f}x")
        statuses: dict[str, int] = {}
        for r in results:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        print("statuses:", statuses)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
