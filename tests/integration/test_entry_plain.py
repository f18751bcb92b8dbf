"""``critique.submit`` through a real worker with no secret: hand-built entry messages get their
verdicts under their own ids, as in test_entry.py."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pipeline.store import keys
from tests.support import wait_until
from tests.support.entry import (
    hand_built,
    pass_results,
    refusal,
    todo_report,
)
from tests.support.rawcelery import QUEUE, entry_body, push, task_meta
from tests.support.submissions import CONFIG, make_sub
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    """This process's client and the worker, with no secret."""
    with client_on(worker_db_url(redis_url), CRITIQUE_SECRET="") as e:
        yield e


WORKER = WorkerSpec("entryplain", concurrency=2)


@pytest.fixture(scope="module")
def plain(env: dict[str, str], worker: WorkerProcess) -> Iterator[redis.Redis]:
    """A client of the Redis of the module's worker (no secret)."""
    client = redis.Redis.from_url(env["REDIS_URL"])
    yield client
    client.close()


class TestWithoutASecret:
    @pytest.fixture
    def r(self, plain: redis.Redis) -> redis.Redis:
        return plain

    def test_a_hand_built_entry_message_gets_its_verdict_under_its_own_id(
        self, r: redis.Redis
    ) -> None:
        """The entry task's id holds the gate's summary, the same as the stored result."""
        from workers.client import CritiqueClient

        run_id = f"entry-{uuid.uuid4().hex[:8]}"
        task_id = str(uuid.uuid4())
        push(r, "critique.submit", task_id, entry_body(hand_built(run_id), task_id, CONFIG))
        meta = task_meta(r, task_id)
        assert meta["status"] == "SUCCESS", meta
        [stored] = CritiqueClient(CONFIG).results(run_id)
        summary = meta["result"]
        assert (summary["run_id"], summary["worker_id"], summary["status"]) == (
            run_id,
            "w1",
            stored.status,
        )
        assert summary["best_score"] == stored.best_score
        assert stored.status == "accepted"

    def test_an_entry_with_an_empty_config_checks_the_output(self, r: redis.Redis) -> None:
        """``config: {}`` (no ``enabled`` anywhere) critiques: the TODO report gets a checked,
        not-accepted verdict in the entry task's result, never ``accepted`` at 1.00."""
        run_id = f"entry-{uuid.uuid4().hex[:8]}"
        task_id = str(uuid.uuid4())
        push(r, "critique.submit", task_id, entry_body(todo_report(run_id), task_id, {}))
        meta = task_meta(r, task_id)
        summary = meta["result"]
        assert meta["status"] == "SUCCESS", meta
        assert summary["status"] in ("escalated", "failed"), summary
        assert summary["checked"] is True and summary["best_score"] < 1.0

    def test_a_client_with_no_config_checks_the_output(self, r: redis.Redis) -> None:
        """``CritiqueClient()`` with no configuration critiques too: not accepted."""
        from pipeline.models import Submission
        from workers.client import CritiqueClient

        client = CritiqueClient()
        sub = Submission.model_validate(todo_report(f"client-{uuid.uuid4().hex[:8]}"))
        result = client.wait(client.submit(sub), timeout=60)
        assert result.checked and result.status in ("escalated", "failed"), str(result)
        assert any("TODO" in d.description for d in result.envelope.defects)

    def test_a_repair_round_still_ends_under_the_entry_id(self, r: redis.Redis) -> None:
        """An output that needs a repair round (a replacement task) still ends its verdict
        under the id the manager sent."""
        run_id = f"entry-{uuid.uuid4().hex[:8]}"
        task_id = str(uuid.uuid4())
        sub = make_sub(run_id, "w2", 1, "looping").model_dump(mode="json")
        push(r, "critique.submit", task_id, entry_body(sub, task_id, CONFIG))
        meta = task_meta(r, task_id)
        assert (meta["status"], meta["result"]["status"]) == ("SUCCESS", "repaired"), meta

    @pytest.mark.parametrize(
        ("change", "exc_type", "says"),
        [
            (lambda b: b["submission"].pop("worker_id"), "SubmissionError", "worker_id"),
            (
                lambda b: b.update(config={"llm": {"api_base": "http://x"}}),
                "RefusedOverride",
                "llm",
            ),
            (lambda b: b.update(extra=1), "SubmissionError", "unknown field"),
            (lambda b: b.update(v=2), "SubmissionError", "'v' must be the integer 1"),
        ],
        ids=["malformed", "worker-only-override", "unknown-field", "version"],
    )
    def test_invalid_entry_fails_with_a_one_line_reason(
        self, r: redis.Redis, change: Any, exc_type: str, says: str
    ) -> None:
        """Invalid input is a FAILURE with one line naming what is wrong, no traceback, and
        starts no pass."""
        run_id = f"bad-{uuid.uuid4().hex[:8]}"
        task_id = str(uuid.uuid4())
        body = entry_body(hand_built(run_id), task_id, CONFIG)
        change(body)
        push(r, "critique.submit", task_id, body)
        got_type, reason = refusal(task_meta(r, task_id))
        assert got_type.startswith(exc_type) and says in reason, (got_type, reason)
        assert not r.exists(keys.entry_claim_key(task_id))

    def test_the_same_entry_message_delivered_twice_runs_one_pass(self, r: redis.Redis) -> None:
        """Two deliveries of one entry message (same task id) claim one pass: one result,
        one result event, one entry record."""
        from workers.app import app
        from workers.client import CritiqueClient

        run_id = f"twice-{uuid.uuid4().hex[:8]}"
        task_id = str(uuid.uuid4())
        body = entry_body(hand_built(run_id), task_id, CONFIG)
        node = f"entryplain@{socket.gethostname()}"

        def submits() -> int:
            stats = app.control.inspect(destination=[node], timeout=2.0).stats() or {}
            return int(((stats.get(node) or {}).get("total") or {}).get("critique.submit", 0))

        before = submits()
        push(r, "critique.submit", task_id, body)
        push(r, "critique.submit", task_id, body)
        assert task_meta(r, task_id)["status"] == "SUCCESS"
        wait_until(lambda: submits() >= before + 2, 30, what="both deliveries to run")

        def settled() -> bool:
            active = app.control.inspect(destination=[node], timeout=2.0).active() or {}
            return r.llen(QUEUE) == 0 and not any(active.values())

        wait_until(settled, 30, what="the worker to go idle")
        assert json.loads(r.get(keys.entry_claim_key(task_id)) or b"{}")["run_id"] == run_id
        assert not r.exists(keys.run_key(run_id, keys.OWNER))  # no key: no owner enforced
        assert len(pass_results(r, run_id)) == 1
        events = [e for e in CritiqueClient(CONFIG).trace(run_id) if e["type"] == "result"]
        assert len(events) == 1
