"""Every "cannot reach" message has one shape (issue 34), whichever code path finds the service
down: ``critique <command>: cannot reach <what> at <url>: <reason> (hint: <what to do>)`` on one
line, exit 3, the URL's password as ``***``. Real processes against a closed port: ``status``
(the store's own error), ``worker`` (the command's Redis check), ``exporter`` (its start-up ping)
and ``submit`` with only the broker down (the client's publish)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support.workers import ROOT, worker_db_url, worker_env
from workers.embedded import free_port

pytestmark = pytest.mark.integration

SHAPE = re.compile(
    r"critique (?P<command>[a-z]+): cannot reach (?P<what>Redis|the broker) at (?P<url>\S+): "
    r"(?P<reason>.+) \(hint: (?P<hint>.+)\)"
)


def _closed_url(password: str = "") -> str:
    auth = f"app:{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{free_port()}/0"


def _run(env: dict[str, str], *argv: str, stdin: str = "") -> tuple[int, list[str]]:
    """Exit code and the stderr lines that are not warnings."""
    proc = subprocess.run(
        [sys.executable, "-m", "workers.cli", *argv],
        input=stdin, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if ": warning: " not in line]
    return proc.returncode, lines


@pytest.mark.parametrize(
    "argv",
    [
        ("status", "some-run"),
        ("worker", "--processes", "1"),
        ("exporter", "--port", str(free_port())),
    ],
    ids=["status", "worker", "exporter"],
)
def test_an_unreachable_redis_is_one_line_of_the_one_shape(argv: tuple[str, ...]) -> None:
    """Redis down (a password in its URL): exit 3 and exactly one line, `critique <command>:
    cannot reach Redis at <url, password hidden>: <reason> (hint: …)`, the hint naming
    REDIS_URL (``status`` rides the outage out first, for ``CRITIQUE_OUTAGE_S``, 1 s here,
    saying so in a warning line)."""
    url = _closed_url("s3cret")
    env = worker_env(url, CRITIQUE_SECRET="", CRITIQUE_OUTAGE_S="1")
    code, lines = _run(env, *argv)
    assert code == 3, lines
    assert len(lines) == 1, lines
    m = SHAPE.fullmatch(lines[0])
    assert m is not None, lines[0]
    assert m["command"] == argv[0] and m["what"] == "Redis"
    assert m["url"] in (url.replace("s3cret", "***"), url.replace("app:s3cret@", ""))
    assert "refused" in m["reason"].lower() and "REDIS_URL" in m["hint"]
    assert "s3cret" not in lines[0]


def test_an_unreachable_broker_is_the_same_shape(redis_url: str) -> None:
    """`critique submit` with the store up and the broker's port closed: the same one line,
    naming the broker and CELERY_BROKER_URL."""
    broker = _closed_url()
    env = worker_env(worker_db_url(redis_url), CELERY_BROKER_URL=broker, CRITIQUE_SECRET="")
    sub = {"run_id": "unreach1", "worker_id": "w1", "task": "t", "output": "x"}
    code, lines = _run(env, "submit", "-", stdin=json.dumps(sub))
    assert code == 3, lines
    assert len(lines) == 1, lines
    m = SHAPE.fullmatch(lines[0])
    assert m is not None, lines[0]
    assert (m["command"], m["what"], m["url"]) == ("submit", "the broker", broker)
    assert "CELERY_BROKER_URL" in m["hint"]
