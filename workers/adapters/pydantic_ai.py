"""Pydantic AI's output validator on the critique fleet: one import, one line to attach.

::

    from workers.adapters.pydantic_ai import CritiqueValidator

    agent.output_validator(CritiqueValidator(run_id="q3-sales", worker_id=lambda ctx: ctx.deps))

Each final output of an agent run is submitted to the fleet (:class:`AsyncCritiqueClient`: no
thread parked per wait) and the verdict decides what Pydantic AI sees:

- *verdict* mode (the default; ``repairer: worker``): a due repair raises ``ModelRetry`` with
  the defects in words (:func:`workers.adapters.verdicts.feedback`), so the agent re-runs its
  model; the re-run's output goes back with ``submit_repair`` as that pass's next attempt, with
  the tokens the re-run spent (the run's ``ctx.usage`` now minus at the previous output). One
  ``ModelRetry`` is one of the service's repair attempts: the service's cap, keep-best, fixpoint
  and run budget decide when retrying stops, and then the run ends with :class:`CritiqueRejected`
  (the reason in words) instead of another retry. Give the agent at least as many output retries
  as the service allows attempts (``Agent(..., retries={"output": 2})`` for the default 2): if
  the agent's run out first, the pending request is released and the run is rejected saying so.
- *repair* mode (the service's own repairer): a passing verdict returns the service's output,
  the repaired one parsed into the agent's output type; an output the service could not make
  pass raises ``ModelRetry`` with its defects while the agent has retries left (each re-run is
  critiqued afresh, a new pass of the same worker).
- Fail closed: the fleet unreachable, a refused submission or no verdict within ``timeout``
  end the run with :class:`CritiqueRejected` (a Pydantic AI ``UnexpectedModelBehavior``, as when
  its own output retries are exhausted). ``fail_open=True`` passes the output on instead, and
  :attr:`CritiqueValidator.verdicts` marks it ``unchecked``.

A streamed run's partial outputs (``ctx.partial_output``) are passed through unchecked; the final
one is critiqued.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic_ai import ModelRetry, RunContext
from pydantic_ai.exceptions import UnexpectedModelBehavior

from pipeline.errors import CritiqueError
from pipeline.models import CritiqueResult, Submission
from workers.aclient import AsyncCritiqueClient
from workers.adapters import verdicts
from workers.adapters.verdicts import KeptVerdicts, Mode, Verdict
from workers.client import CritiqueTimeout

log = logging.getLogger(__name__)

T = TypeVar("T")
PerRun = str | Callable[[RunContext[Any]], str]
"""A value fixed for every run of the agent, or read from the run (e.g. ``ctx.deps``)."""

WAIT_S = 120.0
"""How long one verdict may take before the output is rejected (or passed, ``fail_open``)."""
KEPT_RUNS = 1024
"""At most this many agent runs' verdicts are kept in :attr:`CritiqueValidator.verdicts`."""


class CritiqueRejected(UnexpectedModelBehavior):  # type: ignore[misc, unused-ignore]  # no extra
    """The fleet did not pass the agent's output, or could not be asked: the run ends here.

    ``result`` is the fleet's last verdict (None when there was none: unreachable, refused,
    timed out); ``reason`` says why in words."""

    def __init__(self, reason: str, result: CritiqueResult | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.result = result


@dataclasses.dataclass
class _Chain:
    """One agent run's outputs so far (oldest first) and the verdict of the latest."""

    submission: Submission
    candidates: list[Any]
    result: CritiqueResult
    tokens_at: int


def _text(value: Any) -> str:
    """A run's prompt as text (content parts joined)."""
    if value is None or isinstance(value, str):
        return value or ""
    return "\n".join(p if isinstance(p, str) else str(getattr(p, "content", "")) for p in value)


class CritiqueValidator:
    """A Pydantic AI output validator served by the critique fleet (see the module docstring).

    ``run_id`` is the manager's run on the fleet (its budget, pitfalls and trace); ``worker_id``
    names the worker an agent run plays (default: ``agent-<the run's id>``); ``task`` what the
    worker was asked (default: the run's prompt). Each may be a string or a function of the
    run's ``RunContext``. ``config`` is the submissions' configuration (policy: ``budget``,
    ``max_repair_attempts``, ``critic`` …); verdict mode adds ``repairer: worker``. ``client``
    is an :class:`AsyncCritiqueClient` to use (default: one per event loop, made here).
    """

    def __init__(
        self,
        *,
        run_id: PerRun,
        worker_id: PerRun | None = None,
        task: PerRun | None = None,
        required_fields: Sequence[str] = (),
        iteration: int = 1,
        mode: Mode = "verdict",
        config: Mapping[str, Any] | None = None,
        client: AsyncCritiqueClient | None = None,
        timeout: float = WAIT_S,
        fail_open: bool = False,
    ) -> None:
        self.config = verdicts.door_config(mode, config)
        self.run_id = run_id
        self.worker_id = worker_id
        self.task = task
        self.required_fields = tuple(required_fields)
        self.iteration = iteration
        self.mode: Mode = mode
        self.timeout = timeout
        self.fail_open = fail_open
        self.verdicts = KeptVerdicts(KEPT_RUNS)
        """The verdict of each agent run this validator saw, by the run's id
        (``AgentRunResult.run_id``), the latest :data:`KEPT_RUNS`."""
        self._clients = verdicts.LoopClients(self.config, client)
        self._chains: dict[str, _Chain] = {}

    # -- the hook ---------------------------------------------------------------------------
    async def __call__(self, ctx: RunContext[Any], output: T) -> T:
        """Pydantic AI's output validator: the output as the fleet lets it pass, or
        ``ModelRetry`` with the defects, or :class:`CritiqueRejected`."""
        if ctx.partial_output:
            return output
        key = ctx.run_id or f"run-{id(ctx.messages):x}"
        chain = self._chains.get(key)
        try:
            if chain is None:
                chain = await self._first(ctx, output)
                self._chains[key] = chain
            else:
                await self._again(ctx, chain, output)
        except (CritiqueError, CritiqueTimeout) as exc:
            self._chains.pop(key, None)
            return self._unreachable(key, output, exc)
        return await self._decide(ctx, key, chain, output)

    async def aclose(self) -> None:
        """Close the running loop's client when this validator made it."""
        await self._clients.aclose()

    # -- steps ------------------------------------------------------------------------------
    async def _first(self, ctx: RunContext[Any], output: Any) -> _Chain:
        """Submit the run's first output; its verdict starts the run's chain."""
        client = self._clients.get()
        sub = Submission(
            run_id=self._per_run(self.run_id, ctx, ""),
            iteration=self.iteration,
            worker_id=self._per_run(self.worker_id, ctx, f"agent-{ctx.run_id or 'run'}"[:128]),
            task=self._per_run(self.task, ctx, _text(ctx.prompt)) or "(no task given)",
            output=verdicts.as_payload(output),
            required_fields=self.required_fields,
        )
        result = await client.wait(await client.submit(sub), timeout=self.timeout)
        return _Chain(sub, [output], result, ctx.usage.total_tokens)

    async def _again(self, ctx: RunContext[Any], chain: _Chain, output: Any) -> None:
        """A re-run's output after ``ModelRetry``: the pass's next repair attempt (verdict
        mode, charged the tokens the re-run spent) or a fresh pass (repair mode)."""
        client = self._clients.get()
        spent = max(0, ctx.usage.total_tokens - chain.tokens_at)
        again = chain.submission.model_copy(update={"output": verdicts.as_payload(output)})
        if self.mode == "verdict" and chain.result.repair_request is not None:
            handle = await client.submit_repair(chain.result, again, tokens=spent)
        else:
            handle = await client.submit(again)
            chain.candidates.clear()
        chain.result = await client.wait(handle, timeout=self.timeout)
        chain.candidates.append(output)
        chain.submission = again
        chain.tokens_at = ctx.usage.total_tokens

    async def _decide(self, ctx: RunContext[Any], key: str, chain: _Chain, output: T) -> T:
        """Pass, retry or reject on the chain's latest verdict."""
        result = chain.result
        if verdicts.passes(result):
            self._end(key, Verdict(result.status, result.stop_reason, result))
            return self._kept(chain, output)
        retries_left = ctx.retry < ctx.max_retries
        if result.stop_reason == "worker_repair":
            if retries_left:
                raise ModelRetry(verdicts.feedback(result))
            await self._release(result)
            reason = (
                f"the agent's output retries ({ctx.max_retries}) ran out while the fleet would "
                "allow another repair attempt (give the agent retries={'output': N} with N at "
                f"least the fleet's max_repair_attempts): {'; '.join(result.why())}"
            )
            self._end(key, Verdict(result.status, reason, result))
            raise CritiqueRejected(reason, result)
        if self.mode == "repair" and result.checked and retries_left:
            raise ModelRetry(verdicts.feedback(result))
        reason = f"the fleet did not pass the output: {result}"
        if not result.checked and self.fail_open:
            log.warning("passing %s on unchecked (fail_open): %s", result.worker_id, reason)
            self._end(key, Verdict("unchecked", reason, result))
            return output
        self._end(key, Verdict(result.status, reason, result))
        raise CritiqueRejected(reason, result)

    def _kept(self, chain: _Chain, output: T) -> T:
        """The output the service kept, as the agent's output: in verdict mode the candidate
        it names (keep-best), in repair mode the repaired output parsed into the agent's type
        (the agent's own object when the service changed nothing)."""
        result = chain.result
        if self.mode == "verdict" or not result.attempts:
            kept = verdicts.kept_candidate(result, chain.candidates)
            if kept is not None:
                return kept  # type: ignore[no-any-return]
        return verdicts.as_output(result.output, output)  # type: ignore[no-any-return]

    def _unreachable(self, key: str, output: T, exc: BaseException) -> T:
        """Fail closed (:class:`CritiqueRejected`), or pass unchecked with ``fail_open``."""
        reason = f"the critique fleet did not check the output: {verdicts.first_line(exc)}"
        self._end(key, Verdict("unchecked", reason))
        if self.fail_open:
            log.warning("passing an output on unchecked (fail_open): %s", reason)
            return output
        raise CritiqueRejected(reason) from exc

    # -- helpers ----------------------------------------------------------------------------
    async def _release(self, result: CritiqueResult) -> None:
        """Tell the fleet a ``worker_repair`` request will not be answered (refund its hold)."""
        try:
            await self._clients.get().release_repair(result)
        except CritiqueError as exc:
            log.warning("could not release %s's repair request: %s", result.worker_id, exc)

    def _end(self, key: str, verdict: Verdict) -> None:
        self._chains.pop(key, None)
        self.verdicts.keep(key, verdict)

    @staticmethod
    def _per_run(value: PerRun | None, ctx: RunContext[Any], default: str) -> str:
        if value is None:
            return default
        return str(value(ctx) if callable(value) else value)


def critique_output(agent: Any | None = None, /, **kwargs: Any) -> CritiqueValidator:
    """A :class:`CritiqueValidator` (keyword arguments as its constructor's), attached to
    ``agent`` as its output validator when one is given."""
    validator = CritiqueValidator(**kwargs)
    if agent is not None:
        agent.output_validator(validator)
    return validator
