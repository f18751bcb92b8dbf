"""The client names the broker when a publish cannot reach it: by the error's type."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.support.workers import ROOT, worker_env

pytestmark = pytest.mark.integration

_PROBE = """
from workers import runtime
from workers.client import CritiqueClient
from workers.unreachable import BrokerUnavailableError
run_id = "brk-" + runtime.new_pass_id()
sub = {"run_id": run_id, "worker_id": "w1", "task": "t", "output": {"summary": "s"}}
try:
    CritiqueClient().submit(sub)
except BrokerUnavailableError as exc:
    print("broker:", type(exc.__cause__).__name__, exc.message)
    print("recorded:", runtime.stores().runs.submission(run_id, 1, "w1"))
"""


def test_submit_with_the_broker_down_raises_broker_unavailable(redis_url: str) -> None:
    """With the store up and the broker refusing connections, ``submit`` raises
    BrokerUnavailableError (a StoreUnavailableError) naming the broker's URL, from kombu's
    OperationalError: the type decides, not the wording of its message. The pass it recorded
    before the send is withdrawn: nothing is left for the sweeper to re-drive."""
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
    assert proc.stdout.splitlines()[-1] == "recorded: None"
