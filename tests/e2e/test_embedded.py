"""The embedded Redis never outlives the process that started it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.embedded import ping

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, time
from workers.embedded import EmbeddedRedis
print(EmbeddedRedis().start().port, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_sigkilled_parent_takes_its_redis_server_down() -> None:
    """SIGKILL the parent (no atexit runs): its private redis-server exits too."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        assert ping("127.0.0.1", port)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while ping("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ping("127.0.0.1", port)
