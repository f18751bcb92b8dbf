"""The worker's start-up banner, truthful about task events.

``critique worker`` starts its nodes with task events off (``CRITIQUE_TASK_EVENTS=0`` unless the
operator set it; ``celeryconfig``): each event is a PUBLISH, four per stage, about 12 % of an
LLM-bound worker's CPU when nobody watches. A monitor turns them on when it wants them
(Flower's ``enable_events``, every 5 s; the node then logs Celery's "Events of group {task}
enabled by remote."). Celery's banner would say ``task events: OFF (enable -E to monitor tasks
in this worker)``, which reads as "Flower will see nothing"; :class:`Worker` says what happens
instead. ``workers.app`` makes it the app's worker class.
"""

from __future__ import annotations

from typing import Any

from celery.apps.worker import Worker as CeleryWorker

CELERY_EVENTS_OFF = "OFF (enable -E to monitor tasks in this worker)"
"""Celery's own wording of the banner's ``task events`` line with events off."""
EVENTS_OFF = (
    "OFF until a monitor asks for them (Flower turns them on within 5 s; "
    "CRITIQUE_TASK_EVENTS=1: always on)"
)
"""Ours: what an operator who runs Flower will see."""


def events_line(banner: str) -> str:
    """``banner`` with the task-events line saying :data:`EVENTS_OFF` instead of Celery's."""
    return banner.replace(CELERY_EVENTS_OFF, EVENTS_OFF)


class Worker(CeleryWorker):  # type: ignore[misc]
    """Celery's worker program with :func:`events_line` applied to its banner."""

    def startup_info(self, artlines: bool = True) -> Any:
        return events_line(super().startup_info(artlines=artlines))
