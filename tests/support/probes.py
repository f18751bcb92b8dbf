"""Configuration probes: a snippet run in a child interpreter with a chosen environment."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.workers import ROOT


def config_probe(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose environment has no Celery, critique or Redis
    settings but ``env``: how the configuration reads a deploy's variables at import time."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "CRITIQUE_"))}
    base.pop("REDIS_URL", None)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, "PYTHONPATH": str(ROOT), **env},
        check=False,
    )
