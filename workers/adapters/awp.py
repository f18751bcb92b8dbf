"""AWP's delegation loop on the fleet: its ``CritiqueEngine`` calls served by this service.

``awp-agents``' ``DelegationLoopRunner`` builds ``awp.runtime.critique.CritiqueEngine`` when a
workflow says ``orchestration.delegation_loop.critique.enabled: true``. :class:`FleetCritiqueEngine`
is a drop-in for it (a subclass, so every attribute the runner reads is there), and
:func:`install` makes the runner build it; ``critique awp run WORKFLOW_DIR …`` is ``awp run …``
with it installed (docs/awp.md). The workflow file does not change.

What each call does on the fleet:

- ``critique_results``: the iteration's worker results are submitted at once (``repairer:
  worker``, the manager's policy from the workflow's critique block and budget) and their
  verdicts come back as AWP ``CritiqueEnvelope``\\ s, in AWP's order.
- ``attempt_repair``: AWP's meaning (the worker re-runs with AWP's repair instructions, through
  the runner's ``run_worker_fn``), the service's rules: each re-run's output goes back with
  ``repair_of`` and the fleet re-critiques it, keeps the best, stops at a fixpoint, at the attempt
  cap or when the run's repair budget refuses. The tokens a re-run spent, as AWP's budget counted
  them from the provider's usage, are charged to the fleet's budget.
- ``build_pattern_pitfalls_section``: the fleet's Known Pitfalls for the run (every process and
  machine of it), ``get_manager_critique_summary`` / ``get_summary`` / ``_total_repair_tokens``:
  what the fleet did, its budget's spent tokens.

The fleet's critic is the operator's (the workers' configuration): the workflow's ``model`` and
``mode`` are AWP's in-process critic settings and are not sent (a fleet allows only its own
models); set ``CRITIQUE_MODEL`` on the workers instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from awp.runtime import delegation_loop_runner as _runner_module
from awp.runtime.critique import CritiqueEngine
from awp.runtime.critique.models import CritiqueEnvelope, Defect, Pattern, RepairAttempt

from pipeline.errors import CritiqueError, SubmissionError
from pipeline.models import CritiqueResult, PassRef, Submission
from workers.adapters import verdicts
from workers.client import CritiqueClient, CritiqueTimeout, Handle

log = logging.getLogger(__name__)

WAIT_S = 900.0
"""How long one iteration's critiques (or one re-run's re-critique) may take on the fleet."""


def install() -> None:
    """Make AWP's delegation-loop runner (and its child runners) build
    :class:`FleetCritiqueEngine` instead of its in-process engine, in this process."""
    _runner_module.CritiqueEngine = FleetCritiqueEngine


def uninstall() -> None:
    """Give AWP's runner its own engine back."""
    _runner_module.CritiqueEngine = CritiqueEngine


def workflow_total_tokens(workflow_dir: Path, critique_config: Any) -> int | None:
    """The delegation loop's ``budget.max_total_tokens`` from the workflow file
    (``workflow.awp.yaml``), read with AWP's own parser: the loop whose critique block is
    ``critique_config`` (the top-level loop, else a DAG node's). None when it cannot be read."""
    from awp.parser import parse_manifest

    try:
        manifest = parse_manifest(workflow_dir / "workflow.awp.yaml")
    except Exception as exc:
        log.warning("cannot read the workflow's budget (%s): the fleet's budget applies", exc)
        return None
    orchestration = getattr(manifest, "orchestration", None)
    loops = [getattr(orchestration, "delegation_loop", None)]
    loops += [getattr(n, "config", None) for n in getattr(orchestration, "nodes", None) or ()]
    found = [c for c in loops if c is not None and getattr(c, "budget", None) is not None]
    for loop in found:
        if getattr(loop, "critique", None) == critique_config:
            return int(loop.budget.max_total_tokens) or None
    return int(found[0].budget.max_total_tokens) or None if found else None


REPAIRERS = ("worker", "auto", "llm", "deterministic")
"""What the critique block's ``repairer`` may say: ``worker`` (AWP's meaning, the default: the
worker re-runs), or a repair the service makes itself (docs/awp.md)."""


def workflow_repairer(workflow_dir: Path) -> str:
    """The critique block's ``repairer`` (this service's key; AWP's own model ignores it), or
    ``worker`` when the workflow does not say. ``ValueError`` for anything else."""
    import yaml

    try:
        doc = yaml.safe_load((workflow_dir / "workflow.awp.yaml").read_text(encoding="utf-8"))
        block = doc["orchestration"]["delegation_loop"]["critique"]
        value = block.get("repairer", "worker") if isinstance(block, dict) else "worker"
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return "worker"
    if value not in REPAIRERS:
        raise ValueError(
            f"critique.repairer {value!r} in {workflow_dir / 'workflow.awp.yaml'}: use one of "
            f"{', '.join(REPAIRERS)} (worker: AWP re-runs the worker; the others: the fleet "
            "repairs)"
        )
    return str(value)


def service_config(
    critique_config: Any, total_tokens: int | None, repairer: str = "worker"
) -> dict[str, Any]:
    """The submissions' configuration (the manager's policy) from AWP's critique block."""
    config: dict[str, Any] = {
        "repairer": repairer,
        "max_repair_attempts": int(critique_config.max_repair_attempts),
        "repair_budget_fraction": float(critique_config.repair_budget_fraction),
        "min_score_to_complete": float(critique_config.min_score_to_complete),
        "pattern_memory": bool(critique_config.pattern_memory),
    }
    categories = list(getattr(critique_config, "defect_categories", None) or ())
    if categories:
        config["defect_categories"] = categories
    if total_tokens:
        config["budget"] = {"total_tokens": int(total_tokens)}
    return config


def awp_envelope(result: CritiqueResult, worker_id: str) -> CritiqueEnvelope:
    """The fleet's verdict as AWP's ``CritiqueEnvelope``: the best output's score (0.0 for an
    output the fleet did not check, never a made-up 1.0), its defects and prescriptions, and a
    summary that says the status and why."""
    env = result.envelope
    defects = [Defect(**d) for d in verdicts.defect_records(result)]
    if not result.checked:
        defects.append(
            Defect(
                category="incomplete",
                location="",
                description=f"not critiqued by the fleet: {result.status} ({result.stop_reason})",
                severity="warning",
            )
        )
    why = "; ".join(result.why())
    summary = f"fleet: {result.status} ({result.stop_reason}) {result.score_text()}"
    if env.summary:
        summary += f" — {env.summary}"
    if why:
        summary += f" — {why}"
    return CritiqueEnvelope(
        worker_id=worker_id,
        score=float(result.best_score) if result.best_score is not None else 0.0,
        defects=defects,
        prescriptions=list(env.prescriptions),
        reusable_patterns=[p.prevention_rule for p in env.reusable_patterns],
        effort_estimate=str(env.effort_estimate),
        summary=summary,
    )


def refused_envelope(worker_id: str, why: str) -> CritiqueEnvelope:
    """An output the fleet could not critique (refused, failed or timed out): score 0.0 and
    one critical defect that says so, so AWP's gates do not pass it unchecked."""
    return CritiqueEnvelope(
        worker_id=worker_id,
        score=0.0,
        defects=[Defect("incomplete", "", f"the fleet did not critique it: {why}", "critical")],
        summary=f"fleet: not critiqued ({why})",
    )


def clean_output(result: Any) -> Any:
    """A worker result as submitted: AWP's internal ``_``-keys (tool-call logs, critique
    annotations) dropped; anything else as it is."""
    if isinstance(result, Mapping):
        return {str(k): v for k, v in result.items() if not str(k).startswith("_")}
    return result if isinstance(result, str) else str(result)


class FleetCritiqueEngine(CritiqueEngine):  # type: ignore[misc]  # awp ships no types
    """AWP's ``CritiqueEngine``, served by the critique fleet (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        workflow_dir: Path,
        run_id: str,
        worker_model: str = "",
        llm_client: Any = None,
        max_parallel_workers: int = 16,
        metric_writer: Callable[[str, dict[str, Any]], None] | None = None,
        *,
        client: CritiqueClient | None = None,
    ) -> None:
        super().__init__(
            config=config,
            workflow_dir=workflow_dir,
            run_id=run_id,
            worker_model=worker_model,
            llm_client=llm_client,
            max_parallel_workers=max_parallel_workers,
            metric_writer=metric_writer,
        )
        self.fleet_run_id = verdicts.identifier(f"awp-{run_id}", "awp-run")
        total = workflow_total_tokens(Path(workflow_dir), config)
        self.repairer = workflow_repairer(Path(workflow_dir))
        self.fleet_config = service_config(config, total, self.repairer)
        self._client = client if client is not None else CritiqueClient(self.fleet_config)
        self._lock = threading.Lock()
        self._verdicts: dict[tuple[int, str], tuple[Submission, CritiqueResult]] = {}
        self._fleet_history: list[RepairAttempt] = []
        self._fleet_spent = 0

    # -- what the runner reads ------------------------------------------------------------------
    @property
    def _total_repair_tokens(self) -> int:
        """The fleet's repair budget for this run: tokens charged so far (as providers
        reported them; a re-run's as AWP's budget counted them)."""
        try:
            self._fleet_spent = self._client.budget(self.fleet_run_id).spent
        except CritiqueError as exc:
            log.warning("fleet budget unreadable (%s): last known figure used", exc)
        return self._fleet_spent

    @_total_repair_tokens.setter
    def _total_repair_tokens(self, value: int) -> None:
        """AWP's base class sets it to 0 at construction; the fleet's figure is the truth."""

    @property
    def repair_history(self) -> list[RepairAttempt]:
        return list(self._fleet_history)

    def critique_result(
        self,
        worker_id: str,
        worker_result: dict[str, Any],
        task: str,
        envelope: dict[str, Any],
        iteration: int,
    ) -> CritiqueEnvelope:
        """One result, critiqued on the fleet (the batch path is :meth:`critique_results`)."""
        return self.critique_results(
            [{"worker_id": worker_id, "result": worker_result, "envelope": envelope}],
            task,
            iteration,
        )[0]

    def critique_results(
        self,
        delegation_results: list[dict[str, Any]],
        task: str,
        iteration: int,
    ) -> list[CritiqueEnvelope]:
        """Submit the iteration's results to the fleet at once; their verdicts as AWP
        envelopes, in the order given. An output the fleet refuses or does not answer in
        :data:`WAIT_S` gets a critical "not critiqued" envelope (never a pass)."""
        subs: list[Submission | None] = []
        envelopes: list[CritiqueEnvelope | None] = []
        for dr in delegation_results:
            wid = str(dr.get("worker_id", "unknown"))
            try:
                subs.append(self._submission(dr, task, iteration))
                envelopes.append(None)
            except (SubmissionError, ValueError) as exc:
                subs.append(None)
                envelopes.append(refused_envelope(wid, str(exc).splitlines()[0]))
        ready = [s for s in subs if s is not None]
        handles = iter(self._client.submit_many(ready)) if ready else iter(())
        waits: list[tuple[int, Handle]] = [
            (i, next(handles)) for i, s in enumerate(subs) if s is not None
        ]
        for i, handle in waits:
            wid = str(delegation_results[i].get("worker_id", "unknown"))
            sub = subs[i]
            assert sub is not None
            try:
                result = self._client.wait(handle, timeout=WAIT_S)
            except (SubmissionError, CritiqueTimeout) as exc:
                envelopes[i] = refused_envelope(wid, str(exc).splitlines()[0])
                continue
            with self._lock:
                self._verdicts[(iteration, wid)] = (sub, result)
            if result.attempts and self.repairer != "worker":
                self._take_fleet_repair(delegation_results[i], result, wid)
            envelopes[i] = awp_envelope(result, wid)
        return [e for e in envelopes if e is not None]

    def _take_fleet_repair(self, dr: dict[str, Any], result: CritiqueResult, wid: str) -> None:
        """``repairer`` other than ``worker``: the fleet repaired the output itself. AWP's
        result becomes the kept output (its ``_``-keys kept, ``_critique_repairs`` added), and the
        repairs join the history; AWP sees the final verdict and has nothing left to repair."""
        original = dr.get("result")
        final = awp_envelope(result, wid)
        kept: dict[str, Any] = (
            dict(result.output) if isinstance(result.output, Mapping) else {"output": result.output}
        )
        if isinstance(original, Mapping):
            kept.update({k: v for k, v in original.items() if str(k).startswith("_")})
        attempts = [
            RepairAttempt(
                worker_id=wid,
                attempt=a.attempt,
                original_score=a.original_score,
                repaired_score=a.repaired_score,
                defects_fixed=a.defects_fixed,
                defects_remaining=a.defects_remaining,
                critique_before=final,
                critique_after=final,
            )
            for a in result.attempts
        ]
        kept["_critique_repairs"] = [a.to_dict() for a in attempts]
        dr["result"] = kept
        with self._lock:
            self._fleet_history.extend(attempts)

    def attempt_repair(
        self,
        worker_id: str,
        worker_result: dict[str, Any],
        critique: CritiqueEnvelope,
        task: str,
        envelope: dict[str, Any],
        run_worker_fn: Any,
        budget_checker: Any,
        iteration: int,
    ) -> tuple[dict[str, Any], list[RepairAttempt]]:
        """AWP's repair on the fleet's rules: while the fleet's verdict is ``worker_repair``,
        re-run the worker with AWP's repair instructions and send the output back
        (``repair_of``); return the output the fleet kept and one ``RepairAttempt`` per
        re-run. ``critique`` is updated in place to the final verdict, so AWP's artifacts and
        gates read what the manager gets."""
        with self._lock:
            entry = self._verdicts.get((iteration, worker_id))
        if entry is None:
            return worker_result, []
        sub, result = entry
        candidates: list[dict[str, Any]] = [worker_result]
        current_result, current = worker_result, critique
        attempts: list[RepairAttempt] = []
        while result.stop_reason == "worker_repair":
            can_go, reason = budget_checker()
            if not can_go:
                log.warning("AWP budget stops repairs of %s: %s", worker_id, reason)
                self._client.release_repair(result)
                break
            repair_envelope = dict(envelope)
            repair_envelope["instructions"] = self._build_repair_prompt(
                current_result, current, envelope
            )
            repair_envelope["_repair_attempt"] = len(attempts) + 1
            repair_envelope["_original_critique"] = current.to_dict()
            before = _tokens_consumed(budget_checker)
            try:
                repaired = run_worker_fn(repair_envelope, task)
            except Exception as exc:
                log.error("repair worker of %s failed: %s", worker_id, exc)
                self._client.release_repair(result)
                break
            spent = max(0, _tokens_consumed(budget_checker) - before)
            candidates.append(repaired)
            again = sub.model_copy(update={"output": clean_output(repaired)})
            try:
                handle = self._client.submit_repair(result, again, tokens=spent)
                after = self._client.wait(handle, timeout=WAIT_S)
            except (SubmissionError, CritiqueTimeout) as exc:
                log.error("the fleet did not re-critique %s: %s", worker_id, exc)
                break
            new = awp_envelope(after, worker_id)
            attempt = RepairAttempt(
                worker_id=worker_id,
                attempt=len(attempts) + 1,
                original_score=current.score,
                repaired_score=_round_score(after),
                defects_fixed=current.critical_count - new.critical_count,
                defects_remaining=new.critical_count,
                critique_before=current,
                critique_after=new,
            )
            attempts.append(attempt)
            with self._lock:
                self._fleet_history.append(attempt)
                self._verdicts[(iteration, worker_id)] = (sub, after)
            result, current = after, new
            current_result = candidates[
                verdicts.kept_index(after, [clean_output(c) for c in candidates])
            ]
        if attempts:
            _update(critique, current)
        kept = candidates[verdicts.kept_index(result, [clean_output(c) for c in candidates])]
        return kept, attempts

    def build_pattern_pitfalls_section(self) -> str:
        """The fleet's Known Pitfalls for this run (every process and machine of it)."""
        if not self._config.pattern_memory:
            return ""
        try:
            return self._client.pitfalls(self.fleet_run_id)
        except CritiqueError as exc:
            log.warning("fleet pitfalls unreadable (%s): none injected", exc)
            return ""

    def fleet_patterns(self) -> list[Pattern]:
        """The fleet's pattern memory for this run, as AWP's ``Pattern`` records."""
        return [
            Pattern(
                category=p.category,
                frequency=p.frequency,
                description=p.description,
                prevention_rule=p.prevention_rule,
                first_seen_iteration=p.first_seen_iteration,
                last_seen_iteration=p.last_seen_iteration,
            )
            for p in self._client.patterns(self.fleet_run_id, 50)
        ]

    def get_manager_critique_summary(self, critiques: list[CritiqueEnvelope]) -> str:
        """AWP's manager summary, its patterns and repairs the fleet's."""
        self._sync_patterns()
        return str(super().get_manager_critique_summary(critiques))

    def get_summary(self) -> dict[str, Any]:
        """AWP's summary (patterns, repair history, repair tokens) from the fleet, plus where
        to look on the fleet (its run id) and each verdict's status."""
        self._sync_patterns()
        summary: dict[str, Any] = super().get_summary()
        with self._lock:
            statuses = {
                PassRef.field_of(it, wid): f"{r.status} ({r.stop_reason})"
                for (it, wid), (_, r) in sorted(self._verdicts.items())
            }
        summary["fleet"] = {"run_id": self.fleet_run_id, "verdicts": statuses}
        return summary

    # -- helpers --------------------------------------------------------------------------------
    def _submission(self, dr: Mapping[str, Any], task: str, iteration: int) -> Submission:
        wid = str(dr.get("worker_id", "unknown"))
        envelope = dr.get("envelope") or {}
        contract = envelope.get("output_contract") or {}
        required = contract.get("required_fields") or () if isinstance(contract, Mapping) else ()
        instructions = str(envelope.get("instructions") or "")
        return Submission(
            run_id=self.fleet_run_id,
            iteration=max(1, int(iteration)),
            worker_id=verdicts.identifier(wid, "worker"),
            subtask_signature=instructions[:200],
            task=instructions or task,
            output=clean_output(dr.get("result", {})),
            required_fields=tuple(str(f) for f in required),
        )

    def _sync_patterns(self) -> None:
        """AWP's pattern memory (read by its summaries) as the fleet has it now."""
        try:
            patterns = self.fleet_patterns()
        except CritiqueError as exc:
            log.warning("fleet patterns unreadable (%s)", exc)
            return
        self._pattern_memory.patterns = {p.category + ": " + p.prevention_rule: p for p in patterns}
        self._repair_history = list(self._fleet_history)


def _tokens_consumed(budget_checker: Any) -> int:
    """AWP's run-wide token count (its budget's ``tokens_consumed``, fed by the providers'
    usage), read through the budget checker the runner hands ``attempt_repair``."""
    owner = getattr(budget_checker, "__self__", None)
    return int(getattr(owner, "tokens_consumed", 0) or 0)


def _round_score(result: CritiqueResult) -> float:
    """The score of the latest round (the re-critique), not the best one kept."""
    if result.trace:
        return float(result.trace[-1].score)
    return float(result.best_score or 0.0)


def _update(target: CritiqueEnvelope, final: CritiqueEnvelope) -> None:
    """Make ``target`` (the envelope in AWP's list) say ``final``'s verdict."""
    for name in (
        "score",
        "defects",
        "prescriptions",
        "reusable_patterns",
        "effort_estimate",
        "summary",
    ):
        setattr(target, name, getattr(final, name))
