"""``critique exporter`` listens on loopback unless told otherwise (its metrics need no
password: issue 34), and bounds every connection (issue 33): the options and their defaults."""

from __future__ import annotations

import argparse
import io
from contextlib import redirect_stdout

import pytest

from workers.cli import main
from workers.commands import exporter


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    exporter.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_exporter_binds_loopback_by_default_and_any_host_when_asked() -> None:
    """Without --host the exporter binds 127.0.0.1; --host 0.0.0.0 is an explicit choice."""
    assert _parse().host == "127.0.0.1"
    assert _parse("--host", "0.0.0.0").host == "0.0.0.0"


def test_every_connection_is_bounded_by_default() -> None:
    """A per-connection timeout and a connection cap are on unless set otherwise."""
    args = _parse()
    assert (args.timeout, args.max_connections) == (
        exporter.DEFAULT_TIMEOUT_S,
        exporter.DEFAULT_MAX_CONNECTIONS,
    )
    assert 0 < args.timeout <= 60 and 1 <= args.max_connections <= 256
    assert (_parse("--timeout", "2", "--max-connections", "8").max_connections) == 8


def test_the_default_server_listens_on_loopback_only_and_help_says_how_to_open_it() -> None:
    """The server built from the defaults is bound to 127.0.0.1 (not every interface), and
    `critique exporter --help` names the default and --host as the deliberate way out."""
    server = exporter.serve(_parse().host, 0, lambda *_: [], max_connections=1, timeout_s=1)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        main(["exporter", "--help"])
    text = " ".join(out.getvalue().split())
    assert "default 127.0.0.1: this host only" in text and "--host 0.0.0.0 opens" in text
