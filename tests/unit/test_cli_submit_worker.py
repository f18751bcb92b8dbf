"""``critique submit`` input handling and ``critique worker`` command lines (no Redis needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.cli import main
from workers.commands._input import InputError
from workers.commands.submit import build_overrides, parse_documents, read_submissions

SUB = {"run_id": "r1", "worker_id": "w1", "task": "Summarise.", "output": {"summary": "x"}}


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_reads_an_object_a_list_and_json_lines(tmp_path: Path) -> None:
    """One object, a JSON list and JSON Lines all yield validated submissions, in order."""
    one = _write(tmp_path, "one.json", json.dumps(SUB, indent=2))
    many = _write(
        tmp_path, "many.json", json.dumps([{**SUB, "worker_id": f"l{i}"} for i in (1, 2)])
    )
    lines = "\n".join(json.dumps({**SUB, "worker_id": f"j{i}"}) for i in (1, 2)) + "\n\n"
    jsonl = _write(tmp_path, "subs.jsonl", lines)
    subs = read_submissions([one, many, jsonl])
    assert [s.worker_id for s in subs] == ["w1", "l1", "l2", "j1", "j2"]


def test_a_missing_field_names_the_file_and_the_field(tmp_path: Path) -> None:
    """A submission without 'task' is refused with the file, its index and the field named."""
    bad = _write(
        tmp_path, "bad.json", json.dumps([SUB, {k: v for k, v in SUB.items() if k != "task"}])
    )
    with pytest.raises(InputError, match=r"bad\.json\[1\]: field 'task': Field required"):
        read_submissions([bad])


def test_broken_json_lines_name_the_line() -> None:
    """A JSON Lines input with a broken line names that line."""
    text = json.dumps(SUB) + "\n" + '{"run_id": "r1",\n'
    with pytest.raises(InputError, match=r"subs\.jsonl:2: not valid JSON Lines"):
        parse_documents(text, "subs.jsonl")


def test_broken_json_document_names_line_and_column() -> None:
    """A multi-line JSON document with a syntax error is reported as JSON, with its position."""
    with pytest.raises(InputError, match=r"x\.json: not valid JSON: .* at line 3 column"):
        parse_documents('{\n  "run_id": "r1",\n  oops\n}', "x.json")


def test_non_objects_and_duplicates_are_refused(tmp_path: Path) -> None:
    """A list of strings, and one worker submitted twice in one iteration, are input errors."""
    with pytest.raises(InputError, match="expected a JSON object"):
        read_submissions([_write(tmp_path, "s.json", '["a", "b"]')])
    twice = _write(tmp_path, "t.json", json.dumps([SUB, SUB]))
    with pytest.raises(InputError, match=r"t\.json\[1\]: worker_id 'w1' .* also submitted"):
        read_submissions([twice])


def test_overrides_from_a_file_and_set(tmp_path: Path) -> None:
    """--config JSON and --set (dotted keys, JSON values) merge over enabled=true."""
    cfg = _write(
        tmp_path, "o.json", json.dumps({"critic": "rubric", "budget": {"total_tokens": 9}})
    )
    got = build_overrides(cfg, ["budget.total_tokens=1000", "max_repair_attempts=3", "model=gpt"])
    assert got == {
        "enabled": True,
        "critic": "rubric",
        "budget": {"total_tokens": 1000},
        "max_repair_attempts": 3,
        "model": "gpt",
    }
    with pytest.raises(InputError, match="expected KEY=VALUE"):
        build_overrides(None, ["critic"])


def test_overrides_from_a_workflow_file(tmp_path: Path) -> None:
    """A workflow.awp.yaml given to --config contributes its critique block."""
    wf = _write(
        tmp_path,
        "workflow.awp.yaml",
        "orchestration:\n  delegation_loop:\n    critique:\n      critic: heuristic\n"
        "      max_repair_attempts: 1\n",
    )
    assert build_overrides(wf, []) == {
        "enabled": True,
        "critic": "heuristic",
        "max_repair_attempts": 1,
    }


def test_submit_bad_input_exits_2_before_touching_redis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Malformed input exits 2 even when Redis is unreachable: validation comes first."""
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    bad = _write(tmp_path, "bad.json", json.dumps({**SUB, "iteration": 0}))
    assert main(["submit", bad]) == 2
    assert "bad.json: field 'iteration'" in capsys.readouterr().err
    assert main(["submit", bad.replace("bad", "missing")]) == 2
    assert main(["submit", _write(tmp_path, "ok.json", json.dumps(SUB)), "--set", "nope=1"]) == 2
    assert "unknown configuration key" in capsys.readouterr().err


@pytest.mark.parametrize(("cpus", "threads"), [(1, "32"), (2, "32"), (8, "16")])
def test_worker_dry_run_builds_the_celery_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, cpus: int, threads: str
) -> None:
    """Defaults: every queue, threads pool, 32 calls in flight per usable CPU (a small host's
    one process per CPU: 32 threads; two per CPU: 16 each); options after -- go to Celery."""
    from workers.commands import worker

    monkeypatch.delenv("CRITIQUE_PROCESSES", raising=False)
    monkeypatch.delenv("CRITIQUE_CONCURRENCY", raising=False)
    monkeypatch.setattr(worker, "available_cpus", lambda: cpus)
    assert main(["worker", "--dry-run"]) == 0
    argv = capsys.readouterr().out.split()
    assert argv[1:6] == ["-m", "celery", "-A", "workers.app", "worker"]
    assert argv[argv.index("-Q") + 1] == "critique.cpu,critique.llm,critique.llm.critic"
    assert argv[argv.index("-P") + 1] == "threads"
    assert argv[argv.index("-c") + 1] == threads
    assert main(["worker", "--dry-run", "--processes", "3"]) == 0  # not auto: 16 threads
    assert capsys.readouterr().out.split().count("16") == 3
    assert main(["worker", "-Q", "critique.cpu", "-P", "prefork", "-c", "3", "--dry-run", "--",
                 "--max-tasks-per-child", "50"]) == 0  # fmt: skip
    argv = capsys.readouterr().out.split()
    assert argv[-2:] == ["--max-tasks-per-child", "50"]
    assert argv[argv.index("-c") + 1] == "3"


def test_worker_concurrency_from_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CRITIQUE_CONCURRENCY sets the default concurrency; -c still wins."""
    monkeypatch.setenv("CRITIQUE_CONCURRENCY", "40")
    assert main(["worker", "--dry-run"]) == 0
    assert "-c 40" in capsys.readouterr().out
    assert main(["worker", "--dry-run", "-c", "2"]) == 0
    assert "-c 2" in capsys.readouterr().out


def test_worker_refuses_unknown_queues_and_unreachable_redis(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo in -Q exits 2 listing the real queues; Redis down exits 3 naming the URL."""
    assert main(["worker", "-Q", "critique.gpu"]) == 2
    assert "critique.cpu, critique.llm" in capsys.readouterr().err
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    assert main(["worker"]) == 3
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in capsys.readouterr().err


def test_worker_refuses_a_short_entry_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A guessable CRITIQUE_ENTRY_SECRET stops `critique worker` at start (exit 2), naming the
    variable and never its value."""
    monkeypatch.setenv("CRITIQUE_ENTRY_SECRET", "guessable")
    assert main(["worker", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "CRITIQUE_ENTRY_SECRET" in err and "guessable" not in err
