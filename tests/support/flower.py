"""Flower as a real process for the tests: ``celery -A workers.app flower`` with basic auth on a
free loopback port, its authenticated HTTP API, and polling it until a condition holds.

Used by ``tests/e2e/test_flower.py`` (one Redis) and ``tests/faults/test_flower_sentinel.py``
(a Sentinel broker)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tests.support.workers import ROOT
from workers.embedded import free_port

USER, PASSWORD = "user", "secret"
T = TypeVar("T")


def get(url: str, auth: tuple[str, str] | None = (USER, PASSWORD)) -> tuple[int, bytes]:
    """GET ``url`` (with basic auth unless ``auth`` is None): status code and body."""
    req = urllib.request.Request(url)
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def until(what: str, probe: Callable[[], T | None], timeout: float = 20.0) -> T:
    """Poll ``probe`` until it returns something truthy, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = probe()
        except (OSError, ValueError):
            got = None
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


class FlowerProcess:
    """``celery -A workers.app flower --basic-auth=USER:PASSWORD`` on a free loopback port with
    ``env``, its output in ``log``; :meth:`start` returns once its healthcheck answers."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env = env
        self.log = log
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> FlowerProcess:
        argv = [
            sys.executable, "-m", "celery", "-A", "workers.app", "flower",
            "--address=127.0.0.1", f"--port={self.port}", f"--basic-auth={USER}:{PASSWORD}",
        ]  # fmt: skip
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        until("Flower's healthcheck", lambda: self.get("/healthcheck", None)[0] == 200, timeout)
        return self

    def get(self, path: str, auth: tuple[str, str] | None = (USER, PASSWORD)) -> tuple[int, bytes]:
        """GET ``path`` of this Flower (see :func:`get`)."""
        return get(f"{self.base}{path}", auth)

    def json(self, path: str) -> Any:
        """``path``'s JSON body (authenticated); ``None`` unless it answered 200."""
        code, body = self.get(path)
        return json.loads(body) if code == 200 else None

    def wait_worker_alive(self, prefix: str, timeout: float = 20.0) -> None:
        """Until Flower's event receiver has heard the heartbeat of a worker whose node name
        starts with ``prefix`` (from then on it sees that worker's task events)."""

        def alive() -> bool:
            status = self.json("/api/workers?status=1") or {}
            return any(name.startswith(prefix) and up for name, up in status.items())

        until(f"the heartbeat of {prefix}* in Flower", alive, timeout)

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 10 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
