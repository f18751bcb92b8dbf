"""The client names the broker when a publish cannot reach it: by the error's type."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.support.workers import ROOT, worker_env

pytestmark = pytest.mark.integration

_PROBE = """
from workers.client import CritiqueClient
from workers.unreachable import BrokerUnavailableError
sub = {"run_id": "brk1", "worker_id": "w1", "task": "t", "output": {"summary": "s"}}
try:
    CritiqueClient().submit(sub)
except BrokerUnavailableError as exc:
    print("broker:", type(exc.__cause__).__name__, exc.message)
"""


def test_submit_with_the_broker_down_raises_broker_unavailable(redis_url: str) -> None:
    """With the store up and the broker refusing connections, ``submit`` raises
    BrokerUnavailableError (a StoreUnavailableError) naming the broker's URL, from kombu's
    OperationalError: the type decides, not the wording of its message."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    broker = f"redis://127.0.0.1:{port}/0"
    env = worker_env(redis_url, CELERY_BROKER_URL=broker, CRITIQUE_OUTAGE_S="2")
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"broker: OperationalError cannot reach the broker at {broker}")
