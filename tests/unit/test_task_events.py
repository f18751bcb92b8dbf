"""Task events (what Flower lists): ``CRITIQUE_TASK_EVENTS`` switches them in celeryconfig, and
``critique worker`` turns them off in its processes unless the operator set the variable (a
monitor turns them on itself: Flower's ``enable_events``). No Celery worker is started here:
the switch is read from a fresh import of celeryconfig, in a child interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.commands import worker

ROOT = Path(__file__).resolve().parents[2]

PROBE = (
    "import json, celeryconfig as c; "
    "print(json.dumps([c.worker_send_task_events, c.task_send_sent_event]))"
)


def _events(value: str | None) -> list[bool]:
    env = {k: v for k, v in os.environ.items() if k != worker.TASK_EVENTS_ENV}
    if value is not None:
        env[worker.TASK_EVENTS_ENV] = value
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    return list(json.loads(out))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [True, True]),  # plain `celery -A workers.app worker`, Flower, the client
        ("", [True, True]),
        ("1", [True, True]),
        ("yes", [True, True]),
        ("0", [False, False]),
        ("false", [False, False]),
        (" Off ", [False, False]),
    ],
)
def test_celeryconfig_reads_the_task_events_switch(value: str | None, expected: list[bool]) -> None:
    """Unset or empty: events on (Celery's workers as before); 0/false/no/off: worker task
    events and task-sent events both off; anything else: on."""
    assert _events(value) == expected


def test_critique_worker_turns_task_events_off_unless_the_operator_set_them() -> None:
    """The worker processes' environment gets CRITIQUE_TASK_EVENTS=0 when it is unset or blank;
    an operator's 1 (or 0) is kept."""
    env: dict[str, str] = {}
    worker.worker_environment(env)
    assert env == {worker.TASK_EVENTS_ENV: "0"}
    env = {worker.TASK_EVENTS_ENV: "  "}
    worker.worker_environment(env)
    assert env[worker.TASK_EVENTS_ENV] == "0"
    env = {worker.TASK_EVENTS_ENV: "1", "OTHER": "x"}
    worker.worker_environment(env)
    assert env == {worker.TASK_EVENTS_ENV: "1", "OTHER": "x"}


def test_task_events_switch_passes_the_configuration_check() -> None:
    """The switch is a worker setting, not a configuration field: the worker's configuration
    check (which names unknown CRITIQUE_* variables) accepts it."""
    from pipeline.config import ENV_NON_FIELDS

    assert worker.TASK_EVENTS_ENV in ENV_NON_FIELDS
