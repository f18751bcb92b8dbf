"""The store on a Redis Cluster (``CRITIQUE_STORE_URL=redis+cluster://…``), the broker and the
result backend on a Redis of their own: a real 3-master cluster (``redis-server
--cluster-enabled yes``, ``redis-cli --cluster create … --cluster-replicas 0``), a private broker
Redis and a real worker process. Runs finish with their reference results, each run's keys in
its own slot on the node that owns it, spread over the nodes, and nothing of the store on the
broker; ``critique submit/status/report/resume/watch/archive`` work against it. A second test
gives each master a replica and SIGKILLs one master mid-run: the worker keeps its process and
every submission still ends, once."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import key_slot

from pipeline.errors import StoreUnavailableError
from pipeline.models import CritiqueResult, Submission
from pipeline.store import keys
from tests.support import wait_until
from tests.support.servers import RedisServer
from tests.support.submissions import CONFIG, KINDS, make_sub, reference
from tests.support.workers import WorkerStarter
from workers.embedded import free_port, redis_executable

NODES = 3
RUNS_PER_NODE = 2
PER_RUN = 8
CLUSTER_ARGS = (
    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
    "--cluster-node-timeout", "2000", "--appendonly", "no",
    "--repl-diskless-sync-delay", "0",  # a replica's first sync starts at once, not after 5 s
)  # fmt: skip


def _redis_cli() -> str:
    beside = Path(redis_executable()).with_name("redis-cli")
    found = str(beside) if beside.exists() else shutil.which("redis-cli")
    if not found:
        pytest.skip("redis-cli is not installed (it creates the test's cluster)")
    return found


def _cluster_ok(port: int) -> bool:
    info = redis.Redis(port=port, decode_responses=True).cluster("info")  # parsed: a dict
    return bool(info.get("cluster_state") == "ok")


def _replica_synced(port: int) -> bool:
    """True for a master, or for a replica whose link to its master is up and not syncing."""
    info = redis.Redis(port=port, decode_responses=True).info("replication")
    if info.get("role") != "slave":
        return True
    return info.get("master_link_status") == "up" and not int(
        info.get("master_sync_in_progress", 0)
    )


def _log_tails(nodes: list[RedisServer], lines: int = 15) -> str:
    """The last lines of each node's ``redis.log``: what a failed failover wait reports."""
    out = []
    for n in nodes:
        log = (n.dir / "redis.log").read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- node :{n.port}\n" + "\n".join(log))
    return "\n".join(out)


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[RedisServer]]:
    """A 3-master Redis Cluster of private servers (no persistence); with ``replicas`` (the
    fixture's indirect parameter, default 0) that many replicas per master."""
    cli = _redis_cli()
    replicas = int(getattr(request, "param", 0))
    # The cluster bus on a free port of its own (by default the port + 10000, maybe past 65535).
    nodes = [
        RedisServer(tmp_path / f"node-{i}", (*CLUSTER_ARGS, "--cluster-port", str(free_port())))
        for i in range(NODES * (1 + replicas))
    ]
    try:
        for node in nodes:
            node.start()
        made = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
             "--cluster-replicas", str(replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert made.returncode == 0, made.stdout + made.stderr
        wait_until(
            lambda: all(_cluster_ok(n.port) for n in nodes), timeout=30, what="cluster_state:ok"
        )
        # cluster_state:ok comes before a replica's first sync ends, and a replica that never
        # synced refuses to fail over (its data is of unbounded age): wait for every link.
        wait_until(
            lambda: all(_replica_synced(n.port) for n in nodes), timeout=60, what="replicas synced"
        )
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture
def fault_store_env(cluster: list[RedisServer]) -> dict[str, str]:
    """The store on the cluster, named by two of its three nodes (the client finds the third),
    with fleet lessons, so their one script runs on the cluster too."""
    return {"CRITIQUE_STORE_URL": "redis+cluster://" + ",".join(
        f"127.0.0.1:{n.port}" for n in cluster[:2]
    ), "CRITIQUE_LESSONS_SCOPE": "fleet"}  # fmt: skip


def _owner(cluster: list[RedisServer]) -> dict[int, int]:
    """Slot -> the port of the node that owns it."""
    out: dict[int, int] = {}
    for start, end, master, *_ in redis.Redis(port=cluster[0].port).execute_command(
        "CLUSTER SLOTS"
    ):
        for slot in range(int(start), int(end) + 1):
            out[slot] = int(master[1])
    return out


def _run_ids(owner: dict[int, int], ports: list[int]) -> list[str]:
    """Run ids whose slots (their ``{run_id}`` hash tag) fall :data:`RUNS_PER_NODE` on each node."""
    want = Counter({p: RUNS_PER_NODE for p in ports})
    out: list[str] = []
    while want:
        run_id = f"cl-{uuid.uuid4().hex[:10]}"
        port = owner[key_slot(run_id.encode())]
        if want[port]:
            out.append(run_id)
            want[port] -= 1
            want += Counter()  # drop the nodes that have their runs
    return out


def _node_keys(port: int, prefix: str) -> set[str]:
    return {k.decode() for k in redis.Redis(port=port).scan_iter(f"{prefix}:*", count=1000)}


def _broker_store_keys(port: int, prefix: str) -> dict[int, list[str]]:
    """Keys under the store's prefix in any database of the broker's Redis."""
    r = redis.Redis(port=port)
    dbs = [int(name[2:]) for name in r.info("keyspace")]
    found = {}
    for db in dbs:
        got = [k.decode() for k in redis.Redis(port=port, db=db).scan_iter(f"{prefix}:*")]
        if got:
            found[db] = got
    return found


def _results(run_id: str) -> dict[str, CritiqueResult]:
    from workers import runtime

    return {f"{r.iteration}:{r.worker_id}": r for r in runtime.stores().runs.results(run_id)}


@pytest.mark.faults
@pytest.mark.timeout(150)
def test_runs_on_a_cluster_store_finish_spread_over_its_nodes_and_never_touch_the_broker(
    cluster: list[RedisServer],
    redis_server: RedisServer,
    fault_env: dict[str, str],
    start_worker: WorkerStarter,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Six runs (two on each node's slots) through a real worker end with the reference's
    status, stop reason and pattern counts, one ``result`` event per submission; every key of
    a run lives on the node owning its ``{run_id}`` slot, the keys spread over all three nodes,
    the sweeper's probes and lock are in the cluster too, and the broker's Redis holds no key
    under the store's prefix. Then the CLI on the same store: ``submit --wait``, ``status``,
    ``report``, ``resume`` of a finished run (nothing to re-drive), ``watch`` and ``archive``."""
    from workers import runtime
    from workers.cli import main
    from workers.client import CritiqueClient

    prefix = keys.key_prefix()
    ports = [n.port for n in cluster]
    owner = _owner(cluster)
    assert len(ports) == NODES
    assert set(owner.values()) == set(ports)
    start_worker("cluster", fault_env, concurrency=4)

    run_ids = _run_ids(owner, ports)
    subs: list[Submission] = [
        make_sub(run_id, f"w{i:02d}", 1, KINDS[i % len(KINDS)])
        for run_id in run_ids
        for i in range(PER_RUN)
    ]
    client = CritiqueClient(CONFIG)
    client.submit_many(subs)
    for run_id in run_ids:
        wait_until(lambda r=run_id: len(_results(r)) == PER_RUN, timeout=90, what=f"run {run_id}")

    for run_id in run_ids:
        mine = [s for s in subs if s.run_id == run_id]
        want, ref_patterns = reference(mine, CONFIG)
        got = _results(run_id)
        assert {k: (r.status, r.stop_reason) for k, r in got.items()} == {
            k: (r.status, r.stop_reason) for k, r in want.items()
        }
        top = {
            (p.category, p.prevention_rule): p.frequency
            for p in runtime.stores().patterns.top(run_id, 1000)
        }
        ref = {(p.category, p.prevention_rule): p.frequency for p in ref_patterns.top(run_id, 1000)}
        assert top == ref
        finals = Counter(
            (e["iteration"], e["worker_id"]) for e in client.trace(run_id) if e["type"] == "result"
        )
        assert len(finals) == PER_RUN and set(finals.values()) == {1}

    by_node = {port: _node_keys(port, prefix) for port in ports}
    for run_id in run_ids:
        home = owner[key_slot(run_id.encode())]
        tagged = f"{{{run_id}}}"
        where = {port for port, names in by_node.items() if any(tagged in k for k in names)}
        assert where == {home}, (run_id, where, home)
    holding = {port for port, names in by_node.items() if any("{cl-" in k for k in names)}
    assert holding == set(ports), {p: len(v) for p, v in by_node.items()}
    everything = set().union(*by_node.values())
    probe = keys.shared_key(f"{keys.PROBE}:{{{keys.QUEUE_CPU}}}", prefix)
    assert probe in everything  # the sweeper's probes went to the store, not the broker
    assert keys.shared_key(keys.PENDING_RUNS, prefix) in everything
    # The lessons' one script (four shared keys, one {lessons} slot) ran on the cluster.
    assert keys.shared_key(keys.LESSONS_RUNS, prefix) in everything

    # The CLI, on the same cluster store.
    sub_file = tmp_path / "one.jsonl"
    cli_run = f"cli-{uuid.uuid4().hex[:8]}"
    sub_file.write_text(make_sub(cli_run, "w00", 1, "missing").model_dump_json() + "\n")
    capsys.readouterr()
    assert main(["submit", str(sub_file), "--wait", "--json", "--timeout", "60"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert lines and lines[0]["type"] == "submitted"
    assert any(d.get("status") for d in lines[1:]), lines
    assert main(["status", cli_run, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert json.dumps(status).count("w00") >= 1
    assert main(["report", run_ids[0], "--out", str(tmp_path / "ws"), "--json"]) == 0
    capsys.readouterr()
    assert list((tmp_path / "ws").rglob("critique.json"))
    assert main(["resume", cli_run, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"run_id": cli_run, "resumed": [], "failed": []}
    assert main(["watch", run_ids[1], "--json", "--timeout", "30"]) == 0  # XREAD on the cluster
    capsys.readouterr()
    assert main(["archive", run_ids[1], "--dir", str(tmp_path / "archive"), "--json"]) == 0
    capsys.readouterr()
    assert (tmp_path / "archive" / f"{run_ids[1]}.jsonl").is_file()
    print("store keys per cluster node:", {p: len(v) for p, v in by_node.items()})

    leaked = _broker_store_keys(redis_server.port, prefix)
    assert not leaked, leaked


@pytest.mark.faults
@pytest.mark.timeout(150)
@pytest.mark.parametrize("cluster", [1], indirect=True)
def test_a_cluster_master_killed_mid_run_is_a_reconnect_and_every_submission_ends(
    cluster: list[RedisServer], fault_env: dict[str, str], start_worker: WorkerStarter
) -> None:
    """Three masters with a replica each; the master owning a third of the runs is SIGKILLed
    once some results are in, and its replica takes over its slots. The worker keeps its
    process; every submission still ends with the reference's status and stop reason, with
    exactly one ``result`` event (a result and its event are one script: lost or kept
    together)."""
    from workers import runtime
    from workers.client import CritiqueClient

    owner = _owner(cluster)
    masters = sorted(set(owner.values()))
    assert len(masters) == NODES
    worker = start_worker("cluster-failover", fault_env, concurrency=4)
    run_ids = _run_ids(owner, masters)
    subs = [
        make_sub(run_id, f"w{i:02d}", 1, KINDS[i % len(KINDS)])
        for run_id in run_ids
        for i in range(PER_RUN * 3)
    ]
    client = CritiqueClient(CONFIG)
    client.submit_many(subs)

    def finished() -> int:
        try:
            return sum(len(_results(r)) for r in run_ids)
        except StoreUnavailableError:  # this process's client, mid-failover
            return 0

    wait_until(lambda: finished() >= len(subs) // 4, timeout=60, what="a quarter of the results")
    last = run_ids[-1]  # submitted last: none of its results is in yet, or few
    victim = next(n for n in cluster if n.port == owner[key_slot(last.encode())])
    assert len(_results(last)) < PER_RUN * 3  # the kill lands mid-run for the victim's slots
    victim.kill()
    killed = time.monotonic()
    survivors = [n for n in cluster if n is not victim]
    slot = key_slot(last.encode())
    try:
        wait_until(
            lambda: _owner(survivors)[slot] != victim.port and _cluster_ok(survivors[0].port),
            timeout=30,
            what="the victim's replica promoted",
        )
    except pytest.fail.Exception as e:  # say why: the nodes' logs hold the failover's story
        pytest.fail(f"{e}\n{_log_tails(survivors)}", pytrace=False)
    promoted = time.monotonic() - killed
    wait_until(lambda: finished() == len(subs), timeout=100, what="every result")
    done = time.monotonic() - killed
    print(f"replica promoted {promoted:.1f} s after the kill, every result {done:.1f} s after it")

    assert worker.proc is not None and worker.proc.poll() is None  # the same process
    want, _ = reference(subs, CONFIG)
    got = {f"{run_id}/{k}": r for run_id in run_ids for k, r in _results(run_id).items()}
    assert {k: (r.status, r.stop_reason) for k, r in got.items()} == {
        f"{s.run_id}/{s.iteration}:{s.worker_id}": (
            want[f"{s.iteration}:{s.worker_id}"].status,
            want[f"{s.iteration}:{s.worker_id}"].stop_reason,
        )
        for s in subs
    }
    for run_id in run_ids:
        finals = Counter(
            (e["iteration"], e["worker_id"]) for e in client.trace(run_id) if e["type"] == "result"
        )
        assert len(finals) == PER_RUN * 3 and set(finals.values()) == {1}, run_id
    assert runtime.stores().runs.results(last)  # the promoted replica serves the victim's slots
