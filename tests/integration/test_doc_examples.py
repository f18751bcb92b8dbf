"""The examples in README.md and docs/ print what the docs show: each fenced Python example
runs against a real Redis and a real Celery worker and its stdout is compared line by line with
the ``text`` block after it; each ``$ critique …`` transcript that needs no service (``l0``,
``loop``) is run in a fresh folder and compared with the lines under it."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.workers import ROOT, WorkerProcess, WorkerSpec, client_on, worker_db_url

pytestmark = pytest.mark.integration

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(doc: str) -> list[tuple[str, str]]:
    """Every fenced block of ``doc``: (language, body)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def example_pairs(doc: str) -> list[tuple[str, str]]:
    """Each ``python`` block that is followed by a ``text`` block: (code, expected output)."""
    found = blocks(doc)
    return [
        (code, shown)
        for (lang, code), (next_lang, shown) in itertools.pairwise(found)
        if lang == "python" and next_lang == "text"
    ]


def run_python(code: str, name: str) -> str:
    """``code`` executed as a script would be, its stdout returned."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    return out.getvalue()


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    with client_on(worker_db_url(redis_url)) as e:
        yield e


WORKER = WorkerSpec("docs")


PYTHON_EXAMPLES = [("README.md", 0), ("docs/client.md", 0)]


@pytest.mark.parametrize(("doc", "index"), PYTHON_EXAMPLES)
def test_a_python_example_prints_what_its_doc_shows(
    worker: WorkerProcess, doc: str, index: int
) -> None:
    import redis

    redis.Redis.from_url(worker.redis_url).flushdb()  # the examples reuse run ids: start clean
    code, shown = example_pairs(doc)[index]
    got = run_python(code, doc)
    assert got.rstrip("\n").split("\n") == shown.rstrip("\n").split("\n")


def test_the_readme_client_example_prints_why_analyst_02_escalated() -> None:
    """The README's shown output names analyst_02's deciding defect (checked against the real
    run by the test above)."""
    _, shown = example_pairs("README.md")[0]
    assert "analyst_02 escalated (needs_model, 0 repairs) 0.80 → 0.80: missing_data at " in shown


# --- `$ critique …` transcripts of commands that need no Redis -------------------------------

_TIMING = re.compile(r"\b\d+(\.\d+)? ms\b|\"elapsed_ms\": [\d.]+")


def transcripts(doc: str) -> list[list[tuple[str, list[str]]]]:
    """Each untagged block of ``$ ``-prefixed commands: [(command, expected lines)]."""
    out = []
    for lang, body in blocks(doc):
        if lang or not body.startswith("$ "):
            continue
        steps: list[tuple[str, list[str]]] = []
        for line in body.rstrip("\n").split("\n"):
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                steps[-1][1].append(line)
        out.append(steps)
    return out


def _same(expected: str, got: str) -> bool:
    """Equal once timings are masked; ``...`` in the doc stands for the rest of the line."""
    e, g = _TIMING.sub("<t>", expected), _TIMING.sub("<t>", got)
    if "..." in e:
        return g.startswith(e.split("...")[0])
    return e == g


@pytest.mark.parametrize("index", range(len(transcripts("docs/pipeline.md"))))
def test_a_cli_transcript_prints_what_docs_pipeline_shows(index: int, tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CRITIQUE_") and k not in ("REDIS_URL", "CELERY_BROKER_URL")
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    (tmp_path / "tests" / "fixtures").mkdir(parents=True)
    for f in (ROOT / "tests" / "fixtures").glob("*.json"):
        (tmp_path / "tests" / "fixtures" / f.name).write_bytes(f.read_bytes())
    last = 0
    for command, expected in transcripts("docs/pipeline.md")[index]:
        if command == "echo $?":
            assert expected == [str(last)]
            continue
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        last = done.returncode
        got = done.stdout.rstrip("\n").split("\n") if done.stdout else []
        assert len(got) == len(expected), (command, done.stdout, done.stderr)
        for e, g in zip(expected, got, strict=True):
            assert _same(e, g), (command, e, g)
