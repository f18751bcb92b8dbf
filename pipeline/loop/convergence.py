"""Convergence: one round's decision, :func:`decide_round`.

:func:`decide_round` is pure: it takes the :class:`RoundFacts` of the round just critiqued and
the configuration, and answers a :class:`RoundDecision` — ``accept``, ``repair`` or ``stop``
(with the stop reason, the result status and a one-line reason), or ``ask`` for one more fact
it needs and was not given (``fixpoint``, ``plan``, ``budget``). The decide stage
(:func:`pipeline.loop.stages.decide_stage`) gathers what is asked (the fixpoint test, the reviser's
plan, the budget's answer to the repair's reservation) and decides again, so each fact is
looked up only when the rules get to it, in the order below. First match wins.

Generic critics, round 1 (no repair yet), the band policy (a critical defect repairs
unless the score is in the escalate band):

    escalate_band        score < 0.3 → status ``escalated``, no repair
    (repair)             a critical defect, a Layer-0 error or score < 0.6
    attempts_exhausted   …but ``max_repair_attempts`` is 0
    accepted             otherwise (≥ 0.9 ``accepted``, else ``accepted_with_warnings``)

After a repair (generic critics), or any round (rubric critics):

    accepted                  score ≥ 0.6, no critical defect, no L0 error (generic critics)
    target                    every rubric dimension ≥ target (rubric critics; their "accepted")
    repair_fixpoint_detected  consecutive repair outputs ≥ 0.95 similar → status ``failed``
    no_improvement            score not strictly above the previous round's (generic critics)
    plateau                   rubric mean improved < epsilon for ``plateau_window`` rounds running
    attempts_exhausted        ``max_repair_attempts`` repairs done (generic critics)
    budget                    round ≥ ``rubric.max_rounds`` (rubric critics)

Then, when the loop would repair (or ran out of attempts after repairing):

    needs_model               the reviser's plan fixes nothing: what is left needs a model or a
                              person (the deterministic reviser invents nothing), so
                              no round is spent on it → status ``escalated``
    repair_budget_exhausted   the repair-budget semaphore refused the next repair's reservation

Rubric critics skip ``no_improvement``: one flat round is noise for a rubric (the seed's reason
for a two-round plateau window), so ``plateau`` is their equivalent; with flat scores the loop
ends in ``plateau``, or in ``budget`` when plateau detection is off (``plateau_epsilon`` 0) or
``max_rounds`` comes first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Literal

from pydantic import Field

from pipeline.config import CritiqueConfig, RubricConfig
from pipeline.loop.repair import ACCEPT_CLEAN_FROM, ESCALATE_BELOW, REPAIR_BELOW
from pipeline.models import Frozen, Status, StopReason, Verdict

STOP_VERDICT: dict[StopReason, Verdict] = {
    "accepted": "accepted",
    "target": "target",
    "repair_fixpoint_detected": "fixpoint",
    "no_improvement": "no_improvement",
    "plateau": "plateau",
    "attempts_exhausted": "budget",
    "budget": "budget",
    "repair_budget_exhausted": "budget",
    "escalate_band": "escalated",
    "needs_model": "escalated",
    "worker_repair": "continue",
}
"""The round verdict that each stop reason is reported as."""


STOP_TEXT: dict[StopReason, str] = {
    "accepted": "score ≥ 0.6 with no critical defect and no Layer-0 error",
    "disabled": "critique is off (enabled: false): nothing was checked",
    "cancelled": "the pass was cancelled (critique cancel / client.cancel) before its verdict",
    "target": "every rubric dimension reached the target score",
    "repair_fixpoint_detected": "two consecutive repair outputs are ≥ 0.95 similar",
    "no_improvement": "the score did not strictly improve over the previous round",
    "plateau": "the rubric mean stopped improving (below epsilon for the plateau window)",
    "attempts_exhausted": "max_repair_attempts repairs were made",
    "budget": "the round cap (rubric.max_rounds) was reached",
    "repair_budget_exhausted": "the run's repair budget refused the next repair",
    "escalate_band": "the score is in the escalate band (< 0.3): no repair",
    "needs_model": "the deterministic reviser can fix none of the remaining defects without "
    "inventing content: a model or a person must act",
    "worker_repair": "a repair is due and the worker makes it (repairer: worker): the manager "
    "re-runs it and submits the output with repair_of",
}
"""One line per stop reason, for traces and the CLI."""


def verdict_for(stop: StopReason | None) -> Verdict:
    """``continue`` while the loop goes on, else the stop reason's verdict."""
    return "continue" if stop is None else STOP_VERDICT[stop]


def target_met(scores: Mapping[str, float], rubric: RubricConfig) -> bool:
    """Every configured dimension ≥ the target (a high mean with one weak dimension is not)."""
    return all(scores.get(d, float("-inf")) >= rubric.target_score for d in rubric.dimensions)


def plateau_detected(means: Sequence[float], epsilon: float, window: int) -> bool:
    """True when each of the last ``window`` round-over-round improvements is < ``epsilon``."""
    if len(means) < window + 1:
        return False
    tail = list(means[-(window + 1) :])
    return all(b - a < epsilon - 1e-9 for a, b in pairwise(tail))


Ask = Literal["fixpoint", "plan", "budget"]
"""A fact :func:`decide_round` needs before it can decide."""


class RoundFacts(Frozen):
    """What the round just critiqued knows; :func:`decide_round` decides from these alone.

    The last three are looked up on demand (None: not looked up yet; :func:`decide_round`
    answers ``ask`` for the first one its rules reach)."""

    round: int = Field(ge=1)
    """Critiques done, this one included."""
    repairs_done: int = Field(0, ge=0)
    score: float
    previous_score: float | None = None
    """The previous round's score (None on round 1)."""
    means: tuple[float, ...] = ()
    """The mean of every round so far, this round last (the rubric's weighted mean)."""
    critical: int = Field(0, ge=0)
    """Critical defects in the envelope (Layer-0 ones included)."""
    l0_failed: bool = False
    """Layer-0 reported an error."""
    acceptable: bool = False
    """Score ≥ 0.6, no critical defect, no Layer-0 error."""
    target: bool = False
    """Every rubric dimension reached the target (rubric critics), no critical defect."""
    best_score: float = 0.0
    """The best round's score so far, this one included (for the status)."""
    best_acceptable: bool = False
    best_target: bool = False
    fixpoint: bool | None = None
    """The last two repair outputs are ≥ 0.95 similar (False before a second repair)."""
    unfixable: bool | None = None
    """The serving reviser's plan would change nothing (False when it cannot tell)."""
    budget: Literal["granted", "refused"] | None = None
    """The repair budget's answer to the next repair's reservation ("granted" too when no cap
    binds or the round spends no tokens)."""
    refusal: str = ""
    """Why the budget refused (the reason of ``repair_budget_exhausted``)."""


class RoundDecision(Frozen):
    """What to do after a round: ``accept`` or ``stop`` (both end the loop, with a stop reason
    and a status), ``repair``, or ``ask`` for the fact named in ``ask``."""

    action: Literal["accept", "repair", "stop", "ask"]
    ask: Ask | None = None
    stop_reason: StopReason | None = None
    status: Status | None = None
    reason: str = ""
    """One line for the trace: why (the band policy's reason on round 1, else the stop's)."""

    @property
    def done(self) -> bool:
        """True when the loop ends here."""
        return self.action in ("accept", "stop")


def _ask(what: Ask) -> RoundDecision:
    return RoundDecision(action="ask", ask=what)


def _band(facts: RoundFacts, max_repair_attempts: int) -> tuple[StopReason | None, str]:
    """Generic critics, round 1: escalate, repair (unless no repair is allowed) or accept."""
    score = facts.score
    if score < ESCALATE_BELOW:
        return (
            "escalate_band",
            f"score {score:.2f} is in the escalate band (< {ESCALATE_BELOW:g})",
        )
    if facts.critical or facts.l0_failed or score < REPAIR_BELOW:
        why = []
        if facts.critical:
            why.append(f"{facts.critical} critical defect(s)")
        if facts.l0_failed:
            why.append("a Layer-0 error")
        if score < REPAIR_BELOW:
            why.append(f"score {score:.2f} < {REPAIR_BELOW:g}")
        reason = "repair: " + ", ".join(why)
        return ("attempts_exhausted" if max_repair_attempts <= 0 else None), reason
    return "accepted", f"score {score:.2f}, no critical defect"


def _status(stop: StopReason, facts: RoundFacts) -> Status:
    """The result status: accepted/with warnings on round 1, repaired, failed or escalated."""
    if stop == "repair_fixpoint_detected":
        return "failed"
    if stop == "needs_model":
        return "escalated"
    if facts.repairs_done == 0:
        if stop == "accepted":
            return "accepted" if facts.best_score >= ACCEPT_CLEAN_FROM else "accepted_with_warnings"
        if stop == "target":
            return "accepted"
        return "escalated"
    if stop in ("accepted", "target") or facts.best_acceptable or facts.best_target:
        return "repaired"
    return "escalated"


def decide_round(facts: RoundFacts, config: CritiqueConfig) -> RoundDecision:
    """The round's decision (the rules and their order are in this module's docstring).

    Rubric critics (``config.critic == "rubric"``) use the rubric rules on every round and
    ignore ``max_repair_attempts`` and the escalate band; generic critics use the band policy
    on round 1 and the generic rules after a repair."""
    rubric = config.rubric if config.critic == "rubric" else None
    stop: StopReason | None = None
    reason = ""
    if rubric is None and facts.repairs_done == 0:
        stop, reason = _band(facts, config.max_repair_attempts)
    elif rubric is not None:
        if facts.target:
            stop = "target"
        elif facts.fixpoint is None:
            return _ask("fixpoint")
        elif facts.fixpoint:
            stop = "repair_fixpoint_detected"
        elif plateau_detected(facts.means, rubric.plateau_epsilon, rubric.plateau_window):
            stop = "plateau"
        elif facts.round >= rubric.max_rounds:
            stop = "budget"
    elif facts.acceptable:
        stop = "accepted"
    elif facts.fixpoint is None:
        return _ask("fixpoint")
    elif facts.fixpoint:
        stop = "repair_fixpoint_detected"
    elif facts.previous_score is not None and facts.score <= facts.previous_score:
        stop = "no_improvement"
    elif facts.repairs_done >= config.max_repair_attempts:
        stop = "attempts_exhausted"

    if stop is None or (stop == "attempts_exhausted" and facts.repairs_done > 0):
        if facts.unfixable is None:
            return _ask("plan")
        if facts.unfixable:
            stop, reason = "needs_model", STOP_TEXT["needs_model"]
    if stop is None:
        if facts.budget is None:
            return _ask("budget")
        if facts.budget == "refused":
            stop, reason = "repair_budget_exhausted", facts.refusal
    if stop is None:
        return RoundDecision(action="repair", reason=reason)
    return RoundDecision(
        action="accept" if stop in ("accepted", "target") else "stop",
        stop_reason=stop,
        status=_status(stop, facts),
        reason=reason or STOP_TEXT[stop],
    )
