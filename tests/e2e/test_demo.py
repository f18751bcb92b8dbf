"""``critique demo`` as a process: embedded Redis, in-process worker, clean exit every time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from workers.commands._samples import demo_samples
from workers.embedded import ping

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def bare_env(**extra: str) -> dict[str, str]:
    """The environment of a bare machine: no REDIS_URL, no Celery broker settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
    }
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def demo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "workers.cli", "demo", *args]


def redis_processes_on(port: int) -> list[int]:
    """Pids of redis-server processes started with ``--port PORT``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"redis-server") and str(port).encode() in argv:
            pids.append(int(entry.name))
    return pids


def test_demo_json_runs_the_sample_run(tmp_path: Path) -> None:
    """`critique demo --json` on a bare machine: exit 0, every sample as designed, artifacts,
    pitfalls and budget reported, and the embedded Redis gone afterwards."""
    proc = subprocess.run(
        demo_cmd("--json", "--out", str(tmp_path / "ws")),
        env=bare_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) >= {"run_id", "results", "pitfalls", "artifacts"}
    samples = {(s.iteration, s.worker_id): s for s in demo_samples()}
    got = {(r["iteration"], r["worker_id"]): r for r in doc["results"]}
    assert got.keys() == samples.keys()
    for key, sample in samples.items():
        r = got[key]
        assert (r["status"], r["stop_reason"]) == (sample.expected_status, sample.expected_stop)
        assert r["repairs"] >= (1 if sample.expected_status in ("repaired", "failed") else 0)
    assert doc["pitfalls"].startswith("## Known Pitfalls")
    assert "- [seen " in doc["pitfalls"]
    # No model: every repair is token-free, so nothing is reserved or charged.
    assert doc["budget"]["repair_spent"] == 0 < doc["budget"]["repair_cap"]
    run_dir = tmp_path / "ws" / "runs" / doc["run_id"]
    for n in (1, 2, 3):
        assert (run_dir / "iterations" / f"{n:03d}" / "CRITIQUE.md").is_file()
    assert (run_dir / "report.html").is_file()
    assert all(Path(p).is_file() for p in doc["artifacts"])
    # One token story: report.html shows what providers reported, 0 without a model, as the
    # budget line does (it once summed 13360 "repair tokens" while the budget said 0 spent).
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "<dt>repair tokens (reported)</dt><dd>0</dd>" in page
    assert "<dt>all tokens (reported)</dt><dd>0</dd>" in page
    # CRITIQUE.md: no escalated output with a score band, no line with two scores.
    for n in (1, 2, 3):
        md = (run_dir / "iterations" / f"{n:03d}" / "CRITIQUE.md").read_text(encoding="utf-8")
        for section in md.split("\n## Worker ")[1:]:
            if " — escalated " in section or " — failed " in section:
                assert "| band | accept" not in section and "| next | " in section, section
        assert not re.search(r"score \d\.\d\d[^\n]*score \d\.\d\d", md)
    assert doc["elapsed_s"] < 60
    assert "embedded Redis on" in proc.stderr  # progress goes to stderr with --json
    port = int(re.search(r":(\d+)/", doc["redis"]["url"]).group(1))  # type: ignore[union-attr]
    assert doc["redis"]["embedded"] is True
    assert not ping("127.0.0.1", port)
    assert redis_processes_on(port) == []


def test_ctrl_c_stops_redis_and_worker(tmp_path: Path) -> None:
    """SIGINT in the middle of the run exits 130 and leaves no embedded Redis behind."""
    proc = subprocess.Popen(
        demo_cmd("--out", str(tmp_path / "ws")),
        env=bare_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    port = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.search(r"embedded Redis on redis://127\.0\.0\.1:(\d+)/", line)
            if m:
                port = int(m.group(1))
            if "[ 1/" in line:
                proc.send_signal(signal.SIGINT)
                break
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 130
    assert port is not None
    assert not ping("127.0.0.1", port)
    assert redis_processes_on(port) == []


def test_no_redis_server_exits_3(tmp_path: Path) -> None:
    """When the Redis server cannot start, the demo exits 3 and says why and what to do."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "redis-server").write_text("#!/bin/sh\necho 'cannot bind' >&2\nexit 1\n")
    (fake / "redis-server").chmod(0o755)
    proc = subprocess.run(
        demo_cmd("--json"),
        env=bare_env(PATH=f"{fake}:{os.environ.get('PATH', '')}"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3
    assert "cannot start an embedded Redis" in proc.stderr
    assert "cannot bind" in proc.stderr
    assert proc.stdout == ""


def test_with_redis_url_and_no_worker_exits_3(tmp_path: Path, redis_url: str) -> None:
    """With REDIS_URL set and no worker consuming it, the demo exits 3 naming `critique worker`."""
    proc = subprocess.run(
        demo_cmd("--json"),
        env=bare_env(REDIS_URL=redis_url),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3
    assert "no Celery worker answered" in proc.stderr
    assert "critique worker" in proc.stderr


# --- the demo's output as README.md and docs/demo.md show it -------------------------------------

_VARIABLE = [
    (re.compile(r"redis://127\.0\.0\.1:\d+/"), "redis://127.0.0.1:PORT/"),
    (re.compile(r"demo-\d{8}-\d{6}-[0-9a-f]{6}"), "demo-RUN"),
    (re.compile(r"critique-demo-\d+@\S+"), "critique-demo-PID@HOST"),
    (re.compile(r"done in [\d.]+ s"), "done in T s"),
]


def _masked(line: str) -> str:
    for pattern, repl in _VARIABLE:
        line = pattern.sub(repl, line)
    return line.rstrip()


def _demo_block(doc: str) -> list[str]:
    """The ``text`` block of ``doc`` that shows the demo's output (its first ``[ 1/26]``)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    for m in re.finditer(r"^```text\n(.*?)^```", text, re.S | re.M):
        if "[ 1/26]" in m.group(1):
            shown = [ln for ln in m.group(1).split("\n") if not ln.startswith("real\t")]
            while shown and not shown[-1].strip():
                shown.pop()  # the blank line before `time`'s own output
            return shown
    raise AssertionError(f"{doc} shows no demo output")


_PROGRESS = re.compile(r"^\[\s*\d+/\d+\] ")


def _shows(expected: list[str], got: list[str]) -> str | None:
    """None when ``got`` holds ``expected``'s lines in order, each run of lines between two
    ``…`` lines (the doc's "shortened here") contiguous; else the first line not found.
    Progress lines (``[ 3/26] …``) come in completion order: each must be there, anywhere,
    whatever its counter."""
    lines = [_masked(g) for g in got]
    progress = {_PROGRESS.sub("", line) for line in lines if _PROGRESS.match(line)}
    segments: list[list[str]] = [[]]
    for line in expected:
        if _PROGRESS.match(line):
            if _PROGRESS.sub("", _masked(line)) not in progress:
                return line
            segments.append([])
        elif line.strip() == "…":
            segments.append([])
        else:
            segments[-1].append(_masked(line))
    lines = [line for line in lines if not _PROGRESS.match(line)]
    at = 0
    for seg in filter(None, segments):
        for start in range(at, len(lines) - len(seg) + 1):
            if lines[start : start + len(seg)] == seg:
                at = start + len(seg)
                break
        else:
            return next((s for s in seg if s not in lines), seg[0])
    return None


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """`critique demo` on a bare machine, stdout and stderr as a terminal shows them."""
    where = tmp_path_factory.mktemp("demo-doc")
    proc = subprocess.run(
        demo_cmd(),
        env=bare_env(PYTHONUNBUFFERED="1"),
        cwd=where,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout
    return proc.stdout.rstrip("\n").split("\n")


@pytest.mark.parametrize("doc", ["README.md", "docs/demo.md"])
def test_the_demo_prints_what_the_docs_show(doc: str, demo_output: list[str]) -> None:
    missing = _shows(_demo_block(doc), demo_output)
    assert missing is None, f"{doc} shows {missing!r}; the demo printed:\n" + "\n".join(demo_output)
