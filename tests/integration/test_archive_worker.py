"""A run's archive through a real worker: ``critique archive`` (and the sweeper's pass) write
every result with its rounds, the trace, the pattern counts and the lessons; once the run's
keys expire (a short ``CRITIQUE_RUN_TTL_S``), ``status``, ``report`` and ``results()`` answer
from the archive and say so."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pipeline.store import keys
from tests.support import wait_until
from tests.support.submissions import CONFIG, operator_sub
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url
from workers.cli import main

pytestmark = pytest.mark.integration

TTL_S = 6
"""The run TTL of this module's worker and client: short, so the test sees the keys expire."""


@pytest.fixture(scope="module")
def env(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Client and worker on the worker-test database, with a short run TTL and an archive
    directory of their own."""
    folder = tmp_path_factory.mktemp("archive")
    extra = {"CRITIQUE_RUN_TTL_S": str(TTL_S), "CRITIQUE_ARCHIVE_DIR": str(folder)}
    with client_on(worker_db_url(redis_url), **extra) as e:
        yield e


WORKER = WorkerSpec("archive")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _files(root: Path) -> dict[str, str]:
    """Every critique.json / repairs.json under a report root, by relative path."""
    return {
        str(p.relative_to(root)): p.read_text(encoding="utf-8")
        for p in sorted(root.rglob("*.json"))
    }


def test_an_expired_run_answers_from_its_archive(
    worker: WorkerProcess, env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """archive writes every result with its rounds, the trace, patterns and lessons; after the
    keys expire, status, report (the same critique files as from Redis) and results() read
    the archive, and status and report say so."""
    from workers import archiving
    from workers.client import CritiqueClient

    run_a, run_b = f"arch-{uuid.uuid4().hex[:8]}", f"arch-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(CONFIG)
    subs = [
        operator_sub(run_a, "w1", "clean"),
        operator_sub(run_a, "w2", "looping"),
        operator_sub(run_a, "w3", "bad"),
    ]
    client.wait_many(client.submit_many([*subs, operator_sub(run_b, "w9", "looping")]), timeout=60)
    before = client.results(run_a)
    assert [r.status for r in before] == ["accepted", "repaired", "escalated"]
    trace = _redis_trace(run_a)
    rc, _, _ = _cli(capsys, "report", run_a, "--out", str(tmp_path / "live"))
    assert rc == 0

    rc, out, _ = _cli(capsys, "archive", run_a, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["written"] is True
    lines = [json.loads(line) for line in Path(doc["path"]).read_text().splitlines()]
    results = [x["result"] for x in lines if x["kind"] == "result"]
    assert sorted(r["worker_id"] for r in results) == ["w1", "w2", "w3"]
    assert all(r["trace"] for r in results)  # every result with its rounds
    assert [len(r["attempts"]) > 0 for r in sorted(results, key=lambda r: r["worker_id"])] == [
        False,
        True,
        False,
    ]
    assert [x["event"] for x in lines if x["kind"] == "trace"] == trace
    assert any(x["kind"] == "pattern" for x in lines)
    archived_lessons = [x["lesson"] for x in lines if x["kind"] == "lesson"]
    assert archived_lessons and all(x["scope"] == "run" for x in archived_lessons)
    assert run_b not in json.dumps(archived_lessons)  # the run's own lessons, no other run's

    done = archiving.archive_due_runs(time.time() + 60, quiet_s=1, lock_s=0)  # the sweeper
    assert [(d.run_id, d.why) for d in done] == [(run_b, "settled")]

    wait_until(lambda: not _run_keys(run_a) and not _run_keys(run_b), 30, what="keys to expire")

    rc, out, _ = _cli(capsys, "status", run_a, "--json")
    status = json.loads(out)
    assert rc == 0 and status["finished"] == 3 and status["archive"]["path"] == doc["path"]
    rc, out, _ = _cli(capsys, "status", run_a)
    assert rc == 0 and out.splitlines()[1].startswith(f"(from the archive: {doc['path']}")
    rc, out, _ = _cli(capsys, "report", run_a, "--out", str(tmp_path / "archived"))
    assert rc == 0 and out.startswith("(from the archive: ")
    assert _files(tmp_path / "archived") == _files(tmp_path / "live")
    assert client.results(run_a) == before
    assert [r.worker_id for r in client.results(run_b)] == ["w9"]


def _client() -> redis.Redis:
    from workers import runtime

    return runtime.client()


def _run_keys(run_id: str) -> list[bytes]:
    return list(_client().scan_iter(match=keys.run_key_pattern(run_id), count=1000))


def _redis_trace(run_id: str) -> list[dict[str, object]]:
    from workers import runtime

    return runtime.stores().trace.read(run_id)
