"""What an acknowledged write on a replica costs (``CRITIQUE_STORE_REPLICAS``).

    python bench/replicas.py [--k 2000] [--rounds 3]

Starts a ``redis-server`` master and one replica of it (private, free loopback ports, AOF off,
stopped at exit) and times K result writes (``RedisRunStore.begin_pass`` + ``put_result``, the
gate's write of one finished output) with ``CRITIQUE_STORE_REPLICAS`` 0 (the baseline: no wait)
and 1 (each write ``WAIT``s for the replica on the same connection). Each row is the median of
``--rounds``: microseconds per output (begin + result) and p99 of the result write alone, and
the ratio against the baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _server(port: int, workdir: Path, *extra: str) -> subprocess.Popen[bytes]:
    exe = shutil.which("redis-server") or "redis-server"
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return subprocess.Popen(
        [*argv, "--dir", str(workdir), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _round(k: int, port: int, wanted: str) -> tuple[float, float]:
    import redis

    from pipeline.models import CritiqueEnvelope, CritiqueResult
    from pipeline.store.runs import RedisRunStore

    os.environ["CRITIQUE_STORE_REPLICAS"] = wanted
    runs = RedisRunStore(redis.Redis(port=port))
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    envelope = CritiqueEnvelope(worker_id="w", score=1.0)
    writes: list[float] = []
    t0 = time.perf_counter()
    for i in range(k):
        wid = f"w{i}"
        runs.begin_pass(run_id, 1, wid, "s1")
        result = CritiqueResult(
            run_id=run_id,
            worker_id=wid,
            status="accepted",
            stop_reason="accepted",
            output={"summary": "Sales rose 4% in Q3. " * 10},
            original_score=1.0,
            best_score=1.0,
            envelope=envelope,
            pass_id="s1",
        )
        w0 = time.perf_counter()
        runs.put_result(result, pass_id="s1")
        writes.append(time.perf_counter() - w0)
    per_output_us = (time.perf_counter() - t0) / k * 1e6
    writes.sort()
    return per_output_us, writes[int(0.99 * (len(writes) - 1))] * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=2000, help="result writes per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per row (the median is shown)")
    args = ap.parse_args(argv)

    import redis

    from bench._provenance import git_commit
    from workers.embedded import free_port

    with tempfile.TemporaryDirectory() as tmp:
        mport, rport = free_port(), free_port()
        master = _server(mport, Path(tmp))
        replica = _server(rport, Path(tmp), "--replicaof", "127.0.0.1", str(mport))
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    if redis.Redis(port=rport).info("replication")["master_link_status"] == "up":
                        break
                except redis.RedisError:
                    pass
                time.sleep(0.1)
            else:
                print("the replica did not link up within 20 s", file=sys.stderr)
                return 1
            rows = {}
            for wanted in ("0", "1"):
                got = [_round(args.k, mport, wanted) for _ in range(args.rounds)]
                rows[wanted] = (
                    statistics.median(g[0] for g in got),
                    statistics.median(g[1] for g in got),
                )
        finally:
            for p in (replica, master):
                p.terminate()
                p.wait(timeout=10)
    import importlib.metadata as md

    server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
    print(
        f"commit {git_commit()}; redis-py {md.version('redis')}; redis-server "
        f"{server.stdout.split()[2].removeprefix('v=')}; K={args.k}, median of {args.rounds}"
    )
    base = rows["0"][0]
    print(f"{'CRITIQUE_STORE_REPLICAS':<24} {'µs/output':>10} {'p99 write µs':>13} {'ratio':>6}")
    for wanted, (per, p99) in rows.items():
        print(f"{wanted:<24} {per:>10.0f} {p99:>13.0f} {per / base:>5.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
