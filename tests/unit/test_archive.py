"""The run archive's file format (pipeline.records.archive_file): JSON Lines that round-trip, refuse
what was altered, cut short or forged, and are written and read without following a symlink."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.errors import PathEscapeError
from pipeline.models import (
    CritiqueEnvelope,
    CritiqueResult,
    Lesson,
    Pattern,
    RepairAttempt,
    RoundTrace,
)
from pipeline.records import archive_file
from pipeline.records.archive_file import ArchiveError, RunRecord

SECRET = (b"archive-test-secret-0123456789",)


def _result(worker: str, pass_id: str, *, score: float = 0.9, output: str = "ok") -> CritiqueResult:
    return CritiqueResult(
        run_id="run-1",
        iteration=1,
        worker_id=worker,
        status="repaired",
        stop_reason="accepted",
        output=output,
        original_score=0.4,
        best_score=score,
        envelope=CritiqueEnvelope(worker_id=worker, score=score),
        attempts=(
            RepairAttempt(
                worker_id=worker,
                attempt=1,
                original_score=0.4,
                repaired_score=score,
                defects_fixed=1,
                defects_remaining=0,
            ),
        ),
        trace=(
            RoundTrace(round=1, score=0.4, mean=0.4, defects=2, verdict="continue"),
            RoundTrace(round=2, score=score, mean=score, defects=0, verdict="accepted"),
        ),
        pass_id=pass_id,
        notes=("repair 1: deterministic reviser",),
    )


def _record() -> RunRecord:
    old, new, other = _result("w1", "s1", score=0.5), _result("w1", "s2"), _result("w2", "s3")
    return RunRecord(
        run_id="run-1",
        archived_at=1_700_000_000.5,
        signed_store=True,
        submitted={
            "1:w1": {"task_id": "t2", "signature": "sig-w1", "at": 1.0, "sid": "s2"},
            "1:w2": {"task_id": "t3", "signature": "sig-w2", "at": 2.0, "sid": "s3"},
            "2:w3": {"task_id": "t4", "signature": "sig-w3", "at": 3.0, "sid": "s4"},
        },
        passes=(old, new, other),
        latest=archive_file.latest_members([new, other]),
        failures={
            "2:w3:s4": {
                "stage": "critic",
                "error": "ConfigError",
                "reason": "no key",
                "refused": True,
                "task_id": "t4",
                "at": 4.0,
            }
        },
        completions={"req-1": {"verdict": "reject", "reason": "mean 0.5 < 0.6"}},
        rejections=1,
        trace=({"type": "l0", "worker_id": "w1"}, {"type": "result", "worker_id": "w1"}),
        patterns=(
            Pattern(
                category="missing_data",
                frequency=3,
                description="no findings",
                prevention_rule="include findings",
                first_seen_iteration=1,
                last_seen_iteration=2,
            ),
        ),
        lessons=(
            Lesson(
                category="missing_data",
                runs=2,
                description="no findings",
                prevention_rule="include findings",
            ),
        ),
        pending=("2:w4:s5",),
        budget={"spent": 120, "overrun": 0},
    )


def test_a_record_round_trips_through_json_lines() -> None:
    """Every kind of record comes back equal: results with rounds, attempts and notes, the
    superseded pass apart from the latest, failures, decisions, trace, patterns, lessons."""
    record = _record()
    text = archive_file.encode(record)
    kinds = [json.loads(line)["kind"] for line in text.splitlines()]
    assert kinds[0] == "run" and kinds[-1] == "end"
    assert kinds.count("result") == 3 and kinds.count("trace") == 2
    back = archive_file.decode(text, run_id="run-1")
    assert back == record
    assert [(r.worker_id, r.pass_id) for r in back.results] == [("w1", "s2"), ("w2", "s3")]
    assert back.results[0].trace[1].verdict == "accepted" and back.results[0].attempts
    assert back.counts()["passes"] == 3 and back.counts()["results"] == 2


def test_the_header_counts_and_says_whether_the_store_was_signed() -> None:
    """The first line is the header: run id, schema, when, signed_store, counts, pending."""
    head = json.loads(archive_file.encode(_record()).split("\n", 1)[0])
    assert head["run_id"] == "run-1" and head["schema"] == archive_file.SCHEMA
    assert head["signed_store"] is True and head["archived"] == "2023-11-14T22:13:20Z"
    assert head["counts"]["failures"] == 1 and head["pending"] == ["2:w4:s5"]


def test_the_first_message_of_a_submission_is_not_archived() -> None:
    """The registry's first stage message (a whole output) stays out of the record."""
    record = _record()
    record.submitted["1:w1"]["message"] = {"state": "x" * 1000}
    text = archive_file.encode(record)
    assert "xxxx" not in text
    assert "message" not in archive_file.decode(text).submitted["1:w1"]


def test_line_separators_inside_text_do_not_split_a_record() -> None:
    """An output holding U+2028, U+0085 or a newline stays one line and comes back whole."""
    weird = "a\u2028b\u0085c\nd\re"
    record = RunRecord(
        run_id="run-1",
        archived_at=1.0,
        signed_store=False,
        passes=(_result("w1", "s1", output=weird),),
        latest=archive_file.latest_members([_result("w1", "s1")]),
    )
    back = archive_file.decode(archive_file.encode(record))
    assert back.results[0].output == weird


def test_a_signed_archive_verifies_and_a_changed_one_is_refused() -> None:
    """With CRITIQUE_SECRET the end line is signed: the same key reads it; an altered line,
    a cut-short file, another key or an unsigned file is refused with one line."""
    text = archive_file.encode(_record(), SECRET)
    assert archive_file.decode(text, SECRET) == _record()
    forged = text.replace('"best_score":0.9', '"best_score":1.0', 1)
    with pytest.raises(ArchiveError, match="do not match"):
        archive_file.decode(forged, SECRET)
    with pytest.raises(ArchiveError, match="cut short"):
        archive_file.decode("\n".join(text.splitlines()[:-1]), SECRET)
    with pytest.raises(ArchiveError, match="does not verify"):
        archive_file.decode(text, (b"another-secret-0123456789abcdef",))
    with pytest.raises(ArchiveError, match="does not verify"):
        archive_file.decode(archive_file.encode(_record()), SECRET)


def test_a_rewritten_record_with_a_fresh_digest_needs_the_key() -> None:
    """Recomputing the end line's digest after an edit is not enough when a secret is set."""
    text = archive_file.encode(_record(), SECRET)
    lines = text.splitlines()
    lines[1] = lines[1].replace("sig-w1", "sig-xx")
    body = "".join(line + "\n" for line in lines[:-1])
    end = json.loads(lines[-1])
    end["sha256"] = archive_file.hashlib.sha256(body.encode()).hexdigest()
    with pytest.raises(ArchiveError, match="does not verify"):
        archive_file.decode(body + json.dumps(end) + "\n", SECRET)


def test_a_newer_schema_or_another_run_is_refused() -> None:
    """A file from a newer version, or filed under another run, is not read as this run."""
    record = _record()
    with pytest.raises(ArchiveError, match="not 'run-2'"):
        archive_file.decode(archive_file.encode(record), run_id="run-2")
    lines = archive_file.encode(record).splitlines()
    head = json.loads(lines[0])
    head["schema"] = archive_file.SCHEMA + 1
    lines[0] = json.dumps(head)
    body = "".join(line + "\n" for line in lines[:-1])
    end = json.loads(lines[-1])
    end["sha256"] = archive_file.hashlib.sha256(body.encode()).hexdigest()
    with pytest.raises(ArchiveError, match="schema"):
        archive_file.decode(body + json.dumps(end) + "\n")


def test_garbage_is_one_clear_error() -> None:
    """Empty or non-JSON text is an ArchiveError naming the file, never a traceback."""
    for text in ("", "not json\n", '{"kind": "run"}\n'):
        with pytest.raises(ArchiveError, match=r"^somewhere: "):
            archive_file.decode(text, where="somewhere")


def test_archive_dir_defaults_under_the_workspace() -> None:
    """$CRITIQUE_ARCHIVE_DIR wins; else <$CRITIQUE_WORKSPACE or ./workspace>/archive."""
    assert archive_file.archive_dir({}) == Path("workspace/archive")
    assert archive_file.archive_dir({"CRITIQUE_WORKSPACE": "/srv/ws"}) == Path("/srv/ws/archive")
    env = {"CRITIQUE_WORKSPACE": "/srv/ws", "CRITIQUE_ARCHIVE_DIR": "/mnt/archive"}
    assert archive_file.archive_dir(env) == Path("/mnt/archive")
    with pytest.raises(ValueError):
        archive_file.archive_path(Path("/a"), "../etc")


def test_write_then_read_and_a_rewrite_replaces_the_file_whole(tmp_path: Path) -> None:
    """The file is <dir>/<run-id>.jsonl; archiving again replaces it whole (merging nothing)."""
    record = _record()
    path = archive_file.write(tmp_path / "archive", record, SECRET)
    assert path == tmp_path / "archive" / "run-1.jsonl"
    got = archive_file.read(tmp_path / "archive", "run-1", SECRET)
    assert got == (path, record)
    smaller = RunRecord(run_id="run-1", archived_at=2.0, signed_store=False)
    archive_file.write(tmp_path / "archive", smaller)
    assert archive_file.read(tmp_path / "archive", "run-1") == (path, smaller)
    assert archive_file.read(tmp_path / "archive", "run-9") is None
    assert [p.name for p in (tmp_path / "archive").iterdir()] == ["run-1.jsonl"]


def test_a_symlinked_archive_file_is_neither_written_nor_read(tmp_path: Path) -> None:
    """An archive file that is a symlink is refused both ways; its target is untouched."""
    folder = tmp_path / "archive"
    folder.mkdir()
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me")
    os.symlink(target, folder / "run-1.jsonl")
    with pytest.raises(PathEscapeError, match="symlink"):
        archive_file.write(folder, _record())
    assert target.read_text() == "keep me"
    with pytest.raises(ArchiveError, match="symlink"):
        archive_file.read(folder, "run-1")


def test_a_folder_in_place_of_the_archive_is_one_clear_error(tmp_path: Path) -> None:
    """Something other than a regular file at the archive's path is an ArchiveError naming it,
    not an OSError traceback."""
    folder = tmp_path / "archive"
    (folder / "run-1.jsonl").mkdir(parents=True)
    with pytest.raises(ArchiveError, match="not a regular file"):
        archive_file.read(folder, "run-1")


def test_an_archive_older_than_the_latest_known_is_refused() -> None:
    """check_not_older compares the signed archived_at with the index's latest: equal or newer
    passes, older is refused naming the run, unknown (no marker) passes."""
    from pipeline.records.archive_file import ArchiveError, RunRecord, check_not_older

    record = RunRecord(run_id="run-x", archived_at=100.0, signed_store=True)
    check_not_older(record, None)
    check_not_older(record, 100.0)
    check_not_older(record, 99.0)
    with pytest.raises(ArchiveError, match="older archive of run 'run-x'"):
        check_not_older(record, 100.5)
