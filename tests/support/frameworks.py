"""What the agent-framework adapter tests share: five regional analysts (one writes a report
without findings until told), their report model, and the fleet's environment for them (a
heuristic critic, an LLM reviser on the fake server, no telemetry)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from tests.fakes.openai_server import user_text
from tests.support.workers import llm_env

ANALYST = "You are a sales analyst"
"""The analysts' instructions (their system message): the fake answers requests that carry it."""
REGIONS = ("north", "south", "east", "west", "central")
DEFECTIVE = "south"
"""The analyst whose first report leaves its findings blank."""
REPAIR_MODEL = "openai/repair-model"
"""The fleet's reviser in repair mode (the fake answers it)."""


class Report(BaseModel):
    summary: str
    findings: str
    confidence: float


def prompt(region: str) -> str:
    """What the manager asks the ``region`` analyst."""
    return f"Summarise the Q3 sales report for the {region} region."


def report(region: str) -> Report:
    """The report the fake's analyst writes for ``region`` (once fixed)."""
    return Report(
        summary=f"Q3 sales in the {region}.", findings=f"{region.title()} grew 4%.", confidence=0.9
    )


def about(body: dict[str, Any], region: str) -> bool:
    """The model request is the ``region`` analyst's."""
    return f"the {region} region" in user_text(body)


@contextlib.contextmanager
def fleet_env(redis_url: str, api_base: str, **extra: str) -> Iterator[dict[str, str]]:
    """This process and the worker on the worker database; the worker's critic is the heuristic
    (token-free) and its LLM reviser (repair mode) calls the fake; no telemetry leaves."""
    with llm_env(
        redis_url,
        api_base,
        CRITIQUE_CRITIC="heuristic",
        CRITIQUE_ALLOWED_MODELS=REPAIR_MODEL,
        OTEL_SDK_DISABLED="true",
        OTEL_TRACES_EXPORTER="none",
        **extra,
    ) as env:
        yield env
