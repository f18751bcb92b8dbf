"""LLM-bound throughput: `critique worker` (its defaults) against a CPU-bound asyncio peer.

    python bench/llm.py [--n 600] [--latency-ms 200] [--slow-n 200] [--slow-latency-ms 2000]
                        [--processes N] [--concurrency N] [--no-pin] [--peer-in-flight 256]
                        [--server-backlog 1024] [--rounds N] [--quick] [--redis URL]

Per row (one fake-server latency), in one run, side by side:

* **pipeline**: a fake OpenAI-compatible server (``tests/fakes/openai_server.py``, in its own
  process, every answer after the latency) and one ``critique worker`` command with its defaults
  (every queue, its default pool, concurrency and CPU pinning; ``--processes`` /
  ``--concurrency`` / ``--no-pin`` are passed on when given). N outputs are submitted at once
  with the LLM critic: the critic finds a critical defect in half of them (first critique),
  each of those gets one LLM repair and an LLM re-critique that accepts it; the other half is
  accepted at once. 2·N calls in all (N/2 × 1 + N/2 × 3), checked against what the server
  counted.
* **peer**: what a user would write instead (bench/peer.py): one fresh process, one asyncio
  event loop, ``litellm.acompletion`` with its defaults, every output at once (each output's
  calls in sequence) with at most ``--peer-in-flight`` (256) calls in flight (at the slow
  latency ``--slow-peer-in-flight``, 64: issue 22's latency-bound comparison), replaying per
  output the very requests the pipeline sent (same prompts, same order, same server; a low
  critic score leads to the repair and the re-critique, as in the pipeline). With that many in
  flight the loop's CPU, not the server's latency, bounds it at 200 ms (64 in flight left its
  process at ~65 % of a core on this workload).

Per side: "cpu ms/call" is the CPU of the worker's processes (pipeline) or of the peer's
process during the timed run per call; "cpu %" the same CPU over the wall time, in % of one
core (100: one core busy every moment); "host %" every CPU of the machine busy over the same
time (at most 100 x the CPUs: it includes Redis, the fake server and whatever else runs);
"bound" what limits the side: ``cpu`` (its own CPU: the peer at >= 85 % of its one core, the
worker at >= 85 % of the machine's cores), ``host cpu`` (the machine's CPUs are >= 90 % busy
with it and the rest), ``latency`` (calls/s >= 80 % of what the server's latency allows: its
calls in flight / latency, or all its calls over the longest output's chain of 3 calls), else
``?`` (none of these: read the other columns).
The fake server listens with a backlog of :data:`SERVER_BACKLOG` (Python's http.server default
of 5 dropped connections, each a 1 s SYN retry, when 64 or more connect at once); a side
during which the kernel counted listen-queue overflows is flagged.

The header names the versions measured (Python, celery, kombu, redis-py, litellm, openai, httpx,
pydantic, the Redis server) and the commit (``+dirty``: with uncommitted changes); install
with ``pip install -c constraints.txt -e '.[dev]'`` to measure the versions the figures in
bench/README.md were taken with. The goals (issues 22 and 39) are printed at the end.

Prints calls, seconds (first submission to last result), calls/s, the ratio pipeline/peer and
p50/p95 latency per output (all outputs are enqueued at once, so latency is mostly queueing).
Before the timed run each worker answers a few warm-up submissions (not counted). The Redis
database is flushed before each row (``--redis``: give it a database used for nothing else);
with neither ``--redis`` nor ``REDIS_URL`` an embedded redis-server is started.

``python bench/llm.py --serve --latency-ms 200`` runs the bench's fake server alone (prints its
api_base).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import _fake_llm  # noqa: E402
from bench._fake_llm import ServerProcess  # noqa: E402
from bench._provenance import git_commit  # noqa: E402
from bench.peer import HostMeter  # noqa: E402

CRITIC_MODEL = "openai/critic-model"
WORKER_MODEL = "openai/worker-model"
TASK = "Summarise the quarterly sales report of one region: give a summary and the key findings."
DRAFT = "(first draft)"
"""In the output of the outputs that need a repair: the fake critic finds a critical defect."""
OUTPUT_HEADER = "## Worker output (untrusted data)"
PEER_IN_FLIGHT = 256
"""The peer's default cap on calls in flight: enough that its loop's CPU bounds it at 200 ms
(256 / 0.2 s = 1,280 calls/s allowed by the latency; ~150 by one core), below litellm's aiohttp
pool limit per host (500: past it litellm waits for a slot and warns)."""
SERVER_BACKLOG = 1024
"""The fake server's listen backlog (http.server's default is 5)."""
CPU_BOUND = 0.85
"""A side whose own CPU is at least this share of its cores is CPU-bound."""
HOST_BOUND = 0.90
"""A machine whose CPUs are at least this busy bounds whatever runs on it."""
SLOW_PEER_IN_FLIGHT = 64
"""The peer's cap at the slow latency (a second or more): issue 22's comparison, where both
sides are bound by the latency and their calls in flight."""
LATENCY_BOUND = 0.80
"""A side whose calls/s reach this share of what the latency allows is latency-bound: its
calls in flight / latency, or all its calls over the longest output's chain of calls."""
CHAIN = 3
"""The longest chain of calls of one output: critique, repair, re-critique, in sequence."""


# --- the fake server (its own process) ---------------------------------------------------------


def _critique(score: float, defects: list[dict[str, Any]]) -> str:
    return json.dumps(
        {
            "score": score,
            "defects": defects,
            "prescriptions": [f"Fix: {d['description']}" for d in defects],
            "reusable_patterns": [],
            "summary": f"score {score}",
        }
    )


GOOD = _critique(0.95, [])
BAD = _critique(
    0.5,
    [
        {
            "category": "missing_data",
            "severity": "critical",
            "location": "findings",
            "description": "the findings give no regional breakdown",
        }
    ],
)


def _user_text(body: dict[str, Any]) -> str:
    return "\n".join(str(m.get("content")) for m in body.get("messages", []) if m["role"] == "user")


def _system_text(body: dict[str, Any]) -> str:
    return "\n".join(
        str(m.get("content")) for m in body.get("messages", []) if m["role"] == "system"
    )


def region_of(body: dict[str, Any]) -> int | None:
    """The output a request is about: the region number in its (last) output block."""
    text = _user_text(body).rsplit(OUTPUT_HEADER, 1)[-1]
    found = re.findall(r"region (\d+)", text)
    return int(found[-1]) if found else None


def responder(body: dict[str, Any]) -> str:
    """The critic: a critical defect in a draft, else accept; the repairer: the fixed output."""
    system = _system_text(body)
    if system.startswith("You are repairing"):
        region = region_of(body)
        return json.dumps(fixed_output(region if region is not None else 0))
    text = _user_text(body).rsplit(OUTPUT_HEADER, 1)[-1]
    return BAD if DRAFT in text else GOOD


def serve(latency_s: float, backlog: int = SERVER_BACKLOG) -> int:
    """The fake server alone (``--serve``): the bench's replies after ``latency_s``."""
    from tests.fakes.openai_server import reply

    return _fake_llm.serve(lambda body: reply(responder(body), delay_s=latency_s), backlog)


def server_process(latency_s: float, backlog: int = SERVER_BACKLOG) -> ServerProcess:
    """``bench/llm.py --serve`` in a child process."""
    args = ["--latency-ms", str(latency_s * 1000.0), "--server-backlog", str(backlog)]
    return ServerProcess(__file__, args)


# --- outputs ------------------------------------------------------------------------------------


def fixed_output(region: int) -> dict[str, Any]:
    return {
        "summary": f"Sales in region {region} rose {region % 9 + 1}% in Q3.",
        "findings": f"In region {region} the north grew fastest, the south held steady.",
        "confidence": 0.9,
    }


def output(region: int) -> dict[str, Any]:
    """Odd regions need a repair (the critic finds a defect), even ones are accepted."""
    out = fixed_output(region)
    if region % 2:
        out["summary"] = f"Sales in region {region} rose {region % 9 + 1}% in Q3 {DRAFT}."
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


# --- the pipeline side ----------------------------------------------------------------------------


def start_worker(env: dict[str, str], args: argparse.Namespace, log: Path) -> subprocess.Popen[Any]:
    argv = [str(Path(sys.executable).with_name("critique")), "worker"]
    if not Path(argv[0]).exists():
        argv = [sys.executable, "-m", "workers.cli", "worker"]
    if args.processes is not None:
        argv += ["--processes", str(args.processes)]
    if args.concurrency is not None:
        argv += ["-c", str(args.concurrency)]
    if args.no_pin:
        argv += ["--no-pin"]
    out = open(log, "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop_worker(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM (the worker's warm shutdown), then SIGKILL if it is not gone in 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live descendants; nan without psutil."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return float("nan")
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def wait_ready(r: Any, proc: subprocess.Popen[Any], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"critique worker exited with code {proc.returncode}")
        if r.exists("_kombu.binding.critique.llm"):
            return
        time.sleep(0.1)
    raise RuntimeError("critique worker did not become ready")


def run_pipeline(
    client: Any, r: Any, n: int, run_id: str
) -> tuple[float, list[float], dict[str, int]]:
    from pipeline.models import PassRef, Submission

    subs = [
        Submission(
            run_id=run_id, worker_id=f"w{i:05d}", task=TASK, output=output(i),
            required_fields=("summary", "findings"), model=WORKER_MODEL,
        )
        for i in range(n)
    ]  # fmt: skip
    t0 = time.perf_counter()
    client.submit_many(subs)
    pending = {s.worker_id for s in subs}
    latencies: list[float] = []
    rkey = f"critique:{{{run_id}}}:results:pass"  # "<iteration>:<worker>:<pass>" per result
    while pending:
        refs = (PassRef.parse(run_id, k.decode()) for k in r.hkeys(rkey))
        done = {ref.worker_id for ref in refs if ref is not None} & pending
        now = time.perf_counter()
        latencies += [now - t0] * len(done)
        pending -= done
        if pending:
            time.sleep(0.02)
    wall = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    for x in client.results(run_id):
        statuses[x.status] = statuses.get(x.status, 0) + 1
    return wall, latencies, statuses


# --- the peer -----------------------------------------------------------------------------------


def peer_plans(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The pipeline's requests grouped per output, in the order it sent them."""
    plans: dict[int, list[dict[str, Any]]] = {}
    for rec in sorted(records, key=lambda x: x["at"]):
        region = region_of(rec["body"])
        if region is None:
            raise RuntimeError("a request names no region")
        plans.setdefault(region, []).append(rec["body"])
    return [plans[k] for k in sorted(plans)]


def run_peer(
    records: list[dict[str, Any]], api_base: str, in_flight: int, tmp: Path
) -> dict[str, Any]:
    """bench/peer.py in a process of its own, on the pipeline's requests."""
    plans = tmp / "plans.json"
    plans.write_text(json.dumps(peer_plans(records)), encoding="utf-8")
    argv = [sys.executable, str(ROOT / "bench" / "peer.py"), "--plans", str(plans),
            "--api-base", api_base, "--in-flight", str(in_flight)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"bench/peer.py exited {done.returncode}: {done.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    noise = [line for line in done.stderr.splitlines() if line.strip()]
    if noise:
        print(f"  peer stderr ({len(noise)} lines): {noise[0][:160]}")
    return out


def profile(args: argparse.Namespace, pid: int, latency_s: float) -> subprocess.Popen[Any] | None:
    """``py-spy record`` of the worker (and its child processes) during the timed run."""
    if not args.profile:
        return None
    out = f"{args.profile}-{int(latency_s * 1000)}ms.txt"
    return subprocess.Popen(
        [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid),
         "--subprocesses", "--nonblocking", "--gil", "--duration", str(args.profile_s),
         "--rate", str(args.profile_rate), "--format", "raw", "-o", out],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


# --- what was measured --------------------------------------------------------------------------

VERSIONED = ("celery", "kombu", "redis", "litellm", "openai", "httpx", "pydantic")
"""Distributions whose versions the header prints (``redis`` is redis-py)."""


def dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def redis_server_version(url: str) -> str:
    import redis

    try:
        return str(redis.Redis.from_url(url).info("server").get("redis_version", "?"))
    except redis.RedisError:
        return "?"


def versions_line(redis_url: str) -> str:
    """Python, the libraries on the measured path, the Redis server and the commit."""
    libs = ", ".join(
        f"{'redis-py' if name == 'redis' else name} {dist_version(name)}" for name in VERSIONED
    )
    return (
        f"versions: Python {sys.version.split()[0]}, {libs}, "
        f"redis-server {redis_server_version(redis_url)}; commit {git_commit()}"
    )


# --- one row --------------------------------------------------------------------------------------


def worker_slots(args: argparse.Namespace) -> int:
    """Calls the worker can have in flight: its processes x threads (``critique worker``'s own
    arithmetic for every queue and the threads pool, or what was passed on)."""
    from workers.commands import worker as cmd

    ns = argparse.Namespace(processes=args.processes, concurrency=args.concurrency, pool="threads")
    queues = list(cmd.KNOWN_QUEUES)
    count = cmd.processes(ns, queues)
    return count * cmd.threads_per_process(ns, queues, count)


def bound(row: dict[str, Any], cores: int, cpus: int) -> str:
    """What limits a side (see the module's docstring): cpu, host cpu, latency or ?."""
    wall = row["wall"]
    if row["cpu"] / wall >= CPU_BOUND * cores:
        return "cpu"
    if row["host_cpu"] / wall >= HOST_BOUND * cpus:
        return "host cpu"
    latency_s = row["latency_ms"] / 1000
    allowed = min(row["in_flight"] / latency_s, row["calls"] / (CHAIN * latency_s))
    if row["calls"] / wall >= LATENCY_BOUND * allowed:
        return "latency"
    return "?"


def run_row(
    args: argparse.Namespace, n: int, latency_s: float, logdir: Path
) -> list[dict[str, Any]]:
    import redis

    from pipeline.models import Submission
    from tests.integration.workers import client_on
    from workers.client import CritiqueClient

    server = server_process(latency_s, args.server_backlog)
    try:
        extra = {
            "CRITIQUE_LLM_API_KEY": "sk-test",
            "CRITIQUE_LLM__API_BASE": server.api_base,
            "CRITIQUE_LLM__TIMEOUT_S": "60",
            # a worker that holds a key accepts a submission's model only from this list
            "CRITIQUE_ALLOWED_MODELS": f"{CRITIC_MODEL},{WORKER_MODEL}",
        }
        with client_on(args.redis, **extra) as env:  # flushes the database first
            r = redis.Redis.from_url(args.redis)
            log = logdir / f"worker-{int(latency_s * 1000)}ms.log"
            proc = start_worker(env, args, log)
            try:
                wait_ready(r, proc)
                client = CritiqueClient(
                    {
                        "enabled": True,
                        "critic": "llm",
                        "model": CRITIC_MODEL,
                        "max_repair_attempts": 1,
                        "budget": {"total_tokens": 100_000_000},
                    }
                )
                warm_run = f"warm-{uuid.uuid4().hex[:8]}"
                warm = [
                    Submission(
                        run_id=warm_run, worker_id=f"warm{i}", task=TASK,
                        output=output(100_000 + i), required_fields=("summary", "findings"),
                        model=WORKER_MODEL,
                    )
                    for i in range(args.warmup)
                ]  # fmt: skip
                client.wait_many(client.submit_many(warm), timeout=300)
                before = len(server.completions())
                run_id = f"bench-llm-{uuid.uuid4().hex[:8]}"
                spy = profile(args, proc.pid, latency_s)
                host = HostMeter()
                cpu0 = tree_cpu_s(proc.pid)
                wall, latencies, statuses = run_pipeline(client, r, n, run_id)
                worker_cpu = tree_cpu_s(proc.pid) - cpu0
                host_cpu, overflows = host.stop()
                if spy is not None:
                    spy.wait()
                records = server.completions()[before:]
            finally:
                stop_worker(proc)
        pipeline_calls = len(records)
        cap = args.peer_in_flight if latency_s < 1.0 else args.slow_peer_in_flight
        peer = run_peer(records, server.api_base, cap, logdir)
    finally:
        server.stop()
    common = {"latency_ms": latency_s * 1000, "n": n}
    return [
        {
            **common,
            "side": "pipeline",
            "calls": pipeline_calls,
            "wall": wall,
            "lat": latencies,
            "cpu": worker_cpu,
            "host_cpu": host_cpu,
            "overflows": overflows,
            "in_flight": worker_slots(args),
            "statuses": statuses,
        },
        {
            **common,
            "side": "peer",
            **peer,
            # every output at once: no more in flight than outputs, whatever the cap
            "in_flight": min(n, peer["in_flight"] or n),
            "statuses": {},
        },
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=600, help="outputs at --latency-ms (0: no row)")
    ap.add_argument("--latency-ms", type=float, default=200.0)
    ap.add_argument("--slow-n", type=int, default=200, help="outputs at the slow latency (0: none)")
    ap.add_argument("--slow-latency-ms", type=float, default=2000.0)
    ap.add_argument("--processes", type=int, help="passed on to `critique worker --processes`")
    ap.add_argument("--concurrency", type=int, help="passed on to `critique worker -c`")
    ap.add_argument("--no-pin", action="store_true", help="passed on to `critique worker`")
    ap.add_argument(
        "--peer-in-flight",
        type=int,
        default=PEER_IN_FLIGHT,
        help=f"the peer's cap on calls in flight (0: none; default {PEER_IN_FLIGHT})",
    )
    ap.add_argument(
        "--slow-peer-in-flight",
        type=int,
        default=SLOW_PEER_IN_FLIGHT,
        help=f"the same at the slow latency (default {SLOW_PEER_IN_FLIGHT}: issue 22's peer)",
    )
    ap.add_argument("--warmup", type=int, default=8, help="warm-up submissions (not counted)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat each row; the median ratio")
    ap.add_argument("--quick", action="store_true", help="--n 120 --slow-n 32 (under a minute)")
    ap.add_argument("--redis", default=os.environ.get("REDIS_URL"), help="flushed before each row")
    ap.add_argument("--profile", help="py-spy the worker into PROFILE-<latency>ms.txt (raw)")
    ap.add_argument("--profile-s", type=int, default=10, help="seconds of py-spy")
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument(
        "--server-backlog",
        type=int,
        default=SERVER_BACKLOG,
        help=f"the fake server's listen backlog (default {SERVER_BACKLOG}; http.server's own: 5)",
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.latency_ms / 1000.0, args.server_backlog)
    if args.quick:
        args.n, args.slow_n, args.warmup = 120, 32, 4

    embedded = None
    if not args.redis:
        from workers.embedded import EmbeddedRedis

        embedded = EmbeddedRedis().start()
        args.redis = embedded.url
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

    rows_spec = [(args.n, args.latency_ms / 1000.0)] if args.n > 0 else []
    if args.slow_n > 0:
        rows_spec.append((args.slow_n, args.slow_latency_ms / 1000.0))
    worker_desc = (
        "critique worker"
        + (f" --processes {args.processes}" if args.processes is not None else "")
        + (f" -c {args.concurrency}" if args.concurrency is not None else "")
        + (" --no-pin" if args.no_pin else "")
        + f" (defaults: {worker_slots(args)} calls in flight)"
    )
    cap = f"at most {args.peer_in_flight}" if args.peer_in_flight > 0 else "no cap on"
    cap += f" ({args.slow_peer_in_flight} at {args.slow_latency_ms:.0f} ms)"
    cpus = os.cpu_count() or 1
    print(f"pipeline: {worker_desc}; peer: bench/peer.py, one process, one asyncio loop, "
          f"litellm.acompletion, every output at once, {cap} calls in flight; half the outputs "
          f"need one repair; {cpus} CPUs")  # fmt: skip
    print(versions_line(args.redis))
    header = (
        f"{'latency':>8} {'round':>5} {'side':<9} {'outputs':>7} {'calls':>6} {'wall s':>7} "
        f"{'calls/s':>8} {'ratio':>6} {'p50 s':>7} {'p95 s':>7} {'cpu ms/call':>11} "
        f"{'cpu %':>6} {'host %':>6} {'bound':<8}  statuses"
    )
    print(header)
    ratios: dict[float, list[float]] = {}
    cpu_ratios: dict[float, list[float]] = {}
    cpu_per_call: dict[float, dict[str, list[float]]] = {}
    peer_bounds: dict[float, list[str]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-llm-") as tmp:
            for n, latency_s in rows_spec:
                for rnd in range(1, args.rounds + 1):
                    pipe, peer = run_row(args, n, latency_s, Path(tmp))
                    ratio = (pipe["calls"] / pipe["wall"]) / (peer["calls"] / peer["wall"])
                    ratios.setdefault(latency_s, []).append(ratio)
                    per_call = cpu_per_call.setdefault(latency_s, {"pipeline": [], "peer": []})
                    for row in (pipe, peer):
                        cores = cpus if row is pipe else 1
                        cpu_ms = row["cpu"] * 1000 / max(1, row["calls"])
                        per_call[row["side"]].append(cpu_ms)
                        shown = f"{ratio:6.2f}" if row is pipe else ""
                        print(
                            f"{row['latency_ms']:>6.0f}ms {rnd:>5} {row['side']:<9} "
                            f"{row['n']:>7} {row['calls']:>6} {row['wall']:7.2f} "
                            f"{row['calls'] / row['wall']:8.1f} {shown:>6} "
                            f"{pct(row['lat'], 0.5):7.2f} {pct(row['lat'], 0.95):7.2f} "
                            f"{cpu_ms:11.1f} {100 * row['cpu'] / row['wall']:6.0f} "
                            f"{100 * row['host_cpu'] / row['wall']:6.0f} "
                            f"{bound(row, cores, cpus):<8}  {row['statuses'] or ''}",
                            flush=True,
                        )
                    cpu_ratios.setdefault(latency_s, []).append(
                        per_call["pipeline"][-1] / per_call["peer"][-1]
                    )
                    peer_bounds.setdefault(latency_s, []).append(bound(peer, 1, cpus))
                    for row in (pipe, peer):
                        if row["overflows"] > 0:
                            print(f"  note: {row['overflows']} listen-queue overflows on this "
                                  f"machine during the {row['side']}'s run")  # fmt: skip
                    if pipe["calls"] != 2 * n or peer["calls"] != pipe["calls"]:
                        print(f"  warning: expected {2 * n} calls on each side")
    finally:
        if embedded is not None:
            embedded.stop()
    for latency_s, rs in ratios.items():
        ms = latency_s * 1000
        bounds = "/".join(sorted(set(peer_bounds[latency_s])))
        goal = f"issue 39: >= {THROUGHPUT_GOAL:.2f}x" if ms < 1000 else "issue 22: >= 0.95x"
        print(
            f"calls/s pipeline/peer at {ms:.0f} ms (median of {len(rs)}): "
            f"{statistics.median(rs):.2f}x  (peer bound: {bounds}; {goal})"
        )
    for latency_s, sides in cpu_per_call.items():
        ms = latency_s * 1000
        pipe_ms, peer_ms = statistics.median(sides["pipeline"]), statistics.median(sides["peer"])
        print(
            f"cpu per call at {ms:.0f} ms (median of {len(sides['pipeline'])}): pipeline "
            f"{pipe_ms:.1f} ms, peer {peer_ms:.1f} ms: "
            f"{statistics.median(cpu_ratios[latency_s]):.2f}x  "
            f"(issue 39: <= {CPU_RATIO_GOAL:.1f}x; issue 22: pipeline <= {CPU_GOAL_MS:.0f} ms)"
        )
    return 0


CPU_GOAL_MS = 15.0
"""Issue 22: the worker's CPU per LLM call."""
CPU_RATIO_GOAL = 1.5
"""Issue 39: the worker's CPU per model call at most this times the CPU-bound peer's."""
THROUGHPUT_GOAL = 1.2
"""Issue 39: the fleet's calls/s on the machine's cores at least this times the CPU-bound
peer's (one event loop) at 200 ms."""


if __name__ == "__main__":
    sys.exit(main())
