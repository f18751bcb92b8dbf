"""The model-call path alone: CPU per call of the worker's completer, from one thread and from
a worker pool's many, with and without the model's latency between calls (issue 39).

    python bench/llm_path.py [--calls 1200] [--threads 32] [--latency-ms 200] [--rounds 3]

No Celery, no Redis: :class:`pipeline.llm.completion.LiteLLMCompleter`, as a worker builds it,
calls the fake OpenAI-compatible server (bench/_fake_llm.py, in a process of its own) with a
critic-sized prompt in JSON mode. Rows, each after a few warm-up calls:

* **1 thread, no wait**: ``--calls`` calls one after another, the server answering at once:
  the process never idles, the cheapest a call gets;
* **1 thread, L ms** (``--latency-ms``): one pool thread's share (``--calls`` / N) alone, the
  server answering after L ms as an LLM would: the process idles between calls;
* **N threads, L ms** (``--threads``, a worker process's pool): N threads each making its
  share of ``--calls``;
* **N threads, one loop, L ms**: the same N threads, each call handed to one event loop thread
  of the process (``litellm.acompletion`` with the completer's arguments, in the same
  :func:`~pipeline.llm.providers.call_scope`, awaited through
  ``asyncio.run_coroutine_threadsafe``): what making the model calls from one event loop per
  worker process would cost (the completer's own reply handling is left out of this row,
  which favours it slightly).

The second row over the first is what waiting between calls adds to each (caches gone cold,
the CPU woken from idle: not broken down here); the third over the second what the pool's
threads add on top. ``calls/s`` beside them: the pool rows can reach at most N / latency (160
calls/s at 32 and 200 ms).

``cpu ms/call`` is this process's CPU (user + system, every thread; the server is another
process) over the timed calls. The rows swap places every round; the summary is the median
over rounds. The VM's CPU time per call moves from run to run: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._fake_llm import ServerProcess, serve
from bench._provenance import git_commit

VERDICT = '{"score": 0.9, "defects": []}'
WARMUP = 5


def serve_main(latency_s: float) -> int:
    """The fake server alone (``--serve``): every request answered after ``latency_s``."""
    from tests.fakes.openai_server import reply

    return serve(lambda body: reply(VERDICT, delay_s=latency_s), backlog=1024)


def cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def on_one_loop(complete: Any, request: Any) -> tuple[Callable[[], Any], Callable[[], None]]:
    """``(call, stop)``: ``call()`` makes ``request``'s call as ``litellm.acompletion`` on one
    event loop thread (started here) and waits for it from the calling thread."""
    import litellm

    from pipeline.llm.providers import call_scope

    kwargs = complete.kwargs_for(request)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="llm-loop", daemon=True)
    thread.start()

    async def one() -> Any:
        with call_scope(litellm):
            return await litellm.acompletion(**kwargs)

    def call() -> Any:
        return asyncio.run_coroutine_threadsafe(one(), loop).result()

    def stop() -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    return call, stop


def run_row(api_base: str, calls: int, threads: int, loop: bool = False) -> tuple[float, float]:
    """``(cpu ms per call, wall s)`` of ``calls`` calls from ``threads`` threads; ``loop``:
    each handed to one event loop thread (:func:`on_one_loop`)."""
    from pipeline.config import LLMConfig
    from pipeline.llm.completion import ChatMessage, LiteLLMCompleter, LLMRequest

    complete = LiteLLMCompleter(LLMConfig(api_base=api_base, max_retries=0), api_key="sk-bench")
    request = LLMRequest(
        model="openai/bench-critic",
        messages=(
            ChatMessage(role="system", content="You are the critic. Return JSON. " * 40),
            ChatMessage(role="user", content="The worker's output to critique. " * 120),
        ),
        json_mode=True,
        max_tokens=512,
    )
    stop: Callable[[], None] = lambda: None  # noqa: E731
    call: Callable[[], Any] = lambda: complete(request)  # noqa: E731
    if loop:
        call, stop = on_one_loop(complete, request)
    for _ in range(WARMUP):
        call()
    share = calls // threads

    def work() -> None:
        for _ in range(share):
            call()

    c0, w0 = cpu_s(), time.perf_counter()
    if threads == 1:
        work()
    else:
        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    c1, w1 = cpu_s(), time.perf_counter()
    stop()
    return 1000.0 * (c1 - c0) / (share * threads), w1 - w0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1200, help="timed calls per row")
    ap.add_argument("--threads", type=int, default=32, help="threads of the pool rows")
    ap.add_argument("--latency-ms", type=float, default=200.0, help="the pool rows' latency")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-latency-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve_main(args.serve_latency_ms / 1000.0)
    if args.threads < 1 or args.calls < args.threads or args.rounds < 1:
        ap.error("--threads and --rounds must be at least 1, --calls at least --threads")
    libs = ", ".join(f"{n} {dist_version(n)}" for n in ("litellm", "openai", "httpx"))
    print(f"versions: Python {sys.version.split()[0]}, {libs}; commit {git_commit()}")
    instant = ServerProcess(__file__, ["--serve-latency-ms", "0"])
    slow = ServerProcess(__file__, ["--serve-latency-ms", str(args.latency_ms)])
    lat = f"{args.latency_ms:g} ms"
    share = args.calls // args.threads
    rows = [
        ("1 thread, no wait", instant, 1, False, args.calls),
        (f"1 thread, {lat}", slow, 1, False, share),
        (f"{args.threads} threads, {lat}", slow, args.threads, False, args.calls),
        (f"{args.threads} threads, one loop, {lat}", slow, args.threads, True, args.calls),
    ]
    got: dict[str, list[float]] = {name: [] for name, *_ in rows}
    print(f"{'round':>5} {'row':<32} {'calls':>6} {'wall s':>7} {'calls/s':>7} {'cpu ms/call':>11}")
    try:
        for rnd in range(1, args.rounds + 1):
            for name, server, threads, loop, calls in rows if rnd % 2 else rows[::-1]:
                ms, wall = run_row(server.api_base, calls, threads, loop)
                got[name].append(ms)
                made = calls // threads * threads
                print(f"{rnd:>5} {name:<32} {made:>6} {wall:>7.2f} {made / wall:>7.1f} {ms:>11.2f}")
    finally:
        instant.stop()
        slow.stop()
    hot, idle, pool, looped = (statistics.median(got[name]) for name, *_ in rows)
    print(
        f"median cpu ms/call: 1 thread no wait {hot:.2f}; 1 thread at {lat} {idle:.2f} "
        f"({idle / hot:.2f}x: the wait's part); {args.threads} threads {pool:.2f} "
        f"({pool / idle:.2f}x of one thread at {lat}: the threads' part); "
        f"on one loop {looped:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
