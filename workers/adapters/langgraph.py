"""LangGraph on the fleet: a critique node for the fan-in of a ``Send`` fan-out (docs/langgraph.md).

A manager graph fans a task out with ``Send(worker_node, arg)``; each worker task appends one
item to the state's ``outputs``. :class:`CritiqueNode` is the node they all lead to: it submits
the batch at once (one run, so one repair budget and one Known Pitfalls for all of it), puts the
outputs that pass into ``passed`` and re-sends each output that needs its worker again to that
worker node, with the defects in words (``Send(worker_node, {**item, "feedback": ...})``).

Two modes:

- ``verdict`` (the default; the submissions say ``repairer: worker``): a due repair comes back
  ``worker_repair``; the node re-sends the item to its worker with ``feedback``
  (:func:`workers.adapters.verdicts.feedback`), ``defects`` and ``attempt``, and when the re-run's
  item comes back to the node it goes to the fleet as that verdict's repair
  (:meth:`~workers.client.CritiqueClient.submit_repair`, charged the re-run's ``tokens``). The
  fleet keeps the attempt cap, keep-best, the fixpoint stop and the run's budget.
- ``repair``: the fleet repairs with its own reviser; the repaired output goes into ``passed``.

Whatever the mode, an output whose run's repair budget is spent (``repair_budget_exhausted``)
goes to the review node, which stops the graph with ``interrupt()`` carrying the escalations;
``Command(resume={"<worker_id>": "accept" | "drop"})`` (or one word for all) resumes it with a
checkpointer. Every other output that does not pass lands in ``rejected`` with the reason.

Fail closed: a fleet that cannot be reached, a verdict that does not come within ``timeout``,
or a refused batch raises :class:`CritiqueUnavailable` in the graph (the reason in words; a
checkpointer keeps the state before the node, so the run resumes when the fleet is back), never
a pass. ``fail_open=True`` passes such outputs on instead, marked ``status: "unchecked"``.

The state keys (:class:`CritiqueState`):

``outputs``
    What worker nodes append (``operator.add``): one item per output, ``{"worker_id", "task",
    "output", "tokens"}`` and optionally ``required_fields``, ``claimed_format`` and ``node``
    (the worker node to re-send it to). ``tokens`` is what the worker's model call(s) for this
    output spent as the provider reported them (prompt + completion): a re-run's is charged to
    the run's repair budget. Any other key travels back in a re-send. The node drains it.
``passed`` / ``rejected``
    Records (``operator.add``): the item's own keys, then ``output`` (the output the fleet kept:
    the repaired one in repair mode), ``status``, ``stop_reason``, ``score``, ``defects``,
    ``why`` and ``reruns``.
``critique``
    The node's own bookkeeping (run id, repairs in flight, escalations awaiting review): JSON,
    so any checkpointer stores it.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END
from langgraph.types import Command, Overwrite, Send, interrupt
from pydantic import ValidationError

from pipeline.errors import CritiqueError, SubmissionError
from pipeline.models import CritiqueResult, Submission
from workers.aclient import AsyncCritiqueClient
from workers.adapters import verdicts
from workers.adapters.verdicts import Mode
from workers.client import CritiqueClient, CritiqueTimeout, Handle

log = logging.getLogger(__name__)

DECISIONS = ("accept", "drop")
"""What a reviewer may answer for an escalated output: pass it on as it is, or drop it."""
RESEND_KEYS = frozenset({"output", "tokens", "feedback", "defects", "attempt"})
"""Keys of an item the node sets itself in a re-send (and leaves out of records)."""


class CritiqueState(TypedDict, total=False):
    """The state keys the critique node reads and writes (see the module docstring); a graph's
    own state schema extends it (``class State(CritiqueState): ...``)."""

    outputs: Annotated[list[dict[str, Any]], operator.add]
    passed: Annotated[list[dict[str, Any]], operator.add]
    rejected: Annotated[list[dict[str, Any]], operator.add]
    critique: dict[str, Any]


class CritiqueUnavailable(RuntimeError):
    """The fleet did not critique the batch (unreachable, no verdict within the timeout, a
    refused batch): raised in the graph so nothing unchecked is passed on."""


@dataclass
class _Job:
    """One output to send to the fleet: a fresh submission, or a re-run answering a verdict."""

    item: dict[str, Any]
    submission: Submission
    reruns: int = 0
    repair_of: CritiqueResult | None = None
    tokens: int = 0


@dataclass
class _Plan:
    """What a call of the node does: the jobs for the fleet, the verdicts to release, and the
    items refused before anything was sent."""

    run_id: str
    book: dict[str, Any]
    jobs: list[_Job] = field(default_factory=list)
    release: list[CritiqueResult] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)


Outcome = CritiqueResult | SubmissionError | CritiqueUnavailable


class CritiqueNode:
    """The critique node of a ``Send`` fan-out's fan-in (see the module docstring).

    ``worker_node``: where failed items are re-sent (an item's ``node`` key overrides it);
    ``then``: the node the graph goes on to when every item is settled (``END``: the branch
    ends); ``config``: the submissions' configuration (the manager's policy: ``budget``,
    ``max_repair_attempts`` …); ``run_id``: the fleet run (default: ``lg-<thread_id>``, else
    a fresh one per graph run); ``timeout``: seconds to wait for the batch's verdicts;
    ``interrupt_on``: the stop reasons that go to review instead of ``rejected``.
    """

    def __init__(
        self,
        worker_node: str = "worker",
        then: str = END,
        *,
        mode: Mode = "verdict",
        config: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        timeout: float = 120.0,
        fail_open: bool = False,
        interrupt_on: Iterable[str] = ("repair_budget_exhausted",),
        name: str = "critique",
    ) -> None:
        cfg = verdicts.door_config(mode, config)
        self.worker_node = worker_node
        self.then = then
        self.mode: Mode = mode
        self.config = cfg
        self.run_id = run_id
        self.timeout = float(timeout)
        self.fail_open = fail_open
        self.interrupt_on = frozenset(interrupt_on)
        self.name = name
        self.review_name = f"{name}_review"
        self._client: CritiqueClient | None = None

    # -- wiring ---------------------------------------------------------------------------------
    def attach(
        self, builder: Any, *, sources: Sequence[str] | None = None, asynchronous: bool = False
    ) -> Any:
        """Add the critique node and its review node to a ``StateGraph`` builder, and an edge
        from each worker node in ``sources`` (default: ``worker_node``) to the critique node.
        ``asynchronous``: the node awaits verdicts on the event loop (``ainvoke``/``astream``
        only). Returns the builder."""
        node: Callable[..., Any] = self.acall if asynchronous else self.__call__
        targets = tuple(dict.fromkeys(t for t in (self.worker_node, self.then) if t != END))
        builder.add_node(self.name, node, destinations=(*targets, self.review_name))
        builder.add_node(self.review_name, self.review, destinations=targets)
        for source in sources if sources is not None else (self.worker_node,):
            builder.add_edge(source, self.name)
        return builder

    # -- the node -------------------------------------------------------------------------------
    def __call__(self, state: Mapping[str, Any], config: RunnableConfig) -> Command[Any]:
        """Critique the batch in ``state["outputs"]`` (sync client: a thread per node call)."""
        plan = self._plan(state, config)
        if self._client is None:
            self._client = CritiqueClient(self.config)
        client = self._client
        try:
            handles = _submit(client, plan.jobs)
            for result in plan.release:
                client.release_repair(result)
        except CritiqueError as exc:
            return self._settle(plan, [_unreached(exc)] * len(plan.jobs))
        deadline = time.monotonic() + self.timeout
        outcomes: list[Outcome] = []
        for handle in handles:
            if not isinstance(handle, Handle):
                outcomes.append(handle)
                continue
            try:
                left = max(0.0, deadline - time.monotonic())
                outcomes.append(client.wait(handle, timeout=left))
            except SubmissionError as exc:
                outcomes.append(exc)
            except (CritiqueTimeout, CritiqueError) as exc:
                outcomes.append(_unreached(exc))
        return self._settle(plan, outcomes, client.release_repair)

    async def acall(self, state: Mapping[str, Any], config: RunnableConfig) -> Command[Any]:
        """:meth:`__call__` on the event loop: the verdicts are awaited without a thread
        (:class:`~workers.aclient.AsyncCritiqueClient`)."""
        plan = self._plan(state, config)
        async with AsyncCritiqueClient(self.config) as client:
            try:
                handles = await asyncio.to_thread(_submit, client.sync, plan.jobs)
                for result in plan.release:
                    await client.release_repair(result)
            except CritiqueError as exc:
                return self._settle(plan, [_unreached(exc)] * len(plan.jobs))
            waits = [
                client.wait(h, timeout=self.timeout) if isinstance(h, Handle) else _ready(h)
                for h in handles
            ]
            got = await asyncio.gather(*waits, return_exceptions=True)
            outcomes: list[Outcome] = []
            for g in got:
                if isinstance(g, CritiqueResult | SubmissionError | CritiqueUnavailable):
                    outcomes.append(g)
                elif isinstance(g, CritiqueTimeout | CritiqueError):
                    outcomes.append(_unreached(g))
                elif isinstance(g, BaseException):
                    raise g
            settled = self._settle(plan, outcomes, client.sync.release_repair)
        return settled

    def review(self, state: Mapping[str, Any]) -> Command[Any]:
        """The review node: stop the graph with ``interrupt()`` carrying the escalations; on
        ``Command(resume=...)`` pass the accepted ones on and drop the rest. A resume value
        is ``"accept"``/``"drop"`` for all, or ``{worker_id: "accept" | "drop"}`` (a worker
        not named is dropped); anything else is a ``ValueError`` in the graph."""
        book = dict(state.get("critique") or {})
        escalations = [dict(e) for e in book.get("escalations") or ()]
        if not escalations:
            return Command(goto=self._after(book))
        answer = interrupt(
            {
                "critique": "escalations",
                "run_id": book.get("run_id"),
                "escalations": escalations,
                "resume_with": {e["worker_id"]: list(DECISIONS) for e in escalations},
            }
        )
        decisions = _decisions(answer, [str(e["worker_id"]) for e in escalations])
        passed: list[dict[str, Any]] = []
        rejected: list[dict[str, Any]] = []
        for e in escalations:
            decision = decisions[str(e["worker_id"])]
            record = {**e, "decision": decision}
            (passed if decision == "accept" else rejected).append(record)
        book["escalations"] = []
        update = {"passed": passed, "rejected": rejected, "critique": book}
        return Command(update=update, goto=self._after(book))

    # -- what the calls share -------------------------------------------------------------------
    def _plan(self, state: Mapping[str, Any], config: RunnableConfig) -> _Plan:
        """Sort the state's new items into fresh submissions and re-runs answering a verdict;
        a verdict whose re-run came back without an output (or not at all) is released."""
        book = dict(state.get("critique") or {})
        run_id = str(book.get("run_id") or self.run_id or _default_run(config))
        book["run_id"] = run_id
        waiting: dict[str, Any] = dict(book.get("pending") or {})
        iteration = state.get("iteration", 1)
        iteration = iteration if isinstance(iteration, int) and iteration >= 1 else 1
        plan = _Plan(run_id, book)
        seen: set[str] = set()
        for raw in state.get("outputs") or ():
            item = dict(raw) if isinstance(raw, Mapping) else {"output": raw}
            wid = str(item.get("worker_id") or "")
            if wid in seen:
                plan.rejected.append(_refused(item, "the batch holds this worker_id twice"))
                continue
            seen.add(wid)
            entry = waiting.pop(wid, None)
            if entry is not None:
                verdict = CritiqueResult.model_validate(entry["result"])
                if item.get("output") is None:
                    plan.release.append(verdict)
                    plan.rejected.append(_declined(item, verdict, int(entry["reruns"])))
                    continue
                sub = Submission.model_validate({**entry["submission"], "output": item["output"]})
                plan.jobs.append(_Job(item, sub, int(entry["reruns"]) + 1, verdict, _tokens(item)))
                continue
            try:
                plan.jobs.append(_Job(item, _submission(item, run_id, iteration)))
            except (ValidationError, ValueError, TypeError) as exc:
                plan.rejected.append(_refused(item, verdicts.first_line(exc)))
        for wid, entry in waiting.items():  # re-sent, and no item came back
            verdict = CritiqueResult.model_validate(entry["result"])
            plan.release.append(verdict)
            gone = {**entry["item"], "worker_id": wid}
            plan.rejected.append(_declined(gone, verdict, int(entry["reruns"])))
        book["pending"] = {}
        return plan

    def _settle(
        self,
        plan: _Plan,
        outcomes: Sequence[Outcome],
        release: Callable[[CritiqueResult], Any] | None = None,
    ) -> Command[Any]:
        """The verdicts as the graph's next step: records into the state, re-sends, review."""
        unreached = [o for o in outcomes if isinstance(o, CritiqueUnavailable)]
        if unreached and not self.fail_open:
            if release is not None:  # repairs nobody will answer: give their budget back
                for o in outcomes:
                    if isinstance(o, CritiqueResult) and o.repair_request is not None:
                        _quietly(release, o)
            raise CritiqueUnavailable(
                f"the critique fleet did not check {len(unreached)} of {len(outcomes)} "
                f"output(s) of run {plan.run_id}, so none is passed on: {unreached[0]} "
                "(fail_open=True passes them on marked unchecked)"
            )
        book = plan.book
        passed: list[dict[str, Any]] = []
        rejected = list(plan.rejected)
        escalations: list[dict[str, Any]] = list(book.get("escalations") or ())
        sends: list[Send] = []
        for job, outcome in zip(plan.jobs, outcomes, strict=True):
            if isinstance(outcome, CritiqueUnavailable):
                passed.append(_unchecked(job, str(outcome)))
            elif isinstance(outcome, SubmissionError):
                rejected.append(_refused(job.item, verdicts.first_line(outcome), job.reruns))
            elif verdicts.passes(outcome):
                passed.append(_record(job.item, outcome, job.reruns))
            elif outcome.stop_reason == "worker_repair" and outcome.repair_request is not None:
                sends.append(self._resend(job, outcome, book))
            elif outcome.stop_reason in self.interrupt_on:
                escalations.append(_record(job.item, outcome, job.reruns))
            else:
                rejected.append(_record(job.item, outcome, job.reruns))
        book["escalations"] = escalations
        goto: list[Any] = list(sends)
        if escalations:
            goto.append(self.review_name)
        elif not sends:
            goto.extend(self._after(book))
        update = {
            "outputs": Overwrite([]),
            "passed": passed,
            "rejected": rejected,
            "critique": book,
        }
        return Command(update=update, goto=goto)

    def _resend(self, job: _Job, result: CritiqueResult, book: dict[str, Any]) -> Send:
        """Send a ``worker_repair`` item back to its worker with the defects, and keep the
        verdict for its re-run."""
        base = {k: v for k, v in job.item.items() if k not in RESEND_KEYS}
        book.setdefault("pending", {})[result.worker_id] = {
            "result": result.model_dump(mode="json"),
            "submission": job.submission.model_dump(
                mode="json", exclude={"repair_of", "repair_tokens"}
            ),
            "item": base,
            "reruns": job.reruns,
        }
        request = result.repair_request
        payload = {
            **base,
            "feedback": verdicts.feedback(result),
            "defects": verdicts.defect_records(result),
            "attempt": request.attempt if request is not None else job.reruns + 1,
        }
        return Send(str(job.item.get("node") or self.worker_node), payload)

    def _after(self, book: Mapping[str, Any]) -> list[str]:
        """Where the graph goes once nothing is in flight: ``then`` (nowhere for ``END``)."""
        if book.get("pending") or book.get("escalations") or self.then == END:
            return []
        return [self.then]


# -- helpers ------------------------------------------------------------------------------------
def _submit(client: CritiqueClient, jobs: Sequence[_Job]) -> list[Handle | SubmissionError]:
    """Send the jobs: the fresh ones at once (one bad one is refused alone: the batch is then
    sent one by one), each re-run with ``submit_repair``. Fleet errors propagate."""
    fresh = [j for j in jobs if j.repair_of is None]
    out: dict[int, Handle | SubmissionError] = {}
    if fresh:
        try:
            handles: list[Handle | SubmissionError] = list(
                client.submit_many([j.submission for j in fresh])
            )
        except SubmissionError:
            handles = []
            for j in fresh:
                try:
                    handles.append(client.submit(j.submission))
                except SubmissionError as exc:
                    handles.append(exc)
        out.update({id(j): h for j, h in zip(fresh, handles, strict=True)})
    for j in jobs:
        if j.repair_of is not None:
            try:
                out[id(j)] = client.submit_repair(j.repair_of, j.submission, tokens=j.tokens)
            except (SubmissionError, ValueError) as exc:
                out[id(j)] = SubmissionError(verdicts.first_line(exc))
    return [out[id(j)] for j in jobs]


async def _ready(value: Outcome) -> Outcome:
    return value


def _unreached(exc: BaseException) -> CritiqueUnavailable:
    return CritiqueUnavailable(verdicts.first_line(exc))


def _quietly(release: Callable[[CritiqueResult], Any], result: CritiqueResult) -> None:
    try:
        release(result)
    except CritiqueError as exc:
        log.warning("could not release %s's repair: %s", result.worker_id, exc)


def _default_run(config: RunnableConfig | None) -> str:
    thread = ((config or {}).get("configurable") or {}).get("thread_id")
    if thread:
        return verdicts.identifier(f"lg-{thread}", "lg-run")
    return f"lg-{uuid.uuid4().hex[:12]}"


def _submission(item: Mapping[str, Any], run_id: str, iteration: int) -> Submission:
    """A worker item as the fleet's submission."""
    if "worker_id" not in item or "task" not in item or item.get("output") is None:
        raise ValueError("an output item needs worker_id, task and output")
    task = str(item["task"])
    return Submission.model_validate(
        {
            "run_id": run_id,
            "iteration": iteration,
            "worker_id": str(item["worker_id"]),
            "subtask_signature": str(item.get("subtask_signature") or task[:200]),
            "task": task,
            "output": item["output"],
            "claimed_format": item.get("claimed_format"),
            "required_fields": tuple(item.get("required_fields") or ()),
        }
    )


def _tokens(item: Mapping[str, Any]) -> int:
    """The re-run's tokens as the worker reported them (``tokens``); 0 when it did not."""
    value = item.get("tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _record(item: Mapping[str, Any], result: CritiqueResult, reruns: int) -> dict[str, Any]:
    """An item's record in ``passed``/``rejected``/the escalations: its own keys, the output
    the fleet kept and the verdict in words."""
    return {
        **{k: v for k, v in item.items() if k not in RESEND_KEYS},
        "worker_id": result.worker_id,
        "output": result.output,
        "status": result.status,
        "stop_reason": result.stop_reason,
        "score": result.best_score,
        "defects": verdicts.defect_records(result),
        "why": list(result.why()) or [str(result)],
        "reruns": reruns,
    }


def _declined(item: Mapping[str, Any], result: CritiqueResult, reruns: int) -> dict[str, Any]:
    """A ``worker_repair`` verdict whose worker did not re-run (no output came back): the
    output as the fleet kept it, rejected, the verdict released."""
    record = _record(item, result, reruns)
    record["why"] = ["its worker did not re-run it (no output came back)", *record["why"]]
    return record


def _refused(item: Mapping[str, Any], why: str, reruns: int = 0) -> dict[str, Any]:
    """An item the fleet refused or never got: rejected, with the reason."""
    return {
        **{k: v for k, v in item.items() if k not in RESEND_KEYS},
        "output": item.get("output"),
        "status": "refused",
        "stop_reason": None,
        "score": None,
        "defects": [],
        "why": [why],
        "reruns": reruns,
    }


def _unchecked(job: _Job, why: str) -> dict[str, Any]:
    """``fail_open``: the item passed on unchecked, and marked so."""
    return {
        **_refused(job.item, f"not critiqued: {why}", job.reruns),
        "output": job.submission.output,
        "status": "unchecked",
    }


def _decisions(answer: Any, workers: Sequence[str]) -> dict[str, str]:
    """The reviewer's resume value as a decision per escalated worker."""
    if isinstance(answer, str):
        answer = dict.fromkeys(workers, answer)
    if not isinstance(answer, Mapping):
        raise ValueError(
            f"resume the critique review with 'accept', 'drop' or {{worker_id: decision}}, "
            f"not {type(answer).__name__}"
        )
    out = {}
    for wid in workers:
        decision = answer.get(wid, "drop")
        if decision not in DECISIONS:
            raise ValueError(f"review decision {decision!r} for {wid}: use accept or drop")
        out[wid] = str(decision)
    return out
