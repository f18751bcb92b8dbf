"""Redis bytes per finished output, by key kind, and per live (in-flight) submission.

    python bench/footprint.py [--n 1000] [--live 200] [--processes 1] [--concurrency 4]
                              [--redis URL] [--grace S] [--json]

Starts one ``critique worker`` (bench/pipeline.py's :class:`BenchWorker`: ``--processes`` ×
``--concurrency`` threads on critique.cpu and critique.llm) and measures what Redis holds, as
``MEMORY USAGE <key> SAMPLES 0`` summed over every key SCAN finds in the database the run uses
(the pipeline's run and shared keys, and Celery's own: ``celery-task-meta-*``, kombu's queues,
bindings and ``unacked*``), grouped by key kind:

* run keys (``<prefix>:{<run_id>}:<suffix>``) by their suffix as pipeline/store/keys.py names
  it (``steps``, ``submitted``, ``results``, ``results:pass``, ``trace``, ``patterns:freq`` …;
  a suffix that extends a known one with ids, e.g. a per-pass key, counts as ``<known>:*``, and
  a suffix keys.py does not know yet shows up as itself with its ids replaced by ``*``);
* shared keys (``<prefix>:<suffix>``: blobs, lessons, ``pending:runs`` …) as ``shared:<kind>``;
* ``celery-task-meta-*`` (Celery's result backend) and ``broker:<key>`` (kombu's keys).

1. **Finished.** A scan of the idle worker and broker first (the baseline), then ``--n``
   token-free outputs (bench/pipeline.py's mix: half clean, half defective; heuristic critic,
   deterministic repair) submitted as one run through the real client; once every result is in
   (and past ``CRITIQUE_STEPS_GRACE_S``, the time finished passes' step records are kept, or
   ``--grace``) the same scan again. The table is the difference, per kind, and per finished
   output. Goal: <= 3 KB per finished output (docs/operations.md, "What Redis holds").
2. **Live.** The worker is stopped, ``--live`` outputs are submitted as another run and sit
   queued (their chain's first message in the broker, their submission records in the store):
   the difference per live submission.

KB = 1,000 bytes. Records are signed (a random ``CRITIQUE_SECRET`` for the run when none is
set), as in production. With no --redis and no REDIS_URL it starts an embedded redis-server of
its own. A Redis given with --redis (or REDIS_URL) is never flushed: the script uses a key
prefix of its own there (as long as ``critique``) and at the end deletes only the keys under it
and the Celery results of its own submissions (its live submissions are first drained by a
restarted worker); give it a database no other worker uses, or the other traffic is measured
too. ``--json`` prints the figures as one JSON object after the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline import settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._provenance import git_commit  # noqa: E402
from bench.pipeline import CONFIG, BenchWorker, setup_redis, submissions  # noqa: E402

KB = 1000.0
GOAL_KB = 3.0
META_PREFIX = "celery-task-meta-"
SCAN_COUNT = 1000
BATCH = 500

Figures = dict[str, tuple[int, int]]
"""Kind -> (keys, bytes)."""


# --- where the figures come from -----------------------------------------------------------------
def versions(r: Any) -> dict[str, str]:
    """Python, celery, kombu, redis-py, the redis-server answering ``r``, the git commit."""
    import celery
    import kombu
    import redis

    info = r.info("server")
    return {
        "python": platform.python_version(),
        "celery": str(celery.__version__),
        "kombu": str(kombu.__version__),
        "redis-py": str(redis.__version__),
        "redis-server": str(info.get("redis_version", "?")),
        "commit": git_commit(),
    }


def grace_period(override: float | None) -> tuple[float, str]:
    """Seconds a finished pass's step records outlive its result, and where that figure comes
    from: ``--grace``, else ``CRITIQUE_STEPS_GRACE_S`` (default 0: released with the result)."""
    if override is not None:
        return override, "--grace"
    from pipeline.store import keys

    return float(keys.steps_grace_s()), settings.STEPS_GRACE_S.name


# --- key kinds -----------------------------------------------------------------------------------
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)
_HEX = re.compile(r"(?<![0-9A-Za-z])[0-9a-f]{12,}(?![0-9A-Za-z])", re.I)
_NUM = re.compile(r"(?<![0-9A-Za-z_])\d+(?![0-9A-Za-z_])")
_WORKER = re.compile(r"(?<![0-9A-Za-z])[wc]\d{5}(?![0-9A-Za-z])")  # submissions()' worker ids
_TAG = re.compile(r"\{[^}]*\}")


def _ids_out(text: str) -> str:
    """``text`` with its variable parts (hash tags, uuids, hex ids, numbers, the bench's worker
    ids) replaced by ``*``, and non-printable characters escaped."""
    for pattern, repl in (
        (_TAG, "{*}"), (_UUID, "*"), (_HEX, "*"), (_WORKER, "*"), (_NUM, "*"),
    ):  # fmt: skip
        text = pattern.sub(repl, text)
    return text if text.isprintable() else ascii(text)[1:-1]


class Kinds:
    """Which kind a key is, from pipeline/store/keys.py's layout (see the module docstring)."""

    def __init__(self, prefix: str) -> None:
        from pipeline.store import keys

        self.prefix = prefix
        # every suffix-like string constant keys.py names (run and shared key parts), longest
        # first so that "results:pass" wins over "results" and "steps:pass" over "steps"
        known = {
            v
            for k, v in vars(keys).items()
            if k.isupper() and isinstance(v, str) and v and re.fullmatch(r"[a-z][a-z:_]*", v)
        }
        known |= set(keys.RUN_KEY_SUFFIXES)
        self.known = sorted(known, key=len, reverse=True)
        self.run_key = re.compile(re.escape(prefix) + r":\{[^}]*\}:(.+)", re.S)
        self.other_run_key = re.compile(r"[^:{}]+:\{[^}]*\}:.+", re.S)
        self._cache: dict[str, str] = {}

    def _suffix_kind(self, suffix: str) -> str:
        for k in self.known:
            if suffix == k:
                return k
            if suffix.startswith(k + ":"):
                return k + ":*"
        return _ids_out(suffix)

    def __call__(self, key: str) -> str:
        m = self.run_key.fullmatch(key)
        if m:
            return self._suffix_kind(m.group(1))
        if key.startswith(self.prefix + ":"):
            return "shared:" + self._suffix_kind(key[len(self.prefix) + 1 :])
        if key.startswith(META_PREFIX):
            return META_PREFIX + "*"
        if self.other_run_key.fullmatch(key):
            return "other run keys"  # another prefix's runs (a shared Redis)
        kind = self._cache.get(key)
        if kind is None:
            kind = self._cache[key] = "broker:" + _ids_out(key)
        return kind


# --- measuring -----------------------------------------------------------------------------------
def scan(r: Any) -> dict[str, int]:
    """Every key of the database -> its ``MEMORY USAGE … SAMPLES 0`` (bytes; keys that vanish
    between the SCAN and the reading are left out)."""
    names = list(dict.fromkeys(r.scan_iter(count=SCAN_COUNT)))
    sizes: dict[str, int] = {}
    for i in range(0, len(names), BATCH):
        batch = names[i : i + BATCH]
        pipe = r.pipeline(transaction=False)
        for name in batch:
            pipe.execute_command("MEMORY", "USAGE", name, "SAMPLES", 0)
        for name, size in zip(batch, pipe.execute(), strict=True):
            if size is not None:
                key = name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else name
                sizes[key] = int(size)
    return sizes


def by_kind(sizes: dict[str, int], kinds: Kinds) -> Figures:
    out: dict[str, list[int]] = {}
    for key, size in sizes.items():
        row = out.setdefault(kinds(key), [0, 0])
        row[0] += 1
        row[1] += size
    return {k: (v[0], v[1]) for k, v in out.items()}


def minus(after: Figures, before: Figures) -> Figures:
    """``after - before`` per kind (kinds with no change in keys or bytes left out)."""
    out: Figures = {}
    for kind in set(after) | set(before):
        a, b = after.get(kind, (0, 0)), before.get(kind, (0, 0))
        d = (a[0] - b[0], a[1] - b[1])
        if d != (0, 0):
            out[kind] = d
    return out


def total(fig: Figures) -> tuple[int, int]:
    return sum(k for k, _ in fig.values()), sum(b for _, b in fig.values())


def table(fig: Figures, count: int, per: str) -> dict[str, Any]:
    """Print ``fig`` (a difference) per kind, largest first, and per ``count`` outputs; return
    the same figures for --json."""
    keys_all, bytes_all = total(fig)
    print(f"  {'kind':<30} {'keys':>7} {'total KB':>10} {'KB/' + per:>12} {'share':>7}")
    rows: dict[str, Any] = {}
    for kind, (n_keys, size) in sorted(fig.items(), key=lambda kv: (-kv[1][1], kv[0])):
        share = 100.0 * size / bytes_all if bytes_all else 0.0
        print(f"  {kind:<30} {n_keys:>7} {size / KB:>10.1f} {size / KB / count:>12.3f} "
              f"{share:>6.1f}%")  # fmt: skip
        rows[kind] = {"keys": n_keys, "bytes": size, f"kb_per_{per}": round(size / KB / count, 4)}
    print(f"  {'total':<30} {keys_all:>7} {bytes_all / KB:>10.1f} "
          f"{bytes_all / KB / count:>12.3f} {100.0:>6.1f}%")  # fmt: skip
    return {
        "kinds": rows,
        "keys": keys_all,
        "bytes": bytes_all,
        f"kb_per_{per}": round(bytes_all / KB / count, 4),
    }


def wait_all(client: Any, handles: list[Any], run_id: str, timeout: float) -> Counter[str]:
    """Wait until every handle has its answer; their statuses (``error`` for a failure the
    worker recorded). Polls the run's result count (one read) until it is complete or stops
    moving, then collects each outcome (the client's ``as_completed``)."""
    from workers import runtime

    runs = runtime.stores().runs
    deadline = time.monotonic() + timeout
    last, moved = -1, time.monotonic()
    while time.monotonic() < deadline:
        got = len(runs.results(run_id))
        if got >= len(handles):
            break
        if got != last:
            last, moved = got, time.monotonic()
        elif time.monotonic() - moved > 30:
            break  # some failed (no result ever) or stalled: as_completed sorts it out
        time.sleep(0.5)
    statuses: Counter[str] = Counter()
    left = max(30.0, deadline - time.monotonic())
    for _, got in client.as_completed(handles, timeout=left):
        statuses[str(getattr(got, "status", "error"))] += 1
    return statuses


def cleanup(r: Any, prefix: str, own_prefix: bool, run_ids: list[str], task_ids: list[str]) -> int:
    """Delete this script's keys: its runs' keys (every key under the prefix when the prefix
    is its own) and the Celery results of its submissions. Returns how many."""
    from pipeline.store.keys import run_key_pattern

    patterns = [f"{prefix}:*"] if own_prefix else [run_key_pattern(x, prefix) for x in run_ids]
    names = [k for p in patterns for k in r.scan_iter(match=p, count=SCAN_COUNT)]
    names += [META_PREFIX + t for t in task_ids]
    deleted = 0
    for i in range(0, len(names), BATCH):
        deleted += int(r.delete(*names[i : i + BATCH]))
    return deleted


# --- the run -------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=1000, help="finished outputs, one run")
    ap.add_argument("--live", type=int, default=200, help="live (queued) submissions, one run")
    ap.add_argument("--processes", default="1", help="`critique worker --processes`")
    ap.add_argument("--concurrency", type=int, default=4, help="threads per process")
    ap.add_argument(
        "--redis",
        default=os.environ.get("REDIS_URL"),
        help="a Redis database to use (never flushed; default: a redis-server of its own)",
    )
    ap.add_argument(
        "--grace",
        type=float,
        default=None,
        help="seconds to wait after the results before the scan (default: the product's "
        "grace period for step records, if it has one)",
    )
    ap.add_argument("--json", action="store_true", help="the figures as one JSON object too")
    args = ap.parse_args()
    if args.n < 1 or args.live < 0:
        ap.error("--n must be >= 1 and --live >= 0")

    started = time.perf_counter()
    own_prefix = bool(args.redis)
    if own_prefix:  # a Redis not ours: a prefix of our own, as long as the default "critique"
        os.environ["CRITIQUE_KEY_PREFIX"] = f"fp{uuid.uuid4().hex[:6]}"
    signed_note = "signed records"
    if not os.environ.get("CRITIQUE_SECRET"):
        os.environ["CRITIQUE_SECRET"] = secrets.token_hex(32)
        signed_note += " (a random CRITIQUE_SECRET for this run)"
    url, server = setup_redis(args.redis)

    from pipeline.store.keys import key_prefix
    from workers import runtime
    from workers.client import CritiqueClient
    from workers.recovery.base import sweep_interval_s

    prefix = key_prefix()
    kinds = Kinds(prefix)
    r = runtime.client()
    grace, grace_from = grace_period(args.grace)
    sweep_s = sweep_interval_s()
    settle = grace + max(2.0, sweep_s) if grace > 0 else 2.0

    worker = BenchWorker(args.processes, concurrency=args.concurrency)
    client = CritiqueClient(CONFIG)
    base = f"fp-{uuid.uuid4().hex[:8]}"
    done_run, live_run = f"{base}-done", f"{base}-live"
    task_ids: list[str] = []
    report: dict[str, Any] = {}
    try:
        ver = versions(r)
        print(", ".join(f"{k} {v}" for k, v in ver.items()))
        worker.start()
        print(f"redis {url if own_prefix else 'embedded ' + url}, key prefix {prefix!r}; one "
              f"`critique worker --processes {args.processes}` ({len(worker.nodes)} process(es) "
              f"x {args.concurrency} threads); bench/pipeline.py's mix; {signed_note}; "
              f"MEMORY USAGE SAMPLES 0 over every key; KB = 1000 bytes")  # fmt: skip

        # 1. finished outputs
        time.sleep(1.0)  # idle: the worker's first sweep and probes are part of the baseline
        sizes0 = scan(r)
        base0 = by_kind(sizes0, kinds)
        t0 = time.perf_counter()
        handles = client.submit_many(submissions(done_run, args.n))
        task_ids += [h.task_id for h in handles]
        statuses = wait_all(client, handles, done_run, timeout=max(300.0, args.n * 0.6))
        run_s = time.perf_counter() - t0
        time.sleep(settle)
        after = by_kind(scan(r), kinds)
        finished = minus(after, base0)
        k0, b0 = total(base0)
        print(f"\nfinished: N={args.n} outputs in {run_s:.1f} s, statuses {dict(statuses)}; "
              f"scanned {settle:.0f} s after the last result "
              f"(grace {grace:g} s: {grace_from})")  # fmt: skip
        print(f"baseline before the run (idle worker and broker): {k0} keys, {b0 / KB:.1f} KB, "
              f"subtracted below")  # fmt: skip
        fin = table(finished, args.n, "output")
        per_out = fin["kb_per_output"]
        verdict = "met" if per_out <= GOAL_KB else "not met"
        print(f"Redis per finished output: {per_out:.2f} KB (goal <= {GOAL_KB:g} KB: {verdict})")
        report.update(
            versions=ver, n=args.n, live=args.live, prefix=prefix, statuses=dict(statuses),
            run_s=round(run_s, 2), grace_s=grace, grace_from=grace_from, settle_s=settle,
            baseline={"keys": k0, "bytes": b0}, finished=fin, goal_kb_per_output=GOAL_KB,
        )  # fmt: skip

        # 2. live submissions: queued, no worker consuming
        if args.live:
            worker.stop()
            time.sleep(0.5)
            base1 = by_kind(scan(r), kinds)
            live_handles = client.submit_many(submissions(live_run, args.live))
            task_ids += [h.task_id for h in live_handles]
            live = minus(by_kind(scan(r), kinds), base1)
            print(f"\nlive: {args.live} submissions queued with the worker stopped (their first "
                  f"message in the broker, their records in the store), minus the scan just "
                  f"before them")  # fmt: skip
            report["live_submissions"] = table(live, args.live, "live")
            print(f"Redis per live submission: {report['live_submissions']['kb_per_live']:.2f} KB")
            if own_prefix:  # drain them, so no message of ours stays in a Redis not ours
                worker.start()
                wait_all(client, live_handles, live_run, timeout=max(300.0, args.live * 0.6))
    finally:
        worker.stop()
        if server is None:
            gone = cleanup(r, prefix, own_prefix, [done_run, live_run], task_ids)
            print(f"\ndeleted this run's {gone} keys (prefix {prefix!r}, its Celery results)")
        else:
            server.stop()
    elapsed = time.perf_counter() - started
    print(f"took {elapsed:.0f} s")
    if args.json:
        report["elapsed_s"] = round(elapsed, 1)
        print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
