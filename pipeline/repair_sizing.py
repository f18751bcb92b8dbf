"""Repair sizing: the one place a repair round is ordered and sized (see docs/pipeline.md,
"The repair budget").

:func:`order_repair` reads the Known Pitfalls the serving reviser gets once, renders the repair
prompt once (only for a token-spending reviser), and sizes the round's
:class:`~pipeline.repair.RepairBound`: the repair call plus the re-critique of its output, each
part from the reviser or critic that serves the submission. The decide stage reserves that
bound in the repair budget; the repair stage hands the same pitfalls and prompt to the
reviser, so what was sized is what is sent. The policy's pieces (the prompt, the estimates)
are :mod:`pipeline.repair`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipeline.critics.base import Critic, PromptedReviser, Reviser, SizedCritic, resolve_for
from pipeline.models import CritiqueEnvelope, RepairAttempt, Submission
from pipeline.repair import (
    RepairBound,
    RepairOrder,
    build_repair_prompt,
    estimated_critique_tokens,
    estimated_output_tokens,
    estimated_repair_tokens,
)

PitfallsFn = Callable[[Critic | Reviser], str]
"""``pitfalls(reader) -> str``: the Known Pitfalls text a critic or reviser gets ("" when it
does not read them or pattern memory is off)."""


def order_repair(
    submission: Submission,
    output: str | dict[str, Any],
    envelope: CritiqueEnvelope,
    attempts: Sequence[RepairAttempt],
    *,
    round_no: int,
    reviser: Reviser,
    critic: Critic,
    pitfalls: PitfallsFn,
    sized: bool = True,
) -> RepairOrder:
    """The next repair round of ``output``, ordered once; ``round_no`` is its re-critique's round.

    Without ``sized`` (no budget cap) only the pitfalls are read. With it, each part of the
    bound is 0 when the serving reviser or critic is token-free; its own count when it can size
    its calls (:class:`~pipeline.critics.base.PromptedReviser` /
    :class:`~pipeline.critics.base.SizedCritic`: counted prompt + the ``max_tokens`` it will
    call with); else the estimates of :mod:`pipeline.repair`. The order keeps the rendered
    prompt only for a prompted reviser (any other renders its own: the prompt only sized it).
    """
    serving_reviser: Reviser = resolve_for(reviser, submission)
    reviser_pitfalls = pitfalls(serving_reviser)
    if not sized:
        return RepairOrder(pitfalls=reviser_pitfalls)
    serving_critic: Critic = resolve_for(critic, submission)
    output_tokens = estimated_output_tokens(output)
    prompt: str | None = None
    if serving_reviser.token_free:
        repair = 0
    else:
        prompt = build_repair_prompt(submission, output, envelope, reviser_pitfalls, attempts)
        if isinstance(serving_reviser, PromptedReviser):
            repair, output_tokens = serving_reviser.repair_bound(
                submission,
                output,
                envelope,
                pitfalls=reviser_pitfalls,
                attempts=attempts,
                prompt=prompt,
            )
        else:
            repair = estimated_repair_tokens(prompt, output)
            prompt = None  # this reviser renders nothing: the prompt only sized its call
    if serving_critic.token_free:
        critique = 0
    else:
        critic_pitfalls = (
            reviser_pitfalls
            if serving_critic.reads_pitfalls == serving_reviser.reads_pitfalls
            else pitfalls(serving_critic)
        )
        if isinstance(serving_critic, SizedCritic):
            critique = serving_critic.critique_bound(
                submission,
                output,
                output_tokens=output_tokens,
                pitfalls=critic_pitfalls,
                round=round_no,
            )
        else:
            critique = estimated_critique_tokens(submission, output_tokens, critic_pitfalls)
    bound = RepairBound(repair=repair, critique=critique, output_tokens=output_tokens)
    return RepairOrder(pitfalls=reviser_pitfalls, prompt=prompt, bound=bound)
