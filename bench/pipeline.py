"""Throughput of the real chain against bare Celery chains of the same length.

    python bench/pipeline.py [--n 300] [--rounds 3] [--concurrency 4] [--pool threads] [--redis URL]

Starts one worker process (the same for both runs), sends N mixed submissions (clean and
defective JSON worker results; heuristic critic, deterministic repair) through the real chain,
then N bare chains of no-op tasks with exactly the lengths the real chains had (4 stages plus 4
per repair) carrying the same first message, and prints throughput, the ratio, and p50/p95
latency per output. "bare" is default Celery tasks (each stores its result); "bare-nr" stores
only the last one's, as the pipeline does (its stage tasks hand state on in the message and
record it in the run's steps hash, so only the gate stores a result): the stricter baseline.
Each round runs the real chain then the bare ones; the reported figure is
the median ratio over the rounds (one round is at the mercy of whatever else the machine
does). With no --redis and no REDIS_URL it starts an embedded redis-server.
"""

from __future__ import annotations

import argparse
import os
import statistics
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
    ap.add_argument("--rounds", type=int, default=3, help="real/bare pairs; the median ratio")
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

    from bench.noop_tasks import noop, noop_nr
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
        r = runtime.client()

        def submissions(run_id: str) -> list[Submission]:
            return [
                Submission(
                    run_id=run_id, worker_id=f"w{i:04d}", task="Summarise the Q3 sales report.",
                    output=make_output(KINDS[i % len(KINDS)]),
                    required_fields=("summary", "findings"),
                )
                for i in range(args.n)
            ]  # fmt: skip

        def run_real(subs: list[Submission]) -> tuple[float, list[float], dict[str, int]]:
            run_id = subs[0].run_id
            t0 = time.perf_counter()
            sent: dict[str, float] = {}
            for s in subs:
                sent[s.worker_id] = time.perf_counter()
                client.submit(s)
            latencies: list[float] = []
            pending = set(sent)
            rkey = f"critique:{{{run_id}}}:results"
            while pending:
                done = {k.decode().split(":", 1)[1] for k in r.hkeys(rkey)} & pending
                now = time.perf_counter()
                latencies += [now - sent[wid] for wid in done]
                pending -= done
                time.sleep(0.02)
            wall = time.perf_counter() - t0
            lengths = {x.worker_id: 4 + 4 * len(x.attempts) for x in client.results(run_id)}
            return wall, latencies, lengths

        def run_bare(
            subs: list[Submission], lengths: dict[str, int], stage: Any = None
        ) -> tuple[float, list[float]]:
            msgs = {s.worker_id: runtime.encode(start(s), config) for s in subs}
            stage = stage or noop
            t0 = time.perf_counter()
            bare: list[tuple[float, Any]] = []
            for s in subs:
                n = lengths[s.worker_id]
                # n - 1 no-op stages then one that stores its result, as the real chain's gate
                sig = chain(
                    stage.s(msgs[s.worker_id]), *[stage.s() for _ in range(n - 2)], noop.s()
                )
                bare.append((time.perf_counter(), sig.apply_async()))
            latencies = []
            for started, ar in bare:
                ar.get(timeout=300)
                latencies.append(time.perf_counter() - started)
            return time.perf_counter() - t0, latencies

        # warm-up
        base = f"bench-{uuid.uuid4().hex[:8]}"
        client.wait(client.submit(submissions(base + "-warm")[0]), 60)

        print(f"N={args.n} submissions per round, pool={args.pool} "
              f"concurrency={args.concurrency}, one worker process, "
              f"{args.rounds} round(s)")  # fmt: skip
        print(f"{'round':<6} {'chain':<8} {'tasks':>6} {'wall s':>8} {'outputs/s':>10} "
              f"{'p50 ms':>8} {'p95 ms':>8} {'ratio':>6}")  # fmt: skip
        ratios: list[float] = []
        strict: list[float] = []
        statuses: dict[str, int] = {}
        for rnd in range(1, args.rounds + 1):
            subs = submissions(f"{base}-{rnd}")
            real_s, real_lat, lengths = run_real(subs)
            bare_s, bare_lat = run_bare(subs, lengths)
            nr_s, nr_lat = run_bare(subs, lengths, noop_nr)
            ratios.append(bare_s / real_s)
            strict.append(nr_s / real_s)
            tasks = sum(lengths.values())
            rows = (
                ("real", real_s, real_lat),
                ("bare", bare_s, bare_lat),
                ("bare-nr", nr_s, nr_lat),
            )
            for name, wall, lat in rows:
                ratio = f"{bare_s / real_s:6.2f}" if name == "real" else ""
                p50, p95 = pct(lat, 0.5) * 1000, pct(lat, 0.95) * 1000
                print(f"{rnd:<6} {name:<8} {tasks:>6} {wall:8.2f} {args.n / wall:10.1f} "
                      f"{p50:8.0f} {p95:8.0f} {ratio:>6}")  # fmt: skip
            for x in client.results(subs[0].run_id):
                statuses[x.status] = statuses.get(x.status, 0) + 1
        print(f"throughput ratio real/bare (median of {len(ratios)}): "
              f"{statistics.median(ratios):.2f}x  (goal >= 0.80x)")  # fmt: skip
        print(f"stricter, real/bare-nr (no-op stages that store no result either): "
              f"{statistics.median(strict):.2f}x")  # fmt: skip
        print("statuses:", statuses)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
