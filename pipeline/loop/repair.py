"""The repair policy's pieces: the band thresholds, the repair round's order and its cost (see
docs/pipeline.md, "The repair budget").

The round's decision itself (accept / repair / stop) is
:func:`pipeline.loop.convergence.decide_round`, which uses the thresholds here. The text an LLM
repairer is sent is :func:`pipeline.critics.llm_prompts.build_repair_prompt` (targeted: only
critical and warning defects, and the instruction to change nothing else), and a repair call's
``max_tokens`` is :func:`pipeline.llm.tokens.repair_reply_tokens` (lower in a round sized from
what the run's repairs used: :func:`tight_output_tokens`). A repair round is ordered once, in
the decide stage, as a :class:`RepairOrder`: the Known Pitfalls the reviser gets, the prompt
rendered once (for a reviser that sends it to a model), and the :class:`RepairBound` the round
reserves in the repair-budget semaphore — the repair call's counted prompt plus its
``max_tokens``, and the re-critique's counted prompt (with the repaired output at its largest)
plus its reply's ``max_tokens`` (a short envelope: ``llm.recritique_max_tokens``); each part is
0 when the reviser or critic that serves the submission is token-free. LLM revisers and critics
size their own parts (``repair_bound`` / ``critique_bound``, :mod:`pipeline.critics.llm`); for
any other (a configured ``module:function`` repairer, a custom critic)
:mod:`pipeline.loop.repair_sizing` falls back to :func:`estimated_repair_tokens` and
:func:`estimated_critique_tokens`. The repair stage then hands the same pitfalls and prompt to
the reviser, so what was sized is what is sent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from pipeline.critics.llm_prompts import build_repair_prompt
from pipeline.llm.tokens import SIZE_GROWTH_LIMIT, estimate_tokens, text_of
from pipeline.models import (
    CritiqueEnvelope,
    Frozen,
    RepairAttempt,
    Submission,
)

ESCALATE_BELOW = 0.3
"""Scores under this are escalated to the manager without repair (the escalate band)."""
REPAIR_BELOW = 0.6
"""Scores under this are repaired even without a critical defect."""
ACCEPT_CLEAN_FROM = 0.9
"""Scores from this up are ``accepted``; below it (and ≥ 0.6) ``accepted_with_warnings``."""

CRITIC_OVERHEAD_TOKENS = 1500
"""Allowance for a re-critique's fixed prompt parts (instructions, schema) and its reply, for a
critic that cannot size its own call (see :func:`estimated_critique_tokens`)."""
TIGHT_MARGIN = 1.25
"""A round sized from what this run's repairs used (:func:`tight_output_tokens`,
:func:`tight_reply_tokens`) leaves room for 25 % more than the most they used…"""
TIGHT_SLACK_TOKENS = 16
"""… plus this many tokens (rounding, the size line of the re-critique's prompt)."""


class RepairBound(Frozen):
    """What one repair round reserves: the repair call and the re-critique of its output."""

    repair: int = Field(0, ge=0)
    """Tokens for the repair call(s): 0 when the reviser is token-free."""
    critique: int = Field(0, ge=0)
    """Tokens for the re-critique: 0 when the critic is token-free."""
    output_tokens: int = Field(0, ge=0)
    """The repaired output's size bound (tokens) the re-critique's part was sized with."""

    @property
    def total(self) -> int:
        """The reservation: both parts."""
        return self.repair + self.critique


class RepairOrder(Frozen):
    """One repair round as the decide stage ordered it, carried to the repair stage: what the
    reviser is handed, and what the round reserved. Built once per round
    (:func:`pipeline.loop.repair_sizing.order_repair`)."""

    pitfalls: str = ""
    """The Known Pitfalls text the serving reviser gets ("" when it does not read them)."""
    prompt: str | None = None
    """The targeted repair prompt, rendered once to size the round, for a reviser that sends
    it to a model (None: the reviser renders nothing, or the round was not sized)."""
    bound: RepairBound = Field(default_factory=RepairBound)
    """What the round may spend (all zero when it was not sized: no budget cap)."""
    reply_tokens: int | None = Field(None, ge=1)
    """The repair call's ``max_tokens`` when the round was sized from what this run's repairs
    used (``bound.output_tokens``); None: the reviser's own (:func:`repair_reply_tokens`)."""
    full_bound: RepairBound | None = None
    """The round's full bound when :attr:`bound` is the tighter one sized from what this run's
    repairs used (the full one would pass the cap); None: :attr:`bound` is the full bound."""


def is_acceptable(score: float, envelope: CritiqueEnvelope, l0_failed: bool) -> bool:
    """Acceptable = score ≥ 0.6, no critical defect and no Layer-0 error."""
    return score >= REPAIR_BELOW and not envelope.critical and not l0_failed


def estimated_output_tokens(output: str | dict[str, Any]) -> int:
    """A repaired output's size (tokens, estimated) for revisers that cannot size their own
    calls: 2.5× the output's, the growth Layer-0 accepts from any but a tiny output."""
    return math.ceil(SIZE_GROWTH_LIMIT * estimate_tokens(text_of(output))) + 1


def repair_growth(before: str | dict[str, Any], after: str | dict[str, Any], written: int) -> int:
    """The growth one repair showed, in thousandths (what its commit brings to the run's
    :class:`~pipeline.store.base.RepairUsage`): the repaired output's tokens, the larger of what
    the provider reported the repair call wrote (``written``, its completion tokens) and the
    estimate of the output as the re-critique shows it, per token of the output it repaired.
    0 when no model wrote it (``written`` 0: a token-free fallback's output says nothing about
    what the model writes)."""
    if written <= 0:
        return 0
    base = max(1, estimate_tokens(text_of(before)))
    grown = max(written, estimate_tokens(text_of(after)))
    return math.ceil(1000 * grown / base)


def tight_output_tokens(output: str | dict[str, Any], growth: int, full: int) -> int | None:
    """The repaired output's bound in a round sized from what this run's repairs used: the
    repair call's ``max_tokens``, and the size the re-critique's part counts the repaired output
    at. ``output``'s tokens grown by ``growth`` (thousandths: the largest growth the run's
    committed repairs showed, :func:`repair_growth`) with :data:`TIGHT_MARGIN`, plus
    :data:`TIGHT_SLACK_TOKENS`; never above ``full`` (the full bound's, the size Layer-0 still
    accepts). None without history (``growth`` 0)."""
    if growth <= 0:
        return None
    tokens = max(1, estimate_tokens(text_of(output)))
    grown = math.ceil(tokens * growth * TIGHT_MARGIN / 1000) + TIGHT_SLACK_TOKENS
    return max(1, min(full, grown))


def tight_reply_tokens(reply: int, full: int | None = None) -> int | None:
    """The re-critique reply's bound in a round sized from what this run's repairs used: the
    longest re-critique reply the run's committed rounds saw (``reply``, completion tokens) with
    :data:`TIGHT_MARGIN`, plus :data:`TIGHT_SLACK_TOKENS`; never above ``full`` (the critic's
    own, ``llm.recritique_max_tokens``, when given). None without history (``reply`` 0)."""
    if reply <= 0:
        return None
    bound = math.ceil(reply * TIGHT_MARGIN) + TIGHT_SLACK_TOKENS
    return max(1, bound if full is None else min(full, bound))


def estimated_repair_tokens(prompt: str, output: str | dict[str, Any]) -> int:
    """A repair call's tokens for a reviser that cannot size its own: the rendered repair
    ``prompt`` (estimated) plus the repaired output (:func:`estimated_output_tokens`)."""
    return estimate_tokens(prompt) + estimated_output_tokens(output)


def estimated_critique_tokens(submission: Submission, output_tokens: int, pitfalls: str) -> int:
    """A re-critique's tokens for a critic that cannot size its own: the task, the repaired
    output (``output_tokens``), the pitfalls and a fixed allowance for instructions and reply."""
    return (
        estimate_tokens(submission.task)
        + output_tokens
        + estimate_tokens(pitfalls)
        + CRITIC_OVERHEAD_TOKENS
    )


def repair_token_bound(
    submission: Submission,
    output: str | dict[str, Any],
    envelope: CritiqueEnvelope,
    pitfalls: str,
    attempts: Sequence[RepairAttempt],
) -> int:
    """The estimated bound of one repair round whose reviser and critic cannot size their own
    calls: :func:`estimated_repair_tokens` + :func:`estimated_critique_tokens`."""
    prompt = build_repair_prompt(submission, output, envelope, pitfalls, attempts)
    return estimated_repair_tokens(prompt, output) + estimated_critique_tokens(
        submission, estimated_output_tokens(output), pitfalls
    )
