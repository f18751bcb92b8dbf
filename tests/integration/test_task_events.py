"""The task-events switch as celeryconfig reads it at import, in a fresh interpreter per value
(the worker command's own handling of it is in tests/unit/test_task_events.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline import settings
from tests.support.workers import ROOT

PROBE = (
    "import json, celeryconfig as c; "
    "print(json.dumps([c.worker_send_task_events, c.task_send_sent_event]))"
)


def _events(value: str | None) -> list[bool]:
    env = {k: v for k, v in os.environ.items() if k != settings.TASK_EVENTS.name}
    if value is not None:
        env[settings.TASK_EVENTS.name] = value
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
