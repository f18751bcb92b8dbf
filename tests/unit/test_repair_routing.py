"""A repair by the token-free reviser is routed to critique.cpu (the LLM queue may have no
worker at all: KEDA scales it to zero); a repair that may call a model stays on critique.llm;
a task runs its first repair round itself when that round's queue is the one it came from."""

from __future__ import annotations

import workers.tasks  # registers the stage tasks the signature is built from
from pipeline.loop.stages import LoopState, start
from pipeline.models import Submission
from workers import runtime
from workers.routing import FIRST_ATTEMPT, runs_here, stage_signature

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


def _repairs_here(queue: str | None, first_attempt: int | None, state: LoopState) -> bool:
    """``runs_here`` for a repair, asked by the l0 task as a worker runs it: ``queue`` the
    queue its message came from (None: run eagerly), ``first_attempt`` the attempt it took
    the state off the broker at (None: not recorded)."""
    task = workers.tasks.l0
    # push_request copies the current request's fields: name each one this test depends on
    delivery = {"routing_key": queue} if queue else {}
    task.push_request(**{"delivery_info": delivery, FIRST_ATTEMPT: first_attempt})
    try:
        return runs_here(task, "repair", state, {"enabled": True})
    finally:
        task.pop_request()


def test_a_first_repair_runs_in_the_task_that_came_from_its_queue() -> None:
    """The token-free reviser's repair (critique.cpu) runs in a task that came from
    critique.cpu and has run no repair yet (its state at the attempt it arrived with)."""
    assert _repairs_here("critique.cpu", 0, start(SUB, "p1"))


def test_a_later_repair_round_another_queue_or_an_eager_run_hands_on() -> None:
    """A second repair round in one task, a repair routed to another queue than the task's
    (critique.llm for a model repair, or the task off critique.llm), an eager run and a
    request with no recorded first attempt: each replaces the task instead."""
    first = start(SUB, "p1")
    second = first.model_copy(update={"attempt": 1})
    with_model = start(SUB.model_copy(update={"model": "openai/gpt-4o-mini"}), "p1")
    assert not _repairs_here("critique.cpu", 0, second)
    assert not _repairs_here("critique.llm", 0, first)
    assert not _repairs_here("critique.cpu", 0, with_model)
    assert _repairs_here("critique.llm", 0, with_model)
    assert not _repairs_here(None, 0, first)
    assert not _repairs_here("critique.cpu", None, first)
