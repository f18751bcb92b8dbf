"""What every ``critique`` command shares: one error type, one guard, shared options, one Redis
check.

- :class:`CommandError` ``(message, code)``: a command that cannot go on raises it with a code
  of the one exit-code table (``EXIT_*`` in :mod:`workers.cli`, printed in every ``--help``).
- :func:`service_guard` runs a command's body and maps every error to that table:
  ``CommandError`` to its code, an unknown run or a bad value to 2, an unreachable service to 3;
  each as one ``critique COMMAND: message`` on stderr.
- :func:`at_least` and :func:`above` are argparse types for numeric options; a value out of
  range is reported after parsing as ``--X must be ≥ N`` (``--X must be > N``) with exit 2
  (:func:`check_numbers`, called by the CLI entry point before a command runs).
- :func:`add_run_argument` and :func:`add_json_argument`: the ``RUN`` argument and ``--json``.
- :func:`check_redis` pings each Redis URL a command needs; :func:`unreachable_redis` words the
  failure as every unreachable-service message is: ``cannot reach <what> at <url>: <reason>
  (hint: …)``, one line (the default hint: :data:`REDIS_HINT`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from pipeline.errors import ConfigError, CritiqueError, StoreUnavailableError
from pipeline.models import MAX_ITERATION
from pipeline.store.urls import CLUSTER_SCHEMES, cannot_reach
from workers.exit_codes import EXIT_UNAVAILABLE, EXIT_USAGE

REDIS_HINT = (
    "start Redis there, or point REDIS_URL (and CELERY_BROKER_URL or CRITIQUE_STORE_URL, if you "
    "set them) at a running one"
)
"""What to do when a Redis does not answer: the one hint every command prints."""


class CommandError(Exception):
    """A command cannot go on: ``message`` for stderr, ``code`` from the exit-code table."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return self.message


class UnknownRunError(LookupError):
    """Redis holds nothing for the run: never submitted, mistyped, or its keys expired."""


def unreachable_redis(url: str, exc: BaseException, what: str = "Redis") -> CommandError:
    """``cannot reach <what> at <url>: <reason> (hint: …)``, one line, exit 3 (the URL's
    password shown as ``***``): the shape of every unreachable-service message
    (:func:`pipeline.store.urls.cannot_reach`). An ``exc`` that is already such a message (the
    stores' and the client's ``StoreUnavailableError``) is shown as it is; any other gets
    :data:`REDIS_HINT`."""
    if not isinstance(exc, StoreUnavailableError):
        exc = StoreUnavailableError(cannot_reach(what, url, exc), hint=REDIS_HINT)
    return CommandError(str(exc), EXIT_UNAVAILABLE)


def service_guard(command: str, body: Callable[[], int]) -> int:
    """Run a command body and map every error to the exit-code table, with one line on stderr:
    a :class:`CommandError` to its code; an unknown run, a bad value or a refused configuration
    to 2; an unreachable Redis or broker to 3.

    A ``BrokenPipeError`` is the reader of this command's output going away (``| head``), not
    Redis (redis-py wraps its own socket errors in its ``ConnectionError``): it is left to the
    CLI entry point, which ends quietly, instead of being reported as "cannot reach Redis".
    ``KeyboardInterrupt`` and ``SystemExit`` pass through as well.
    """
    # lazy: workers.unreachable is not loaded by `critique --help`, which imports this module and
    # stays fast
    from workers.unreachable import unreachable_errors

    try:
        return body()
    except BrokenPipeError:
        raise
    except CommandError as exc:
        error, code = exc, exc.code
    except UnknownRunError as exc:
        error, code = CommandError(str(exc)), EXIT_USAGE
    except unreachable_errors() as exc:  # a StoreUnavailableError names its URL already
        # lazy: workers.runtime loads celery; `critique --help` imports this module
        from workers import runtime

        error, code = unreachable_redis(runtime.store_url(), exc), EXIT_UNAVAILABLE
    except (CritiqueError, ValueError) as exc:
        error, code = CommandError(str(exc)), EXIT_USAGE
    print(f"critique {command}: {error}", file=sys.stderr)
    return code


# -- numeric options ----------------------------------------------------------------------------
@dataclass(frozen=True)
class OutOfRange:
    """A parsed option value outside its range; :func:`check_numbers` reports it."""

    value: float
    rule: str
    """``≥ 1``, ``> 0``: what the value must be."""


def _number(kind: Callable[[str], float], name: str, ok: Callable[[float], bool], rule: str) -> Any:
    def parse(text: str) -> float | OutOfRange:
        value = kind(text)  # ValueError: argparse's own "invalid int value" (exit 2)
        return value if ok(value) else OutOfRange(value, rule)

    parse.__name__ = name  # argparse names the type in "invalid int value: 'x'"
    return parse


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer ≥ ``low`` (``--X must be ≥ low`` otherwise)."""
    result: Callable[[str], int] = _number(int, "int", lambda v: v >= low, f"≥ {low}")
    return result


def between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` (``--X must be low–high``)."""
    result: Callable[[str], int] = _number(int, "int", lambda v: low <= v <= high, f"{low}–{high}")
    return result


def above(low: float) -> Callable[[str], float]:
    """An argparse type: a number > ``low`` (``--X must be > low`` otherwise; NaN is not)."""
    result: Callable[[str], float] = _number(float, "float", lambda v: v > low, f"> {low:g}")
    return result


def number_problem(args: argparse.Namespace) -> str | None:
    """``--X must be ≥ N`` for the first option parsed out of its range, else None."""
    for dest, value in vars(args).items():
        if isinstance(value, OutOfRange):
            return f"--{dest.replace('_', '-')} must be {value.rule}"
    return None


def check_numbers(args: argparse.Namespace) -> None:
    """Raise :class:`CommandError` (exit 2) for an option parsed out of its range."""
    problem = number_problem(args)
    if problem:
        raise CommandError(problem, EXIT_USAGE)


# -- shared arguments ---------------------------------------------------------------------------
def add_run_argument(parser: argparse.ArgumentParser) -> None:
    """The ``RUN`` positional argument (``args.run_id``)."""
    parser.add_argument("run_id", metavar="RUN", help="the run id")


def add_json_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """``--json`` (``args.json``), its help saying what is printed."""
    parser.add_argument("--json", action="store_true", help=help)


def add_worker_argument(parser: argparse.ArgumentParser) -> None:
    """``--worker W`` (``args.worker``, a list: repeatable; empty when not given)."""
    parser.add_argument(
        "--worker", action="append", default=[], metavar="W", help="only this worker (repeatable)"
    )


def add_iteration_argument(parser: argparse.ArgumentParser) -> None:
    """``--iteration N`` (``args.iteration``, None when not given; 1 ≤ N ≤ the highest
    iteration a submission may name, :data:`pipeline.models.MAX_ITERATION`)."""
    parser.add_argument("--iteration", type=_iteration, metavar="N", help="only this iteration")


def _iteration(text: str) -> int | OutOfRange:
    """An iteration number: ``--iteration must be ≥ 1`` below, ``≤ 1000000`` above (a
    submission names no higher one)."""
    value = int(text)  # ValueError: argparse's own "invalid int value" (exit 2)
    if value < 1:
        return OutOfRange(value, "≥ 1")
    return value if value <= MAX_ITERATION else OutOfRange(value, f"≤ {MAX_ITERATION}")


_iteration.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"


# -- the Redis check ----------------------------------------------------------------------------
REDIS_SCHEMES = ("redis", "rediss", "unix", "sentinel")


def check_redis(urls: Iterable[tuple[str, str]]) -> None:
    """PING each ``(url, what)`` (``what``: ``"Redis"``, ``"the broker"``) in turn; raise a
    :class:`CommandError` for the first that does not answer (exit 3, :data:`REDIS_HINT`), or
    whose setting is invalid (a ``sentinel://`` URL without ``CRITIQUE_REDIS_MASTER``: exit 2).
    A ``sentinel://`` URL is checked at its current master, found through the Sentinels; a
    ``redis+cluster://`` one at the cluster's nodes; another broker transport is skipped (Celery
    reports its own connection errors)."""
    # lazy: pipeline.store.redis_common loads redis; `critique --help` imports this module
    from pipeline.store.redis_common import store_client_from_url

    for url, what in dict.fromkeys(urls):
        if urlparse(url).scheme not in (*REDIS_SCHEMES, *CLUSTER_SCHEMES):
            continue
        try:
            client = store_client_from_url(url, socket_connect_timeout=3, socket_timeout=3)
            try:
                client.ping()
            finally:
                client.close()
        except ConfigError as exc:
            raise CommandError(str(exc), EXIT_USAGE) from None
        except Exception as exc:
            raise unreachable_redis(url, exc, what) from None
