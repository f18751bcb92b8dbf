"""The repair budget's utilisation when demand passes the cap, beside the ideal.

    python bench/budget.py [--n 20] [--demand 2,1.95] [--workers 2] [--concurrency 4]
                           [--latency 0.05] [--redis URL]

N outputs that each need exactly one LLM repair (the fake critic finds a critical defect in the
first critique and accepts the repaired output) are submitted at once through real worker
processes (their defaults: ``llm.max_tokens`` 2048) against the fake OpenAI-compatible server
(``tests/fakes/openai_server.py``, every answer after ``--latency`` seconds, usage reported as
the provider would: a token per four characters). One probe submission first measures what a
repair phase really costs (the repair call and the re-critique, as charged); the cap is then
``N × that / demand``, for each demand of ``--demand`` (by default twice the cap, where the cap
is 10 repairs' worth, and 1.95×, where it is 10¼). Four modes, each on every cap:

* **before**: the re-critique reserved at the whole ``llm.max_tokens`` and no wait
  (``CRITIQUE_LLM__RECRITIQUE_MAX_TOKENS=2048``, ``budget.wait_s`` 0): how the budget behaved
  before repairs waited for held tokens;
* **sized**: the re-critique reserved at its short envelope bound (``llm.recritique_max_tokens``,
  512), still no wait;
* **sized+wait**: sized, and a reservation that only held tokens block waits for them
  (``budget.wait_s`` 60), but a round whose full bound would pass the cap is refused
  (``budget.size_from_usage`` false);
* **from-usage**: the defaults: sized+wait, and a round whose full bound would pass the cap is
  sized from what the run's committed repairs used (``budget.size_from_usage``).

Prints per demand and mode the mean reservation of a funded repair round, the repairs funded
(and how many of them were sized from the run's repairs) and refused, the spend, the
utilisation (spent / cap) and the ideal (the most whole repairs the cap can fund, × their
cost, / cap), and how many repairs waited. The Redis database is flushed before each worker set
(``--redis``: give it a database used for nothing else; default: a redis-server of its own).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._provenance import git_commit  # noqa: E402

MODEL = "openai/critic-model"
TASK = (
    "Summarise the quarterly sales report of one region: give a summary, the key findings with "
    "their figures, and a confidence between 0 and 1."
)
WORDS = ["north", "south", "region", "store", "online", "order", "growth", "margin", "price"]


class Provider:
    """The fake provider: the critic finds one critical defect in round 1 and accepts from
    round 2; the repairer writes a fresh, complete output. Usage is the fake's own
    (``len(text) // 4`` both ways)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0

    def critic(self, body: dict[str, Any]) -> str:
        from tests.fakes.openai_server import user_text

        first = "Critique round: 1" in user_text(body)
        defects = [
            {
                "category": "incomplete",
                "severity": "critical",
                "location": "findings",
                "description": "the findings give no figures: each finding needs its number",
            }
        ]
        return json.dumps(
            {
                "score": 0.4 if first else 0.95,
                "defects": defects if first else [],
                "prescriptions": ["Give each finding with its figure."] if first else [],
                "reusable_patterns": [],
                "summary": "findings without figures" if first else "complete",
            }
        )

    def repair(self, body: dict[str, Any]) -> str:
        with self._lock:
            self._n += 1
            rng = random.Random(self._n)
        return json.dumps(
            {
                "summary": " ".join(rng.choice(WORDS) for _ in range(40)),
                "findings": " ".join(rng.choice(WORDS) for _ in range(60)),
                "confidence": 0.8,
            }
        )


def submission(run_id: str, i: int) -> Any:
    from pipeline.models import Submission

    rng = random.Random(10_000 + i)
    return Submission(
        run_id=run_id,
        worker_id=f"w{i:03d}",
        task=TASK,
        output={
            "summary": " ".join(rng.choice(WORDS) for _ in range(40)),
            "findings": " ".join(rng.choice(WORDS) for _ in range(30)),
            "confidence": 0.8,
        },
        required_fields=("summary", "findings", "confidence"),
    )


VERSIONED = ("celery", "kombu", "redis", "litellm", "httpx", "pydantic")


def versions_line(url: str) -> str:
    """Python, the libraries on the measured path, the Redis server and the commit."""
    from importlib import metadata

    import redis

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    try:
        server = str(redis.Redis.from_url(url).info("server").get("redis_version", "?"))
    except redis.RedisError:
        server = "?"
    libs = ", ".join(f"{'redis-py' if n == 'redis' else n} {version(n)}" for n in VERSIONED)
    return (
        f"versions: Python {sys.version.split()[0]}, {libs}, redis-server {server}; "
        f"commit {git_commit()}"
    )


def config(total_cap: int, wait_s: float, from_usage: bool = True) -> dict[str, Any]:
    return {
        "enabled": True,
        "critic": "llm",
        "model": MODEL,
        "max_repair_attempts": 1,
        "budget": {
            "total_tokens": round(total_cap / 0.15) + 1,
            "wait_s": wait_s,
            "size_from_usage": from_usage,
        },
    }


def run_mode(
    args: argparse.Namespace,
    client_cls: Any,
    name: str,
    cap: int | None,
    wait_s: float,
    from_usage: bool = False,
) -> dict[str, Any]:
    """One mode's run; with ``cap`` None, a probe that measures a repair phase's cost."""
    run_id = f"bench-budget-{name.replace('+', '-')}-{uuid.uuid4().hex[:6]}"
    if cap is None:
        client = client_cls(config(10**9, wait_s))
        [probe] = client.wait_many([client.submit(submission(run_id, 9999))], timeout=120)
        return {"per_repair": probe.budget_charged}
    client = client_cls(config(cap, wait_s, from_usage))
    t0 = time.perf_counter()
    results = client.wait_many(
        client.submit_many([submission(run_id, i) for i in range(args.n)]), timeout=600
    )
    wall = time.perf_counter() - t0
    events = list(client.trace(run_id))
    reserved = [e["reserved"] for e in events if e.get("reserved")]
    charged = [r.budget_charged for r in results if r.budget_charged]
    refused = [r for r in results if r.stop_reason == "repair_budget_exhausted"]
    waits = [e["budget_wait_s"] for e in events if e.get("budget_wait_s") is not None]
    tight = [e for e in events if e.get("budget_full") is not None]
    return {
        "mode": name,
        "cap": cap,
        "tight": len(tight),
        "reserved": round(sum(reserved) / len(reserved)) if reserved else 0,
        "funded": len(charged),
        "refused": len(refused),
        "spent": sum(charged),
        "waited": len(waits),
        "longest_wait": max(waits, default=0.0),
        "wall": wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=20, help="outputs, each needing one repair")
    ap.add_argument(
        "--demand", default="2,1.95", help="demand / cap, one run per value (comma-separated)"
    )
    ap.add_argument("--workers", type=int, default=2, help="worker processes")
    ap.add_argument("--concurrency", type=int, default=4, help="threads per worker")
    ap.add_argument("--latency", type=float, default=0.05, help="fake server's answer delay, s")
    from bench._redis import add_redis_option, redis_url

    add_redis_option(ap)
    args = ap.parse_args()
    args.redis = redis_url(args.redis)
    demands = [float(d) for d in str(args.demand).split(",") if d.strip()]

    from tests.fakes.openai_server import CRITIC, REPAIR, FakeOpenAIServer
    from tests.integration.workers import WorkerProcess, client_on
    from workers.client import CritiqueClient

    provider = Provider()
    rows: list[dict[str, Any]] = []
    per_repair = 0
    with FakeOpenAIServer() as fake, tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        fake.on(CRITIC, lambda body: {"reply": provider.critic(body), "delay_s": args.latency})
        fake.on(REPAIR, lambda body: {"reply": provider.repair(body), "delay_s": args.latency})
        for recritique, modes in (
            ("2048", (("before", 0.0, False),)),
            (
                "512",
                (("sized", 0.0, False), ("sized+wait", 60.0, False), ("from-usage", 60.0, True)),
            ),
        ):
            extra = {
                "CRITIQUE_LLM_API_KEY": "sk-test",
                "CRITIQUE_ALLOWED_MODELS": MODEL,
                "CRITIQUE_LLM__API_BASE": fake.api_base,
                "CRITIQUE_LLM__TIMEOUT_S": "30",
                "CRITIQUE_LLM__RECRITIQUE_MAX_TOKENS": recritique,
            }
            with client_on(args.redis, **extra) as env:  # flushes the database first
                procs = [
                    WorkerProcess(
                        env["REDIS_URL"],
                        concurrency=args.concurrency,
                        name=f"bench-budget-{recritique}-{i}",
                        env=env,
                        log=Path(tmp) / f"{recritique}-{i}.log",
                    ).start()
                    for i in range(args.workers)
                ]
                try:
                    if not per_repair:
                        per_repair = run_mode(args, CritiqueClient, "probe", None, 0.0)[
                            "per_repair"
                        ]
                    for demand in demands:
                        cap = round(args.n * per_repair / demand)
                        for name, wait_s, from_usage in modes:
                            row = run_mode(args, CritiqueClient, name, cap, wait_s, from_usage)
                            rows.append({**row, "demand": demand})
                finally:
                    for w in procs:
                        w.stop()
        print(versions_line(args.redis))
    print(
        f"N={args.n} outputs, each needing one LLM repair costing {per_repair} tokens "
        f"(repair + re-critique, as the fake provider reports them); {args.workers} worker "
        f"process(es) x {args.concurrency} threads; fake server latency "
        f"{args.latency * 1000:.0f} ms"
    )
    print(
        f"{'demand':>6} {'cap':>6} {'mode':<11} {'reserved':>8} {'funded':>6} {'from use':>8} "
        f"{'refused':>7} {'spent':>7} {'utilisation':>11} {'ideal':>6} {'waited':>6} "
        f"{'longest s':>9} {'wall s':>6}"
    )
    rows.sort(key=lambda r: -r["demand"])
    for r in rows:
        cap = r["cap"]
        ideal = min(args.n, cap // per_repair) * per_repair if per_repair else 0
        print(
            f"{r['demand']:>5g}x {cap:>6} {r['mode']:<11} {r['reserved']:>8} {r['funded']:>6} "
            f"{r['tight']:>8} {r['refused']:>7} {r['spent']:>7} {r['spent'] / cap:>11.1%} "
            f"{ideal / cap:>6.1%} {r['waited']:>6} {r['longest_wait']:>9.1f} {r['wall']:>6.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
