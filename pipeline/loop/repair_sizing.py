"""Repair sizing: the one place a repair round is ordered and sized (see docs/pipeline.md,
"The repair budget").

:func:`order_repair` reads the Known Pitfalls the serving reviser gets once, renders the repair
prompt once (only for a token-spending reviser), and sizes the round's
:class:`~pipeline.loop.repair.RepairBound`: the repair call plus the re-critique of its output, each
part from the reviser or critic that serves the submission. The decide stage reserves that
bound in the repair budget; the repair stage hands the same pitfalls and prompt to the
reviser, so what was sized is what is sent. The policy's pieces (the estimates) are
:mod:`pipeline.loop.repair`'s, the prompt :func:`pipeline.critics.llm_prompts.build_repair_prompt`.

Given what the run's committed repairs used (a :class:`~pipeline.store.base.RepairUsage`), the
round is sized tighter when it can be: the repaired output's bound (the repair call's
``max_tokens``, and the size the re-critique counts it at) follows the largest growth they
showed and the re-critique's reply the longest reply they got, each with a margin
(:func:`~pipeline.loop.repair.tight_output_tokens`,
:func:`~pipeline.loop.repair.tight_reply_tokens`). Only a round whose every LLM call is made within
the reservation can be sized so (a :class:`~pipeline.critics.base.PromptedReviser`, and a
:class:`~pipeline.critics.base.SizedCritic` or a token-free critic): what it may spend is then
bounded by the smaller reservation too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipeline.critics.base import Critic, PromptedReviser, Reviser, SizedCritic, resolve_for
from pipeline.critics.llm_prompts import build_repair_prompt
from pipeline.loop.repair import (
    RepairBound,
    RepairOrder,
    estimated_critique_tokens,
    estimated_output_tokens,
    estimated_repair_tokens,
    tight_output_tokens,
    tight_reply_tokens,
)
from pipeline.models import CritiqueEnvelope, RepairAttempt, Submission
from pipeline.store.base import RepairUsage

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
    usage: RepairUsage | None = None,
) -> RepairOrder:
    """The next repair round of ``output``, ordered once; ``round_no`` is its re-critique's round.

    Without ``sized`` (no budget cap) only the pitfalls are read. With it, each part of the
    bound is 0 when the serving reviser or critic is token-free; its own count when it can size
    its calls (:class:`~pipeline.critics.base.PromptedReviser` /
    :class:`~pipeline.critics.base.SizedCritic`: counted prompt + the ``max_tokens`` it will
    call with); else the estimates of :mod:`pipeline.loop.repair`. The order keeps the rendered
    prompt only for a prompted reviser (any other renders its own: the prompt only sized it).

    With ``usage`` (what the run's committed repairs used), the round is sized from it when
    that gives a smaller bound (:func:`tight_bound`): the order's ``bound`` is then the tight
    one, ``full_bound`` the full one and ``reply_tokens`` the repair call's ``max_tokens``;
    without history, or when nothing is gained, the order is the full one.
    """
    serving_reviser: Reviser = resolve_for(reviser, submission)
    reviser_pitfalls = pitfalls(serving_reviser)
    if not sized:
        return RepairOrder(pitfalls=reviser_pitfalls)
    serving_critic: Critic = resolve_for(critic, submission)
    output_tokens = estimated_output_tokens(output)
    prompt: str | None = None
    critic_pitfalls = ""
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
    order = RepairOrder(pitfalls=reviser_pitfalls, prompt=prompt, bound=bound)
    if usage is None:
        return order
    return _sized_from_usage(
        order,
        submission,
        output,
        envelope,
        attempts,
        round_no=round_no,
        reviser=serving_reviser,
        critic=serving_critic,
        critic_pitfalls=critic_pitfalls,
        usage=usage,
    )


def _sized_from_usage(
    order: RepairOrder,
    submission: Submission,
    output: str | dict[str, Any],
    envelope: CritiqueEnvelope,
    attempts: Sequence[RepairAttempt],
    *,
    round_no: int,
    reviser: Reviser,
    critic: Critic,
    critic_pitfalls: str,
    usage: RepairUsage,
) -> RepairOrder:
    """``order`` (full) sized from ``usage`` when :func:`tight_bound` gives a smaller bound, by
    the serving ``reviser`` and ``critic`` that sized it; else ``order`` itself. Only a prompted
    reviser with a sized or token-free critic: their calls are made within the reservation."""
    prompt = order.prompt
    if prompt is None or not isinstance(reviser, PromptedReviser):
        return order
    if not (critic.token_free or isinstance(critic, SizedCritic)):
        return order  # an estimated critic's calls are not made within the reservation
    prompted: PromptedReviser = reviser
    full = order.bound

    def resize(output_bound: int, reply_bound: int | None) -> RepairBound:
        repair_part, out = prompted.repair_bound(
            submission,
            output,
            envelope,
            pitfalls=order.pitfalls,
            attempts=attempts,
            prompt=prompt,
            max_tokens=output_bound,
        )
        critique_part = 0
        if full.critique > 0 and isinstance(critic, SizedCritic):
            critique_part = critic.critique_bound(
                submission,
                output,
                output_tokens=out,
                pitfalls=critic_pitfalls,
                round=round_no,
                reply_tokens=reply_bound,
            )
        return RepairBound(repair=repair_part, critique=critique_part, output_tokens=out)

    tight = tight_bound(output, full, usage, resize)
    if tight is None:
        return order
    return order.model_copy(
        update={"bound": tight, "full_bound": full, "reply_tokens": tight.output_tokens}
    )


ResizeFn = Callable[[int, int | None], RepairBound]
"""``resize(output_tokens, reply_tokens) -> RepairBound``: the round sized again with the
repaired output's bound (the repair call's ``max_tokens``) and the re-critique reply's bound
(None: the critic's own)."""


def tight_bound(
    output: str | dict[str, Any], full: RepairBound, usage: RepairUsage, resize: ResizeFn
) -> RepairBound | None:
    """The round's bound sized from what the run's committed repairs used, or None.

    The repaired output's bound follows the largest growth they showed
    (:func:`~pipeline.loop.repair.tight_output_tokens`, never above ``full.output_tokens``) and,
    when the round has a re-critique to pay for, the reply's the longest re-critique reply they got
    (:func:`~pipeline.loop.repair.tight_reply_tokens`); ``resize`` counts the round again with them.
    None without that history (no model-written repair committed, or no re-critique reply
    when there is a re-critique), or when the result is not smaller than ``full`` in total
    and no larger in each part (it never is larger: each bound is the lesser)."""
    if full.repair <= 0:
        return None  # nothing of the repair call to size: a token-free reviser
    out = tight_output_tokens(output, usage.growth, full.output_tokens)
    if out is None:
        return None
    reply = None
    if full.critique > 0:
        reply = tight_reply_tokens(usage.reply)
        if reply is None:
            return None
    tight = resize(out, reply)
    if tight.repair > full.repair or tight.critique > full.critique:
        return None
    if tight.total >= full.total:
        return None
    return tight
