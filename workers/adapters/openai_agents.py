"""The OpenAI Agents SDK's guardrails on the critique fleet: one import, one line to attach.

::

    from workers.adapters.openai_agents import CritiqueGuardrails

    critique = CritiqueGuardrails(run_id="q3-sales")
    analyst = Agent(name="analyst", ..., output_guardrails=[critique.output_guardrail()])
    manager = Agent(name="manager", ..., tools=[critique.as_tool(worker, "north", "…")])

Two hooks, one verdict (:class:`Verdict`, the guardrail's ``output_info``), waited for with
:class:`~workers.aclient.AsyncCritiqueClient` (no thread parked per wait):

- :meth:`CritiqueGuardrails.output_guardrail`: an agent's final output. A passing verdict lets
  it through; anything else trips the wire (``OutputGuardrailTripwireTriggered``), whose
  ``guardrail_result.output.output_info`` is the verdict: status, defects, feedback.
- :meth:`CritiqueGuardrails.tool_output_guardrail` (and :meth:`CritiqueGuardrails.as_tool`, a
  sub-agent as a tool with it attached): a tool's output. A passing verdict allows it; anything
  else is ``reject_content`` with the defects in words, so the calling model sees why and may
  call the tool again.

*Verdict* mode (the default; ``repairer: worker``): a due repair is a tripwire (output
guardrail) or a ``reject_content`` that asks the model to call the tool again with the defects
(tool guardrail). The worker's next output (the next run of the same agent, or the next call of
the same tool, under one ``run_id`` and worker id) goes back with ``submit_repair`` as that pass's
next attempt, charged what the re-run spent as the provider reported it: for an agent run, the
new run's ``context_wrapper.usage`` (minus the usage at the previous output when it is the same
run); for a sub-agent made a tool with :meth:`~CritiqueGuardrails.as_tool`, the nested run's own
model responses (``RunResult.raw_responses``: the manager's own turns are not the worker's). The
fleet keeps the attempt cap, keep-best, the fixpoint stop and the run's budget.

*Repair* mode (the fleet's own repairer): the repaired output is the verdict's ``output``. A
tool guardrail hands it to the model in place of the tool's output (the SDK lets a tool
guardrail replace an output only through ``reject_content``, whose message is what the model
reads); an output guardrail cannot replace a run's final output (the SDK gives it no way), so
:func:`critiqued_output` reads it from the run's result.

Fail closed: the fleet unreachable, a refused submission or no verdict within ``timeout`` trip
the wire or reject the tool's content with the reason in words; ``fail_open=True`` lets the
output through instead, its verdict's status ``unchecked``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal

import pydantic
from agents import (
    Agent,
    FunctionTool,
    GuardrailFunctionOutput,
    OutputGuardrail,
    RunContextWrapper,
    RunResult,
    RunResultStreaming,
    ToolGuardrailFunctionOutput,
    ToolOutputGuardrail,
    ToolOutputGuardrailData,
    Usage,
    output_guardrail,
    tool_output_guardrail,
)

from pipeline.errors import CritiqueError
from pipeline.models import CritiqueResult, Submission
from workers.aclient import AsyncCritiqueClient
from workers.adapters import verdicts
from workers.adapters.verdicts import Mode
from workers.client import CritiqueTimeout

log = logging.getLogger(__name__)

Outcome = Literal["pass", "replace", "retry", "reject"]
AgentValue = str | Callable[[RunContextWrapper[Any], Agent[Any]], str]
"""Fixed for every run, or read from the run's context and agent (e.g. ``ctx.context``)."""
ToolValue = str | Callable[[ToolOutputGuardrailData], str]
"""Fixed for every call, or read from the tool call (``data.context.tool_arguments`` …)."""
Extractor = Callable[[RunResult | RunResultStreaming], Awaitable[Any]]

WAIT_S = 120.0
"""How long one verdict may take before the output is rejected (or let through, ``fail_open``)."""
KEPT_TOOL_RUNS = 4096
"""At most this many sub-agent runs' token counts wait for their tool guardrail."""
NAME = "critique"
"""The guardrails' name, as the SDK's results and traces show it."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the fleet said about one output: a guardrail's ``output_info``.

    ``status`` is the fleet's (or ``unchecked``: let through without a verdict, ``fail_open``),
    ``reason`` one line in words, ``feedback`` what to tell the worker ("" for a passing
    output), ``defects`` the envelope's defects as plain records, ``output`` the output the fleet
    kept (repair mode: the repaired one; None without a verdict), ``result`` the fleet's
    :class:`~pipeline.models.CritiqueResult` (None when there was none)."""

    worker_id: str
    status: str
    stop_reason: str
    reason: str
    feedback: str = ""
    defects: tuple[dict[str, str], ...] = ()
    output: Any = None
    result: CritiqueResult | None = None

    @property
    def checked(self) -> bool:
        """False for an output nobody checked: never treat it as reviewed."""
        return self.result is not None and self.result.checked

    @property
    def passed(self) -> bool:
        """The fleet let the output pass (accepted, with warnings, repaired)."""
        return self.result is not None and verdicts.passes(self.result)

    @property
    def retry(self) -> bool:
        """The fleet asks for the worker's re-run (``worker_repair``)."""
        return self.stop_reason == "worker_repair"


@dataclasses.dataclass
class _Chain:
    """One worker's outputs so far (oldest first) while a ``worker_repair`` request waits, and
    where the usage counter stood at the latest (output guardrail: the run's usage object)."""

    submission: Submission
    candidates: list[Any]
    result: CritiqueResult
    usage: Usage | None = None
    tokens_at: int = 0


@dataclasses.dataclass(frozen=True)
class _Ask:
    """One output to critique: who wrote it, for what, and what its re-run spent."""

    key: tuple[str, str]
    worker_id: str
    task: str
    required_fields: tuple[str, ...]
    output: Any
    tokens: Callable[[_Chain | None], int]


def tool_task(data: ToolOutputGuardrailData) -> str:
    """What a tool call asked: an agent tool's ``input`` argument, else its raw arguments."""
    raw = data.context.tool_arguments or ""
    try:
        args = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(args, Mapping) and isinstance(args.get("input"), str) and len(args) == 1:
        return str(args["input"])
    return raw


def run_tokens(result: RunResult | RunResultStreaming) -> int:
    """The tokens one run's own model responses used, as the provider reported them."""
    return sum(int(r.usage.total_tokens or 0) for r in result.raw_responses)


def critiqued_output(result: RunResult | RunResultStreaming, default: Any = None) -> Any:
    """A run's output as the fleet kept it: the output guardrail's verdict's ``output`` (repair
    mode: the repaired one, in the type of the run's ``final_output``); ``default`` when no
    critique guardrail gave one (it let an unchecked output through, or did not run)."""
    for gr in reversed(result.output_guardrail_results):
        info = gr.output.output_info
        if isinstance(info, Verdict) and info.passed and info.output is not None:
            return info.output
    return default


class CritiqueGuardrails:
    """Output and tool output guardrails served by the critique fleet (see the module docstring).

    ``run_id`` is the manager's run on the fleet (its budget, Known Pitfalls and trace);
    ``config`` the submissions' configuration (policy: ``budget``, ``max_repair_attempts``,
    ``critic`` …), to which verdict mode adds ``repairer: worker``; ``timeout`` the seconds one
    verdict may take; ``fail_open`` lets an output the fleet did not check through, marked
    ``unchecked``. ``client`` is an :class:`AsyncCritiqueClient` to use (default: one per event
    loop, made here)."""

    def __init__(
        self,
        *,
        run_id: str,
        mode: Mode = "verdict",
        config: Mapping[str, Any] | None = None,
        iteration: int = 1,
        client: AsyncCritiqueClient | None = None,
        timeout: float = WAIT_S,
        fail_open: bool = False,
    ) -> None:
        self.config = verdicts.door_config(mode, config)
        self.run_id = run_id
        self.mode: Mode = mode
        self.iteration = iteration
        self.timeout = timeout
        self.fail_open = fail_open
        self._clients = verdicts.LoopClients(self.config, client)
        self._chains: dict[tuple[str, str], _Chain] = {}
        self._tool_tokens: OrderedDict[str, int] = OrderedDict()

    # -- the hooks ------------------------------------------------------------------------------
    def output_guardrail(
        self,
        *,
        worker_id: AgentValue | None = None,
        task: AgentValue | None = None,
        required_fields: Sequence[str] = (),
        name: str = NAME,
    ) -> OutputGuardrail[Any]:
        """An output guardrail for ``Agent(output_guardrails=[…])``: the fleet's verdict on the
        run's final output, a tripwire when it does not pass. ``worker_id`` (default: the
        agent's name) and ``task`` (default: the agent's instructions when they are text) are
        strings or functions of ``(ctx, agent)``."""
        fields = tuple(required_fields)

        @output_guardrail(name=name)
        async def critique(
            ctx: RunContextWrapper[Any], agent: Agent[Any], output: Any
        ) -> GuardrailFunctionOutput:
            wid = verdicts.identifier(_value(worker_id, (ctx, agent), agent.name), "agent")
            default_task = agent.instructions if isinstance(agent.instructions, str) else ""
            usage = ctx.usage

            def spent(chain: _Chain | None) -> int:
                at = chain.tokens_at if chain is not None and chain.usage is usage else 0
                return max(0, int(usage.total_tokens) - at)

            ask = _Ask(
                key=(self.run_id, wid),
                worker_id=wid,
                task=_value(task, (ctx, agent), default_task),
                required_fields=fields,
                output=output,
                tokens=spent,
            )
            verdict, outcome = await self._critique(ask, usage)
            return GuardrailFunctionOutput(
                output_info=verdict, tripwire_triggered=outcome not in ("pass", "replace")
            )

        return critique

    def tool_output_guardrail(
        self,
        *,
        worker_id: ToolValue | None = None,
        task: ToolValue | None = None,
        required_fields: Sequence[str] = (),
        name: str = NAME,
    ) -> ToolOutputGuardrail[Any]:
        """A tool output guardrail for ``FunctionTool.tool_output_guardrails``: ``allow`` a
        passing output, ``reject_content`` with the defects in words otherwise. ``worker_id``
        (default: the tool's name) and ``task`` (default: the call's ``input`` argument) are
        strings or functions of the guardrail's ``ToolOutputGuardrailData``. A re-run is charged
        the tokens its nested run reported when the tool came from :meth:`as_tool`; a plain
        function tool's are not known (0: not charged, as the fleet's result notes)."""
        fields = tuple(required_fields)

        @tool_output_guardrail(name=name)
        async def critique(data: ToolOutputGuardrailData) -> ToolGuardrailFunctionOutput:
            tool = data.context.tool_name
            wid = verdicts.identifier(_value(worker_id, (data,), tool), "tool")
            call_id = data.context.tool_call_id
            tokens = self._tool_tokens.pop(call_id, 0)
            ask = _Ask(
                key=(self.run_id, wid),
                worker_id=wid,
                task=_value(task, (data,), tool_task(data)),
                required_fields=fields,
                output=data.output,
                tokens=lambda _chain: tokens,
            )
            verdict, outcome = await self._critique(ask, None)
            if outcome == "pass":
                return ToolGuardrailFunctionOutput.allow(verdict)
            if outcome == "replace":
                replaced = verdicts.as_text(verdict.output)
                return ToolGuardrailFunctionOutput.reject_content(replaced, verdict)
            if outcome == "retry":
                message = (
                    f"REJECTED by the critique fleet: this output of {tool} is not usable yet. "
                    f"Call {tool} again and include these defects in its input, so that the "
                    f"worker fixes them:\n{verdict.feedback}"
                )
            else:
                message = (
                    f"REJECTED by the critique fleet: do not use this output of {tool}. "
                    f"{verdict.reason}"
                )
            return ToolGuardrailFunctionOutput.reject_content(message, verdict)

        return critique

    def as_tool(
        self,
        agent: Agent[Any],
        tool_name: str | None = None,
        tool_description: str | None = None,
        *,
        worker_id: ToolValue | None = None,
        task: ToolValue | None = None,
        required_fields: Sequence[str] = (),
        custom_output_extractor: Extractor | None = None,
        **as_tool_kwargs: Any,
    ) -> FunctionTool:
        """``agent.as_tool(tool_name, tool_description, …)`` with :meth:`tool_output_guardrail`
        attached, and the nested run's reported tokens recorded for its re-run's charge.
        ``custom_output_extractor`` (else the run's ``final_output``) makes the tool's output."""

        async def extract(result: RunResult | RunResultStreaming) -> Any:
            invocation = result.agent_tool_invocation
            if invocation is not None:
                self._tool_tokens[invocation.tool_call_id] = run_tokens(result)
                while len(self._tool_tokens) > KEPT_TOOL_RUNS:
                    self._tool_tokens.popitem(last=False)
            if custom_output_extractor is not None:
                return await custom_output_extractor(result)
            return result.final_output

        tool = agent.as_tool(
            tool_name, tool_description, custom_output_extractor=extract, **as_tool_kwargs
        )
        guardrail = self.tool_output_guardrail(
            worker_id=worker_id, task=task, required_fields=required_fields
        )
        tool.tool_output_guardrails = [*(tool.tool_output_guardrails or ()), guardrail]
        return tool

    async def release(self, worker_id: str | None = None) -> int:
        """Tell the fleet that waiting ``worker_repair`` requests (one worker's, or all) will not
        be answered: their budget holds are refunded at once. Returns how many were released."""
        keys = [k for k in self._chains if worker_id is None or k[1] == worker_id]
        released = 0
        for key in keys:
            chain = self._chains.pop(key, None)
            if chain is not None and await self._release(chain.result):
                released += 1
        return released

    async def aclose(self) -> None:
        """Release the waiting repair requests, then close the running loop's client (when
        made here)."""
        await self.release()
        await self._clients.aclose()

    # -- the verdict ----------------------------------------------------------------------------
    async def _critique(self, ask: _Ask, usage: Usage | None) -> tuple[Verdict, Outcome]:
        """Submit the output (a repair attempt when its worker's re-run was asked for), wait,
        and say what the framework should do with it."""
        chain = self._chains.pop(ask.key, None)
        payload = verdicts.as_payload(ask.output)
        client = self._clients.get()
        try:
            if chain is not None and chain.result.repair_request is not None:
                sub = chain.submission.model_copy(update={"output": payload})
                handle = await client.submit_repair(chain.result, sub, tokens=ask.tokens(chain))
                candidates = [*chain.candidates, ask.output]
            else:
                sub = Submission(
                    run_id=self.run_id,
                    iteration=self.iteration,
                    worker_id=ask.worker_id,
                    task=ask.task or "(no task given)",
                    output=payload,
                    required_fields=ask.required_fields,
                )
                handle = await client.submit(sub)
                candidates = [ask.output]
            result = await client.wait(handle, timeout=self.timeout)
        except (CritiqueError, CritiqueTimeout, ValueError) as exc:
            return self._unchecked(ask, exc)
        return self._decide(ask, sub, candidates, result, usage)

    def _decide(
        self,
        ask: _Ask,
        sub: Submission,
        candidates: list[Any],
        result: CritiqueResult,
        usage: Usage | None,
    ) -> tuple[Verdict, Outcome]:
        defects = tuple(verdicts.defect_records(result))

        def verdict(reason: str, output: Any = None) -> Verdict:
            return Verdict(
                worker_id=ask.worker_id,
                status=result.status,
                stop_reason=result.stop_reason,
                reason=reason,
                feedback=verdicts.feedback(result),
                defects=defects,
                output=output,
                result=result,
            )

        if verdicts.passes(result):
            kept = self._kept(result, candidates)
            outcome: Outcome = "pass" if kept is ask.output else "replace"
            return verdict(str(result), kept), outcome
        if result.stop_reason == "worker_repair":
            tokens_at = usage.total_tokens if usage is not None else 0
            self._chains[ask.key] = _Chain(sub, candidates, result, usage, tokens_at)
            return verdict(f"the fleet asks for a re-run: {result}"), "retry"
        if not result.checked and self.fail_open:
            log.warning("letting %s through unchecked (fail_open): %s", ask.worker_id, result)
            passed = verdict(f"let through unchecked (fail_open): {result}", ask.output)
            return dataclasses.replace(passed, status="unchecked"), "pass"
        return verdict(f"the fleet did not pass the output: {result}"), "reject"

    def _kept(self, result: CritiqueResult, candidates: list[Any]) -> Any:
        """The output the fleet kept, as the worker's object: the candidate it names (verdict
        mode, keep-best), else its repaired output in the type of the worker's output."""
        kept = verdicts.kept_candidate(result, candidates)
        if kept is not None:
            return kept
        try:
            return verdicts.as_output(result.output, candidates[-1])
        except (pydantic.ValidationError, ValueError):
            return result.output

    def _unchecked(self, ask: _Ask, exc: BaseException) -> tuple[Verdict, Outcome]:
        """Fail closed (reject or trip), or let through marked unchecked with ``fail_open``."""
        reason = f"the critique fleet did not check the output: {verdicts.first_line(exc)}"
        if self.fail_open:
            log.warning("letting %s through unchecked (fail_open): %s", ask.worker_id, reason)
            return Verdict(ask.worker_id, "unchecked", "", reason, output=ask.output), "pass"
        return Verdict(ask.worker_id, "unchecked", "", reason), "reject"

    # -- helpers --------------------------------------------------------------------------------
    async def _release(self, result: CritiqueResult) -> bool:
        """Refund a ``worker_repair`` request's hold."""
        try:
            return await self._clients.get().release_repair(result)
        except CritiqueError as exc:
            log.warning("could not release %s's repair request: %s", result.worker_id, exc)
            return False


def _value(value: Any, args: tuple[Any, ...], default: str) -> str:
    if value is None:
        return default
    return str(value(*args) if callable(value) else value)
