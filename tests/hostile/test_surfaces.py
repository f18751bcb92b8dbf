"""Hostile text on the surfaces people read (issue 28 item 6), against a real worker and Redis.

``critique report`` never writes through a symlink under the artifacts root (also for a run
with no finished result), ``CRITIQUE.md`` shows worker-made HTML as text, the CLI prints
worker-made names with their control characters escaped, and a reader that closes the pipe
early (``| head -1``) ends the command quietly with exit 141, not "Redis unreachable".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipeline.models import FileRef, Submission
from tests.support.hostile import ENABLED, HOSTILE_WORKER
from tests.support.workers import ROOT, WorkerProcess
from workers.cli import main
from workers.exit_codes import EXIT_BROKEN_PIPE, EXIT_USAGE

pytestmark = pytest.mark.integration

EVIL = "<script>alert(1)</script>"
EVIL_KEY = "<img src=x onerror=alert(2)>"
EVIL_FILE = "<script>f</script>.md"
ESC_NAME = "a\x1b]0;pwned\x07.md"
"""A file name whose OSC sequence would retitle the terminal window if printed raw."""
EVIL_WORKER_ID = "w-evil"
WORKER = HOSTILE_WORKER


def _run_id(prefix: str = "surf") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _critique(
    env: dict[str, str], *args: str, cwd: Path = ROOT
) -> subprocess.CompletedProcess[bytes]:
    """``critique ARGS`` as a process (the installed script, else ``-m workers.cli``)."""
    script = Path(sys.executable).with_name("critique")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "workers.cli"]
    return subprocess.run([*argv, *args], capture_output=True, env=env, cwd=cwd, timeout=120)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (symlinks not followed) with its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


HOSTILE = {
    EVIL: "&lt;script&gt;alert(1)&lt;/script&gt;",
    EVIL_KEY: "&lt;img src=x onerror=alert(2)&gt;",
    EVIL_FILE: "&lt;script&gt;f&lt;/script&gt;.md",
}
"""Each hostile string the run carries, and how Markdown must show it."""


@pytest.fixture(scope="module")
def evil_run(worker: WorkerProcess) -> tuple[str, set[str]]:
    """A finished run whose one result carries HTML from an ``error`` field, a required key
    name and a file name (with a placeholder line quoting HTML); returns the run id and the
    hostile strings that reached the stored result's defects or prescriptions (the file name
    and the quoted line always do)."""
    from workers.client import CritiqueClient

    run_id = _run_id()
    sub = Submission(
        run_id=run_id,
        worker_id=EVIL_WORKER_ID,
        task="Summarise the Q3 sales report.",
        output={"error": EVIL},
        required_fields=(EVIL_KEY,),
        files=(FileRef(path=EVIL_FILE, size=5, content=f"TODO {EVIL}\n"),),
    )
    client = CritiqueClient(ENABLED)
    result = client.wait(client.submit(sub), timeout=60)
    env = result.envelope
    text = " ".join([*(f"{d.location} {d.description}" for d in env.defects), *env.prescriptions])
    carried = {s for s in HOSTILE if s in text}
    assert {EVIL, EVIL_FILE} <= carried, text
    return run_id, carried


def test_critique_md_shows_worker_html_as_text(
    worker: WorkerProcess,
    evil_run: tuple[str, set[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """CRITIQUE.md escapes the HTML an error field, a key name and a file name carry into the
    result: each one shows as entities, no raw tag is left."""
    run_id, carried = evil_run
    rc, _, err = _cli(capsys, "report", run_id, "--out", str(tmp_path))
    assert rc == 0, err
    md = (tmp_path / "runs" / run_id / "iterations" / "001" / "CRITIQUE.md").read_text("utf-8")
    assert "<script" not in md and "<img" not in md
    for hostile in carried:
        assert HOSTILE[hostile] in md, hostile
    lessons = (tmp_path / "runs" / run_id / "lessons.md").read_text("utf-8")
    assert "<script" not in lessons and "<img" not in lessons


def _pending_run(worker_ids: list[str]) -> str:
    """A run whose submissions are registered but never finish (no chain behind them)."""
    from workers import runtime

    run_id = _run_id("pending")
    runs = runtime.stores().runs
    for w in worker_ids:
        runs.mark_submitted(run_id, 1, w, f"no-such-task-{uuid.uuid4().hex}", "sig")
    return run_id


LINKS = {
    "runs": lambda run: "runs",
    "run folder": lambda run: f"runs/{run}",
    "report.html": lambda run: f"runs/{run}/report.html",
    "lessons.md": lambda run: f"runs/{run}/lessons.md",
    "delegation folder": lambda run: f"runs/{run}/iterations/001/delegations/{EVIL_WORKER_ID}",
}


@pytest.mark.parametrize(
    ("finished", "where"),
    [
        (True, "runs"),
        (True, "run folder"),
        (True, "report.html"),
        (True, "delegation folder"),
        (False, "run folder"),
        (False, "lessons.md"),
    ],
)
def test_report_refuses_a_symlink_under_the_root(
    evil_run: tuple[str, set[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    finished: bool,
    where: str,
) -> None:
    """A symlink anywhere under the root (a folder, or report.html / lessons.md themselves)
    leading outside it: exit 2, one line naming the link, nothing written outside; the same
    for a run with no finished result (only report.html and lessons.md to write)."""
    run_id = evil_run[0] if finished else _pending_run(["w1"])
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine\n", encoding="utf-8")
    link = root / LINKS[where](run_id)
    link.parent.mkdir(parents=True)
    if where.endswith((".html", ".md")):
        os.symlink(outside / "keep.txt", link)  # a write through it would overwrite keep.txt
    else:
        os.symlink(outside, link)
    before = _tree(outside)
    rc, out, err = _cli(capsys, "report", run_id, "--out", str(root))
    assert rc == EXIT_USAGE, (out, err)
    assert out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("critique report: refusing to write") and "is a symlink" in err
    assert repr(str(link)) in err
    assert _tree(outside) == before and sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()] == []


def test_report_of_a_run_without_results_writes_under_a_plain_root(
    worker: WorkerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no symlink in the way, a run with no finished result still gets report.html and
    lessons.md (and nothing else)."""
    run_id = _pending_run(["w1"])
    rc, out, err = _cli(capsys, "report", run_id, "--out", str(tmp_path))
    assert rc == 0, err
    run_dir = tmp_path / "runs" / run_id
    assert out.splitlines()[:2] == [str(run_dir / "report.html"), str(run_dir / "lessons.md")]
    assert sorted(_tree(tmp_path)) == [f"runs/{run_id}/lessons.md", f"runs/{run_id}/report.html"]


def test_l0_prints_a_file_name_with_escape_sequences_escaped(
    hostile_env: dict[str, str], tmp_path: Path
) -> None:
    """`critique l0` on files named with OSC/BEL and C1 CSI characters prints each name with
    visible escapes (text and --json), never the raw bytes; a missing one is escaped on stderr."""
    c1_name = "b\u009b2J.md"
    for name in (ESC_NAME, c1_name):
        (tmp_path / name).write_text("# Notes\n\nTODO\n", encoding="utf-8")
    proc = _critique(hostile_env, "l0", ESC_NAME, c1_name, cwd=tmp_path)
    out, err = proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")
    assert proc.returncode == 1, (out, err)
    assert "a\\x1b]0;pwned\\x07.md:3:1: error no_placeholder" in out
    assert "b\\x9b2J.md:3:1: error no_placeholder" in out
    assert not any(ch in out + err for ch in "\x1b\x07\x9b")

    proc = _critique(hostile_env, "l0", "--json", ESC_NAME, c1_name, cwd=tmp_path)
    raw = proc.stdout.decode("utf-8")
    assert not any(ch in raw for ch in "\x1b\x07\x9b") and "\\u009b" in raw
    assert {f["path"] for f in json.loads(raw)["failures"]} == {ESC_NAME, c1_name}

    proc = _critique(hostile_env, "l0", "gone\x1b[2J.md", cwd=tmp_path)
    err = proc.stderr.decode("utf-8")
    assert proc.returncode == 2 and "gone\\x1b[2J.md" in err and "\x1b" not in err, err


def test_status_and_watch_escape_a_forged_registry_key(
    worker: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """A submission key written straight into Redis with an ESC sequence in its worker id is
    shown escaped by `critique status` and by `critique watch`'s pending list."""
    run_id = _pending_run(["w\x1b[2Jx"])
    rc, out, _ = _cli(capsys, "status", run_id)
    assert rc == 0 and "w\\x1b[2Jx" in out and "\x1b" not in out, out
    rc, out, _ = _cli(capsys, "status", run_id, "--json")
    assert "\x1b" not in out and json.loads(out)["pending"] == ["1:w\x1b[2Jx"]
    rc, out, _ = _cli(capsys, "watch", run_id, "--timeout", "0.5")
    assert rc == 1 and "pending: 1:w\\x1b[2Jx" in out and "\x1b" not in out, out


def test_status_into_head_ends_quietly(hostile_env: dict[str, str], tmp_path: Path) -> None:
    """`critique status RUN | head -1` through a real shell: head prints the first line, and
    critique exits 141 (as a SIGPIPE-killed tool) with nothing on stderr — not 3 with
    "cannot reach Redis" — though its output is far larger than the pipe's buffer."""
    workers = [f"w{i:04d}-" + "x" * 100 for i in range(600)]  # ~130 KB of status output
    run_id = _pending_run(workers)
    script = Path(sys.executable).with_name("critique")
    argv = f"'{script}'" if script.exists() else f"'{sys.executable}' -m workers.cli"
    line = f'{argv} status "$1" | head -1; echo "exit ${{PIPESTATUS[0]}}"'
    proc = subprocess.run(
        ["bash", "-c", line, "bash", run_id],
        capture_output=True,
        env=hostile_env,
        cwd=tmp_path,
        timeout=120,
    )
    out, err = proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")
    assert err == ""
    assert out.splitlines() == [
        f"run {run_id}: 600 submitted, 0 finished, 0 failed, 600 pending",
        f"exit {EXIT_BROKEN_PIPE}",
    ]
