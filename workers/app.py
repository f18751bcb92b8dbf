"""The Celery app: ``celery -A workers.app worker -Q critique.cpu,critique.llm``.

Configuration comes from :mod:`celeryconfig` (JSON only, acks late, reject on worker loss,
task events on, routes per queue). The tasks live in :mod:`workers.tasks`.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

app = Celery("critique", include=["workers.tasks"])
app.config_from_object("celeryconfig")
