"""The critique phase of one AWP iteration: AWP's in-process engine against the fleet.

    python bench/awp.py [--workers 16] [--latency-ms 1000] [--fleet 1,2,4] [--concurrency 4]
                        [--repeat 3] [--redis URL]

One run, rows side by side, each the median of ``--repeat`` timed calls (after one warm-up):

* **awp in-process** (the baseline): ``awp.runtime.critique.CritiqueEngine.critique_results`` on
  ``--workers`` worker results, as AWP's delegation-loop runner calls it: its thread pool (at
  most 16 threads) sends each result to the critic model through AWP's ``LLMClient``.
* **fleet N**: :class:`workers.adapters.awp.FleetCritiqueEngine` (what ``critique awp run``
  installs) on the same results, with N ``critique worker`` processes (``--processes 1 -c
  --concurrency`` each) whose LLM critic is the same model.

The critic is a fake OpenAI-compatible server in its own process that answers every request after
``--latency-ms`` with an accepting critique (both critics read the same JSON shape). Every
result is distinct (a nonce per call), so the fleet's critique cache never answers. The
wall-clock time is ``critique_results`` from call to return; "calls" is what the server counted
for that call (one per result: nothing critiqued twice). Needs the awp extra
(``pip install -c constraints.txt -e '.[dev,awp]'``); the header names the versions and commit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This file is named after the package it measures: its own directory must not shadow ``awp``.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _fake_llm  # noqa: E402
from bench._fake_llm import ServerProcess  # noqa: E402
from bench._provenance import git_commit  # noqa: E402
from bench._redis import add_redis_option, redis_url  # noqa: E402

CRITIC_MODEL = "openai/fake-critic"
ACCEPT = json.dumps(
    {
        "score": 0.95,
        "defects": [],
        "prescriptions": [],
        "reusable_patterns": [],
        "effort_estimate": "trivial",
        "summary": "fine",
    }
)
VERSIONED = ("awp-agents", "celery", "kombu", "redis", "litellm", "openai", "httpx", "pydantic")


def serve(latency_s: float) -> int:
    """The fake critic alone (``--serve``): prints its URL, answers until SIGTERM."""
    from tests.fakes.openai_server import reply

    return _fake_llm.serve(lambda body: reply(ACCEPT, delay_s=latency_s))


def results(n: int, nonce: str) -> list[dict[str, Any]]:
    """One iteration's delegation results, as AWP's runner hands them to its engine."""
    contract = {"required_fields": ["summary", "findings", "confidence"]}
    return [
        {
            "worker_id": f"w{k}",
            "envelope": {"instructions": f"Survey aspect {k}.", "output_contract": contract},
            "result": {
                "summary": f"Aspect {k} ({nonce}): two observations recorded.",
                "findings": [f"aspect {k} observation A", f"aspect {k} observation B"],
                "confidence": 0.85,
            },
        }
        for k in range(1, n + 1)
    ]


def timed(
    engine: Any, server: ServerProcess, n: int, repeat: int
) -> tuple[float, list[float], int]:
    """Median wall seconds of ``critique_results`` (after a warm-up), each run, calls per run."""
    engine.critique_results(results(n, uuid.uuid4().hex), "Survey the project.", 1)
    walls: list[float] = []
    calls = 0
    for i in range(repeat):
        before = server.calls()
        started = time.perf_counter()
        envelopes = engine.critique_results(results(n, uuid.uuid4().hex), "Survey.", i + 2)
        walls.append(time.perf_counter() - started)
        calls = server.calls() - before
        if len(envelopes) != n or any(e.score < 0.9 for e in envelopes):
            raise RuntimeError(f"unexpected verdicts: {[e.summary for e in envelopes][:3]}")
    return statistics.median(walls), walls, calls


def start_workers(count: int, concurrency: int, env: dict[str, str], logdir: Path) -> list[Any]:
    exe = str(Path(sys.executable).with_name("critique"))
    procs = []
    for i in range(count):
        log = open(logdir / f"worker-{i}.log", "ab")  # noqa: SIM115 - closed with the process
        argv = [exe, "worker", "--processes", "1", "-c", str(concurrency), "-n", f"bench{i}@%h"]
        procs.append(
            subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        )
    from workers.app import app

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a critique worker exited; see {logdir}")
        if len(app.control.ping(timeout=1.0) or []) >= count:
            return procs
    raise RuntimeError("the critique workers did not answer a ping")


def stop_workers(procs: list[Any]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def versions(url: str) -> str:
    from importlib import metadata

    import redis

    libs = []
    for name in VERSIONED:
        try:
            libs.append(f"{'redis-py' if name == 'redis' else name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            libs.append(f"{name} not installed")
    server = redis.Redis.from_url(url).info("server").get("redis_version", "?")
    return (
        f"versions: Python {sys.version.split()[0]}, {', '.join(libs)}, redis-server {server}; "
        f"commit {git_commit()}; {os.cpu_count()} cores"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=16, help="worker results per iteration")
    ap.add_argument("--latency-ms", type=float, default=1000.0, help="the critic's latency")
    ap.add_argument("--fleet", default="1,2,4", help="critique worker processes per fleet row")
    ap.add_argument("--concurrency", type=int, default=4, help="threads per critique worker")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per row (median)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    add_redis_option(ap)
    args = ap.parse_args()
    latency_s = args.latency_ms / 1000.0
    if args.serve:
        return serve(latency_s)
    try:
        from awp.models.orchestration import CritiqueConfig as AwpCritiqueConfig
        from awp.runtime.critique import CritiqueEngine
    except ImportError:
        print("bench/awp.py needs the awp extra: pip install -c constraints.txt -e '.[dev,awp]'")
        return 2
    logging.getLogger("workers.adapters.awp").setLevel(logging.ERROR)
    url = redis_url(args.redis)
    server = ServerProcess(__file__, ["--latency-ms", str(latency_s * 1000)])
    env = dict(os.environ)
    env.update(
        REDIS_URL=url,
        CELERY_BROKER_URL=url,
        CELERY_RESULT_BACKEND=url,
        CRITIQUE_SECRET=secrets.token_hex(32),
        CRITIQUE_CRITIC="llm",
        CRITIQUE_MODEL=CRITIC_MODEL,
        CRITIQUE_ALLOWED_MODELS=CRITIC_MODEL,
        CRITIQUE_LLM_API_KEY="sk-bench",
        CRITIQUE_LLM__API_BASE=server.url + "/v1",
        CRITIQUE_LLM__MAX_RETRIES="0",
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LLM_BASE_URL=server.url + "/v1",
        LLM_API_KEY="sk-bench",
        LLM_MODEL="fake-model",
        PYTHONPATH=str(ROOT),
    )
    os.environ.update(env)
    print(f"AWP critique phase: {args.workers} worker results, critic latency {latency_s:g} s")
    print(versions(url))
    rows: list[tuple[str, int | str, int, float, list[float], int]] = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-awp-"))
    try:
        cfg = AwpCritiqueConfig(enabled=True, model="fake-model")
        awp = CritiqueEngine(
            config=cfg, workflow_dir=workdir, run_id="bench", max_parallel_workers=16
        )
        median, walls, calls = timed(awp, server, args.workers, args.repeat)
        rows.append(("awp in-process", "-", min(16, args.workers), median, walls, calls))
        from workers.adapters.awp import FleetCritiqueEngine

        for count in (int(x) for x in args.fleet.split(",") if x.strip()):
            procs = start_workers(count, args.concurrency, env, workdir)
            try:
                fleet = FleetCritiqueEngine(
                    config=cfg, workflow_dir=workdir, run_id=f"bench-{count}-{uuid.uuid4().hex[:6]}"
                )
                median, walls, calls = timed(fleet, server, args.workers, args.repeat)
                rows.append(("fleet", count, count * args.concurrency, median, walls, calls))
            finally:
                stop_workers(procs)
    finally:
        server.stop()
    base = rows[0][3]
    print()
    print(f"{'engine':<16}{'processes':>10}{'parallel':>10}{'calls':>7}{'wall s':>9}"
          f"{'runs':>22}{'vs awp':>9}")  # fmt: skip
    for name, procs_, par, median, walls, calls in rows:
        runs = " ".join(f"{w:.2f}" for w in walls)
        ratio = "baseline" if name.startswith("awp") else f"{base / median:.2f}x"
        print(f"{name:<16}{procs_!s:>10}{par:>10}{calls:>7}{median:>9.2f}{runs:>22}{ratio:>9}")
    print("\nvs awp: AWP's in-process wall time / this row's (above 1: faster than AWP's threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
