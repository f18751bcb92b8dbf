"""Task events (what Flower lists): ``CRITIQUE_TASK_EVENTS`` switches them in celeryconfig, and
``critique worker`` turns them off in its processes unless the operator set the variable (a
monitor turns them on itself: Flower's ``enable_events``). No Celery worker is started here:
the switch is read from a fresh import of celeryconfig, in a child interpreter."""

from __future__ import annotations

from pipeline import settings
from workers.commands import worker


def test_critique_worker_turns_task_events_off_unless_the_operator_set_them() -> None:
    """The worker processes' environment gets CRITIQUE_TASK_EVENTS=0 when it is unset or blank;
    an operator's 1 (or 0) is kept."""
    env: dict[str, str] = {}
    worker.worker_environment(env)
    assert env == {settings.TASK_EVENTS.name: "0"}
    env = {settings.TASK_EVENTS.name: "  "}
    worker.worker_environment(env)
    assert env[settings.TASK_EVENTS.name] == "0"
    env = {settings.TASK_EVENTS.name: "1", "OTHER": "x"}
    worker.worker_environment(env)
    assert env == {settings.TASK_EVENTS.name: "1", "OTHER": "x"}


def test_task_events_switch_passes_the_configuration_check() -> None:
    """The switch is a worker setting, not a configuration field: the worker's configuration
    check (which names unknown CRITIQUE_* variables) accepts it."""
    from pipeline.config import ENV_NON_FIELDS

    assert settings.TASK_EVENTS.name in ENV_NON_FIELDS
