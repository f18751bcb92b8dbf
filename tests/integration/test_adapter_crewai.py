"""CrewAI's guardrail adapter, tested with the real ``crewai`` package in an environment of its
own: CrewAI 1.15.30 requires pydantic<2.13, openai<3, mcp<2 and httpx~=0.28.1, which our pins
(constraints.txt) exceed, so it cannot be installed here.

This test builds (or reuses) a virtualenv from constraints-crewai.txt, cached under
``$XDG_CACHE_HOME/critique-pipeline/crewai-py<X.Y>-<sha of the file>`` (``~/.cache`` without
``XDG_CACHE_HOME``; ``$CRITIQUE_CREWAI_VENV`` names a ready one instead, e.g. one a CI step
built), and runs tests/crewai there as a subprocess, with this checkout on ``PYTHONPATH`` and
the fleet's ``critique worker`` under this environment's Python. It passes when every one of
them ran and passed. A cold build downloads from PyPI (about 1.5 to 2.5 minutes); later runs
reuse the cache until constraints-crewai.txt changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.workers import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

CONSTRAINTS = ROOT / "constraints-crewai.txt"
SUITE = "tests/crewai"
EXPECTED = 8
"""How many tests tests/crewai holds: each must run and pass (none skipped)."""
READY = ".ready"
"""Written last into a built environment: one without it is rebuilt."""


def cached_env() -> Path:
    """Where the environment for the current constraints-crewai.txt and Python lives."""
    given = os.environ.get("CRITIQUE_CREWAI_VENV")
    if given:
        return Path(given)
    digest = hashlib.sha256(CONSTRAINTS.read_bytes()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return base / "critique-pipeline" / f"crewai-{tag}-{digest}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder at a time (two sessions sharing a cache wait for each other)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(args: list[str], what: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        pytest.fail(f"{what} failed ({done.returncode}): {' '.join(args)}\n{tail}")


def build(venv: Path) -> float:
    """Make ``venv`` from constraints-crewai.txt unless it is ready; the seconds it took."""
    if (venv / READY).exists():
        return 0.0
    with _locked(venv.with_name(venv.name + ".lock")):
        if (venv / READY).exists():
            return 0.0
        started = time.monotonic()
        shutil.rmtree(venv, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(venv)], "making CrewAI's virtualenv")
        python = str(venv / "bin" / "python")
        pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
        _run([*pip, "install", "-r", str(CONSTRAINTS)], "installing constraints-crewai.txt")
        _run([*pip, "check"], "checking CrewAI's environment")
        took = time.monotonic() - started
        (venv / READY).write_text(f"{took:.0f} s to build from {CONSTRAINTS.name}\n")
        return took


@pytest.fixture(scope="module")
def crewai_python() -> Path:
    """The Python of CrewAI's environment, built when the cache lacks it."""
    venv = cached_env()
    took = build(venv)
    if took:
        print(f"built CrewAI's environment in {took:.0f} s: {venv}")
    return venv / "bin" / "python"


def test_the_crewai_guardrail_tests_pass_in_crewais_own_environment(
    crewai_python: Path, tmp_path: Path
) -> None:
    """tests/crewai under CrewAI's environment: every test ran (none skipped) and passed."""
    report = tmp_path / "crewai.xml"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CREWAI_TESTS_FLEET_PYTHON": sys.executable,
        "CREWAI_STORAGE_DIR": str(tmp_path / "crewai-storage"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    args = [
        str(crewai_python), "-m", "pytest", SUITE, "-p", "no:cacheprovider", "-q",
        "-W", "ignore::DeprecationWarning", f"--junitxml={report}",
    ]  # fmt: skip
    done = subprocess.run(
        args,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=1200,
    )
    out = (done.stdout + done.stderr)[-12000:]
    assert done.returncode == 0, out
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    assert counts == {"tests": EXPECTED, "failures": 0, "errors": 0, "skipped": 0}, out
