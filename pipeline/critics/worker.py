"""The worker as the reviser (``repairer: worker``): the service critiques, the worker repairs.

A delegation-loop manager that re-runs its worker with the defects (AWP's repair, the *verdict*
mode of the framework adapters) keeps the service's rules for everything around that re-run:
the decide stage decides a repair is due exactly as for any token-spending reviser (no plan: a
worker, like a model, may fix anything), sizes it and reserves it in the run's repair budget;
then, instead of calling a model, the repair stage hands the pass back (stop reason
``worker_repair``) and parks its state. The worker's new output, submitted with
``repair_of``, resumes that state at Layer-0 as the repair's result: re-critique, keep-best,
the fixpoint test, the attempt cap and the budget's charge run as they would after a repair the
service made (:func:`pipeline.loop.stages.l0_stage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.critics.base import RevisionResult
from pipeline.models import CritiqueEnvelope, RepairAttempt, Submission


class WorkerRepairDue(Exception):
    """Raised by :meth:`WorkerReviser.revise`: the runner hands the pass back instead of
    calling it, so reaching it is a wiring error, not a repair."""


class WorkerReviser:
    """``repairer: worker``: the manager's worker makes each repair; this object only declares
    the capabilities the decide stage sizes the repair by (it spends tokens, on the manager's
    side, and reads the Known Pitfalls the repair prompt carries)."""

    name = "worker"
    token_free = False
    reads_pitfalls = True

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        raise WorkerRepairDue(
            "repairer 'worker': the manager's worker makes this repair; the runner hands the "
            "pass back (stop reason worker_repair) instead of calling a reviser"
        )
