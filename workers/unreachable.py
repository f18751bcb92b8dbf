"""Which failures mean "a service could not be reached" (exit 3, transient), by exception type.

One answer for the client and every command: Redis refusing, dropping or timing out a
connection (``redis.exceptions.ConnectionError``/``TimeoutError``, or the stores' mapping of
them, :class:`~pipeline.errors.StoreUnavailableError`), the broker refusing a publish
(``kombu.exceptions.OperationalError``), and the socket-level failures under both (refused,
reset, an unresolvable host). Never by the wording of a message, which changes between
library versions. redis and kombu are imported on first use, so ``critique --help`` does
not pay for them.
"""

from __future__ import annotations

import socket
from functools import cache

from pipeline.errors import StoreUnavailableError


class BrokerUnavailableError(StoreUnavailableError):
    """The broker (``CELERY_BROKER_URL``, by default the same Redis) could not take a message."""


@cache
def unreachable_errors() -> tuple[type[BaseException], ...]:
    """The exception types that say a service could not be reached (see the module docstring)."""
    import redis
    from kombu.exceptions import OperationalError

    return (
        StoreUnavailableError,
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        OperationalError,
        ConnectionError,  # the builtin: refused, reset, aborted, broken pipe
        socket.gaierror,  # the host name does not resolve
    )


def is_unreachable(exc: BaseException) -> bool:
    """True when ``exc`` says a service could not be reached, not that a request was wrong."""
    return isinstance(exc, unreachable_errors())
