"""A Redis Sentinel deployment as real processes, for the fault tests: a master with AOF, one
replica and three Sentinels (``redis-server --sentinel``) on free loopback ports in a temp dir,
and a worker process that runs on its ``sentinel://`` URL. The fixtures that start them
(``sentinels``, ``sentinel_env``) are in ``tests/faults/conftest.py``."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from pipeline.store.redis_common import celery_url
from tests.support.servers import ServerProcess
from tests.support.workers import WorkerProcess
from workers.embedded import free_port, ping

MASTER = "mymaster"
"""The name the Sentinels monitor (``CRITIQUE_REDIS_MASTER``)."""


class RedisNode(ServerProcess):
    """One ``redis-server`` process (a data node or, with ``sentinel``, a Sentinel)."""

    def __init__(self, workdir: Path, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, argv: list[str], timeout: float = 15.0) -> RedisNode:
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - the child keeps it open
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log_text = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {log_text}")
            if ping("127.0.0.1", self.port):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not answer on port {self.port}")

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, decode_responses=True)


class SentinelSetup:
    """A master (AOF, ``appendfsync always``), one replica of it (AOF too) and three Sentinels
    monitoring it (quorum 2, down after 1 s, failover timeout 5 s)."""

    def __init__(self, workdir: Path) -> None:
        self.exe = str(shutil.which("redis-server"))
        self.master = RedisNode(workdir, "master")
        self.replica = RedisNode(workdir, "replica")
        self.sentinels = [RedisNode(workdir, f"sentinel{i}") for i in range(3)]

    def _data_argv(self, s: RedisNode, *extra: str) -> list[str]:
        return [
            self.exe,
            "--port", str(s.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
            "--save", "", "--appendonly", "yes", "--appendfsync", "always",
            "--dir", str(s.dir), *extra,
        ]  # fmt: skip

    def start(self) -> SentinelSetup:
        self.master.start(self._data_argv(self.master))
        self.replica.start(
            self._data_argv(self.replica, "--replicaof", "127.0.0.1", str(self.master.port))
        )
        for s in self.sentinels:
            conf = s.dir / "sentinel.conf"  # each Sentinel rewrites its own config file
            conf.write_text(
                f"port {s.port}\nbind 127.0.0.1\ndir {s.dir}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            s.start([self.exe, str(conf), "--sentinel"])
        self._wait_settled(self.master.port, 40.0)
        return self

    def _wait_settled(self, master_port: int, timeout: float) -> None:
        """Until the replica is in sync and every Sentinel knows the master, its replica and
        the two other Sentinels (they find each other through the master's hello channel)."""
        deadline = time.monotonic() + timeout
        seen: Any = None
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.exceptions.RedisError):
                seen = [s.client().sentinel_master(MASTER) for s in self.sentinels]
                link = self.replica.client().info("replication").get("master_link_status")
                if link == "up" and all(
                    int(m["port"]) == master_port
                    and int(m["num-slaves"]) >= 1
                    and int(m["num-other-sentinels"]) >= 2
                    for m in seen
                ):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the Sentinels did not settle within {timeout} s: {seen}")

    def url(self) -> str:
        """The issue's form: the Sentinels ``;``-separated, the database once, at the end."""
        return ";".join(f"sentinel://127.0.0.1:{s.port}" for s in self.sentinels) + "/0"

    def master_port(self) -> int | None:
        """The master's port as the first Sentinel that answers says."""
        for s in self.sentinels:
            with contextlib.suppress(redis.exceptions.RedisError):
                addr = s.client().sentinel_get_master_addr_by_name(MASTER)
                if addr:
                    return int(addr[1])
        return None

    def stop(self) -> None:
        for s in [*self.sentinels, self.replica, self.master]:
            s.stop()


class SentinelWorker(WorkerProcess):
    """A worker process on the Sentinel URL; its readiness probe (a remote-control ping) needs
    the master name too."""

    def _probe_app(self) -> Any:
        return control_app(self.redis_url)


def control_app(url: str) -> Any:
    from celery import Celery

    probe = Celery("probe", broker=celery_url(url, setting="REDIS_URL"), set_as_current=False)
    probe.conf.broker_transport_options = {"master_name": MASTER}
    return probe
