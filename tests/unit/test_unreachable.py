"""Which failures read as "a service could not be reached" (exit 3): by type, never by text."""

from __future__ import annotations

import socket

import pytest
import redis
from kombu.exceptions import OperationalError

from pipeline.errors import StoreUnavailableError, SubmissionError
from workers.unreachable import BrokerUnavailableError, is_unreachable


@pytest.mark.parametrize(
    "exc",
    [
        redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:1"),
        redis.exceptions.TimeoutError("Timeout reading from socket"),
        OperationalError("[Errno 111] Connection refused"),
        ConnectionRefusedError(111, "Connection refused"),
        ConnectionResetError(104, "Connection reset by peer"),
        socket.gaierror(-2, "Name or service not known"),
        StoreUnavailableError("the Redis store at redis://x:6379/0 is unavailable"),
        BrokerUnavailableError("cannot reach the broker at redis://x:6379/0"),
    ],
)
def test_connection_failures_are_unreachable_by_type(exc: BaseException) -> None:
    """Redis, kombu and socket connection failures, and the stores' mapping of them, count."""
    assert is_unreachable(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("could not connect the dots: connection refused"),  # wording alone: no
        SubmissionError("submission 0 cannot be serialised for the broker: Connection"),
        redis.exceptions.ResponseError("WRONGTYPE Operation against a key"),
        FileNotFoundError(2, "No such file or directory"),
    ],
)
def test_other_failures_are_not_unreachable_whatever_they_say(exc: BaseException) -> None:
    """A message that mentions a connection does not make an error an outage."""
    assert not is_unreachable(exc)


def test_a_broker_failure_is_a_store_unavailable_error() -> None:
    """Code that catches StoreUnavailableError (transient, exit 3) also catches the broker's."""
    assert issubclass(BrokerUnavailableError, StoreUnavailableError)
