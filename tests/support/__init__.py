"""What the test suites share, so no suite imports another suite's test module.

This package: waiting on a condition, stopping a process, the compiled-scanner requirement, a
recording budget ledger, reading a run's step records. Its modules: ``workers`` (the worker
harness behind the ``start_worker`` and ``worker`` fixtures of tests/conftest.py), ``revisers``
(callables a worker loads from its configuration), ``submissions`` and ``entry`` (builders),
``rawcelery`` (hand-built broker messages), ``servers`` and ``sentinel`` (Redis processes the
fault tests kill), ``flower``, ``faults``, ``hostile``, ``provider_keys``, ``probes`` and
``providers``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from pipeline.store.base import BudgetAnswer
from pipeline.store.memory import MemoryBudgetLedger

T = TypeVar("T")

REQUIRE_FASTSCAN_ENV = "CRITIQUE_TEST_REQUIRE_FASTSCAN"
"""Set to ``1`` (CI does) to make tests of the compiled scanner fail, not skip, when it is not
built."""


def wait_until(
    condition: Callable[[], T],
    timeout: float = 10.0,
    *,
    what: str | None = None,
    interval: float = 0.02,
) -> T:
    """Poll ``condition`` until it returns something truthy and return that; fail the test
    naming ``what`` (or the callable) when ``timeout`` seconds pass first.

    The timeout only bounds a hang: a test asserts the condition, never how long it took.
    """
    deadline = time.monotonic() + timeout
    delay = min(interval, 0.005)
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            name = what or getattr(condition, "__name__", repr(condition))
            pytest.fail(f"timed out after {timeout:g} s waiting for {name}", pytrace=False)
        time.sleep(delay)
        delay = min(delay * 2, interval)


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, wait_s: float = 60) -> int:
    """Send ``sig`` to ``proc`` if it still runs, wait ``wait_s`` for it to end (else kill it)
    and return its exit code: the end of every test that started a worker command."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


def require_fastscan() -> None:
    """Skip the calling test when the compiled scanner (the ``_fastscan`` extension) is not
    built, saying so and how to build it; fail it instead under
    ``CRITIQUE_TEST_REQUIRE_FASTSCAN=1``.

    The extension is optional in ``setup.py`` (an install without a C compiler still works, on
    the pure-Python twin), so a plain run may lack it; CI requires it.
    """
    from pipeline.contract._scan import compiled_available

    if compiled_available():
        return
    reason = (
        "the compiled scanner (the _fastscan extension) is not built: it needs a C "
        "compiler at install time (pip install -e . or python setup.py build_ext --inplace)"
    )
    if os.environ.get(REQUIRE_FASTSCAN_ENV) == "1":
        pytest.fail(f"{reason}; {REQUIRE_FASTSCAN_ENV}=1 requires it", pytrace=False)
    pytest.skip(reason)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class RecordingLedger(MemoryBudgetLedger):
    """The in-memory budget ledger, remembering every reservation asked: (lease id, tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.reserved: list[tuple[str, int]] = []

    def ask(
        self,
        run_id: str,
        lease_id: str,
        tokens: int,
        cap: int,
        ttl_s: float,
        wait_s: float = 0.0,
    ) -> BudgetAnswer:
        self.reserved.append((lease_id, tokens))
        return super().ask(run_id, lease_id, tokens, cap, ttl_s, wait_s)


def run_steps(client: Any, run_id: str) -> dict[str, bytes]:
    """Every pass's step records of a run still in Redis (each pass has a hash of its own,
    released when its result lands unless ``CRITIQUE_STEPS_GRACE_S`` keeps it): step -> output."""
    from pipeline.store import keys

    out: dict[str, bytes] = {}
    for key in client.scan_iter(keys.pass_steps_key(run_id, "*"), count=1000):
        out.update({k.decode(): v for k, v in client.hgetall(key).items()})
    return out
