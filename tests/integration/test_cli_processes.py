"""CLI runs as processes: what a bare ``--version`` / ``--help`` imports, and a worker that
refuses a bad URL before it spawns a node (the in-process checks of the same commands are in
tests/unit/test_cli_exit_codes.py, test_cli_submit_worker.py and test_urls.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.store.urls import URL_SETTINGS
from workers.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
URL_ENVS = [s.env for s in URL_SETTINGS]
"""The variables that name a Redis or broker URL (left out of the worker's environment)."""


def test_version_and_help_stay_light() -> None:
    """--version imports neither litellm nor celery (the CLI starts fast)."""
    probe = (
        "import sys, workers.cli as c\n"
        "try:\n    c.main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('celery', 'litellm') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_importing_the_client_leaves_the_managers_process_as_it_was() -> None:
    """A manager that imports ``workers.client`` (or the asyncio client) gets no Celery app:
    ``workers.app`` configures Celery, logging and ``os.environ`` on import, and is loaded only
    where a worker, a submit's signature or a broker error needs it."""
    probe = "import sys, workers.client, workers.aclient\nprint('workers.app' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_help_lists_the_commands_without_importing_celery() -> None:
    """`critique --help` knows demo, worker and submit, and building it imports no Celery."""
    text = build_parser().format_help()
    for name in ("demo", "worker", "submit"):
        assert name in text
    probe = (
        "import sys, workers.cli as c; c.build_parser(); "
        "print(sorted(m for m in ('celery', 'litellm', 'redis') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.strip() == "[]"


def test_worker_exits_2_before_it_spawns_a_node() -> None:
    """A real `critique worker --processes 2`: one line, exit 2 within seconds, no Celery node
    started (it used to start nodes that died on ModuleNotFoundError('localhost'), forever)."""
    env = {k: v for k, v in os.environ.items() if k not in URL_ENVS}
    env["REDIS_URL"] = "localhost:6394"
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", "worker", "--processes", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.count("\n") == 1 and "REDIS_URL='localhost:6394' has no scheme" in done.stderr
    )
    assert "celery" not in done.stderr.lower() and "ModuleNotFoundError" not in done.stderr
    assert time.monotonic() - began < 30
