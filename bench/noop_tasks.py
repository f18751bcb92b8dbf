"""Bench-only Celery task: a stage that does no work (the bare-chain baseline)."""

from __future__ import annotations

from typing import Any

from workers.app import app


@app.task(name="critique.bench.noop")
def noop(msg: dict[str, Any]) -> dict[str, Any]:
    """Return the message unchanged."""
    return msg
