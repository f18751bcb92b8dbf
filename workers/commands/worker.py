"""``critique worker``: start Celery workers for the pipeline's queues.

The stages run on separate queues so they scale separately:

    critique.cpu         Layer-0 checks, heuristic and rubric critics, token-free repairs,
                         decide, gates (CPU-bound)
    critique.llm         LLM critic (mode: inline) and LLM repair (long, waiting on the network)
    critique.llm.critic  the LLM critic in mode: dedicated (its own model and workers)

Defaults: every queue, the threads pool (LLM calls wait on I/O, so threads are cheap), and
``$CRITIQUE_CONCURRENCY`` threads, else 32 calls in flight per CPU (16 threads, 32 on a small host
whose processes are one per CPU), in each of ``--processes`` worker processes. A
worker for ``critique.cpu`` alone is better off with processes: ``critique worker -Q
critique.cpu -P prefork`` (concurrency defaults to the number of CPUs). Scale out by starting
more workers, on any machine that reaches the same Redis.

Processes (``--processes N``, ``$CRITIQUE_PROCESSES``, default ``auto``): one Python process
runs at most one core's worth of Python however many threads it has (the GIL), and in practice
less: a thread back from the network waits for the GIL behind the busy ones, and the process's
core idles meanwhile. So a threads worker on an LLM queue defaults to two processes per usable
CPU (:data:`PROCESSES_PER_CPU`; the affinity mask, capped by a cgroup CPU quota: a container
limited to 4 CPUs gets 8), 16 threads each: the same 32 calls in flight per CPU as one process
of 32 threads, with the cores busy (a small host, below, gets 32 threads per process)
(bench/llm.py on 2 CPUs, 200 ms calls: a third more calls/s
than one process per CPU; bench/README.md). Each process holds ~230 MB (litellm), so a small
host (at most :data:`SMALL_HOST_CPUS` usable CPUs: a laptop, a 1-CPU pod) gets one process
per CPU instead: a 2-core laptop runs 2 nodes (~0.5 GB), not 4 (~1 GB). On many CPUs,
``--processes`` trades that memory against throughput. Threads carry the waits
on the network, processes carry the CPU. Any other worker (``critique.cpu`` only; the prefork
or solo pool) defaults to 1 process, as before: prefork already forks one child per CPU.
With N = 1 the command replaces itself with ``celery worker`` (as it always did). With N > 1
it becomes a small supervisor (like gunicorn's arbiter) of N ``celery worker`` processes, each
its own node (``critique-<i>@<host>``, or ``<name>-<i>@<host>`` from ``-n <name>@<host>``),
announced in one line (nodes, threads, the supervisor's pid) followed by one Celery banner, the
first node's (the others start with ``celery --quiet``: the same banner N times is noise).
When the nodes of a threads pool are one per CPU of the affinity mask, each runs on its CPU
only (:func:`cpu_slots`; ``--no-pin``: any CPU), said in a second line. The supervisor:

* SIGTERM, SIGINT and SIGQUIT are forwarded to every child (SIGHUP as SIGTERM), so Ctrl-C or a
  service manager's stop is Celery's warm shutdown in every process (twice: cold); the
  children run in their own session, so a terminal's Ctrl-C reaches them once, through the
  supervisor, and they get SIGTERM if the supervisor itself dies (Linux ``PR_SET_PDEATHSIG``).
  It exits when every child has, with 0 when all exited 0, else the first child's non-zero
  status (a signal N as 128 + N).
* A child that dies unexpectedly (non-zero status or a signal: OOM-killed, segfault) is
  reported on stderr (which process, its node and pid, how it ended) and restarted: its
  siblings keep their running tasks (LLM calls of minutes) instead of being drained for a
  restart of the whole service, and with late acks the dead child's messages come back to the
  queue. More than :data:`MAX_RESTARTS` unexpected exits within :data:`RESTART_WINDOW_S`
  seconds is a crash loop that restarting will not fix: the rest are stopped (warm) and the
  command exits 1, for the service manager to see. A child that exits 0 on its own was shut
  down on purpose (``celery control shutdown``, a signal sent to it): it is not restarted.

Task events (what Flower lists) are off in these processes unless ``$CRITIQUE_TASK_EVENTS`` is
set (1 or 0): Flower turns them on in every worker it sees (``enable_events``, every 5 s), and
without a monitor they cost a PUBLISH each, four per stage (about 12 % of an LLM-bound worker's
CPU). The banner says so (``task events: OFF until a monitor asks for them …``,
:mod:`workers.banner`) rather than Celery's "enable -E", and each node logs Celery's "Events of
group {task} enabled by remote." when Flower turns them on.

Before anything starts, the worker's own configuration is checked, so a mistake stops the
worker instead of failing every chain it would run (exit 2, naming what to fix): the workflow
file (``CRITIQUE_CONFIG``) and every ``CRITIQUE_*`` variable (a typo such as
``CRITIQUE_MAX_REPAIRS`` is named), and the provider key of every model the configuration
names (``model``, ``paired_model``, ``allowed_models``: litellm's environment check, e.g.
``OPENAI_API_KEY``; ``CRITIQUE_LLM_API_KEY`` serves those models' providers) when the worker
consumes an LLM queue (``critique.llm``, ``critique.llm.critic``; a ``critique.cpu`` worker
calls no model). A secret that is too short exits 2 too; without ``CRITIQUE_SECRET`` it warns
that stage messages go unsigned (anyone with broker access can forge a verdict), and with an
API key but no ``allowed_models`` that it refuses every submission naming a model.
``--dry-run`` runs these checks and prints the command (one line per process).

Then it checks that Redis answers (exit 3 with the URL when it does not) and replaces itself
with ``python -m celery -A workers.app worker …`` (options after ``--`` go to Celery), so
signals (Ctrl-C: warm shutdown; twice: cold) are Celery's own, and so are its exit codes but
one: Ctrl-C exits 130 (Celery's 1 reads as a failure; :mod:`workers.app` maps it), SIGTERM 0;
with N > 1 it
replaces itself with the supervisor (``python -m workers.commands.worker --supervise``, which
imports nothing heavy: the checks' imports, litellm among them, are not kept in memory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from pathlib import Path

from pipeline import settings
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.security.model_policy import ALLOWED_MODELS_ENV, held_keys
from pipeline.security.signing import parse_named_secrets, parse_secrets
from pipeline.store.keys import QUEUE_CRITIC, QUEUE_LLM, QUEUES
from pipeline.store.urls import DEFAULT_REDIS_URL, store_url
from workers.commands._common import CommandError, check_redis, service_guard
from workers.commands._input import terminal_line
from workers.exit_codes import EXIT_FAILED, EXIT_OK

HELP = "start a Celery worker for the pipeline's queues (critique.cpu, critique.llm, ...)"

KNOWN_QUEUES = QUEUES  # pipeline.store.keys is redis-free: `critique --help` stays light
LLM_QUEUES = (QUEUE_LLM, QUEUE_CRITIC)
"""The queues whose stages may call a model: a worker on them needs the provider keys."""
POOLS = ("threads", "prefork", "solo", "gevent", "eventlet")
THREADS_DEFAULT = 16
IN_FLIGHT_PER_CPU = 32
"""Calls in flight per usable CPU that ``--processes auto`` sizes its default threads for: a
small host's one process per CPU gets 32 threads, a bigger host's two get 16 each (32 per CPU:
bench/llm.py on 2 CPUs at 200 ms, 2 x 32 gave 1.3x the calls/s of 2 x 16 and ~1 ms less worker
CPU per call; at 2 s, 2 x 16 capped the fleet at 16 calls/s; bench/README.md)."""
PROCESSES_PER_CPU = 2
"""``--processes auto`` for a threads worker on an LLM queue: processes per usable CPU (one per
CPU on a small host, :data:`SMALL_HOST_CPUS`)."""
SMALL_HOST_CPUS = 2
"""A host with at most this many usable CPUs (a laptop, a 1-CPU pod) gets one process per CPU
from ``--processes auto``: the memory of two per CPU (~230 MB each) buys little there."""
THREAD_POOLS = ("threads", "gevent", "eventlet")
"""Pools whose concurrency is threads (or greenlets) of one process: several processes."""
# CRITIQUE_TASK_EVENTS (pipeline.settings), 1 or 0: task events (what Flower lists; see
# celeryconfig). Unset, this command's processes send none until a monitor asks for them
# (Flower's ``enable_events``, every 5 s): each event is a PUBLISH, four per stage, about 12 %
# of an LLM-bound worker's CPU.
MAX_RESTARTS = 5
"""Unexpected child exits tolerated within :data:`RESTART_WINDOW_S` (more: a crash loop)."""
RESTART_WINDOW_S = 60.0
MIN_UPTIME_S = 5.0
"""A child that dies sooner than this after its start is restarted after a 1 s pause."""
UNSIGNED_WARNING = (
    "CRITIQUE_SECRET is unset: anyone who can write to the broker can forge verdicts; "
    "set it on every worker and client"
)

_DESCRIPTION = f"""{HELP}.

queues:
  critique.cpu         Layer-0 checks, heuristic and rubric critics, token-free repairs,
                       decide, gates (CPU-bound)
  critique.llm         LLM critic (mode: inline) and LLM repair (I/O-bound: threads pool)
  critique.llm.critic  LLM critic in mode: dedicated (a separate critic model)

examples:
  critique worker                                  # every queue, threads, auto processes
  critique worker -Q critique.llm -c 64            # LLM stages only, 64 threads per process
  critique worker --processes 4 -c 32              # 4 processes x 32 threads, one command
  critique worker -Q critique.cpu -P prefork -c 4  # CPU stages in 4 processes
  critique worker -- --max-tasks-per-child 100     # pass options on to `celery worker`

sizing: capacity = processes x threads (-c). On the LLM queues the threads carry the waits (one
per LLM call in flight: ~ calls/s you need x seconds per call) and the processes carry the CPU
(each process runs one core's worth of Python; the pipeline's own work per output is
milliseconds of CPU, and one process keeps a core only partly busy: the GIL), so the default
(auto) is two processes per usable CPU (affinity mask and cgroup quota) with
$CRITIQUE_CONCURRENCY (else 16) threads each: 32 calls in flight per CPU; on a host with at
most 2 usable CPUs (a laptop, a 1-CPU pod) one process per CPU with 32 threads (each process
holds ~230 MB: a 2-core laptop gets 2 nodes, ~0.5 GB). Raise -c for slow models or many calls
in flight; keep --processes at about twice the CPU count on bigger hosts. A critique.cpu-only
or prefork/solo worker defaults to 1 process (prefork forks one child per CPU itself). With
--processes N > 1 this command supervises N `celery worker` nodes (<name>-1@<host> ...
<name>-N@<host>, name from -n, else "critique"), says so in one line and shows one Celery
banner (the first node's; the others start --quiet); when the N nodes of a threads pool are
one per CPU of the affinity mask (auto on 1-2 CPUs), each runs on its CPU only (one process
runs one core's worth of Python: kept on one core it spends less CPU per call; --no-pin: any
CPU; several such commands on one host share the CPUs evenly): SIGTERM/SIGINT reach all of
them (warm shutdown), a child that dies is reported on stderr and restarted (more than 5 in
60 s: the others are stopped, exit 1). A --logfile or --pidfile after -- needs %n in it (the
node name) to be one file per process.

checks before it starts (exit 2 naming what to fix): the workflow file ($CRITIQUE_CONFIG),
every CRITIQUE_* variable, CRITIQUE_SECRET, and on an LLM queue the provider key of every
configured model (e.g. OPENAI_API_KEY; CRITIQUE_LLM_API_KEY serves any provider).

task events (Flower): off until a monitor asks for them (a running Flower turns them on within
5 s, and the node logs "Events of group {{task}} enabled by remote"); the banner's "task events"
line says so. $CRITIQUE_TASK_EVENTS=1: always on.

signals: Ctrl-C (SIGINT): warm shutdown (running tasks finish, nothing new is taken), then
exit 130; a second Ctrl-C: cold shutdown (running tasks are cut short and their messages go
back to the queue). SIGTERM (a service manager's stop): warm shutdown, then exit 0. With
--processes N every process gets the signal and the command exits with the same code.

Redis: $REDIS_URL (default redis://127.0.0.1:6379/0); the broker is the same unless
$CELERY_BROKER_URL says otherwise, the store unless $CRITIQUE_STORE_URL does (it may be a
Redis Cluster: redis+cluster://host:port,host:port,...). Exit 3 when one cannot be reached.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = _DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "-Q",
        "--queues",
        default=settings.value(settings.QUEUES),
        help="comma-separated queues to consume (default: $CRITIQUE_QUEUES or all three)",
    )
    parser.add_argument(
        "-P",
        "--pool",
        choices=POOLS,
        default="threads",
        help="execution pool (default threads; prefork suits a critique.cpu-only worker)",
    )
    parser.add_argument(
        "-c",
        "--concurrency",
        type=int,
        help=f"threads or processes (default: $CRITIQUE_CONCURRENCY, else {THREADS_DEFAULT} "
        f"for threads/gevent/eventlet ({IN_FLIGHT_PER_CPU} per usable CPU when --processes "
        "auto sizes an LLM worker: 32 per process on a small host) and the CPU count for "
        "prefork)",
    )
    parser.add_argument(
        "-l",
        "--loglevel",
        default=settings.value(settings.LOG_LEVEL),
        help="DEBUG, INFO, WARNING, ERROR (default: $CRITIQUE_LOG_LEVEL or INFO)",
    )
    parser.add_argument(
        "--processes",
        metavar="N",
        help=f"worker processes, each a Celery node with -c threads: a whole number >= 1 or "
        f"auto (default: ${settings.PROCESSES.name}, else auto = two per usable CPU, one per "
        f"CPU on a host of at most {SMALL_HOST_CPUS} CPUs, when the pool is "
        "threads/gevent/eventlet and an LLM queue is consumed, else 1)",
    )
    parser.add_argument(
        "-n",
        "--hostname",
        help="node name, e.g. llm1@%%h (Celery's default); with --processes N > 1 each "
        "process is <name>-<i>@<host> (default critique-<i>@%%h)",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="leave the worker processes free to run on any CPU (default: N > 1 processes of "
        "a threads pool on exactly N CPUs, as auto gives a host of 2, run one per CPU)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the celery command instead of running it (no Redis check)",
    )
    parser.add_argument(
        "celery_args",
        nargs="*",
        metavar="-- CELERY_OPTION",
        help="further `celery worker` options, after --",
    )


def _concurrency(args: argparse.Namespace, auto_processes: int | None = None) -> int:
    """``-c``, else ``$CRITIQUE_CONCURRENCY``, else the pool's default: for threads, with
    ``auto_processes`` (the process count ``--processes auto`` chose) the threads that keep
    :data:`IN_FLIGHT_PER_CPU` calls in flight per usable CPU (at least
    :data:`THREADS_DEFAULT`), else :data:`THREADS_DEFAULT`."""
    if args.concurrency is not None:
        return int(args.concurrency)
    env = settings.raw(settings.CONCURRENCY)
    if env:
        return int(env)
    if args.pool == "prefork":
        return os.cpu_count() or 1
    if args.pool == "solo":
        return 1
    if auto_processes:
        wanted = -(-IN_FLIGHT_PER_CPU * available_cpus() // auto_processes)  # ceiling
        return max(THREADS_DEFAULT, wanted)
    return THREADS_DEFAULT


def _processes_asked(args: argparse.Namespace) -> tuple[str | None, str]:
    """The process count asked for, and where: ``--processes``, else ``$CRITIQUE_PROCESSES``
    (None: neither, which is auto)."""
    if args.processes is not None:
        return str(args.processes), "--processes"
    return settings.raw(settings.PROCESSES), settings.PROCESSES.name


def _is_auto(raw: str | None) -> bool:
    return str(raw or "auto").strip().lower() == "auto"


def _sized_per_cpu(args: argparse.Namespace, queues: list[str]) -> bool:
    """Whether ``--processes auto`` sizes the process count by the CPUs (:func:`processes`):
    no count asked for, a threads-like pool, an LLM queue."""
    return (
        _is_auto(_processes_asked(args)[0])
        and args.pool in THREAD_POOLS
        and bool(set(queues) & set(LLM_QUEUES))
    )


def _cgroup_cpu_limit() -> int | None:
    """The CPUs a cgroup CPU quota allows this process (rounded up), or None without one.

    cgroup v2 (``cpu.max`` of this process's cgroup, e.g. a systemd ``CPUQuota=`` or a
    container's ``--cpus``/Kubernetes CPU limit) first, then cgroup v1 (``cpu.cfs_quota_us``)."""
    candidates = []
    try:
        for line in Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines():
            if line.startswith("0::"):
                candidates.append(Path("/sys/fs/cgroup" + line[3:].rstrip("/")) / "cpu.max")
    except OSError:
        pass
    candidates.append(Path("/sys/fs/cgroup/cpu.max"))
    for path in candidates:
        try:
            quota, period = path.read_text(encoding="utf-8").split()[:2]
        except (OSError, ValueError):
            continue
        if quota == "max":
            return None
        try:
            return max(1, math.ceil(int(quota) / int(period)))
        except (ValueError, ZeroDivisionError):
            return None
    try:
        v1 = Path("/sys/fs/cgroup/cpu")
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text(encoding="utf-8"))
        period_us = int((v1 / "cpu.cfs_period_us").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return max(1, math.ceil(quota_us / period_us)) if quota_us > 0 and period_us > 0 else None


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask (``taskset``, cpusets), capped by a cgroup
    CPU quota; at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    return max(1, min(count, limit) if limit else count)


def threads_per_process(args: argparse.Namespace, queues: list[str], count: int) -> int:
    """The concurrency each of the ``count`` processes (:func:`processes`) this command starts
    for ``queues`` gets; the calls in flight are ``count`` times it (bench/llm.py reports
    them). ``ValueError`` for a ``$CRITIQUE_CONCURRENCY`` that is not a whole number."""
    return _concurrency(args, count if _sized_per_cpu(args, queues) else None)


def processes(args: argparse.Namespace, queues: list[str]) -> int:
    """How many worker processes: ``--processes``, else ``$CRITIQUE_PROCESSES``, else auto
    (:data:`PROCESSES_PER_CPU` x :func:`available_cpus` for a threads/gevent/eventlet worker
    on an LLM queue, one per CPU on a host of at most :data:`SMALL_HOST_CPUS`; else 1).
    Raises ``ValueError`` naming the bad value."""
    raw, where = _processes_asked(args)
    if _is_auto(raw):
        if not _sized_per_cpu(args, queues):
            return 1
        cpus = available_cpus()
        return cpus if cpus <= SMALL_HOST_CPUS else PROCESSES_PER_CPU * cpus
    try:
        n = int(str(raw).strip())
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{where} must be a whole number >= 1 or auto (got {raw!r})")
    return n


def cpu_slots(args: argparse.Namespace, count: int) -> list[int] | None:
    """The CPU each of the ``count`` worker processes is pinned to (process i: the i-th CPU of
    the affinity mask), or None when they are left free. Pinned only when the processes are
    exactly one per CPU of the mask (the ``--processes auto`` of a host of one or two CPUs, or
    as many asked for as the mask has) and a threads-like pool: not with ``--no-pin``, one
    process, a prefork/solo pool (a prefork node forks its own children, which would all share
    its one CPU), fewer or more processes than CPUs, or a cgroup CPU quota below the mask (the
    quota, not the mask, says how much may run: which CPUs is the host's business). Fewer
    processes than CPUs stay free so that a second command on the same host (another queue, a
    scale-out) never stacks its nodes onto the CPUs this one took while others idle; two
    commands of one process per CPU each share every CPU evenly.

    Why (bench/README.md, "One node per CPU, pinned"): a process runs one core's worth of
    Python (the GIL), and its threads, scheduled across every core, hand the GIL to one another
    from core to core; kept on one core, each process spent ~7 % less CPU per model call and
    the fleet made ~10 % more calls/s (bench/llm.py, 2 processes x 32 threads on 2 CPUs). Two
    processes per CPU gained nothing from it."""
    if not args.pin or count < 2 or args.pool not in THREAD_POOLS:
        return None
    try:
        mask = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return None
    # available_cpus(): the mask capped by the quota; below the mask's size, a quota caps it
    return mask if len(mask) == count == available_cpus() else None


def node_names(hostname: str | None, n: int) -> list[str]:
    """The node names of ``n`` processes: ``<name>-<i>@<host>`` (i = 1..n) from ``-n
    <name>@<host>`` (Celery's reading: a name without ``@`` is the host), else
    ``critique-<i>@%h``."""
    name, host = hostname.split("@", 1) if hostname and "@" in hostname else ("", hostname)
    return [f"{name or 'critique'}-{i}@{host or '%h'}" for i in range(1, n + 1)]


def celery_argv(
    args: argparse.Namespace,
    queues: list[str],
    concurrency: int,
    hostname: str | None = None,
    *,
    quiet: bool = False,
) -> list[str]:
    """The ``celery worker`` command line of one process (node name ``hostname``, else
    ``-n`` as given; ``quiet``: no banner, Celery's ``--quiet``)."""
    argv = [
        sys.executable, "-m", "celery", "-A", "workers.app", *(["--quiet"] if quiet else []),
        "worker",
        "-Q", ",".join(queues), "-P", args.pool, "-c", str(concurrency), "-l", args.loglevel,
    ]  # fmt: skip
    hostname = hostname or args.hostname
    if hostname:
        argv += ["-n", hostname]
    return argv + list(args.celery_args)


def worker_argvs(
    args: argparse.Namespace, queues: list[str], concurrency: int, count: int
) -> list[list[str]]:
    """The command line of each of ``count`` worker processes: one as given, or ``count``
    with distinct node names (:func:`node_names`), only the first showing Celery's banner."""
    if count == 1:
        return [celery_argv(args, queues, concurrency)]
    names = node_names(args.hostname, count)
    return [celery_argv(args, queues, concurrency, n, quiet=i > 0) for i, n in enumerate(names)]


def worker_environment(env: MutableMapping[str, str]) -> None:
    """What this command sets in its worker processes' environment (``env``, in place): task
    events off (:data:`pipeline.settings.TASK_EVENTS` = 0) unless the operator set them either
    way."""
    if not settings.given(settings.TASK_EVENTS, env):
        env[settings.TASK_EVENTS.name] = "0"


def unlisted_models_warning(allowed_models: tuple[str, ...]) -> str | None:
    """The start-up warning of a worker that holds an API key and lists no ``allowed_models``:
    it refuses every submission that names a model (:mod:`pipeline.security.model_policy`)."""
    held = held_keys(os.environ)
    if not held or allowed_models:
        return None
    return (
        f"an API key is set ({held[0]}) and allowed_models is empty, so every submission that "
        f"names a model (its own or as model / paired_model) is refused; set "
        f"{ALLOWED_MODELS_ENV} to the models submissions may use"
    )


def check_own_config(*, keys: bool = True) -> tuple[str, ...]:
    """Raise ``ConfigError`` unless this worker's own configuration loads (workflow file and
    ``CRITIQUE_*`` environment) and, with ``keys`` (a worker that consumes an LLM queue), every
    model it names has its provider key. Returns its ``allowed_models``."""
    # lazy: pipeline.llm.providers is not loaded by `critique --help`, which imports this module and
    # stays fast
    from pipeline.llm.providers import check_keys, configured_models

    try:
        config = load_config()
    except RecursionError:
        raise ConfigError(
            f"CRITIQUE_CONFIG {settings.raw(settings.CONFIG)}: nested too deeply to parse",
            key=settings.CONFIG.name,
        ) from None
    models = configured_models(config) if keys else ()
    if models:  # litellm is imported only when there is a model to check
        check_keys(models, api_base=config.llm.api_base, where="this worker's environment")
    return config.allowed_models


def run(args: argparse.Namespace) -> int:
    return service_guard("worker", lambda: _start(args))


def _start(args: argparse.Namespace) -> int:
    queues = [q.strip() for q in str(args.queues).split(",") if q.strip()]
    unknown = [q for q in queues if q not in KNOWN_QUEUES]
    if not queues or unknown:
        what = f"unknown queue(s) {', '.join(unknown)}" if unknown else "no queue given"
        raise CommandError(f"{what}; the pipeline's queues are {', '.join(KNOWN_QUEUES)}")
    count = processes(args, queues)  # a bad value: ValueError, exit 2
    try:
        concurrency = threads_per_process(args, queues, count)
    except ValueError:
        raise CommandError("CRITIQUE_CONCURRENCY must be an integer") from None
    if concurrency < 1:
        raise CommandError("concurrency must be ≥ 1")
    argvs = worker_argvs(args, queues, concurrency, count)
    # lazy: pipeline.store.redis_common loads redis; `critique --help` imports this module
    from pipeline.store.redis_common import check_redis_urls

    try:
        check_redis_urls()  # a sentinel:// URL parses and has CRITIQUE_REDIS_MASTER
        allowed_models = check_own_config(keys=bool(set(queues) & set(LLM_QUEUES)))
        signed = bool(parse_secrets(settings.raw(settings.SECRET)))
        parse_named_secrets(settings.raw(settings.ENTRY_SECRET))  # too short: exit 2
    except ConfigError as exc:
        raise CommandError(terminal_line(exc)) from None
    pinned = cpu_slots(args, count)
    if args.dry_run:
        print("\n".join(" ".join(argv) for argv in argvs))
        if pinned:
            print(f"critique worker: {_pinning(argvs, pinned)}", file=sys.stderr)
        return EXIT_OK
    if not signed:
        print(f"critique worker: warning: {UNSIGNED_WARNING}", file=sys.stderr)
    unlisted = unlisted_models_warning(allowed_models)
    if unlisted:
        print(f"critique worker: warning: {unlisted}", file=sys.stderr)

    store = store_url()  # CRITIQUE_STORE_URL, else REDIS_URL
    broker = os.environ.get("CELERY_BROKER_URL") or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
    check_redis([(store, "Redis"), (broker, "Redis")])  # a sentinel:// URL: its master
    worker_environment(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    if len(argvs) == 1:
        os.execv(sys.executable, argvs[0])
    # A lean supervisor: a fresh interpreter that imports only the standard library and this
    # module, so what the checks imported (pydantic, redis, maybe litellm) is not kept in memory.
    supervisor = [sys.executable, "-m", "workers.commands.worker", "--supervise", json.dumps(argvs)]
    if pinned:
        supervisor.append(json.dumps(pinned))
    os.execv(sys.executable, supervisor)
    return EXIT_OK  # pragma: no cover - execv does not return


# --- the supervisor of N worker processes (--processes N > 1) ---------------------------------
def _say(message: str) -> None:
    print(f"critique worker: {message}", file=sys.stderr, flush=True)


def _node(argv: list[str]) -> str:
    """The node name in a ``celery worker`` command line, ``%h`` spelled out."""
    name = argv[argv.index("-n") + 1] if "-n" in argv else "celery@%h"
    return name.replace("%h", socket.gethostname())


def _threads(argv: list[str]) -> str:
    """`` x <c> threads`` (or processes, as the pool has them) from a ``celery worker`` command
    line; empty when it has no ``-c``."""
    if "-c" not in argv:
        return ""
    pool = argv[argv.index("-P") + 1] if "-P" in argv else "threads"
    unit = "processes" if pool == "prefork" else "threads"
    return f" x {argv[argv.index('-c') + 1]} {unit}"


def _how(status: int) -> str:
    """How a child ended, from its exit code (negative: the signal that killed it)."""
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent SIGTERM when the supervisor dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so a SIGKILLed supervisor leaves no orphan workers; None
    where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _pinning(argvs: list[list[str]], cpus: list[int]) -> str:
    """What the supervisor says of ``cpus`` (:func:`cpu_slots`), the nodes named."""
    each = ", ".join(f"{_node(argv)} on CPU {cpu}" for argv, cpu in zip(argvs, cpus, strict=True))
    return f"each process on a CPU of its own: {each} (--no-pin: any CPU)"


def _child_setup(preexec: Callable[[], None] | None, cpu: int | None) -> Callable[[], None] | None:
    """The ``preexec_fn`` of a child: ``preexec`` (:func:`_parent_death_signal`), then its CPU
    (``cpu``, :func:`cpu_slots`; every thread it starts inherits it)."""
    if cpu is None:
        return preexec

    def setup() -> None:
        if preexec is not None:
            preexec()
        with contextlib.suppress(OSError):  # the CPU went away (a cpuset changed): run free
            os.sched_setaffinity(0, {cpu})

    return setup


def supervise(
    argvs: list[list[str]],
    *,
    cpus: list[int] | None = None,
    max_restarts: int = MAX_RESTARTS,
    window_s: float = RESTART_WINDOW_S,
) -> int:
    """Run one child per command line until every child has exited; returns the exit status.
    ``cpus``: the CPU each child (and its restarts) is pinned to (:func:`cpu_slots`).

    Forwards SIGTERM, SIGINT and SIGQUIT to every child (SIGHUP as SIGTERM) and from then on
    restarts nothing. A child that exits 0 on its own is not restarted. A child that dies
    otherwise is reported on stderr and restarted, unless it is the (max_restarts + 1)-th
    unexpected exit within ``window_s`` seconds: then the others get SIGTERM and the status is
    1. Otherwise the status is 0 when every child exited 0, else the first non-zero child
    status (128 + N for signal N)."""
    count = len(argvs)
    children: dict[int, tuple[int, subprocess.Popen[bytes], float]] = {}
    stopping = False
    status = EXIT_OK
    deaths: deque[float] = deque()
    preexec = _parent_death_signal()

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        sig = signal.SIGTERM if signum == signal.SIGHUP else signum
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, forward)

    def spawn(index: int) -> None:
        # Own session: a terminal's Ctrl-C reaches the children once, through forward().
        setup = _child_setup(preexec, cpus[index] if cpus else None)
        proc = subprocess.Popen(argvs[index], start_new_session=True, preexec_fn=setup)
        children[proc.pid] = (index, proc, time.monotonic())
        if stopping:  # a signal came while it was starting
            os.kill(proc.pid, signal.SIGTERM)

    nodes = [_node(argv) for argv in argvs]
    _say(f"{count} processes{_threads(argvs[0])}: {', '.join(nodes)} (pid {os.getpid()} "
         f"supervises them; the banner below is {nodes[0]}'s, the others start quiet)")  # fmt: skip
    if cpus:
        _say(_pinning(argvs, cpus))
    for index in range(count):
        spawn(index)
    while children:
        try:
            pid, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        entry = children.pop(pid, None)
        if entry is None:
            continue
        index, proc, started = entry
        code = os.waitstatus_to_exitcode(wait_status)
        proc.returncode = code
        what = f"process {index + 1} of {count} ({nodes[index]}, pid {pid})"
        if stopping or code == 0:
            if code != 0 and status == EXIT_OK:
                status = 128 - code if code < 0 else code
            if code == 0 and not stopping:
                _say(f"{what} exited with status 0 on its own (a remote shutdown or a signal "
                     "sent to it): not restarted")  # fmt: skip
            continue
        now = time.monotonic()
        deaths.append(now)
        while deaths and now - deaths[0] > window_s:
            deaths.popleft()
        _say(f"{what} {_how(code)} unexpectedly after {now - started:.0f} s")
        if len(deaths) > max_restarts:
            _say(f"{len(deaths)} unexpected exits within {window_s:.0f} s: a crash loop; "
                 "stopping the other processes (warm shutdown), then exiting 1")  # fmt: skip
            forward(signal.SIGTERM, None)
            status = EXIT_FAILED
            continue
        _say(f"restarting {what.split(' (')[0]} as {nodes[index]}")
        if now - started < MIN_UPTIME_S:
            time.sleep(1.0)  # do not spin on a child that cannot start
        if not stopping:
            spawn(index)
    return status


if __name__ == "__main__":  # the supervisor run() execs into (--processes N > 1)
    if sys.argv[1:2] != ["--supervise"] or len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m workers.commands.worker --supervise ARGVS_JSON [CPUS_JSON]")
    sys.exit(
        supervise(json.loads(sys.argv[2]), cpus=json.loads(sys.argv[3]) if sys.argv[3:] else None)
    )
