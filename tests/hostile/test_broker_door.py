"""The broker door: whoever can push to a worker's queue (the ``critique-manager`` user's raw
LPUSH) cannot end the worker, run a Celery built-in task, make a worker write a result-backend
record or a key of the attacker's choosing, or park messages in it with a far ``eta``. Each
refused message is moved to the bounded dead-letter list and counted; the same worker process
serves honest submissions afterwards (the suite's autouse check)."""

from __future__ import annotations

import base64
import json
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import redis

from pipeline.store import keys
from tests.support import pid_alive, wait_until
from tests.support.hostile import HOSTILE_WORKER, assert_still_serving
from tests.support.rawcelery import QUEUE, protocol2
from tests.support.workers import ROOT, WorkerProcess

WORKER = HOSTILE_WORKER
DEADLETTER = f"critique:{keys.DEADLETTER}"
COUNTERS = "critique:metrics:{counters}"


def envelope(task: str = "critique.submit", task_id: str | None = None, args: Any = None) -> dict:
    doc: dict[str, Any] = json.loads(protocol2(task, task_id or uuid.uuid4().hex, args or [{}]))
    return doc


def with_body(doc: dict[str, Any], body: Any) -> str:
    doc["body"] = base64.b64encode(json.dumps(body).encode()).decode()
    return json.dumps(doc)


def poison() -> dict[str, bytes | str]:
    """The eleven shapes that ended a worker before the door."""
    bad_headers, bad_props, bad_args, null_body = envelope(), envelope(), envelope(), envelope()
    bad_headers["headers"] = "headers"
    bad_props["properties"] = [1, 2]
    null_body["body"] = None
    not_b64 = envelope()
    not_b64["body"] = "%%% not base64 %%%"
    return {
        "non-JSON": b"x",
        "invalid UTF-8": b'{"body": "\xff\xfe"}',
        "a JSON number": b"42",
        "a JSON list": b"[1, 2, 3]",
        "a JSON string": b'"hello"',
        "a body that is not base64": json.dumps(not_b64),
        "very deep nesting": b"[" * 200_000 + b"]" * 200_000,
        "headers of the wrong type": json.dumps(bad_headers),
        "properties of the wrong type": json.dumps(bad_props),
        "body arguments of the wrong type": with_body(bad_args, {"args": "x", "kwargs": 5}),
        "body: null": json.dumps(null_body),
    }


def dead_letters(r: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(x) for x in r.lrange(DEADLETTER, 0, -1)]


def until_dead_lettered(r: redis.Redis, count: int, what: str) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = wait_until(
        lambda: (e := dead_letters(r)) and len(e) >= count and e, 60, what=what
    )
    return got


def counted(r: redis.Redis) -> int:
    raw = r.hgetall(COUNTERS)
    return sum(int(v) for k, v in raw.items() if k.decode().startswith("deadletter:"))


def test_processes_2_survive_more_poison_than_the_crash_loop_threshold(
    hostile_env: dict[str, str], r: redis.Redis, tmp_path: Path
) -> None:
    """`critique worker --processes 2`: more poison pushes than MAX_RESTARTS, quickly; the
    supervisor and both children keep their PIDs and keep serving."""
    from workers.app import app
    from workers.commands import worker as worker_cmd

    name = f"door{uuid.uuid4().hex[:6]}"
    nodes = [f"{name}-1@{socket.gethostname()}", f"{name}-2@{socket.gethostname()}"]
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "worker", "--processes", "2",
             "-Q", QUEUE, "-c", "2", "-l", "WARNING", "-n", f"{name}@%h",
             "--", "--without-gossip", "--without-mingle"],
            env=hostile_env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:

        def pids() -> dict[str, int]:
            got = app.control.inspect(destination=nodes, timeout=1.0).stats() or {}
            return {n: s["pid"] for n, s in got.items()} if set(got) == set(nodes) else {}

        before: dict[str, int] = wait_until(pids, 60, what="both nodes up")
        r.delete(DEADLETTER)
        shapes = list(poison().values())
        pushes = (shapes * 2)[: worker_cmd.MAX_RESTARTS * 2 + 1]
        for raw in pushes:
            r.lpush(QUEUE, raw)
        until_dead_lettered(r, len(pushes), "every push dead-lettered")
        assert proc.poll() is None, log.read_text(errors="replace")
        assert wait_until(pids, 30, what="both nodes still up") == before
        assert all(pid_alive(p) for p in before.values())
        text = log.read_text(errors="replace")
        assert "crash loop" not in text and "restarting" not in text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_each_poison_shape_is_dead_lettered_and_the_same_worker_process_serves(
    worker: WorkerProcess, r: redis.Redis
) -> None:
    """Eleven shapes pushed raw: the worker keeps its PID, each lands in the dead-letter list
    with its reason and an escaped excerpt, and the fleet metric counts them."""
    pid = worker.proc.pid if worker.proc else None
    r.delete(DEADLETTER)
    before = counted(r)
    shapes = poison()
    for raw in shapes.values():
        r.lpush(QUEUE, raw)
    entries = until_dead_lettered(r, len(shapes), "every poison message dead-lettered")
    assert len(entries) == len(shapes)
    assert {e["reason"] for e in entries} <= {"encoding", "json", "depth", "envelope", "body"}
    for e in entries:
        assert e["queue"] == QUEUE and isinstance(e["at"], float)
        assert e["excerpt"] is None or (e["excerpt"].isascii() and len(e["excerpt"]) < 200)
    wait_until(lambda: counted(r) >= before + len(shapes), 30, what="the dead-letter metric")
    assert_still_serving(worker)
    assert worker.proc is not None and worker.proc.pid == pid and worker.proc.poll() is None


def test_the_dead_letter_list_is_capped(worker: WorkerProcess, r: redis.Redis) -> None:
    """More refusals than the cap: the list keeps the newest DEADLETTER_MAX."""
    r.delete(DEADLETTER)
    r.lpush(DEADLETTER, *[b"{}"] * keys.DEADLETTER_MAX)
    r.lpush(QUEUE, b"not json")
    wait_until(lambda: b"not json" not in r.lrange(QUEUE, 0, -1) and
               json.loads(r.lindex(DEADLETTER, 0) or b"{}").get("reason") == "json",
               30, what="the newest entry")  # fmt: skip
    assert r.llen(DEADLETTER) == keys.DEADLETTER_MAX


def test_builtin_tasks_write_no_result_create_no_key_and_do_not_loop(
    worker: WorkerProcess, r: redis.Redis
) -> None:
    """celery.accumulate under a chosen id, celery.group routing a member to a store key,
    celery.chord_unlock: each refused as a task the worker does not run, acked once, and
    nothing written under its id or at the key."""
    r.delete(DEADLETTER)
    acc, grp, unlock = (uuid.uuid4().hex for _ in range(3))
    entries_key = "critique:{x}:entries"
    member = {"task": "critique.probe", "args": [], "kwargs": {},
              "options": {"queue": entries_key}, "subtask_type": None}  # fmt: skip
    r.lpush(QUEUE, protocol2("celery.accumulate", acc, [{"status": "accepted"}]))
    r.lpush(QUEUE, protocol2("celery.group", grp, [[member], [], grp]))
    r.lpush(QUEUE, protocol2("celery.chord_unlock", unlock, [grp, {"task": "critique.l0"}]))
    entries = until_dead_lettered(r, 3, "the three built-in task messages")
    assert {e["id"]: e["reason"] for e in entries} == {acc: "task", grp: "task", unlock: "task"}
    assert_still_serving(worker)
    for task_id in (acc, grp, unlock):
        assert not r.exists(f"celery-task-meta-{task_id}")
    assert not r.exists(entries_key)
    assert len(dead_letters(r)) == 3 and not r.llen(QUEUE)  # refused once, not retried


def test_a_callback_to_a_store_key_is_refused(worker: WorkerProcess, r: redis.Redis) -> None:
    """A product task whose chain would send a task to a queue named like a store key."""
    r.delete(DEADLETTER)
    link = {"task": "critique.probe", "options": {"queue": "critique:pending:runs"}}
    doc = envelope()
    r.lpush(QUEUE, with_body(doc, [[{}], {}, {"chain": [link], "callbacks": None,
                                                "errbacks": None, "chord": None}]))  # fmt: skip
    entries = until_dead_lettered(r, 1, "the chained message")
    assert entries[0]["reason"] == "body"
    assert_still_serving(worker)
    assert r.type("critique:pending:runs") in (b"zset", b"none")


def test_a_far_eta_and_a_huge_countdown_are_refused_not_held(
    worker: WorkerProcess, r: redis.Redis
) -> None:
    """eta in 2099 (raw) and countdown=10**8 (a Celery client): dead-lettered, never in
    kombu's unacked hash nor held by the worker."""
    from workers.app import app

    r.delete(DEADLETTER)
    far = envelope()
    far["headers"]["eta"] = "2099-01-01T00:00:00+00:00"
    r.lpush(QUEUE, json.dumps(far))
    sent = app.send_task("critique.submit", args=[{}], countdown=10**8, queue=QUEUE)
    entries = until_dead_lettered(r, 2, "the two delayed messages")
    assert {e["reason"] for e in entries} == {"eta"}
    assert {e["id"] for e in entries} == {far["headers"]["id"], sent.id}
    held = b" ".join(r.hvals("unacked"))
    assert far["headers"]["id"].encode() not in held and sent.id.encode() not in held


def test_a_refused_entry_message_gets_a_one_line_failure_never_over_a_verdict(
    worker: WorkerProcess, r: redis.Redis
) -> None:
    """A raw-LPUSH manager learns its malformed critique.submit was refused; a task id that
    already holds a record keeps it."""
    r.delete(DEADLETTER)
    fresh, taken = uuid.uuid4().hex, uuid.uuid4().hex
    r.set(f"celery-task-meta-{taken}", json.dumps({"status": "SUCCESS", "result": 1}))
    for task_id in (fresh, taken):
        doc = envelope(task_id=task_id)
        r.lpush(QUEUE, with_body(doc, [[{}], {"extra": 1}, {}]))
    until_dead_lettered(r, 2, "the two malformed entry messages")
    meta = json.loads(r.get(f"celery-task-meta-{fresh}") or b"{}")
    assert meta["status"] == "FAILURE"
    assert meta["result"]["exc_type"] == "SubmissionError"
    assert "refused" in meta["result"]["exc_message"][0]
    assert json.loads(r.get(f"celery-task-meta-{taken}") or b"{}")["status"] == "SUCCESS"
