"""``critique.submit`` through a real worker, driven as a manager in another language would:
entry messages built by hand (Celery protocol-2 JSON LPUSHed onto ``critique.cpu``, signed
with ``hmac``/``json`` alone), verdicts read from ``celery-task-meta-<id>``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.loop.stages import start
from pipeline.store import keys
from tests.support import wait_until
from tests.support.entry import (
    MANAGER_KEY,
    NODE,
    NODE_EXAMPLE,
    SUBMIT_JS,
    WORKER_KEY,
    docs_node_block,
    hand_built,
    node_env,
    pass_results,
    refusal,
    run_docs_js,
    run_node,
)
from tests.support.rawcelery import QUEUE, entry_body, push, sign, task_meta
from tests.support.submissions import CONFIG, make_sub
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    """This process's client and the worker: the workers' key and the managers' entry key."""
    with client_on(
        worker_db_url(redis_url), CRITIQUE_SECRET=WORKER_KEY, CRITIQUE_ENTRY_SECRET=MANAGER_KEY
    ) as e:
        yield e


WORKER = WorkerSpec("entrysplit", concurrency=2)


@pytest.fixture(scope="module")
def split(env: dict[str, str], worker: WorkerProcess) -> Iterator[redis.Redis]:
    """A client of the Redis of the module's worker, which holds the workers' key and the
    managers' entry key."""
    client = redis.Redis.from_url(env["REDIS_URL"])
    yield client
    client.close()


class TestSplitKeys:
    """Workers hold CRITIQUE_SECRET (stage messages, records) and CRITIQUE_ENTRY_SECRET;
    the manager holds only the entry key."""

    @pytest.fixture
    def r(self, split: redis.Redis) -> redis.Redis:
        return split

    def test_an_entry_signed_with_the_managers_key_gets_its_verdict(self, r: redis.Redis) -> None:
        """Signed by hand (hmac + canonical json) with the entry key: accepted, verdict under
        the entry id."""
        run_id = f"signed-{uuid.uuid4().hex[:8]}"
        task_id = str(uuid.uuid4())
        push(
            r,
            "critique.submit",
            task_id,
            entry_body(hand_built(run_id), task_id, CONFIG, MANAGER_KEY),
        )
        meta = task_meta(r, task_id)
        assert (meta["status"], meta["result"]["status"]) == ("SUCCESS", "accepted"), meta

    @pytest.mark.parametrize(
        ("build", "says"),
        [
            (lambda sub, tid: entry_body(sub, tid, CONFIG), "unsigned"),
            (lambda sub, tid: _altered(entry_body(sub, tid, CONFIG, MANAGER_KEY)), "altered"),
            (lambda sub, tid: entry_body(sub, tid, CONFIG, WORKER_KEY), "another key"),
            (lambda sub, tid: entry_body(sub, "other-id", CONFIG, MANAGER_KEY), "replayed"),
        ],
        ids=["unsigned", "altered", "workers-key", "another-task-id"],
    )
    def test_an_unsigned_or_altered_entry_is_refused_with_its_reason(
        self, r: redis.Redis, build: Any, says: str
    ) -> None:
        """Refused as ForgedMessageError, the reason in one line, no pass started."""
        run_id = f"forged-{uuid.uuid4().hex[:8]}"
        task_id = str(uuid.uuid4())
        push(r, "critique.submit", task_id, build(hand_built(run_id), task_id))
        got_type, reason = refusal(task_meta(r, task_id))
        assert got_type == "ForgedMessageError" and says in reason, reason
        assert not r.exists(keys.entry_claim_key(task_id))
        assert not r.exists(keys.run_key(run_id, keys.OWNER))

    def test_the_managers_key_cannot_forge_a_stage_message(self, r: redis.Redis) -> None:
        """A critique.l0 message carrying a finished-looking state, signed with the entry key:
        refused as forged, and no result is stored for it."""
        from workers import runtime

        run_id = f"stage-{uuid.uuid4().hex[:8]}"
        task_id = str(uuid.uuid4())
        sub = make_sub(run_id, "w1", 1, "clean")
        state = start(sub, "p" + uuid.uuid4().hex[:15])
        msg = {
            "v": runtime.MESSAGE_VERSION,
            "sid": state.pass_id,
            "config": CONFIG,
            "state": state.model_dump_json(),
            "task_name": keys.TASK_L0,
            "task_id": task_id,
        }
        push(r, keys.TASK_L0, task_id, sign(msg, MANAGER_KEY))
        meta = task_meta(r, task_id)
        assert meta["status"] == "FAILURE"
        assert meta["result"]["exc_type"] == "ForgedMessageError"
        assert "another key" in meta["result"]["exc_message"][0]
        assert pass_results(r, run_id) == {}

    def test_a_forged_entry_under_a_finished_id_leaves_its_verdict(self, r: redis.Redis) -> None:
        """Garbage sent under a submission's entry id after its verdict landed is refused and
        does not replace that verdict in the result backend."""
        from workers.app import app

        run_id = f"keep-{uuid.uuid4().hex[:8]}"
        task_id = str(uuid.uuid4())
        push(
            r,
            "critique.submit",
            task_id,
            entry_body(hand_built(run_id), task_id, CONFIG, MANAGER_KEY),
        )
        assert task_meta(r, task_id)["status"] == "SUCCESS"
        push(r, "critique.submit", task_id, {"v": 1, "garbage": True})
        node = f"entrysplit@{socket.gethostname()}"

        def idle() -> bool:
            active = app.control.inspect(destination=[node], timeout=2.0).active() or {}
            return r.llen(QUEUE) == 0 and not any(active.values())

        wait_until(idle, 30, what="the forged message to be consumed")
        meta = json.loads(r.get(f"celery-task-meta-{task_id}") or b"{}")
        assert (meta["status"], meta["result"]["status"]) == ("SUCCESS", "accepted")


def _altered(body: dict[str, Any]) -> dict[str, Any]:
    body["submission"]["output"]["summary"] = "Sales rose 40%."
    return body


@pytest.mark.skipif(NODE is None, reason="node is not installed")
class TestTheDocsJavaScriptExample:
    """docs/examples/node/submit.js, the manager docs/entry.md shows, run with ``node``."""

    def test_its_signature_is_the_python_one(self) -> None:
        """docs/entry.md's signEntry gives the signature pipeline.security.signing computes, for a
        body with non-ASCII text, nesting, decimals, null and booleans."""
        from pipeline.security import signing

        body = {
            "v": 1,
            "submission": {
                **hand_built("run-ü"),
                "notes": ['Δ 0.5\n\t\u0001 "q" \\', None, True, 3],
            },
            "config": {"min_score_to_complete": 0.85, "budget": {"total_tokens": 5000}},
            "task_name": "critique.submit",
            "task_id": "id-1",
        }
        script = "const m = require(process.argv[1]); const b = JSON.parse(process.argv[2]);"
        script += "console.log(m.signEntry(b, process.argv[3]).sig, m.keyId(process.argv[3]))"
        out = subprocess.run(
            [str(NODE), "-e", script, str(SUBMIT_JS), json.dumps(body), MANAGER_KEY],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert out.stdout.split() == [
            signing.signature(body, MANAGER_KEY.encode()),
            signing.key_id(MANAGER_KEY.encode()),
        ]

    def test_it_submits_and_prints_the_verdict(self, split: redis.Redis, tmp_path: Path) -> None:
        """Run as documented against a worker with split keys: it pushes a signed entry
        message and prints the accepted verdict it read from the result backend."""
        run_id = f"node-{uuid.uuid4().hex[:8]}"
        out = run_docs_js(tmp_path, run_id, split)
        assert out.returncode == 0, out.stderr
        verdict = json.loads(out.stdout)
        assert (verdict["run_id"], verdict["status"]) == (run_id, "accepted")

    def test_the_shipped_sample_prints_the_verdict_the_doc_shows(self, split: redis.Redis) -> None:
        """`node submit.js submission.json` (config {}, REDIS_URL) on the TODO report prints
        exactly the line docs/entry.md shows, exit 0: a checked verdict that is not accepted."""
        out = run_node(["submission.json"], node_env(split, CRITIQUE_ENTRY_SECRET=MANAGER_KEY))
        assert (out.returncode, out.stderr) == (0, ""), out.stderr
        verdict = json.loads(out.stdout)
        assert verdict["status"] not in ("accepted", "accepted_with_warnings", "unchecked")
        assert verdict["best_score"] is not None
        assert out.stdout == docs_node_block("text")

    def test_enabled_false_prints_unchecked_with_no_score(
        self, split: redis.Redis, tmp_path: Path
    ) -> None:
        """A config.json of {"enabled": false} gets what docs/entry.md says: unchecked,
        stop_reason disabled, best_score null, checked false, never accepted."""
        sample = json.loads((NODE_EXAMPLE / "submission.json").read_text(encoding="utf-8"))
        run_id = f"node-off-{uuid.uuid4().hex[:8]}"
        (tmp_path / "sub.json").write_text(json.dumps({**sample, "run_id": run_id}))
        (tmp_path / "off.json").write_text('{"enabled": false}')
        env = node_env(split, CRITIQUE_ENTRY_SECRET=MANAGER_KEY)
        out = run_node([str(tmp_path / "sub.json"), str(tmp_path / "off.json")], env)
        assert out.returncode == 0, out.stderr
        verdict = json.loads(out.stdout)
        got = (verdict["status"], verdict["stop_reason"], verdict["best_score"], verdict["checked"])
        assert got == ("unchecked", "disabled", None, False)

    @pytest.mark.parametrize(
        ("key", "says"),
        [
            (None, "CRITIQUE_ENTRY_SECRET is not set: nothing was sent"),
            (WORKER_KEY, "CRITIQUE_ENTRY_SECRET is not a key the workers accept"),
        ],
        ids=["no-key", "another-key"],
    )
    def test_a_key_the_workers_would_refuse_stops_at_the_door(
        self, split: redis.Redis, tmp_path: Path, key: str | None, says: str
    ) -> None:
        """With no managers' key, or another key, the fleet's posture stops it before it
        pushes: exit 2, one line naming CRITIQUE_ENTRY_SECRET, no message and no pass."""
        run_id = f"door-{uuid.uuid4().hex[:8]}"
        (tmp_path / "sub.json").write_text(json.dumps(hand_built(run_id)))
        metas = len(list(split.scan_iter("celery-task-meta-*")))
        extra = {} if key is None else {"CRITIQUE_ENTRY_SECRET": key}
        out = run_node([str(tmp_path / "sub.json")], node_env(split, **extra))
        assert out.returncode == 2, out.stderr
        assert says in out.stderr and out.stderr.count("\n") == 1, out.stderr
        assert split.llen(QUEUE) == 0
        time.sleep(1.0)  # what a pushed message would have written by now
        assert len(list(split.scan_iter("celery-task-meta-*"))) == metas
        assert pass_results(split, run_id) == {}

    def test_an_unsigned_message_to_a_fleet_without_a_posture_prints_the_refusal(
        self, split: redis.Redis, tmp_path: Path
    ) -> None:
        """Where no posture is published (an older fleet: here, another key prefix) it pushes
        unsigned, and exits 1 printing the worker's one-line refusal."""
        (tmp_path / "sub.json").write_text(json.dumps(hand_built(f"node-{uuid.uuid4().hex[:8]}")))
        out = run_node([str(tmp_path / "sub.json")], node_env(split, CRITIQUE_KEY_PREFIX="none"))
        assert out.returncode == 1
        assert out.stderr.strip() == (
            "refused: ForgedMessageError: unsigned message: it carries no 'sig' field"
        )

    @pytest.mark.parametrize(
        ("env", "says"),
        [
            ({"REDIS_HOST": "127.0.0.1", "REDIS_PORT": "6379"}, "are not read: set REDIS_URL"),
            ({"REDIS_URL": "localhost:6379"}, "REDIS_URL='localhost:6379' has no scheme"),
            ({"REDIS_URL": "redis://h:1/x"}, "has a path 'x' where the database number goes"),
            ({"REDIS_URL": "redis://h:1/0?db=3"}, "has options"),
            ({"REDIS_URL": "rediss://u:pw-secret@h:1/0"}, "REDIS_URL='rediss://u:***@h:1/0'"),
        ],
        ids=["redis-host", "no-scheme", "bad-db", "query", "tls"],
    )
    def test_a_redis_url_it_cannot_use_is_exit_2_naming_it(
        self, env: dict[str, str], says: str
    ) -> None:
        """REDIS_URL it cannot use (or REDIS_HOST/REDIS_PORT instead of it) is one line, exit
        2, before anything is sent, with the password never shown."""
        base = {k: v for k, v in os.environ.items() if k[:6] != "REDIS_"}
        out = run_node(["submission.json"], {**base, **env})
        assert out.returncode == 2, out.stderr
        assert says in out.stderr and out.stderr.count("\n") == 1, out.stderr
        assert "pw-secret" not in out.stderr

    def test_an_unreachable_redis_is_exit_3_naming_it(self) -> None:
        """Nothing listening at REDIS_URL: one line naming the Redis, exit 3."""
        from workers.embedded import free_port

        url = f"redis://127.0.0.1:{free_port()}/0"
        out = run_node(["submission.json"], {**os.environ, "REDIS_URL": url})
        assert out.returncode == 3, out.stderr
        assert out.stderr.startswith(f"Redis at {url}: ECONNREFUSED"), out.stderr
        assert out.stderr.count("\n") == 1
