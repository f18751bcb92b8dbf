"""The run archive against a real Redis (no worker needed): what ``archive_run`` reads from the
store, when ``archive_due_runs`` (the sweeper's pass) archives a run, and ``critique archive``'s
one-line refusals."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pipeline import settings
from pipeline.models import CritiqueEnvelope, CritiqueResult, PassRef, ReusablePattern
from pipeline.records import archive_file
from pipeline.store import keys
from pipeline.store.archive_index import RedisArchiveIndex
from pipeline.store.base import encode_event
from pipeline.store.pending import RedisPendingIndex
from tests.support.workers import client_on
from workers import archiving
from workers.cli import main

pytestmark = pytest.mark.integration

SECRET = "archive-integration-secret-0123456789"


@pytest.fixture
def env(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process's runtime on the (flushed) test database, signing with a secret, archiving
    to a temporary directory (returned)."""
    folder = tmp_path / "archive"
    with client_on(redis_url, CRITIQUE_ARCHIVE_DIR=str(folder), CRITIQUE_SECRET=SECRET):
        yield folder


def _result(run_id: str, worker: str, pass_id: str, score: float = 0.9) -> CritiqueResult:
    return CritiqueResult(
        run_id=run_id,
        worker_id=worker,
        status="accepted",
        stop_reason="accepted",
        output=f"output of {worker}",
        original_score=score,
        best_score=score,
        envelope=CritiqueEnvelope(worker_id=worker, score=score),
        pass_id=pass_id,
        notes=(f"note of {pass_id}",),
    )


def _submit(run_id: str, worker: str, pass_id: str) -> None:
    """What the client does at submit: latest pass, pending, registry (with the first message)."""
    from workers import runtime

    runs = runtime.stores().runs
    runs.begin_pass(run_id, 1, worker, pass_id)
    RedisPendingIndex(runtime.client()).add(
        run_id, PassRef(run_id, 1, worker, pass_id).member, time.time()
    )
    runs.mark_submitted(
        run_id,
        1,
        worker,
        f"task-{pass_id}",
        f"sig-{worker}",
        pass_id=pass_id,
        message={"state": "x" * 500},
    )


def _finish(run_id: str, worker: str, pass_id: str, score: float = 0.9) -> None:
    """What the chain does: a trace event, a pattern, then the gate's result."""
    from workers import runtime

    s = runtime.stores()
    s.trace.emit(run_id, {"type": "l0", "worker_id": worker, "sid": pass_id})
    pattern = ReusablePattern(category="missing_data", description="d", prevention_rule="add it")
    s.patterns.record(run_id, f"crit-{pass_id}", 1, [pattern], pass_key=pass_id)
    event = encode_event({"type": "result", "worker_id": worker, "sid": pass_id})
    s.runs.put_result(_result(run_id, worker, pass_id, score), pass_id=pass_id, events=[event])


def _seed(run_id: str) -> None:
    """w1: a superseded pass then its latest; w2: finished; w3: failed; a gate decision."""
    from workers import runtime

    _submit(run_id, "w1", "s0")
    _finish(run_id, "w1", "s0", 0.4)
    _submit(run_id, "w1", "s1")
    _finish(run_id, "w1", "s1")
    _submit(run_id, "w2", "s2")
    _finish(run_id, "w2", "s2")
    _submit(run_id, "w3", "s3")
    runtime.stores().runs.put_failure(
        run_id,
        PassRef(run_id, 1, "w3", "s3").member,
        stage="critic",
        error="E",
        reason="r",
        refused=False,
    )
    runtime.stores().runs.record_completion(run_id, "req-1", {"verdict": "reject", "n": 1})


def _index() -> RedisArchiveIndex:
    from workers import runtime

    return RedisArchiveIndex(runtime.client())


def test_archive_run_writes_every_verified_record(env: Path) -> None:
    """The file holds both passes of w1 (latest marked), w2, w3's failure, the decision, the
    trace, the pattern counts, the signed-store flag, and no first message."""
    _seed("run-a")
    done = archiving.archive_run("run-a")
    assert done.path == env / "run-a.jsonl" and done.why == "requested"
    path, record = archiving.read_archived("run-a") or (None, None)
    assert path == done.path and record is not None
    assert [(r.worker_id, r.pass_id) for r in record.results] == [("w1", "s1"), ("w2", "s2")]
    assert sorted(r.pass_id for r in record.passes) == ["s0", "s1", "s2"]
    assert record.results[0].notes == ("note of s1",)
    assert list(record.failures) == [PassRef("run-a", 1, "w3", "s3").member]
    assert record.completions == {"req-1": {"verdict": "reject", "n": 1}}
    assert [e.get("sid") for e in record.trace if e.get("type") == "result"] == ["s0", "s1", "s2"]
    assert record.patterns[0].frequency == 3 and record.signed_store is True
    assert record.submitted["1:w1"]["sid"] == "s1" and "message" not in record.submitted["1:w1"]
    assert '"sig":"hmac-sha256:' in path.read_text().splitlines()[-1]


def test_a_forged_record_in_the_store_is_not_archived(env: Path, redis_url: str) -> None:
    """A result written to Redis without the workers' key is left out of the archive."""
    _seed("run-f")
    forged = _result("run-f", "w9", "s9", 1.0).model_dump_json()
    r = redis.Redis.from_url(redis_url)
    r.hset(keys.run_key("run-f", keys.PASS_RESULTS), PassRef("run-f", 1, "w9", "s9").member, forged)
    r.hset(keys.run_key("run-f", keys.RESULTS), "1:w9", forged)
    record = archiving.archive_run("run-f").record
    assert record is not None
    assert "w9" not in {p.worker_id for p in record.passes}


def test_the_sweeper_archives_a_settled_run_once_it_is_quiet(env: Path) -> None:
    """Not while it is recent; once quiet and settled, once; not again while unchanged."""
    _seed("run-q")
    now = time.time()
    assert archiving.archive_due_runs(now, quiet_s=60, lock_s=0) == []
    assert not (env / "run-q.jsonl").exists()
    later = now + 120
    done = archiving.archive_due_runs(later, quiet_s=60, lock_s=0)
    assert [(d.run_id, d.why) for d in done] == [("run-q", "settled")]
    assert (env / "run-q.jsonl").exists()
    assert _index().listed("run-q") > later + 3600  # next look: near its expiry
    assert archiving.archive_due_runs(later + 10**7, quiet_s=60, lock_s=0) == []


def test_a_run_with_a_pending_pass_is_archived_before_it_expires(env: Path) -> None:
    """Pending passes hold off the quiet archive, not the one before expiry; the record lists
    them."""
    _seed("run-p")
    _submit("run-p", "w4", "s4")
    assert archiving.archive_due_runs(time.time() + 10**4, quiet_s=60, lock_s=0) == []
    done = archiving.archive_due_runs(time.time() + 10**5, quiet_s=60, margin_s=10**9, lock_s=0)
    assert [(d.run_id, d.why) for d in done] == [("run-p", "expiring")]
    assert done[0].record is not None and done[0].record.pending == (
        PassRef("run-p", 1, "w4", "s4").member,
    )


def test_a_run_that_changed_after_its_archive_is_archived_again(env: Path) -> None:
    """A result landing after the archive makes the run due again (at the latest when it
    nears its expiry); the rewrite holds it."""
    _seed("run-c")
    archiving.archive_run("run-c")
    assert archiving.archive_due_runs(time.time(), quiet_s=60, margin_s=10**9, lock_s=0) == []
    _submit("run-c", "w5", "s5")
    _finish("run-c", "w5", "s5")
    near_expiry = time.time() + keys.run_ttl_s() + 10  # the next look comes by then
    done = archiving.archive_due_runs(near_expiry, quiet_s=60, margin_s=10**9, lock_s=0)
    assert [d.run_id for d in done] == ["run-c"]
    _, record = archiving.read_archived("run-c") or (None, None)
    assert record is not None and "w5" in {r.worker_id for r in record.results}


def test_a_run_gone_unarchived_is_reported_and_leaves_the_index(env: Path, redis_url: str) -> None:
    """Keys expired before any archive: logged as lost, and the index forgets the run; an
    archived run that expired leaves quietly."""
    _seed("run-l")
    _seed("run-k")
    archiving.archive_run("run-k")
    r = redis.Redis.from_url(redis_url)
    for run_id in ("run-l", "run-k"):
        r.delete(*[keys.run_key(run_id, s) for s in keys.RUN_KEY_SUFFIXES])
        _index().later(run_id, 0)
    done = archiving.archive_due_runs(time.time(), quiet_s=60, lock_s=0)
    assert [(d.run_id, d.why, d.path) for d in done] == [("run-l", "expired unarchived", None)]
    assert _index().listed("run-l") is None and _index().listed("run-k") is None


def test_a_failed_write_is_retried_later(env: Path) -> None:
    """An archive directory that cannot be written is one logged failure, tried again later."""
    _seed("run-w")
    blocker = env.parent / "not-a-dir"
    blocker.write_text("a file")
    now = time.time() + 120
    done = archiving.archive_due_runs(now, quiet_s=60, lock_s=0, directory=blocker)
    assert [(d.run_id, d.path) for d in done] == [("run-w", None)]
    assert done[0].why.startswith("failed: ")
    assert _index().listed("run-w") == pytest.approx(now + archiving.RETRY_S)


def test_archiving_off_and_the_fleet_lock(env: Path) -> None:
    """quiet 0 turns a worker's archiving off; one pass per lock period runs fleet-wide."""
    _seed("run-o")
    later = time.time() + 10**4
    assert archiving.archive_due_runs(later, quiet_s=0) == []
    assert len(archiving.archive_due_runs(later, quiet_s=60, lock_s=30)) == 1
    _seed("run-o2")
    assert archiving.archive_due_runs(later, quiet_s=60, lock_s=30) == []


def test_bad_archive_after_setting_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """CRITIQUE_ARCHIVE_AFTER_S must be a number of seconds ≥ 0, named in the error."""
    from pipeline.errors import ConfigError

    monkeypatch.setenv(settings.ARCHIVE_AFTER_S.name, "soon")
    with pytest.raises(ConfigError, match="CRITIQUE_ARCHIVE_AFTER_S"):
        archiving.archive_after_s()
    monkeypatch.setenv(settings.ARCHIVE_AFTER_S.name, "0")
    assert archiving.archive_after_s() == 0


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_archive_command_prints_the_file_and_what_it_holds(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`critique archive RUN --json` writes the file and says what it holds."""
    _seed("run-j")
    rc, out, _ = _cli(capsys, "archive", "run-j", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["written"] is True and doc["path"] == str(env / "run-j.jsonl")
    assert doc["counts"]["results"] == 2 and doc["counts"]["passes"] == 3
    rc, out, _ = _cli(capsys, "archive", "run-j")
    assert rc == 0 and out.splitlines()[1].startswith("run run-j archived: 2 result(s)")


def test_archive_command_refuses_bad_inputs_in_one_line(
    env: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Unknown run, an unwritable directory, a symlinked archive file: one line, exit 2,
    nothing written."""
    rc, out, err = _cli(capsys, "archive", "no-such-run")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "no-such-run" in err and "no archive" in err
    _seed("run-b")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, _, err = _cli(capsys, "archive", "run-b", "--dir", str(blocker))
    assert rc == 2 and err.startswith("critique archive: cannot write under")
    assert len(err.strip().splitlines()) == 1
    env.mkdir()
    target = tmp_path / "target"
    target.write_text("keep")
    os.symlink(target, env / "run-b.jsonl")
    rc, _, err = _cli(capsys, "archive", "run-b")
    assert rc == 2 and "symlink" in err and len(err.strip().splitlines()) == 1
    assert target.read_text() == "keep"
    rc, _, err = _cli(capsys, "archive", "bad/../id")
    assert rc == 2 and "not a valid identifier" in err


def test_status_refuses_a_symlinked_or_forged_archive(
    env: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Once Redis holds nothing of the run, a symlinked or altered archive is refused in one
    line (exit 2), never shown as the run's verdicts."""
    env.mkdir()
    good = archive_file.RunRecord(
        run_id="run-s",
        archived_at=1.0,
        signed_store=True,
        passes=(_result("run-s", "w1", "s1"),),
        latest=archive_file.latest_members([_result("run-s", "w1", "s1")]),
    )
    text = archive_file.encode(good, (SECRET.encode(),))
    (env / "run-s.jsonl").write_text(text.replace('"best_score":0.9', '"best_score":1.0'))
    rc, out, err = _cli(capsys, "status", "run-s")
    assert rc == 2 and out == "" and "do not match" in err
    (env / "run-s.jsonl").unlink()
    (tmp_path / "real.jsonl").write_text(text)
    os.symlink(tmp_path / "real.jsonl", env / "run-s.jsonl")
    rc, out, err = _cli(capsys, "status", "run-s")
    assert rc == 2 and "symlink" in err and len(err.strip().splitlines()) == 1


def test_the_archivers_keys_all_expire(env: Path, redis_url: str) -> None:
    """The run index, the run's marker (a day past the run's keys) and the lock carry TTLs."""
    _seed("run-t")
    archiving.archive_run("run-t")
    assert archiving.archive_due_runs(time.time(), quiet_s=60, lock_s=30) == []
    r = redis.Redis.from_url(redis_url)
    day_ms = 24 * 3600 * 1000
    marker = keys.shared_key(f"{keys.ARCHIVE_DONE}:{{run-t}}")
    assert day_ms < r.pttl(marker) <= keys.run_ttl_s() * 1000 + day_ms
    assert 0 < r.pttl(keys.shared_key(keys.ARCHIVE_RUNS)) <= keys.run_ttl_s() * 1000
    assert 0 < r.pttl(keys.shared_key(keys.ARCHIVE_LOCK)) <= 30_000


def test_a_run_redis_still_holds_is_never_read_from_its_archive(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """While Redis holds the run, results() and status answer from Redis, even with an archive
    (possibly stale) on disk: an in-flight run's missing result is [] / pending."""
    from workers.client import CritiqueClient

    _seed("run-i")
    archiving.archive_run("run-i")
    _submit("run-i", "w7", "s7")
    client = CritiqueClient({"enabled": True})
    assert client.results("run-i", 2) == []
    assert [r.worker_id for r in client.results("run-i")] == ["w1", "w2"]
    rc, out, _ = _cli(capsys, "status", "run-i", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["archive"] is None and doc["pending"] == ["1:w7"]


def test_an_older_signed_archive_put_back_is_refused(env: Path) -> None:
    """A validly signed archive of the run older than the one the archive index knows as its
    latest (a rollback by whoever can write the directory) is refused on read-back; the
    directory is created 0700 and the file 0600."""
    _seed("run-o")
    first = archiving.archive_run("run-o", now=time.time() - 5)
    assert first.path is not None
    older = first.path.read_bytes()
    _submit("run-o", "w5", "s5")
    _finish("run-o", "w5", "s5", 0.2)
    latest = archiving.archive_run("run-o")
    assert latest.path == first.path
    assert (os.stat(env).st_mode & 0o777, os.stat(latest.path).st_mode & 0o777) == (0o700, 0o600)
    assert archiving.read_archived("run-o") is not None
    first.path.write_bytes(older)
    with pytest.raises(archive_file.ArchiveError, match="older archive of run 'run-o'"):
        archiving.read_archived("run-o")
