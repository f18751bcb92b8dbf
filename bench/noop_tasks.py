"""Bench-only Celery task: a stage that does no work (the bare-chain baseline)."""

from __future__ import annotations

from typing import Any

from workers.app import app


@app.task(name="critique.bench.noop")
def noop(msg: dict[str, Any]) -> dict[str, Any]:
    """Return the message unchanged."""
    return msg


@app.task(name="critique.bench.noop_nr", ignore_result=True, store_errors_even_if_ignored=True)
def noop_nr(msg: dict[str, Any]) -> dict[str, Any]:
    """The same, storing no result (as the pipeline's stage tasks; the last one stores)."""
    return msg
