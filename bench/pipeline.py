"""Throughput of the real chain against bare Celery chains of the same length.

    python bench/pipeline.py [--n 300] [--rounds 3] [--concurrency 4] [--pool threads] [--redis URL]

Starts one worker process through ``critique worker --processes 1`` (the same for both runs),
sends N mixed submissions (clean and defective JSON worker results; heuristic critic,
deterministic repair) through the real chain, then N bare chains of no-op tasks with exactly
the lengths the real chains had (tasks per chain of each kind of output, counted by the worker
before the rounds) carrying the same first message, and prints throughput, the ratio, p50/p95
latency per output, and the worker's CPU time per output (user + system of the worker's
processes, from /proc, over the run). "bare" is default Celery tasks (each stores its result);
"bare-nr" stores only the last one's, as the pipeline does (its stage tasks hand state on in
the message and record it in the run's steps hash, so only the gate stores a result): the
stricter baseline. Each round runs the real chain then the bare ones; the reported figure is
the median ratio over the rounds (one round is at the mercy of whatever else the machine does).
With no --redis and no REDIS_URL it starts an embedded redis-server.

The helpers here (:class:`BenchWorker`, :func:`run_real`, :func:`run_bare`, the /proc readers)
serve bench/scale.py and bench/memory.py too.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("clean", "missing", "broken", "clean")
"""The submissions' mix: half clean (accepted at once), half defective (one repair)."""


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


# --- the worker's processes, from /proc ----------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc; just ``pid`` elsewhere)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children", encoding="ascii") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants, plus the
    children they have reaped."""
    total = 0.0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after "pid (comm)": state is field 3, utime/stime 14/15, cutime/cstime 16/17
        total += sum(int(x) for x in fields[11:15]) / _TICK
    return total


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, MiB (VmRSS, summed)."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


# --- a worker started the way users start it ------------------------------------------------------
class BenchWorker:
    """``critique worker --processes P`` (a count or ``auto``) consuming critique.cpu and
    critique.llm, with the bench's no-op tasks loaded, output discarded (or appended to
    ``log``)."""

    def __init__(
        self,
        processes: int | str = 1,
        *,
        pool: str = "threads",
        concurrency: int = 4,
        extra_env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> None:
        from workers.commands.worker import PROCESSES_PER_CPU, available_cpus, node_names

        self.name = f"bench{uuid.uuid4().hex[:6]}"
        host = socket.gethostname()
        # "auto": the command's own default for this (LLM-queue, threads) worker
        auto = PROCESSES_PER_CPU * available_cpus()
        self.count = auto if processes == "auto" else int(processes)
        self.nodes = (
            [f"{self.name}@{host}"]
            if self.count == 1
            else [n.replace("%h", host) for n in node_names(f"{self.name}@%h", self.count)]
        )
        self.argv = [
            sys.executable, "-m", "workers.cli", "worker", "--processes", str(processes),
            "-Q", "critique.cpu,critique.llm", "-P", pool, "-c", str(concurrency),
            "-n", f"{self.name}@%h", "-l", "WARNING",
            "--", "-I", "bench.noop_tasks", "--without-gossip", "--without-mingle",
        ]  # fmt: skip
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), **(extra_env or {}))
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120) -> BenchWorker:
        """Start it and wait until every node answers a ping."""
        from workers.app import app

        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while True:
            replies = app.control.ping(destination=self.nodes, timeout=1.0) or []
            if {n for r in replies for n in r} >= set(self.nodes):
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start: {' '.join(self.argv)}")
            time.sleep(0.5)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_s(self) -> float:
        return tree_cpu_s(self.pid)

    def rss_mb(self) -> float:
        return tree_rss_mb(self.pid)

    def tasks_done(self) -> int:
        """Pipeline tasks (``critique.*`` but the bench's no-ops) its nodes have run so far, as
        Celery counts them (``inspect stats``): what :func:`calibrate` counts."""
        from workers.app import app

        stats = app.control.inspect(destination=self.nodes, timeout=2.0).stats() or {}
        return sum(
            count
            for node in stats.values()
            for name, count in (node.get("total") or {}).items()
            if name.startswith("critique.") and not name.startswith("critique.bench.")
        )

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # SIGTERM: the warm shutdown of every process
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def setup_redis(url: str | None) -> tuple[str, Any]:
    """Point this process (and the workers it starts) at ``url``, else at an embedded
    redis-server; returns the URL and the server to stop (or None)."""
    server = None
    if not url:
        from workers.embedded import EmbeddedRedis

        server = EmbeddedRedis().start()
        url = server.url
    os.environ.update(
        REDIS_URL=url,
        CELERY_BROKER_URL=url,
        CELERY_RESULT_BACKEND=url,
        LITELLM_LOCAL_MODEL_COST_MAP="True",
    )
    return url, server


# --- the two workloads -------------------------------------------------------------------------
CONFIG: dict[str, Any] = {"enabled": True, "budget": {"total_tokens": 10_000_000}}


def submissions(run_id: str, n: int, kinds: tuple[str, ...] = KINDS) -> list[Any]:
    from pipeline.models import Submission

    return [
        Submission(
            run_id=run_id, worker_id=f"w{i:05d}", task="Summarise the Q3 sales report.",
            output=make_output(kinds[i % len(kinds)]), required_fields=("summary", "findings"),
        )
        for i in range(n)
    ]  # fmt: skip


def calibrate(client: Any, worker: BenchWorker, kinds: tuple[str, ...] = KINDS) -> dict[str, int]:
    """Tasks one chain runs for each kind of output, counted by the workers (one submission
    at a time, so the count is exact): the bare chains copy these lengths. Counting instead of
    assuming keeps the comparison fair when the chain's shape changes (a stage folded into
    another, a repair that takes more tasks)."""
    run_id = f"calib-{uuid.uuid4().hex[:8]}"
    lengths: dict[str, int] = {}
    for i, kind in enumerate(dict.fromkeys(kinds)):
        before = worker.tasks_done()
        sub = submissions(run_id, 1, (kind,))[0].model_copy(update={"worker_id": f"c{i}"})
        client.wait(client.submit(sub), 60)
        last, now = -1, worker.tasks_done()
        while now != last:  # the gate's count lands just after its result
            time.sleep(0.3)
            last, now = now, worker.tasks_done()
        lengths[kind] = now - before
    return lengths


def lengths_of(
    subs: list[Any], per_kind: dict[str, int], kinds: tuple[str, ...] = KINDS
) -> dict[str, int]:
    """Each submission's chain length, from its kind (``submissions`` cycles ``kinds``)."""
    return {s.worker_id: per_kind[kinds[i % len(kinds)]] for i, s in enumerate(subs)}


def run_real(
    client: Any,
    r: Any,
    subs: list[Any],
    poll_s: float = 0.02,
    timing: dict[str, float] | None = None,
) -> tuple[float, list[float]]:
    """Submit every submission, wait for every result; returns wall seconds and each output's
    latency (``timing["enqueue_s"]``: how long submitting them all took)."""
    from pipeline.models import PassRef
    from pipeline.store.keys import PASS_RESULTS, run_key

    run_id = subs[0].run_id
    t0 = time.perf_counter()
    sent: dict[str, float] = {}
    for s in subs:
        sent[s.worker_id] = time.perf_counter()
        client.submit(s)
    if timing is not None:
        timing["enqueue_s"] = time.perf_counter() - t0
    latencies: list[float] = []
    pending = set(sent)
    rkey = run_key(run_id, PASS_RESULTS)  # "<iteration>:<worker>:<pass>" -> the pass's result
    while pending:
        refs = (PassRef.parse(run_id, k.decode()) for k in r.hkeys(rkey))
        done = {ref.worker_id for ref in refs if ref is not None} & pending
        now = time.perf_counter()
        latencies += [now - sent[wid] for wid in done]
        pending -= done
        if pending:
            time.sleep(poll_s)
    return time.perf_counter() - t0, latencies


def run_bare(
    subs: list[Any], lengths: dict[str, int], stage: Any = None
) -> tuple[float, list[float]]:
    """The same number of chains with the same lengths and first message, of no-op tasks
    (``stage``, default ``critique.bench.noop``; the last one always stores its result)."""
    from celery import chain

    from bench.noop_tasks import noop
    from pipeline.loop.stages import start
    from workers import runtime

    msgs = {s.worker_id: runtime.encode(start(s), CONFIG) for s in subs}
    stage = stage or noop
    t0 = time.perf_counter()
    bare: list[tuple[float, Any]] = []
    for s in subs:
        n = lengths[s.worker_id]
        # n - 1 no-op stages then one that stores its result, as the task that ends a pass
        if n > 1:
            sig = chain(stage.s(msgs[s.worker_id]), *[stage.s() for _ in range(n - 2)], noop.s())
        else:
            sig = noop.s(msgs[s.worker_id])
        bare.append((time.perf_counter(), sig.apply_async()))
    # Poll the stored results (one GET each) rather than AsyncResult.get: the Redis backend's
    # pub/sub wait can miss a result stored before it subscribed and then waits out its whole
    # timeout (seen here: the bench hung on a bare chain whose result was already stored).
    latencies: list[float] = []
    waiting = list(bare)
    deadline = time.monotonic() + 600
    while waiting:
        still = []
        for started, ar in waiting:
            if ar.ready():
                latencies.append(time.perf_counter() - started)
            else:
                still.append((started, ar))
        waiting = still
        if waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(waiting)} bare chains have no result after 600 s")
            time.sleep(0.02)
    return time.perf_counter() - t0, latencies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pool", default="threads", choices=["threads", "prefork", "solo"])
    ap.add_argument("--redis", default=os.environ.get("REDIS_URL"))
    ap.add_argument("--rounds", type=int, default=3, help="real/bare pairs; the median ratio")
    args = ap.parse_args()

    args.redis, server = setup_redis(args.redis)
    from bench.noop_tasks import noop_nr
    from workers import runtime
    from workers.client import CritiqueClient

    worker = BenchWorker(1, pool=args.pool, concurrency=args.concurrency)
    try:
        worker.start()
        client = CritiqueClient(CONFIG)
        r = runtime.client()
        base = f"bench-{uuid.uuid4().hex[:8]}"
        client.wait(client.submit(submissions(base + "-warm", 1)[0]), 60)  # warm-up
        per_kind = calibrate(client, worker)

        print(f"N={args.n} submissions per round, pool={args.pool} "
              f"concurrency={args.concurrency}, one worker process, "
              f"{args.rounds} round(s)")  # fmt: skip
        print(f"{'round':<6} {'chain':<8} {'tasks':>6} {'wall s':>8} {'outputs/s':>10} "
              f"{'p50 ms':>8} {'p95 ms':>8} {'cpu ms/out':>10} {'ratio':>6}")  # fmt: skip
        ratios: list[float] = []
        strict: list[float] = []
        cpu: dict[str, list[float]] = {"real": [], "bare": [], "bare-nr": []}
        statuses: Counter[str] = Counter()
        for rnd in range(1, args.rounds + 1):
            subs = submissions(f"{base}-{rnd}", args.n)
            lengths = lengths_of(subs, per_kind)
            done0, c0 = worker.tasks_done(), worker.cpu_s()
            real_s, real_lat = run_real(client, r, subs)
            c1 = worker.cpu_s()
            counted = worker.tasks_done() - done0
            if abs(counted - sum(lengths.values())) > 0.01 * sum(lengths.values()):
                print(f"note: the workers ran {counted} pipeline tasks, calibration "
                      f"predicted {sum(lengths.values())}")  # fmt: skip
            bare_s, bare_lat = run_bare(subs, lengths)
            c2 = worker.cpu_s()
            nr_s, nr_lat = run_bare(subs, lengths, noop_nr)
            c3 = worker.cpu_s()
            ratios.append(bare_s / real_s)
            strict.append(nr_s / real_s)
            tasks = sum(lengths.values())
            rows = (
                ("real", real_s, real_lat, c1 - c0),
                ("bare", bare_s, bare_lat, c2 - c1),
                ("bare-nr", nr_s, nr_lat, c3 - c2),
            )
            for name, wall, lat, cpu_s in rows:
                ratio = f"{bare_s / real_s:6.2f}" if name == "real" else ""
                p50, p95 = pct(lat, 0.5) * 1000, pct(lat, 0.95) * 1000
                per_out = cpu_s * 1000 / args.n
                cpu[name].append(per_out)
                print(f"{rnd:<6} {name:<8} {tasks:>6} {wall:8.2f} {args.n / wall:10.1f} "
                      f"{p50:8.0f} {p95:8.0f} {per_out:10.2f} {ratio:>6}")  # fmt: skip
            statuses.update(x.status for x in client.results(subs[0].run_id))
        print(f"throughput ratio real/bare (median of {len(ratios)}): "
              f"{statistics.median(ratios):.2f}x  (goal >= 0.80x)")  # fmt: skip
        print(f"stricter, real/bare-nr (no-op stages that store no result either): "
              f"{statistics.median(strict):.2f}x")  # fmt: skip
        med = {k: statistics.median(v) for k, v in cpu.items()}
        print(f"worker CPU per output (median): real {med['real']:.2f} ms, "
              f"bare {med['bare']:.2f} ms, bare-nr {med['bare-nr']:.2f} ms; "
              f"the pipeline's own: {med['real'] - med['bare-nr']:.2f} ms "
              f"({tasks / args.n:.1f} tasks per output)")  # fmt: skip
        print("statuses:", dict(statuses))
    finally:
        worker.stop()
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
