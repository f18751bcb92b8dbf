"""The ``--redis`` option the benches share: a database of the bench's own, else a private
``redis-server`` started for the run (stopped at exit)."""

from __future__ import annotations

import argparse

HELP = "a database for this bench alone: it is flushed (default: a redis-server of its own)"


def add_redis_option(ap: argparse.ArgumentParser) -> None:
    """Add ``--redis URL`` to a bench's arguments."""
    ap.add_argument("--redis", default=None, help=HELP)


def redis_url(given: str | None) -> str:
    """``given``, else the URL of a private Redis server started now (it stops at exit)."""
    if given:
        return given
    from workers.embedded import EmbeddedRedis

    return str(EmbeddedRedis().start().url)
