"""A repair by the token-free reviser is routed to critique.cpu (the LLM queue may have no
worker at all: KEDA scales it to zero); a repair that may call a model stays on critique.llm."""

from __future__ import annotations

import workers.tasks  # noqa: F401  (registers the stage tasks the signature is built from)
from pipeline.models import Submission
from workers import runtime
from workers.routing import stage_signature

SUB = Submission(run_id="r1", worker_id="w1", task="Summarise.", output={"summary": "x"})


def _repair_queue(overrides: dict[str, object], submission: Submission = SUB) -> object:
    config = runtime.config_for(overrides)
    sig = stage_signature("repair", {"config": overrides}, config, submission)
    assert sig.task == "critique.repair"
    return sig.options.get("queue")


def test_token_free_repairs_stay_on_the_cpu_queue() -> None:
    """Heuristic and rubric configurations, and `auto` without any model: critique.cpu."""
    assert _repair_queue({"enabled": True}) == "critique.cpu"
    assert _repair_queue({"enabled": True, "critic": "heuristic"}) == "critique.cpu"
    assert _repair_queue({"enabled": True, "critic": "rubric"}) == "critique.cpu"
    assert _repair_queue({"enabled": True, "repairer": "deterministic"}) == "critique.cpu"


def test_model_repairs_keep_the_llm_route() -> None:
    """A submission with a model under `auto`, or repairer `llm`: no override, so
    celeryconfig's route (critique.llm) applies."""
    with_model = SUB.model_copy(update={"model": "openai/gpt-4o-mini"})
    assert _repair_queue({"enabled": True}, with_model) is None
    assert _repair_queue({"enabled": True, "repairer": "llm"}) is None
