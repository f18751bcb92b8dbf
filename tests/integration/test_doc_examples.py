"""The examples in README.md and docs/ print what the docs show: each fenced Python example
(README.md, docs/client.md, docs/llm.md) runs against a real Redis and a real Celery worker and
its stdout is compared line by line with the ``text`` block after it; each ``$ command``
transcript of docs/pipeline.md, operations.md, configuration.md, security.md and demo.md is run
and compared with the lines under it (operations.md's against a real worker, in page order).
Blocks marked illustrative in the doc, each saying why, are the only ones not run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.docs import FENCE, example_pairs, run_python
from tests.support.workers import ROOT, WorkerProcess, WorkerSpec, client_on, worker_db_url

pytestmark = pytest.mark.integration

SECRET = "docs-examples-secret-0123456789"
"""The ``CRITIQUE_SECRET`` the docs' worker and commands share, as every deploy sets one."""


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    """The docs' worker and commands on the test Redis, sharing one secret, and without any
    provider key (the docs show a keyless worker)."""
    with client_on(worker_db_url(redis_url), CRITIQUE_SECRET=SECRET) as e:
        yield {k: v for k, v in e.items() if not k.endswith("_API_KEY")}


WORKER = WorkerSpec("docs", concurrency=1)
"""One worker thread, so results arrive in the order they were submitted, as the docs show."""


PYTHON_EXAMPLES = [
    ("README.md", 0),
    ("docs/client.md", 0),
    ("docs/llm.md", 0),
    ("docs/llm.md", 1),
    ("docs/llm.md", 2),
]


@pytest.mark.parametrize(("doc", "index"), PYTHON_EXAMPLES)
def test_a_python_example_prints_what_its_doc_shows(
    worker: WorkerProcess, doc: str, index: int
) -> None:
    import redis

    redis.Redis.from_url(worker.redis_url).flushdb()  # the examples reuse run ids: start clean
    code, shown = example_pairs(doc)[index]
    saved = dict(os.environ)
    try:
        got = run_python(code, doc)
    finally:  # an example may set variables, as a worker's environment would hold them
        os.environ.clear()
        os.environ.update(saved)
    assert got.rstrip("\n").split("\n") == shown.rstrip("\n").split("\n")


def test_every_python_example_with_its_output_is_run() -> None:
    """Each ``python`` block a doc follows with its output is in :data:`PYTHON_EXAMPLES`."""
    docs = sorted({doc for doc, _ in PYTHON_EXAMPLES})
    found = [(doc, i) for doc in docs for i in range(len(example_pairs(doc)))]
    assert found == sorted(PYTHON_EXAMPLES)


def test_the_readme_client_example_prints_why_analyst_02_escalated() -> None:
    """The README's shown output names analyst_02's deciding defect (checked against the real
    run by the test above)."""
    _, shown = example_pairs("README.md")[0]
    assert "analyst_02 escalated (needs_model, 0 repairs) 0.80 → 0.80: missing_data at " in shown


# --- `$ command` transcripts -----------------------------------------------------------------
#
# A transcript is a fenced block (untagged, ``text`` or ``console``) whose first line starts with
# ``$ ``: each ``$ `` line is a command (a line ending in ``\`` continues it), the lines under it
# what it prints (stdout and stderr together, in the order the doc shows). The blocks of one
# page run in document order in one fresh folder, so a later block sees what an earlier one made
# (files, submissions). In the expected lines ``...`` stands for the rest of a line and a line
# holding only ``…`` for any number of lines; times, task ids, Redis URLs and the checkout's path
# are masked on both sides. ``$ cat FILE`` shows a file the steps use: the test writes it from
# the lines shown when the folder lacks it. A block right under a line starting with
# ``*Illustrative`` is not run (that line says why).

ILLUSTRATIVE = "*Illustrative"

_MASKS = [
    (re.compile(r"\b\d+(\.\d+)? ?ms\b"), "<t>"),
    (re.compile(r"\b\d+(\.\d+)? s\b"), "<t>"),
    (re.compile(r"\"elapsed_(ms|s)\": ?[\d.]+"), '"elapsed": <t>'),
    (re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}"), "<id>"),
    (re.compile(r"\"pass_id\": \"[0-9a-f]{16}\""), '"pass_id": <id>'),
    (re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\b"), "<date>"),
    (re.compile(r"redis://[\w.:@-]+/\d+"), "<redis>"),
]


class Transcript:
    """One transcript block of a doc: where it starts and its (command, expected lines) steps."""

    def __init__(self, doc: str, line: int, body: str, illustrative: bool) -> None:
        self.doc, self.line, self.illustrative = doc, line, illustrative
        self.steps: list[tuple[str, list[str]]] = []
        lines = body.rstrip("\n").split("\n")
        i = 0
        while i < len(lines):
            line_ = lines[i]
            if line_.startswith("$ "):
                command = line_[2:]
                while command.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    command = command[:-1] + "\n" + lines[i]
                self.steps.append((command, []))
            else:
                self.steps[-1][1].append(line_)
            i += 1


def doc_transcripts(doc: str) -> list[Transcript]:
    """Every transcript block of ``doc``, in document order."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        lang, body = m.group(1), m.group(2)
        if lang not in ("", "text", "console") or not body.startswith("$ "):
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n\n", 1)[-1]  # the paragraph above
        line = text[: m.start()].count("\n") + 1
        out.append(Transcript(doc, line, body, before.startswith(ILLUSTRATIVE)))
    return out


def transcripts(doc: str) -> list[list[tuple[str, list[str]]]]:
    """The steps of each transcript of ``doc`` that the tests run."""
    return [t.steps for t in doc_transcripts(doc) if not t.illustrative]


def _mask(line: str) -> str:
    line = line.replace(str(Path(sys.executable).parent), "/path/to/critique-pipeline/.venv/bin")
    for rx, to in _MASKS:
        line = rx.sub(to, line)
    return line.rstrip()


def _same(expected: str, got: str) -> bool:
    """Equal once times and ids are masked; ``...`` or ``…`` in the doc stands for any text."""
    e, g = _mask(expected), _mask(got)
    parts = re.split(r"\.\.\.|…", e)
    if len(parts) == 1:
        return e == g
    return re.fullmatch(".*".join(re.escape(p.strip(" ")) for p in parts), g.strip()) is not None


def _matches(expected: list[str], got: list[str]) -> bool:
    """``got`` line by line as ``expected`` shows it, a ``…`` line standing for any lines."""
    if not expected:
        return not got
    if expected[0] == "…":
        return any(_matches(expected[1:], got[i:]) for i in range(len(got) + 1))
    return bool(got) and _same(expected[0], got[0]) and _matches(expected[1:], got[1:])


def offline_env() -> dict[str, str]:
    """This process's environment without any critique, Redis, broker or provider setting."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CRITIQUE_", "CELERY_"))
        and k != "REDIS_URL"
        and not k.endswith("_API_KEY")
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["COLUMNS"] = "200"
    return env


def run_transcripts(doc: str, folder: Path, env: dict[str, str], redis: str | None = None) -> None:
    """Run every transcript of ``doc`` that is not illustrative, in order, in ``folder``.

    With ``redis``, a ``redis://127.0.0.1:6379/N`` in a command means database N of that server
    (never the machine's own Redis)."""
    (folder / "tests" / "fixtures").mkdir(parents=True, exist_ok=True)
    for f in (ROOT / "tests" / "fixtures").glob("*.json"):
        (folder / "tests" / "fixtures" / f.name).write_bytes(f.read_bytes())
    last = 0
    for block in doc_transcripts(doc):
        if block.illustrative:
            continue
        for command, expected in block.steps:
            where = f"{doc}:{block.line}: $ {command}"
            if command == "echo $?":
                assert expected == [str(last)], where
                continue
            cat = re.fullmatch(r"cat (\S+)(\s+#.*)?", command)
            if cat and not (folder / cat.group(1)).exists():
                (folder / cat.group(1)).write_text("\n".join(expected) + "\n", encoding="utf-8")
            if redis:
                command = command.replace("redis://127.0.0.1:6379/", redis.rsplit("/", 1)[0] + "/")
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=300,
            )
            last = done.returncode
            out = done.stdout.replace(str(folder), "/srv/critique")  # the page's folder
            got = out.rstrip("\n").split("\n") if out else []
            assert _matches(expected, got), (where, "\n".join(got))


OFFLINE_DOCS = ["docs/pipeline.md", "docs/configuration.md", "docs/security.md", "docs/demo.md"]


@pytest.mark.parametrize("doc", OFFLINE_DOCS)
def test_the_transcripts_of_a_page_print_what_it_shows(
    doc: str, redis_url: str, tmp_path: Path
) -> None:
    """Each transcript of ``doc`` needs no worker: run with no critique setting in the
    environment, a Redis URL in a command meaning the test's own Redis."""
    run_transcripts(doc, tmp_path, offline_env(), redis=redis_url)


def test_the_transcripts_of_docs_operations_print_what_it_shows(
    worker: WorkerProcess, tmp_path: Path
) -> None:
    """docs/operations.md's sessions, in order: the worker's own checks, ``submit`` (``--wait``,
    ``--json``, refusals), ``watch``, ``status``, ``report`` and ``archive`` of run q3-sales
    against a real worker; the archive folder reads as /srv/critique/archive."""
    import redis

    url = worker.redis_url
    redis.Redis.from_url(url).flushdb()  # a run of its own: q3-sales starts empty
    env = offline_env() | {
        "REDIS_URL": url,
        "CRITIQUE_SECRET": SECRET,
        "CRITIQUE_ARCHIVE_DIR": str(tmp_path / "archive"),
    }
    run_transcripts("docs/operations.md", tmp_path, env, redis=url)


def test_every_transcript_is_run_or_marked_illustrative() -> None:
    """Each page with a `$ command` transcript that is not marked illustrative is run by a test
    above, and the illustrative ones stay few (each says why it cannot run here)."""
    run = {"docs/operations.md", *OFFLINE_DOCS}
    pages = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")))]
    runnable = {d for d in pages if transcripts(d)}
    assert runnable <= run, runnable - run
    skipped = [f"{t.doc}:{t.line}" for d in pages for t in doc_transcripts(d) if t.illustrative]
    assert len(skipped) <= 6, skipped
