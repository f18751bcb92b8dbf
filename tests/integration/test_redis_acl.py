"""deploy/redis-acl.conf as shipped, on a Redis this test starts: a manager logged in as
``critique-manager`` submits through the entry task and reads its verdict, and Redis refuses
(NOPERM) its writes to store keys, result keys and stage queues; the workers run as
``critique-worker``."""

from __future__ import annotations

import json
import shlex
import string
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pipeline.store import keys
from tests.support.entry import NODE, hand_built, run_docs_js
from tests.support.rawcelery import entry_body, push, task_meta
from tests.support.submissions import CONFIG
from tests.support.workers import ROOT, WorkerProcess, WorkerSpec, worker_env
from workers.embedded import EmbeddedRedis

ACL_FILE = ROOT / "deploy" / "redis-acl.conf"
PASSWORDS = {
    "CRITIQUE_MANAGER_REDIS_PASSWORD": "manager-" + uuid.uuid4().hex,
    "CRITIQUE_WORKER_REDIS_PASSWORD": "worker-" + uuid.uuid4().hex,
    "CRITIQUE_FLOWER_REDIS_PASSWORD": "flower-" + uuid.uuid4().hex,
}
WORKER_KEY = "workers-only-key-" + "w" * 16
MANAGER_KEY = "managers-entry-key-" + "m" * 16


def acl_commands() -> list[list[str]]:
    """The shipped file's commands, passwords filled in as envsubst would."""
    out = []
    for line in ACL_FILE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(shlex.split(string.Template(line).substitute(PASSWORDS)))
    return out


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    srv = EmbeddedRedis().start()
    admin = redis.Redis.from_url(srv.url_for(0))
    for command in acl_commands():
        assert admin.execute_command(*command) in (b"OK", "OK", True), command
    yield srv
    srv.stop()


def _url(server: EmbeddedRedis, user: str, password_env: str) -> str:
    return f"redis://{user}:{PASSWORDS[password_env]}@127.0.0.1:{server.port}/0"


@pytest.fixture(scope="module")
def env(server: EmbeddedRedis) -> dict[str, str]:
    """The worker's environment: logged in as critique-worker, holding both keys."""
    url = _url(server, "critique-worker", "CRITIQUE_WORKER_REDIS_PASSWORD")
    return worker_env(url, CRITIQUE_SECRET=WORKER_KEY, CRITIQUE_ENTRY_SECRET=MANAGER_KEY)


WORKER = WorkerSpec("acl", concurrency=2)


@pytest.fixture(scope="module")
def manager(server: EmbeddedRedis, worker: WorkerProcess) -> redis.Redis:
    """A manager's connection as critique-manager, with the module's worker (logged in as
    critique-worker) running."""
    return redis.Redis.from_url(_url(server, "critique-manager", "CRITIQUE_MANAGER_REDIS_PASSWORD"))


def test_the_manager_user_submits_and_reads_its_verdict(manager: redis.Redis) -> None:
    """LPUSH on the entry queue and GET of its result key are all a manager needs."""
    run_id = f"acl-{uuid.uuid4().hex[:8]}"
    task_id = str(uuid.uuid4())
    push(
        manager,
        keys.TASK_SUBMIT,
        task_id,
        entry_body(hand_built(run_id), task_id, CONFIG, MANAGER_KEY),
    )
    meta = task_meta(manager, task_id)
    assert (meta["status"], meta["result"]["status"]) == ("SUCCESS", "accepted"), meta


@pytest.mark.parametrize(
    "attempt",
    [
        lambda r, run: r.hset(keys.run_key(run, keys.PASS_RESULTS), "1:w1:p", "forged"),
        lambda r, run: r.hset(keys.pass_steps_key(run, "1:w1:p"), "1:w1:p:0:0:l0", "forged"),
        lambda r, run: r.hset(keys.run_key(run, keys.RESULTS), "1:w1", "forged"),
        lambda r, run: r.set(f"celery-task-meta-{uuid.uuid4()}", '{"status": "SUCCESS"}'),
        lambda r, run: r.lpush(keys.QUEUE_LLM, "a stage message"),
        lambda r, run: r.hgetall(keys.run_key(run, keys.PASS_RESULTS)),
        lambda r, run: r.delete(keys.QUEUE_CPU),
    ],
    ids=[
        "pass-result",
        "step-record",
        "result",
        "result-backend",
        "stage-queue",
        "read-store",
        "del",
    ],
)
def test_the_manager_user_cannot_touch_the_store(manager: redis.Redis, attempt: object) -> None:
    """Redis refuses the manager's writes (and reads) of store keys, result-backend keys and
    the other queues with NOPERM."""
    with pytest.raises(redis.exceptions.NoPermissionError):
        attempt(manager, "acl-run")  # type: ignore[operator]
    kw = manager.connection_pool.connection_kwargs
    celery_user = redis.Redis(
        host=kw["host"],
        port=kw["port"],
        username="critique-manager-celery",
        password=kw["password"],
    )
    with pytest.raises(redis.exceptions.NoPermissionError):
        attempt(celery_user, "acl-run")  # type: ignore[operator]


@pytest.mark.parametrize("user", ["critique-manager", "critique-manager-celery"])
def test_the_manager_users_read_the_fleets_posture_and_check_their_key_before_pushing(
    manager: redis.Redis, user: str
) -> None:
    """Both manager users may HGETALL the fleet's posture (docs/entry.md), which says entry
    messages must be signed and lists the managers' key by id: with that key the check passes,
    without one it names CRITIQUE_ENTRY_SECRET; the workers' key ids are there, never a key."""
    from pipeline.security import signing
    from pipeline.security.posture import WorkerPosture, entry_refusal
    from tests.support import wait_until

    kw = manager.connection_pool.connection_kwargs
    r = redis.Redis(host=kw["host"], port=kw["port"], username=user, password=kw["password"])
    posture_key = keys.shared_key(keys.FLEET_POSTURE)
    raw = wait_until(lambda: r.hgetall(posture_key), 30, what="the fleet's posture")
    postures = [WorkerPosture.model_validate_json(v) for v in raw.values()]
    assert [(p.signed, p.entry_signed) for p in postures] == [(True, True)]
    assert postures[0].key_ids == (signing.key_id(WORKER_KEY.encode()),)
    assert [(k.name, k.key_id) for k in postures[0].entry_keys] == [
        ("entry", signing.key_id(MANAGER_KEY.encode()))
    ]
    assert all(key.encode() not in v for v in raw.values() for key in (WORKER_KEY, MANAGER_KEY))
    now = postures[0].seen
    assert entry_refusal(postures, (MANAGER_KEY.encode(),), now) is None
    refused = entry_refusal(postures, (), now)
    assert refused is not None and refused.key == "CRITIQUE_ENTRY_SECRET"
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.get(posture_key)
    r.close()


def test_a_celery_library_manager_sends_with_send_task_and_gets_the_verdict(
    manager: redis.Redis,
) -> None:
    """As critique-manager-celery, Celery's send_task (kombu declares the queue and binding
    first) and AsyncResult.get are enough to submit and read the verdict."""
    from celery import Celery

    from workers.entry import ENTRY_VERSION

    kw = manager.connection_pool.connection_kwargs
    url = f"redis://critique-manager-celery:{kw['password']}@{kw['host']}:{kw['port']}/0"
    app = Celery("manager-celery", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_serializer="json", result_serializer="json", accept_content=["json"],
        result_accept_content=["json"], task_publish_retry=False,
    )  # fmt: skip
    run_id = f"acl-{uuid.uuid4().hex[:8]}"
    task_id = str(uuid.uuid4())
    body = entry_body(hand_built(run_id), task_id, CONFIG, MANAGER_KEY)
    assert body["v"] == ENTRY_VERSION
    try:
        res = app.send_task(
            keys.TASK_SUBMIT, args=(body,), queue=keys.QUEUE_SUBMIT, task_id=task_id
        )
        summary = res.get(timeout=60)
        assert (summary["run_id"], summary["status"]) == (run_id, "accepted")
    finally:
        app.close()


def test_a_celery_client_as_the_manager_user_gets_the_verdict_with_asyncresult(
    manager: redis.Redis,
) -> None:
    """Celery's own AsyncResult.get (GET and SUBSCRIBE on the result channel) works with the
    manager user's rights alone."""
    from celery import Celery
    from celery.result import AsyncResult

    kw = manager.connection_pool.connection_kwargs
    url = f"redis://{kw['username']}:{kw['password']}@{kw['host']}:{kw['port']}/0"
    app = Celery("manager", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        result_serializer="json", accept_content=["json"], result_accept_content=["json"]
    )
    run_id = f"acl-{uuid.uuid4().hex[:8]}"
    task_id = str(uuid.uuid4())
    try:
        result = AsyncResult(task_id, app=app)
        push(
            manager,
            keys.TASK_SUBMIT,
            task_id,
            entry_body(hand_built(run_id), task_id, CONFIG, MANAGER_KEY),
        )
        summary = result.get(timeout=60)
        assert (summary["run_id"], summary["status"]) == (run_id, "accepted")
    finally:
        app.close()


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_docs_javascript_manager_logs_in_as_the_manager_user(
    manager: redis.Redis, tmp_path: Path
) -> None:
    """docs/entry.md's Node example, as critique-manager (AUTH user password from REDIS_URL),
    reads the fleet's posture, submits and prints the verdict: the whole manager in another
    language, with no store rights."""
    run_id = f"acl-node-{uuid.uuid4().hex[:8]}"
    assert manager.connection_pool.connection_kwargs["username"] == "critique-manager"
    out = run_docs_js(tmp_path, run_id, manager)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "accepted"


def _user(manager: redis.Redis, user: str, password_env: str, db: int = 0) -> redis.Redis:
    """A connection to the module's Redis as ``user`` (on database ``db``)."""
    kw = manager.connection_pool.connection_kwargs
    return redis.Redis(
        host=kw["host"], port=kw["port"], username=user, password=PASSWORDS[password_env], db=db
    )


MANAGER_USERS = ["critique-manager", "critique-manager-celery"]


@pytest.mark.parametrize("user", MANAGER_USERS)
def test_the_manager_users_are_pinned_to_database_0(manager: redis.Redis, user: str) -> None:
    """SELECT 0 is allowed (docs/entry.md's client sends it; redis-py and kombu send none for
    /0), SELECT of any other database is refused with NOPERM, and a client whose URL names
    database 1 cannot connect: another fleet's queue and results on the same Redis are out of
    reach."""
    conn = _user(manager, user, "CRITIQUE_MANAGER_REDIS_PASSWORD")
    assert conn.execute_command("SELECT", "0") in (b"OK", "OK", True)
    with pytest.raises(redis.exceptions.NoPermissionError):
        conn.execute_command("SELECT", "1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        _user(manager, user, "CRITIQUE_MANAGER_REDIS_PASSWORD", db=1).ping()


@pytest.fixture(scope="module")
def flower_user(manager: redis.Redis) -> redis.Redis:
    return _user(manager, "critique-flower", "CRITIQUE_FLOWER_REDIS_PASSWORD")


@pytest.mark.parametrize(
    "attempt",
    [
        lambda r: r.scan(0),
        lambda r: r.keys("*"),
        lambda r: r.dbsize(),
        lambda r: r.randomkey(),
        lambda r: r.lrange(keys.QUEUE_CPU, 0, -1),
        lambda r: r.lindex(keys.QUEUE_CPU, 0),
        lambda r: r.hgetall("unacked"),
        lambda r: r.hgetall(keys.run_key("acl-run", keys.PASS_RESULTS)),
        lambda r: r.get(f"{keys.key_prefix()}:anything"),
        lambda r: r.set(f"celery-task-meta-{uuid.uuid4()}", '{"status": "SUCCESS"}'),
        lambda r: r.lpush(keys.QUEUE_CPU, "a message"),
        lambda r: r.delete(keys.QUEUE_CPU),
        lambda r: r.sadd("_kombu.binding.critique.cpu", "x"),
        lambda r: r.eval("return 1", 0),
        lambda r: r.script_load("return 1"),
        lambda r: r.execute_command("SELECT", "1"),
        lambda r: r.publish("/0.celeryev/task.succeeded", "a forged event"),
    ],
    ids=[
        "scan",
        "keys",
        "dbsize",
        "randomkey",
        "lrange-entry-queue",
        "lindex-entry-queue",
        "unacked",
        "read-store",
        "get-store",
        "result-backend-write",
        "push",
        "del",
        "binding-of-the-entry-queue",
        "eval",
        "script-load",
        "select",
        "publish-event",
    ],
)
def test_the_flower_user_cannot_list_keys_read_messages_or_write(
    flower_user: redis.Redis, attempt: object
) -> None:
    """Redis refuses (NOPERM) what Flower never does: listing or counting keys, reading the
    queues' messages or the store, writing results, queues or bindings, running a script of
    its own, another database, forging an event."""
    with pytest.raises(redis.exceptions.NoPermissionError):
        attempt(flower_user)  # type: ignore[operator]


def test_flower_as_the_flower_user_sees_the_fleet(
    manager: redis.Redis, server: EmbeddedRedis, tmp_path: Path
) -> None:
    """Flower logged in as critique-flower, as shipped: it hears the worker's heartbeat and the
    entry task's events (Flower's task list), reads the workers' registered tasks (remote
    control), the queue lengths and one task's result by id, and Redis refuses none of the
    commands it sends (ACL LOG)."""
    from tests.support.flower import FlowerProcess, until

    admin = redis.Redis.from_url(server.url_for(0))
    admin.execute_command("ACL", "LOG", "RESET")
    url = _url(server, "critique-flower", "CRITIQUE_FLOWER_REDIS_PASSWORD")
    flower = FlowerProcess(worker_env(url), tmp_path / "flower.log")
    try:
        flower.start()
        flower.wait_worker_alive("acl@", timeout=30)
        run_id = f"acl-flower-{uuid.uuid4().hex[:8]}"
        task_id = str(uuid.uuid4())
        body = entry_body(hand_built(run_id), task_id, CONFIG, MANAGER_KEY)
        push(manager, keys.TASK_SUBMIT, task_id, body)
        assert task_meta(manager, task_id)["status"] == "SUCCESS"
        seen = until(
            "the entry task in Flower's task list",
            lambda: (flower.json(f"/api/task/info/{task_id}") or {}).get("state") == "SUCCESS",
            timeout=30,
        )
        assert seen
        result = flower.json(f"/api/task/result/{task_id}")
        assert result and result["state"] == "SUCCESS", result
        lengths = flower.json("/api/queues/length")
        assert lengths and keys.QUEUE_CPU in {q["name"] for q in lengths["active_queues"]}
        workers = until(
            "the worker's registered tasks through remote control",
            lambda: {
                name: info
                for name, info in (flower.json("/api/workers?refresh=1") or {}).items()
                if name.startswith("acl@") and info.get("registered")
            },
            timeout=30,
        )
        assert keys.TASK_SUBMIT in next(iter(workers.values()))["registered"]
    finally:
        flower.stop()
    refused = [entry for entry in admin.acl_log() if entry.get("username") == "critique-flower"]
    assert not refused, refused
