"""A Redis Sentinel deployment as real processes, for the fault tests: a master with AOF, one
replica and three Sentinels (``redis-server --sentinel``) on free loopback ports in a temp dir,
and a worker process that runs on its ``sentinel://`` URL. The fixtures that start them
(``sentinels``, ``sentinel_env``) are in ``tests/faults/conftest.py``."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from pipeline.store.redis_common import celery_url
from tests.support.servers import ServerProcess
from tests.support.workers import WorkerProcess
from workers.embedded import free_port, ping

if TYPE_CHECKING:
    from tests.support.netns import Netns

MASTER = "mymaster"
"""The name the Sentinels monitor (``CRITIQUE_REDIS_MASTER``)."""


class RedisNode(ServerProcess):
    """One ``redis-server`` process (a data node or, with ``sentinel``, a Sentinel)."""

    def __init__(
        self, workdir: Path, name: str, host: str = "127.0.0.1", prefix: Sequence[str] = ()
    ) -> None:
        self.name = name
        self.host = host
        self.prefix = list(prefix)
        """What the command runs under (e.g. ``ip netns exec <ns>``: the node is on that side)."""
        self.port = free_port()
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, argv: list[str], timeout: float = 15.0) -> RedisNode:
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - the child keeps it open
        self.proc = subprocess.Popen([*self.prefix, *argv], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log_text = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {log_text}")
            if ping(self.host, self.port):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not answer on port {self.port}")

    def client(self) -> redis.Redis:
        """A client that tries once (a node cut off by a partition costs one second)."""
        return redis.Redis(
            self.host,
            self.port,
            socket_timeout=5,
            socket_connect_timeout=1,
            retry=None,
            decode_responses=True,
        )


class SentinelSetup:
    """A master (AOF, ``appendfsync always``), ``replicas`` replicas of it (AOF too) and three
    Sentinels monitoring it (quorum 2, down after 1 s, failover timeout 5 s).

    With ``netns``, the master and the first Sentinel run inside that namespace (one side of a
    partition, :class:`tests.support.netns.Netns`) and the rest on this side: cutting the link
    leaves the master with a minority of the Sentinels and none of its replicas."""

    def __init__(self, workdir: Path, replicas: int = 1, netns: Netns | None = None) -> None:
        self.exe = str(shutil.which("redis-server"))
        inside: dict[str, Any] = {}
        here = "127.0.0.1"
        if netns is not None:
            inside = {"host": netns.inner, "prefix": netns.exec}
            here = netns.outer
        self.master = RedisNode(workdir, "master", **inside)
        self.replicas = [
            RedisNode(workdir, "replica" if i == 0 else f"replica{i}", here)
            for i in range(replicas)
        ]
        self.replica = self.replicas[0]
        self.sentinels = [
            RedisNode(workdir, "sentinel0", **inside) if inside else RedisNode(workdir, "sentinel0")
        ]
        self.sentinels += [RedisNode(workdir, f"sentinel{i}", here) for i in (1, 2)]

    def _data_argv(self, s: RedisNode, *extra: str) -> list[str]:
        return [
            self.exe,
            "--port", str(s.port), "--bind", s.host, "--protected-mode", _protected(s),
            "--save", "", "--appendonly", "yes", "--appendfsync", "always",
            "--dir", str(s.dir), *extra,
        ]  # fmt: skip

    def start(self) -> SentinelSetup:
        self.master.start(self._data_argv(self.master))
        for replica in self.replicas:
            replica.start(
                self._data_argv(replica, "--replicaof", self.master.host, str(self.master.port))
            )
        for s in self.sentinels:
            conf = s.dir / "sentinel.conf"  # each Sentinel rewrites its own config file
            conf.write_text(
                f"port {s.port}\nbind {s.host}\nprotected-mode {_protected(s)}\ndir {s.dir}\n"
                f"sentinel monitor {MASTER} {self.master.host} {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            s.start([self.exe, str(conf), "--sentinel"])
        self._wait_settled(self.master.port, 40.0)
        return self

    def _wait_settled(self, master_port: int, timeout: float) -> None:
        """Until the replicas are in sync and every Sentinel knows the master, its replicas and
        the two other Sentinels (they find each other through the master's hello channel)."""
        deadline = time.monotonic() + timeout
        seen: Any = None
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.exceptions.RedisError):
                seen = [s.client().sentinel_master(MASTER) for s in self.sentinels]
                links = {
                    r.client().info("replication").get("master_link_status") for r in self.replicas
                }
                if links == {"up"} and all(
                    int(m["port"]) == master_port
                    and int(m["num-slaves"]) >= len(self.replicas)
                    and int(m["num-other-sentinels"]) >= 2
                    for m in seen
                ):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the Sentinels did not settle within {timeout} s: {seen}")

    def url(self) -> str:
        """The issue's form: the Sentinels ``;``-separated, the database once, at the end."""
        return ";".join(f"sentinel://{s.host}:{s.port}" for s in self.sentinels) + "/0"

    def master_port(self) -> int | None:
        """The master's port as the first Sentinel that answers says."""
        for s in self.sentinels:
            with contextlib.suppress(redis.exceptions.RedisError):
                addr = s.client().sentinel_get_master_addr_by_name(MASTER)
                if addr:
                    return int(addr[1])
        return None

    def stop(self) -> None:
        for s in [*self.sentinels, *self.replicas, self.master]:
            s.stop()


def _protected(node: RedisNode) -> str:
    """Protected mode (loopback clients only) unless the node serves a namespace's private
    address, which the other side's processes must reach."""
    return "yes" if node.host == "127.0.0.1" else "no"


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


def tasks_run(url: str, workers: list[WorkerProcess]) -> dict[str, int]:
    """Tasks each worker has run so far (remote control ``stats``, over the broker). A client
    process's first remote-control calls after a failover may meet a connection of the old
    master (closed: a connection error) or get no reply in time: asked again, up to 5 times,
    until every worker has answered."""
    nodes = [w.nodename for w in workers]
    stats: dict[str, Any] = {}
    for attempt in range(5):
        probe = control_app(url)
        try:
            stats = probe.control.inspect(destination=nodes, timeout=3).stats() or {}
        except redis.exceptions.ConnectionError:
            if attempt == 4:
                raise
        finally:
            probe.close()
        if set(nodes) <= set(stats):
            break
    return {node: sum((doc.get("total") or {}).values()) for node, doc in stats.items()}
