"""The peer of bench/llm.py: what a user would write instead of the fleet, CPU-bound.

    python bench/peer.py --plans PLANS.json --api-base URL [--in-flight N] [--warmup N]

One process (this one, started fresh: no Celery app, no Redis client, no other thread of the
bench's in it), one asyncio event loop, ``litellm.acompletion`` at its defaults against the
bench's fake server. ``PLANS.json`` holds, per output, the request bodies the pipeline sent
for it, in its order (bench/llm.py's ``peer_plans``): the critique; when the critic's score is
below :data:`ACCEPT_BELOW`, the repair and the re-critique (the pipeline's requests, with the
same prompts, models and parameters). Every output runs at once, each output's calls in
sequence; ``--in-flight N`` caps the calls in flight (0, the default: no cap, up to one per
output). With enough in flight that the fake server's latency is not the limit (N outputs at
200 ms: N / 0.2 s calls/s at most), the loop's CPU is: the process runs at ~100 % of one core.

Before the timed run, ``--warmup`` calls (the first plans' critiques, not counted) create
litellm's HTTP client and do its first-call imports, as the fleet's warm-up submissions do.

Prints one JSON line: ``calls``, ``wall`` (s), ``cpu`` (s of this process, every thread of
it: user + system), ``host_cpu`` (busy s of every CPU of the machine), ``overflows`` (the
kernel's listen-queue overflows, machine-wide), ``lat`` (s from the start to each output's
last reply), ``in_flight`` (the cap, 0: none), ``max_in_flight`` (the most calls in flight
seen), ``threads`` (live threads at the end: litellm's own, if it starts any), ``lag_p99_ms``
(the event loop's p99 lateness of a 10 ms timer during the run: a loop busy every moment is
late).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ACCEPT_BELOW = 0.8
"""The peer repairs an output whose critic score is below this (the pipeline's target)."""
LAG_TICK_S = 0.01


def peer_kwargs(body: dict[str, Any], api_base: str) -> dict[str, Any]:
    """``litellm.acompletion``'s arguments for one request the pipeline sent."""
    kwargs: dict[str, Any] = {
        "model": "openai/" + str(body["model"]),
        "messages": body["messages"],
        "api_base": api_base,
        "api_key": "sk-test",
        "timeout": 60,
    }
    for key in ("temperature", "max_tokens", "response_format"):
        if key in body:
            kwargs[key] = body[key]
    return kwargs


def listen_overflows() -> int:
    """The kernel's count of connections dropped because a listen queue was full (every socket
    of the machine; -1 where /proc/net/netstat has none)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return -1
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            fields = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(fields.get("ListenOverflows", -1))
    return -1


class HostMeter:
    """The machine's busy CPU seconds (every CPU: user, nice, system, irq, softirq; nan without
    psutil) and the listen-queue overflows over a span of time."""

    def __init__(self) -> None:
        self.busy0, self.overflows0 = self._busy(), listen_overflows()

    @staticmethod
    def _busy() -> float:
        try:
            import psutil
        except ImportError:
            return float("nan")
        t = psutil.cpu_times()
        extra = getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        return float(t.user + t.nice + t.system + extra)

    def stop(self) -> tuple[float, int]:
        """(busy CPU seconds, overflows) since the start."""
        return self._busy() - self.busy0, listen_overflows() - self.overflows0


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else 0.0


async def run(
    plans: list[list[dict[str, Any]]], api_base: str, in_flight: int, warmup: int
) -> dict[str, Any]:
    import litellm

    gate = asyncio.Semaphore(in_flight) if in_flight > 0 else None
    calls = 0
    flying = 0
    most = 0

    async def call(body: dict[str, Any]) -> str:
        nonlocal calls, flying, most
        if gate is not None:
            await gate.acquire()
        flying += 1
        most = max(most, flying)
        try:
            resp = await litellm.acompletion(**peer_kwargs(body, api_base))
        finally:
            flying -= 1
            if gate is not None:
                gate.release()
        calls += 1
        return str(resp.choices[0].message.content or "")

    # warm-up (not counted): litellm's client, its first-call imports
    await asyncio.gather(*(call(p[0]) for p in plans[: max(0, warmup)]))
    calls = most = 0

    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            t = loop.time()
            await asyncio.sleep(LAG_TICK_S)
            lags.append(loop.time() - t - LAG_TICK_S)

    async def one(plan: list[dict[str, Any]]) -> float:
        # critique; when the score is low: repair, re-critique (the pipeline's requests)
        text = await call(plan[0])
        i = 1
        while i + 1 < len(plan) and float(json.loads(text).get("score", 1.0)) < ACCEPT_BELOW:
            await call(plan[i])
            text = await call(plan[i + 1])
            i += 2
        return time.perf_counter() - t0

    tick = asyncio.create_task(ticker())
    host = HostMeter()
    t0, cpu0 = time.perf_counter(), time.process_time()
    latencies = await asyncio.gather(*(one(p) for p in plans))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    host_cpu, overflows = host.stop()
    stop.set()
    await tick
    return {
        "calls": calls,
        "wall": wall,
        "cpu": cpu,
        "host_cpu": host_cpu,
        "overflows": overflows,
        "lat": list(latencies),
        "in_flight": in_flight,
        "max_in_flight": most,
        "threads": threading.active_count(),
        "lag_p99_ms": _pct(lags, 0.99) * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--plans", required=True, help="JSON: per output, its request bodies")
    ap.add_argument("--api-base", required=True)
    ap.add_argument("--in-flight", type=int, default=0, help="cap on calls in flight (0: none)")
    ap.add_argument("--warmup", type=int, default=8, help="warm-up calls (not counted)")
    args = ap.parse_args(argv)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    plans = json.loads(Path(args.plans).read_text(encoding="utf-8"))
    import litellm  # noqa: F401 - its import is not part of the timed run

    out = asyncio.run(run(plans, args.api_base, args.in_flight, args.warmup))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
