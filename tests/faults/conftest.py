"""Fault-test services: a private ``redis-server`` with AOF that a test kills and restarts, a
Sentinel deployment (``tests.support.sentinel``), and the environment that points this process
and real worker processes at them.

Never the shared Redis: each test gets its own server on a free loopback port, in a temp dir.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.servers import FAULT_ENV, RedisServer, forget_app_connections
from tests.support.workers import client_on

if TYPE_CHECKING:  # tests.support.sentinel imports this module
    from tests.support.sentinel import SentinelSetup


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private Redis with AOF for one test; gone afterwards."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fault_store_env() -> dict[str, str]:
    """More environment for :func:`fault_env` (none; a test module overrides this fixture to
    put the store elsewhere, e.g. ``CRITIQUE_STORE_URL``)."""
    return {}


@pytest.fixture
def fault_env(
    redis_server: RedisServer, fault_store_env: dict[str, str]
) -> Iterator[dict[str, str]]:
    """This process's client pointed at the private Redis (db 0), with :data:`FAULT_ENV` and
    :func:`fault_store_env`; the environment for the test's worker processes."""
    with client_on(redis_server.url(0), **FAULT_ENV, **fault_store_env) as env:
        forget_app_connections()
        try:
            yield env
        finally:
            forget_app_connections()


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSetup]:
    """A master (AOF), one replica and three Sentinels, settled (``tests.support.sentinel``);
    every one stopped afterwards."""
    from tests.support.sentinel import SentinelSetup

    setup = SentinelSetup(tmp_path / "redis")
    try:
        yield setup.start()
    finally:
        setup.stop()


@pytest.fixture
def sentinel_env(sentinels: SentinelSetup) -> Iterator[dict[str, str]]:
    """This process's client (store, broker, result backend) on the Sentinel URL; the
    environment for the workers."""
    from pipeline.store.redis_common import celery_url
    from tests.support.sentinel import MASTER
    from workers.app import app, check_sentinel_settings

    url = sentinels.url()
    saved = (app.conf.broker_transport_options, app.conf.result_backend_transport_options)
    with client_on(url, flush=False, CRITIQUE_REDIS_MASTER=MASTER, **FAULT_ENV) as env:
        # celeryconfig was read before this test set the URL: what it does at start-up for a
        # sentinel:// URL (normalized URL, master_name, sentinel_kwargs), done here.
        # (Celery reads CELERY_BROKER_URL / CELERY_RESULT_BACKEND from the environment first.)
        normalized = celery_url(url, setting="REDIS_URL")
        os.environ["CELERY_BROKER_URL"] = os.environ["CELERY_RESULT_BACKEND"] = normalized
        app.conf.broker_url = app.conf.result_backend = normalized
        app.conf.broker_transport_options = {
            k: v for k, v in saved[0].items() if k not in ("master_name", "sentinel_kwargs")
        }
        app.conf.result_backend_transport_options = {
            k: v for k, v in saved[1].items() if k not in ("master_name", "sentinel_kwargs")
        }
        check_sentinel_settings(app.conf)
        forget_app_connections()
        try:
            yield env
        finally:
            forget_app_connections()
            app.conf.broker_transport_options, app.conf.result_backend_transport_options = saved
