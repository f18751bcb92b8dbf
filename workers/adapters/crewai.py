"""CrewAI's task guardrail on the critique fleet: one import, one line to attach.

::

    from workers.adapters.crewai import CritiqueGuardrail

    critique = CritiqueGuardrail(run_id="q3-sales", agent=analyst)
    task = Task(..., agent=analyst, guardrail=critique.check)

CrewAI calls a task's guardrail with the agent's ``TaskOutput`` and reads ``(bool, value)``:
``(False, feedback)`` re-runs the agent with the feedback in its prompt, ``(True, value)``
replaces the output (text: CrewAI parses it into the task's ``output_pydantic`` /
``output_json`` again). Guardrails are sync, so the guardrail waits with the sync
:class:`~workers.client.CritiqueClient`, in the thread CrewAI runs the task in.

- *verdict* mode (the default; ``repairer: worker``): a due repair returns ``(False, the
  defects in words)`` (:func:`workers.adapters.verdicts.feedback`), so CrewAI re-runs the agent;
  the re-run's output goes back with ``submit_repair`` as that pass's next attempt, charged the
  tokens the re-run spent (the agent's LLM usage counters, ``llm.get_token_usage_summary()``,
  now minus at the previous output: the provider's own counts). The fleet's attempt cap,
  keep-best, fixpoint and run budget decide when re-running stops; a passing verdict returns the
  output the fleet kept, an output the fleet gave up on raises :class:`CritiqueRejected` (the
  task fails with the reason) rather than a re-run past the fleet's cap.
- *repair* mode (the fleet's own repairer): a passing verdict returns ``(True, the fleet's
  output)``, the repaired one as text; an output the fleet could not make pass returns
  ``(False, its defects)`` while CrewAI has guardrail retries left (each re-run is critiqued
  afresh, a new pass of the same worker), then :class:`CritiqueRejected`.
- Fail closed: the fleet unreachable, a refused submission or no verdict within ``timeout``
  return ``(False, the reason in words)``: the output is not passed (CrewAI re-runs the agent
  while it has guardrail retries, asking the fleet again, then fails the task with the reason).
  ``fail_open=True`` passes the output on instead, and :attr:`CritiqueGuardrail.verdicts` marks
  it ``unchecked``.
"""

# No ``from __future__ import annotations`` here: CrewAI checks a guardrail's return annotation
# at run time (it must be ``tuple[bool, Any]`` itself, not its text).
import dataclasses
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from crewai.context import get_current_task_id

from pipeline.errors import CritiqueError
from pipeline.models import CritiqueResult, Submission
from workers.adapters import verdicts
from workers.adapters.verdicts import KeptVerdicts, Mode, Verdict
from workers.client import CritiqueClient, CritiqueTimeout

log = logging.getLogger(__name__)

PerOutput = str | Callable[[Any], str]
"""A value fixed for the task, or read from its ``TaskOutput`` (``description``, ``agent`` …)."""

WAIT_S = 120.0
"""How long one verdict may take before the output is rejected (or passed, ``fail_open``)."""
KEPT_TASKS = 1024
"""At most this many task executions' verdicts are kept in :attr:`CritiqueGuardrail.verdicts`."""


class CritiqueRejected(Exception):
    """The fleet finished with the task's output and did not pass it: the task fails here
    (CrewAI re-raises a guardrail's exception), instead of re-running the agent past the
    fleet's own attempt cap. ``result`` is the fleet's verdict; ``reason`` says why in words."""

    def __init__(self, reason: str, result: CritiqueResult | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.result = result


@dataclasses.dataclass
class _Chain:
    """One task execution's outputs so far (oldest first: their text and their payload) and
    the verdict of the latest; kept only while a re-run of the agent is due."""

    submission: Submission
    texts: list[str]
    payloads: list[Any]
    result: CritiqueResult
    tokens_at: int
    reruns: int = 0


def _fenced_json(raw: str) -> Any:
    """``raw`` parsed as JSON, a Markdown code fence around it allowed; None when it is not."""
    text = raw.strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.rsplit("```", 1)[0]
    try:
        return json.loads(text)
    except ValueError:
        return None


def payload_of(output: Any) -> str | dict[str, Any]:
    """A ``TaskOutput`` as a submission's ``output``: its Pydantic or JSON output as the JSON
    object, else its raw text, parsed when it is a JSON object (a fenced one too) so the fleet
    checks its fields; any other text as it is."""
    if getattr(output, "pydantic", None) is not None:
        return verdicts.as_payload(output.pydantic)
    if getattr(output, "json_dict", None) is not None:
        return verdicts.as_payload(dict(output.json_dict))
    raw = str(getattr(output, "raw", "") or "")
    parsed = _fenced_json(raw)
    if isinstance(parsed, dict):
        return {str(k): v for k, v in parsed.items()}
    return raw


class CritiqueGuardrail:
    """A CrewAI task guardrail served by the critique fleet (see the module docstring).

    ``run_id`` is the manager's run on the fleet (its budget, pitfalls and trace); ``agent`` the
    task's agent: its role names the worker (default worker id) and its LLM's usage counters
    are what a re-run is charged (required in verdict mode: give each agent its own LLM, as
    ``Agent(llm="provider/model")`` does, or concurrent agents' tokens mix). ``worker_id`` and
    ``task`` (default: the task's description and expected output) may be strings or functions
    of the ``TaskOutput``. ``config`` is the submissions' configuration (``budget``,
    ``max_repair_attempts``, ``critic`` …); verdict mode adds ``repairer: worker``. ``client``
    is a :class:`CritiqueClient` to use (default: one made here, so a bad configuration fails
    where the guardrail is built).
    """

    def __init__(
        self,
        *,
        run_id: str,
        agent: Any | None = None,
        worker_id: PerOutput | None = None,
        task: PerOutput | None = None,
        required_fields: Sequence[str] = (),
        iteration: int = 1,
        mode: Mode = "verdict",
        config: Mapping[str, Any] | None = None,
        client: CritiqueClient | None = None,
        timeout: float = WAIT_S,
        fail_open: bool = False,
    ) -> None:
        self.config = verdicts.door_config(mode, config)
        if mode == "verdict" and agent is None:
            raise ValueError(
                "verdict mode charges each re-run's tokens to the run: pass agent= (the task's "
                "agent, whose LLM counts them)"
            )
        self.run_id = run_id
        self.agent = agent
        self.worker_id = worker_id
        self.task = task
        self.required_fields = tuple(required_fields)
        self.iteration = iteration
        self.mode: Mode = mode
        self.timeout = timeout
        self.fail_open = fail_open
        self.client = client if client is not None else CritiqueClient(self.config)
        self.verdicts = KeptVerdicts(KEPT_TASKS)
        """The verdict of each task execution this guardrail saw, by the task's id
        (``str(task.id)``), the latest :data:`KEPT_TASKS`."""
        self._chains: dict[str, _Chain] = {}
        self._lock = threading.Lock()

    # -- the hook ---------------------------------------------------------------------------
    def check(self, output: Any) -> tuple[bool, Any]:
        """The task's guardrail (``Task(guardrail=critique.check)``): ``(True, the output to
        keep)``, ``(False, what to fix)``, or :class:`CritiqueRejected` when the fleet gave up
        on the output. (A bound method, not the object: CrewAI reads a guardrail's source.)"""
        key = get_current_task_id() or f"task-{id(self):x}"
        with self._lock:
            chain = self._chains.pop(key, None)
        try:
            if chain is None:
                chain = self._first(output)
            else:
                self._again(chain, output)
        except (CritiqueError, CritiqueTimeout) as exc:
            return self._unreachable(key, output, exc)
        return self._decide(key, chain, output)

    # -- steps ------------------------------------------------------------------------------
    def _first(self, output: Any) -> _Chain:
        """Submit the task's first output; its verdict starts the execution's chain."""
        expected = str(getattr(output, "expected_output", "") or "")
        described = str(getattr(output, "description", "") or "")
        asked = f"{described}\n\nExpected output: {expected}" if expected else described
        role = str(getattr(self.agent, "role", "") or getattr(output, "agent", "") or "")
        sub = Submission(
            run_id=self.run_id,
            iteration=self.iteration,
            worker_id=self._per_output(
                self.worker_id, output, verdicts.identifier(role, "crewai-agent")
            ),
            task=self._per_output(self.task, output, asked) or "(no task given)",
            output=payload_of(output),
            required_fields=self.required_fields,
        )
        result = self.client.wait(self.client.submit(sub), timeout=self.timeout)
        return _Chain(sub, [str(output.raw)], [sub.output], result, self._tokens())

    def _again(self, chain: _Chain, output: Any) -> None:
        """A re-run's output after ``(False, feedback)``: the pass's next repair attempt
        (verdict mode, charged the tokens the re-run spent) or a fresh pass (repair mode)."""
        now = self._tokens()
        again = chain.submission.model_copy(update={"output": payload_of(output)})
        if self.mode == "verdict" and chain.result.repair_request is not None:
            spent = max(0, now - chain.tokens_at)
            handle = self.client.submit_repair(chain.result, again, tokens=spent)
        else:
            handle = self.client.submit(again)
            chain.texts.clear()
            chain.payloads.clear()
        chain.result = self.client.wait(handle, timeout=self.timeout)
        chain.texts.append(str(output.raw))
        chain.payloads.append(again.output)
        chain.submission = again
        chain.tokens_at = now

    def _decide(self, key: str, chain: _Chain, output: Any) -> tuple[bool, Any]:
        """Pass, re-run or reject on the chain's latest verdict."""
        result = chain.result
        if verdicts.passes(result):
            self._end(key, Verdict(result.status, result.stop_reason, result))
            return True, self._kept(chain)
        retries = self._retries()
        retries_left = retries is None or chain.reruns < retries
        if result.stop_reason == "worker_repair":
            if retries_left:
                return self._rerun(key, chain, verdicts.feedback(result))
            self._release(result)
            reason = (
                f"the task's guardrail retries ({retries}) ran out while the fleet would allow "
                "another repair attempt (give the task guardrail_max_retries at least the "
                f"fleet's max_repair_attempts): {'; '.join(result.why())}"
            )
            self._end(key, Verdict(result.status, reason, result))
            return False, reason
        if self.mode == "repair" and result.checked and retries_left:
            return self._rerun(key, chain, verdicts.feedback(result))
        reason = f"the fleet did not pass the output: {result}"
        if not result.checked:
            if self.fail_open:
                log.warning("passing %s on unchecked (fail_open): %s", result.worker_id, reason)
                self._end(key, Verdict("unchecked", reason, result))
                return True, str(output.raw)
            self._end(key, Verdict(result.status, reason, result))
            return False, reason
        self._end(key, Verdict(result.status, reason, result))
        raise CritiqueRejected(reason, result)

    def _rerun(self, key: str, chain: _Chain, feedback: str) -> tuple[bool, Any]:
        """Keep the chain for the agent's re-run and hand CrewAI the defects."""
        chain.reruns += 1
        with self._lock:
            self._chains[key] = chain
        return False, feedback

    def _kept(self, chain: _Chain) -> str:
        """The output the fleet kept, as the text CrewAI parses: the worker's own text when it
        is one of the chain's outputs (keep-best; untouched when accepted as it was), else the
        fleet's repaired output (text as it is, an object as JSON)."""
        result = chain.result
        i = verdicts.kept_index(result, chain.payloads)
        if verdicts.comparable(chain.payloads[i]) == verdicts.comparable(result.output):
            return chain.texts[i]
        return verdicts.as_text(result.output)

    def _unreachable(self, key: str, output: Any, exc: BaseException) -> tuple[bool, Any]:
        """Fail closed: ``(False, the reason)``; with ``fail_open`` the output passes,
        marked unchecked."""
        reason = f"the critique fleet did not check the output: {verdicts.first_line(exc)}"
        self._end(key, Verdict("unchecked", reason))
        if self.fail_open:
            log.warning("passing an output on unchecked (fail_open): %s", reason)
            return True, str(output.raw)
        return False, reason

    # -- helpers ----------------------------------------------------------------------------
    def _tokens(self) -> int:
        """The agent's LLM's lifetime token count (prompt + completion as the provider reported
        them); 0 without an agent whose LLM counts (repair mode needs none)."""
        summary = getattr(getattr(self.agent, "llm", None), "get_token_usage_summary", None)
        return int(summary().total_tokens) if callable(summary) else 0

    def _retries(self) -> int | None:
        """The running task's ``guardrail_max_retries`` (the agent's executor's task, when it
        is the task CrewAI is running now); None when it cannot be told."""
        task = getattr(getattr(self.agent, "agent_executor", None), "task", None)
        if task is None or str(getattr(task, "id", "")) != get_current_task_id():
            return None
        retries = getattr(task, "guardrail_max_retries", None)
        return retries if isinstance(retries, int) else None

    def _release(self, result: CritiqueResult) -> None:
        """Tell the fleet a ``worker_repair`` request will not be answered (refund its hold)."""
        try:
            self.client.release_repair(result)
        except CritiqueError as exc:
            log.warning("could not release %s's repair request: %s", result.worker_id, exc)

    def _end(self, key: str, verdict: Verdict) -> None:
        with self._lock:
            self._chains.pop(key, None)
            self.verdicts.keep(key, verdict)

    @staticmethod
    def _per_output(value: PerOutput | None, output: Any, default: str) -> str:
        if value is None:
            return default
        return str(value(output) if callable(value) else value)
