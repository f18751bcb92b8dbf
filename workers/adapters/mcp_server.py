"""``critique mcp``: the fleet as an MCP server, for any MCP client (an agent, an IDE, a manager).

Five tools, each a thin translation onto the asyncio client (:class:`AsyncCritiqueClient`, its
public API only) and the verdict mapping every adapter shares (:mod:`workers.adapters.verdicts`):

- ``submit``: one or many submissions (the :class:`~pipeline.models.Submission` fields) and an
  optional ``config`` of policy overrides → one handle per submission, in order;
- ``wait``: a handle and a timeout → the verdict (:class:`Verdict`, the result model's fields);
- ``poll``: a handle → the verdict, or ``pending``;
- ``status``: a run id → the run's snapshot, as ``critique status --json`` prints it;
- ``pitfalls``: a run id → the run's Known Pitfalls text.

The server process is a client like any other: it signs with its ``CRITIQUE_SECRET``, a
configuration it may not send (a worker-only field such as ``llm.api_base``) is refused at
submit with the client's one line, and a fleet that would refuse it says so before anything is
enqueued. It fails closed: an unreachable Redis or broker, a refused submission, a chain a
worker failed, or no verdict within the timeout is a tool error (``isError``) that says why in
words, never a verdict that passes; ``fail_open=True`` (``--fail-open``) makes an unreachable
fleet or a timeout at ``wait`` an ``unchecked`` verdict instead, marked as such. docs/mcp.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import CritiqueError, SubmissionError
from pipeline.models import CritiqueResult, Status, StopReason, Submission
from workers.aclient import AsyncCritiqueClient
from workers.adapters import verdicts
from workers.client import CritiqueClient, CritiqueTimeout, Handle
from workers.commands._runs import load_snapshot
from workers.commands.status import snapshot_doc
from workers.unreachable import unreachable_errors

log = logging.getLogger(__name__)

NAME = "critique"
"""The server's name, as MCP clients list it."""
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
HTTP_PATH = "/mcp"
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
MAX_BATCH = 1000
"""The most submissions one ``submit`` call takes (one batch: one bad one enqueues none)."""
MAX_WAIT_S = 900.0
"""The longest one ``wait`` call blocks (the submission keeps running after it)."""
_CLIENTS_KEPT = 32
"""How many per-``config`` submitting clients the server keeps (oldest dropped first)."""

_ID = r"^[A-Za-z0-9._-]{1,128}$"

INSTRUCTIONS = (
    "Critiques LLM worker outputs on a critique fleet. submit the outputs (one run_id per "
    "delegation loop), then wait (or poll) for each handle's verdict. Use an output only when "
    "its verdict says passes: true (accepted, accepted_with_warnings, repaired: then use the "
    "verdict's output, the kept one). Otherwise send it back to its worker with the verdict's "
    "feedback. Before dispatching the next workers, read pitfalls for the run."
)


# -- the tools' structured inputs and outputs ----------------------------------------------------
class HandleRef(BaseModel):
    """What ``submit`` returns per submission, and what ``wait`` and ``poll`` take: the pass it
    started (each submit is a new pass; a verdict is always that pass's)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(pattern=_ID)
    iteration: int = Field(1, ge=1)
    worker_id: str = Field(pattern=_ID)
    pass_id: str = Field(pattern=_ID, description="the pass this submit started")
    task_id: str = Field("", max_length=128)

    @classmethod
    def of(cls, handle: Handle) -> HandleRef:
        return cls(
            run_id=handle.run_id,
            iteration=handle.iteration,
            worker_id=handle.worker_id,
            pass_id=handle.pass_id,
            task_id=handle.task_id,
        )

    def handle(self) -> Handle:
        return Handle(self.run_id, self.iteration, self.worker_id, self.task_id, self.pass_id)


class Submitted(BaseModel):
    """``submit``'s answer: one handle per submission, in the order given."""

    handles: list[HandleRef]


class DefectOut(BaseModel):
    """One defect of the verdict (a grounding false positive has severity ``info``)."""

    category: str
    location: str
    description: str
    severity: str


class RepairRequestOut(BaseModel):
    """``repairer: worker``: what the worker's re-run answers (submit its output with
    ``repair_of`` = ``of_pass`` and ``repair_tokens`` = what the re-run spent)."""

    of_pass: str
    attempt: int
    reserved_tokens: int
    expires_s: float


class Verdict(BaseModel):
    """A pass's verdict: the result model's fields (``CritiqueResult``), as a manager reads them."""

    run_id: str
    iteration: int
    worker_id: str
    pass_id: str
    status: Status
    stop_reason: StopReason | Literal["not_critiqued"]
    passes: bool = Field(description="true: the output may be used as it is (the kept `output`)")
    checked: bool = Field(description="false: no verdict (unchecked, cancelled): not reviewed")
    original_score: float | None
    best_score: float | None
    line: str = Field(description="the verdict in one line, with why when it did not pass")
    why: list[str] = Field(description="escalated or failed: the deciding defects, then next:")
    feedback: str = Field(description="what to tell the worker sent back; empty when it passes")
    defects: list[DefectOut]
    prescriptions: list[str]
    output: str | dict[str, Any] = Field(description="the kept (best) output: the repaired one")
    repairs: int = Field(description="repair attempts made")
    budget_charged: int = Field(description="tokens this pass charged to the run's budget")
    notes: list[str]
    repair_request: RepairRequestOut | None = None


class Poll(BaseModel):
    """``poll``'s answer: ``pending``, or ``finished`` with the verdict."""

    state: Literal["pending", "finished"]
    handle: HandleRef
    verdict: Verdict | None = None


def verdict_of(result: CritiqueResult) -> Verdict:
    """A :class:`CritiqueResult` as the tools return it (through :mod:`verdicts`)."""
    request = result.repair_request
    return Verdict(
        run_id=result.run_id,
        iteration=result.iteration,
        worker_id=result.worker_id,
        pass_id=result.pass_id,
        status=result.status,
        stop_reason=result.stop_reason,
        passes=verdicts.passes(result),
        checked=result.checked,
        original_score=result.original_score,
        best_score=result.best_score,
        line=str(result),
        why=list(result.why()),
        feedback=verdicts.feedback(result),
        defects=[DefectOut(**d) for d in verdicts.defect_records(result)],
        prescriptions=list(result.envelope.prescriptions),
        output=result.output,
        repairs=len(result.attempts),
        budget_charged=result.budget_charged,
        notes=list(result.notes),
        repair_request=None
        if request is None
        else RepairRequestOut(
            of_pass=request.of_pass,
            attempt=request.attempt,
            reserved_tokens=request.reserved_tokens,
            expires_s=request.expires_s,
        ),
    )


def unchecked_verdict(handle: HandleRef, why: str) -> Verdict:
    """``fail_open``: an output the fleet did not critique, passed on and marked so (no score,
    ``passes`` false, the reason in ``why``). Its output is the caller's own: not echoed."""
    line = f"{handle.worker_id} unchecked (not critiqued: {why}): do not treat it as reviewed"
    return Verdict(
        run_id=handle.run_id,
        iteration=handle.iteration,
        worker_id=handle.worker_id,
        pass_id=handle.pass_id,
        status="unchecked",
        stop_reason="not_critiqued",
        passes=False,
        checked=False,
        original_score=None,
        best_score=None,
        line=line,
        why=[f"not critiqued: {why}"],
        feedback="",
        defects=[],
        prescriptions=[],
        output="",
        repairs=0,
        budget_charged=0,
        notes=["fail-open: the fleet gave no verdict; nothing was checked"],
    )


def read_errors(*more: type[BaseException]) -> tuple[type[BaseException], ...]:
    """What a tool maps to a tool error: an unreachable service, a refusal, a bad value (and
    ``more``)."""
    return (*unreachable_errors(), CritiqueError, ValueError, *more)


def not_critiqued(exc: BaseException) -> ToolError:
    """The tool error for an output the fleet did not (or will not) critique: says so, and why."""
    return ToolError(f"not critiqued: {verdicts.first_line(exc)}")


# -- the server ----------------------------------------------------------------------------------
class FleetTools:
    """The tools' bodies: one asyncio client for the waits (no thread per wait), one submitting
    client per distinct ``config`` (a client's configuration is checked when it is made)."""

    def __init__(self, config: Mapping[str, Any] | None = None, *, fail_open: bool = False) -> None:
        self.config = dict(config or {})
        self.fail_open = fail_open
        self.client = AsyncCritiqueClient(self.config)  # a bad configuration fails here
        self._submitters: dict[str, CritiqueClient] = {"{}": self.client.sync}

    async def aclose(self) -> None:
        await self.client.aclose()

    def submitter(self, overrides: Mapping[str, Any] | None) -> CritiqueClient:
        """The client that submits with the server's configuration updated by ``overrides``
        (a key at a time): :class:`RefusedOverrideError` for a worker-only field, as at submit."""
        key = json.dumps(overrides or {}, sort_keys=True, default=str)
        client = self._submitters.get(key)
        if client is None:
            client = CritiqueClient({**self.config, **dict(overrides or {})})
            if len(self._submitters) >= _CLIENTS_KEPT:
                del self._submitters[next(k for k in self._submitters if k != "{}")]
            self._submitters[key] = client
        return client

    async def submit(
        self, submissions: list[Submission], config: dict[str, Any] | None
    ) -> Submitted:
        if not submissions:
            raise ToolError("nothing to submit: give one or more submissions")
        if len(submissions) > MAX_BATCH:
            raise ToolError(f"{len(submissions)} submissions in one call: at most {MAX_BATCH}")
        try:
            client = self.submitter(config)
            handles = await asyncio.to_thread(client.submit_many, submissions)
        except unreachable_errors() as exc:
            raise not_critiqued(exc) from None
        except (CritiqueError, ValueError) as exc:  # refused, as at submit: its one line
            raise ToolError(verdicts.first_line(exc)) from None
        return Submitted(handles=[HandleRef.of(h) for h in handles])

    async def wait(self, handle: HandleRef, timeout_s: float) -> Verdict:
        try:
            result = await self.client.wait(handle.handle(), timeout=timeout_s)
        except SubmissionError as exc:  # a worker refused or failed the pass: never a pass
            raise not_critiqued(exc) from None
        except CritiqueTimeout as exc:
            if self.fail_open:
                return unchecked_verdict(handle, verdicts.first_line(exc))
            raise ToolError(
                f"no verdict yet: {verdicts.first_line(exc)}; the output is not passed (the "
                "submission keeps running: wait or poll again)"
            ) from None
        except unreachable_errors() as exc:
            if self.fail_open:
                return unchecked_verdict(handle, verdicts.first_line(exc))
            raise not_critiqued(exc) from None
        except (CritiqueError, ValueError) as exc:
            raise not_critiqued(exc) from None
        return verdict_of(result)

    async def poll(self, handle: HandleRef) -> Poll:
        try:
            got = await asyncio.to_thread(self.client.sync.outcome, handle.handle())
        except read_errors() as exc:
            raise not_critiqued(exc) from None
        if isinstance(got, SubmissionError):
            raise not_critiqued(got)
        if got is None:
            return Poll(state="pending", handle=handle)
        return Poll(state="finished", handle=handle, verdict=verdict_of(got))

    async def status(self, run_id: str, iteration: int | None) -> dict[str, Any]:
        def read() -> dict[str, Any]:
            return snapshot_doc(load_snapshot(run_id, iteration, archive=True), iteration)

        try:
            return await asyncio.to_thread(read)
        except read_errors(LookupError) as exc:
            raise ToolError(verdicts.first_line(exc)) from None

    async def pitfalls(self, run_id: str, limit: int) -> str:
        try:
            return await self.client.pitfalls(run_id, limit)
        except read_errors() as exc:
            raise ToolError(verdicts.first_line(exc)) from None


def build_server(
    config: Mapping[str, Any] | None = None,
    *,
    fail_open: bool = False,
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "WARNING",
) -> MCPServer[Any]:
    """The MCP server (the SDK's ``MCPServer``) with the five tools, its submissions sent with
    ``config`` (the manager's policy; a submit's ``config`` overrides it key by key). Raises
    ``ConfigError``/``RefusedOverrideError`` for a configuration this process may not send.
    Run it with ``.run("stdio")`` or ``.run("streamable-http", host=…, port=…)``, or connect
    to it in-process with ``mcp.Client(server)``."""
    tools = FleetTools(config, fail_open=fail_open)

    @contextlib.asynccontextmanager
    async def lifespan(_server: MCPServer[Any]) -> AsyncIterator[None]:
        try:
            yield None
        finally:
            await tools.aclose()

    server: MCPServer[Any] = MCPServer(
        NAME,
        title="Critique fleet",
        instructions=INSTRUCTIONS,
        log_level=log_level,
        lifespan=lifespan,
    )
    reads = ToolAnnotations(read_only_hint=True, open_world_hint=False)

    @server.tool(
        annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False),
        structured_output=True,
    )
    async def submit(
        submissions: Annotated[
            list[Submission],
            Field(description="the outputs to critique, one per worker (one or many)"),
        ],
        config: Annotated[
            dict[str, Any] | None,
            Field(
                description="policy overrides for these submissions, e.g. "
                '{"repairer": "worker"} or {"budget": {"total_tokens": 200000}}; a '
                "worker-only field (llm.*, command, allowed_models, …) is refused"
            ),
        ] = None,
    ) -> Submitted:
        """Submit worker outputs for critique (one batch: one bad submission enqueues none).
        Returns one handle per submission, in order: pass each to wait or poll."""
        return await tools.submit(submissions, config)

    @server.tool(annotations=reads, structured_output=True)
    async def wait(
        handle: Annotated[HandleRef, Field(description="a handle submit returned")],
        timeout_s: Annotated[
            float, Field(ge=0, le=MAX_WAIT_S, description="seconds to wait at most")
        ] = 60.0,
    ) -> Verdict:
        """Wait for a submission's verdict. An error (never a verdict) when the fleet cannot be
        reached, a worker refused it, or no verdict came within timeout_s."""
        return await tools.wait(handle, timeout_s)

    @server.tool(annotations=reads, structured_output=True)
    async def poll(
        handle: Annotated[HandleRef, Field(description="a handle submit returned")],
    ) -> Poll:
        """A submission's verdict if it has one (state finished), else state pending."""
        return await tools.poll(handle)

    @server.tool(annotations=reads, structured_output=True)
    async def status(
        run_id: Annotated[str, Field(pattern=_ID, description="the run id")],
        iteration: Annotated[int | None, Field(ge=1, description="only this iteration")] = None,
    ) -> dict[str, Any]:
        """A run's submissions and how each stands (finished with its verdict, failed,
        pending): the document `critique status RUN --json` prints."""
        return await tools.status(run_id, iteration)

    @server.tool(annotations=reads, structured_output=True)
    async def pitfalls(
        run_id: Annotated[str, Field(pattern=_ID, description="the run id")],
        limit: Annotated[int, Field(ge=1, le=100, description="at most this many")] = 10,
    ) -> str:
        """The run's Known Pitfalls: the defects its outputs kept making, to put in the
        instructions of the workers dispatched next ("" when there are none yet)."""
        return await tools.pitfalls(run_id, limit)

    return server


def serve(
    server: MCPServer[Any],
    transport: Literal["stdio", "http"] = "stdio",
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
) -> None:
    """Run ``server`` until it is stopped: on stdin/stdout, or over streamable HTTP at
    ``http://host:port/mcp`` (loopback by default; a host that is not loopback is exposed to
    the network without authentication: a warning says so)."""
    if transport == "stdio":
        server.run("stdio")
        return
    if host not in LOOPBACK:
        print(
            f"critique mcp: warning: listening on {host}, not loopback: anyone who can reach "
            f"port {port} can submit to this fleet and read its runs (no authentication); put "
            "an authenticating proxy in front of it",
            file=sys.stderr,
        )
    server.run("streamable-http", host=host, port=port, streamable_http_path=HTTP_PATH)
