"""The critique cache's effect on a run with duplicate outputs, side by side with it off.

    python bench/cache.py [--n 60] [--dup 0.3] [--latency 0.2] [--workers 2] [--concurrency 4]
                          [--redis URL]

N outputs, a fraction ``--dup`` of them verbatim copies of others (shuffled, fixed seed), are
critiqued by the LLM critic against the fake OpenAI-compatible server
(``tests/fakes/openai_server.py``, every answer after ``--latency`` seconds) through real
worker processes, once with ``CRITIQUE_CACHE__ENABLED=true`` and once without. Before each mode
the Redis database is flushed (it must be one used for nothing else) and the workers are
restarted; one warm-up submission (not counted) loads litellm in each. Prints, per mode, the
LLM calls the server received, the tokens (sum of the results' usage), the wall time from the
first submission to the last result, and the ratio cache-on / cache-off.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CRITIC_MODEL = "openai/critic-model"
REPLY = json.dumps(
    {
        "score": 0.95,
        "defects": [],
        "prescriptions": [],
        "reusable_patterns": [],
        "summary": "fine",
    }
)


def outputs(n: int, dup: float, seed: int = 7) -> list[dict[str, Any]]:
    """``n`` outputs of which ``round(n * dup)`` repeat one of the distinct ones."""
    rng = random.Random(seed)
    n_dup = round(n * dup)
    distinct = [
        {"summary": f"Sales in region {i} rose {i % 9 + 1}% in Q3.", "confidence": 0.9}
        for i in range(n - n_dup)
    ]
    out = distinct + [dict(rng.choice(distinct)) for _ in range(n_dup)]
    rng.shuffle(out)
    return out


def run_mode(args: argparse.Namespace, cache: bool, logdir: Path) -> dict[str, Any]:
    from pipeline.models import Submission
    from tests.fakes.openai_server import FakeOpenAIServer, reply
    from tests.integration.workers import WorkerProcess, client_on
    from workers.client import CritiqueClient

    extra = {
        "CRITIQUE_LLM_API_KEY": "sk-test",
        "CRITIQUE_LLM__TIMEOUT_S": "30",
    }
    if cache:
        extra["CRITIQUE_CACHE__ENABLED"] = "true"
    mode = "cache-on" if cache else "cache-off"
    with FakeOpenAIServer() as fake:
        fake.set_default(lambda _body: reply(REPLY, delay_s=args.latency))
        extra["CRITIQUE_LLM__API_BASE"] = fake.api_base
        with client_on(args.redis, **extra) as env:  # flushes the database first
            procs = [
                WorkerProcess(
                    env["REDIS_URL"],
                    concurrency=args.concurrency,
                    name=f"bench-{mode}-{i}",
                    env=env,
                    log=logdir / f"{mode}-{i}.log",
                ).start()
                for i in range(args.workers)
            ]
            try:
                client = CritiqueClient({"enabled": True, "critic": "llm", "model": CRITIC_MODEL})
                warm = Submission(
                    run_id=f"warm-{uuid.uuid4().hex[:8]}",
                    worker_id="warm",
                    task="Summarise the report.",
                    output={"summary": "warm-up", "confidence": 0.5},
                    required_fields=("summary",),
                )
                client.wait(client.submit(warm), 120)
                calls_before = len(fake.completions)
                run_id = f"bench-cache-{uuid.uuid4().hex[:8]}"
                subs = [
                    Submission(
                        run_id=run_id,
                        worker_id=f"w{i:03d}",
                        task="Summarise the report.",
                        output=out,
                        required_fields=("summary",),
                    )
                    for i, out in enumerate(outputs(args.n, args.dup))
                ]
                t0 = time.perf_counter()
                results = client.wait_many(client.submit_many(subs), timeout=600)
                wall = time.perf_counter() - t0
            finally:
                for w in procs:
                    w.stop()
        calls = len(fake.completions) - calls_before
    hits = sum(any("critique cache hit" in n for n in r.notes) for r in results)
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return {
        "mode": mode,
        "calls": calls,
        "tokens": sum(r.usage.tokens for r in results),
        "wall": wall,
        "hits": hits,
        "statuses": statuses,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--dup", type=float, default=0.3, help="fraction of duplicate outputs")
    ap.add_argument("--latency", type=float, default=0.2, help="fake server's answer delay, s")
    ap.add_argument("--workers", type=int, default=2, help="worker processes")
    ap.add_argument("--concurrency", type=int, default=4, help="threads per worker")
    from bench._redis import add_redis_option, redis_url

    add_redis_option(ap)
    args = ap.parse_args()
    args.redis = redis_url(args.redis)

    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        rows = [run_mode(args, False, Path(tmp)), run_mode(args, True, Path(tmp))]
    off, on = rows
    n_dup = round(args.n * args.dup)
    print(
        f"N={args.n} outputs, {n_dup} duplicates ({args.dup:.0%}), LLM critic, fake server "
        f"latency {args.latency * 1000:.0f} ms, {args.workers} worker process(es) x "
        f"{args.concurrency} threads"
    )
    print(f"{'mode':<10} {'LLM calls':>9} {'tokens':>8} {'wall s':>7} {'cache hits':>10}  statuses")
    for r in rows:
        print(
            f"{r['mode']:<10} {r['calls']:>9} {r['tokens']:>8} {r['wall']:7.2f} "
            f"{r['hits']:>10}  {r['statuses']}"
        )

    def ratio(key: str) -> str:
        return f"{on[key] / off[key]:.2f}" if off[key] else "n/a"

    print(
        f"{'on/off':<10} {ratio('calls'):>9} {ratio('tokens'):>8} {ratio('wall'):>7} "
        f"{'':>10}  (ideal for calls and tokens: {(args.n - n_dup) / args.n:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
