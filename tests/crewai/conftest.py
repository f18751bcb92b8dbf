"""CrewAI's telemetry, tracing and version check off before a test module imports crewai; only
where crewai is installed (CrewAI's own environment), so the main suite's environment variables
stay as they are."""

from __future__ import annotations

import importlib.util
import os

from tests.crewai import OFFLINE

if importlib.util.find_spec("crewai") is not None:
    for name, value in OFFLINE.items():
        os.environ.setdefault(name, value)
