"""``critique worker``: start a Celery worker for the pipeline's queues.

The stages run on separate queues so they scale separately:

    critique.cpu         Layer-0 checks, heuristic and rubric critics, token-free repairs,
                         decide, gates (CPU-bound)
    critique.llm         LLM critic (mode: inline) and LLM repair (long, waiting on the network)
    critique.llm.critic  the LLM critic in mode: dedicated (its own model and workers)

Defaults: every queue, the threads pool (LLM calls wait on I/O, so threads are cheap), and
``$CRITIQUE_CONCURRENCY`` threads, else 16. A worker for ``critique.cpu`` alone is better off
with processes: ``critique worker -Q critique.cpu -P prefork`` (concurrency defaults to the
number of CPUs). Scale out by starting more workers, on any machine that reaches the same Redis.

Before anything starts, the worker's own configuration is checked, so a mistake stops the
worker instead of failing every chain it would run (exit 2, naming what to fix): the workflow
file (``CRITIQUE_CONFIG``) and every ``CRITIQUE_*`` variable (a typo such as
``CRITIQUE_MAX_REPAIRS`` is named), and the provider key of every model the configuration
names (``model``, ``paired_model``, ``allowed_models``: litellm's environment check, e.g.
``OPENAI_API_KEY``; ``CRITIQUE_LLM_API_KEY`` serves any provider) when the worker consumes an
LLM queue (``critique.llm``, ``critique.llm.critic``; a ``critique.cpu`` worker calls no
model). A secret that is too short exits 2 too; without ``CRITIQUE_SECRET`` it warns that stage
messages go unsigned (anyone with broker access can forge a verdict). ``--dry-run`` runs these
checks and prints the command.

Then it checks that Redis answers (exit 3 with the URL when it does not) and replaces itself
with ``python -m celery -A workers.app worker …`` (options after ``--`` go to Celery), so
signals (Ctrl-C: warm shutdown; twice: cold) and exit codes are Celery's own.
"""

from __future__ import annotations

import argparse
import os
import sys
from urllib.parse import urlparse

from workers.cli import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from workers.commands._input import one_line

HELP = "start a Celery worker for the pipeline's queues (critique.cpu, critique.llm, ...)"

# keys.QUEUES, spelled out: importing pipeline.store would load redis on every `critique --help`
# (tests/unit/test_cli_submit_worker.py pins that the two agree).
KNOWN_QUEUES = ("critique.cpu", "critique.llm", "critique.llm.critic")
LLM_QUEUES = ("critique.llm", "critique.llm.critic")
"""The queues whose stages may call a model: a worker on them needs the provider keys."""
POOLS = ("threads", "prefork", "solo", "gevent", "eventlet")
THREADS_DEFAULT = 16
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
  critique worker                                  # every queue, threads pool
  critique worker -Q critique.llm -c 64            # LLM stages only, 64 threads
  critique worker -Q critique.cpu -P prefork -c 4  # CPU stages in 4 processes
  critique worker -- --max-tasks-per-child 100     # pass options on to `celery worker`

checks before it starts (exit 2 naming what to fix): the workflow file ($CRITIQUE_CONFIG),
every CRITIQUE_* variable, CRITIQUE_SECRET, and on an LLM queue the provider key of every
configured model (e.g. OPENAI_API_KEY; CRITIQUE_LLM_API_KEY serves any provider).

Redis: $REDIS_URL (default redis://127.0.0.1:6379/0); the broker is the same unless
$CELERY_BROKER_URL says otherwise. Exit 3 when it cannot be reached.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = _DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "-Q",
        "--queues",
        default=os.environ.get("CRITIQUE_QUEUES", ",".join(KNOWN_QUEUES)),
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
        "for threads/gevent/eventlet and the CPU count for prefork)",
    )
    parser.add_argument(
        "-l",
        "--loglevel",
        default=os.environ.get("CRITIQUE_LOG_LEVEL", "INFO"),
        help="DEBUG, INFO, WARNING, ERROR (default: $CRITIQUE_LOG_LEVEL or INFO)",
    )
    parser.add_argument("-n", "--hostname", help="node name, e.g. llm1@%%h (Celery's default)")
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


def _concurrency(args: argparse.Namespace) -> int:
    if args.concurrency is not None:
        return int(args.concurrency)
    env = os.environ.get("CRITIQUE_CONCURRENCY")
    if env:
        return int(env)
    if args.pool == "prefork":
        return os.cpu_count() or 1
    if args.pool == "solo":
        return 1
    return THREADS_DEFAULT


def celery_argv(args: argparse.Namespace, queues: list[str], concurrency: int) -> list[str]:
    """The ``celery worker`` command line this invocation runs."""
    argv = [
        sys.executable, "-m", "celery", "-A", "workers.app", "worker",
        "-Q", ",".join(queues), "-P", args.pool, "-c", str(concurrency), "-l", args.loglevel,
    ]  # fmt: skip
    if args.hostname:
        argv += ["-n", args.hostname]
    return argv + list(args.celery_args)


def check_own_config(*, keys: bool = True) -> None:
    """Raise ``ConfigError`` unless this worker's own configuration loads (workflow file and
    ``CRITIQUE_*`` environment) and, with ``keys`` (a worker that consumes an LLM queue), every
    model it names has its provider key."""
    from pipeline.config import load_config
    from pipeline.errors import ConfigError
    from pipeline.providers import check_keys, configured_models

    try:
        config = load_config()
    except RecursionError:
        raise ConfigError(
            f"CRITIQUE_CONFIG {os.environ.get('CRITIQUE_CONFIG')}: nested too deeply to parse",
            key="CRITIQUE_CONFIG",
        ) from None
    models = configured_models(config) if keys else ()
    if models:  # litellm is imported only when there is a model to check
        check_keys(models, api_base=config.llm.api_base, where="this worker's environment")


def _unreachable(urls: list[str]) -> str | None:
    """A message for the first Redis URL that does not answer PING, else None."""
    import redis

    for url in urls:
        if urlparse(url).scheme not in ("redis", "rediss", "unix"):
            continue  # another broker transport: Celery reports its own connection errors
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
            try:
                client.ping()
            finally:
                client.close()
        except Exception as exc:
            return f"cannot reach Redis at {url}: {exc}"
    return None


def run(args: argparse.Namespace) -> int:
    queues = [q.strip() for q in str(args.queues).split(",") if q.strip()]
    unknown = [q for q in queues if q not in KNOWN_QUEUES]
    if not queues or unknown:
        what = f"unknown queue(s) {', '.join(unknown)}" if unknown else "no queue given"
        print(
            f"critique worker: {what}; the pipeline's queues are {', '.join(KNOWN_QUEUES)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        concurrency = _concurrency(args)
    except ValueError:
        print("critique worker: CRITIQUE_CONCURRENCY must be an integer", file=sys.stderr)
        return EXIT_USAGE
    if concurrency < 1:
        print("critique worker: concurrency must be ≥ 1", file=sys.stderr)
        return EXIT_USAGE
    argv = celery_argv(args, queues, concurrency)
    from pipeline.errors import ConfigError
    from pipeline.signing import SECRET_ENV, parse_secrets

    try:
        check_own_config(keys=bool(set(queues) & set(LLM_QUEUES)))
        signed = bool(parse_secrets(os.environ.get(SECRET_ENV)))
    except ConfigError as exc:
        print(f"critique worker: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        print(" ".join(argv))
        return EXIT_OK
    if not signed:
        print(f"critique worker: warning: {UNSIGNED_WARNING}", file=sys.stderr)
    store = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    broker = os.environ.get("CELERY_BROKER_URL", store)
    problem = _unreachable(list(dict.fromkeys([store, broker])))
    if problem:
        print(
            f"critique worker: {problem}\n"
            "start Redis there, or point REDIS_URL (and CELERY_BROKER_URL, if you set it) at "
            "a running one",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return EXIT_OK  # pragma: no cover - execv does not return
