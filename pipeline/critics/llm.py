"""The LLM critic, the LLM reviser and the paired critic (docs/llm.md).

All three take an injected :class:`~pipeline.llm.completion.Completer` (tests pass a fake); nothing
here imports litellm. The pieces they are built from live beside them:
:mod:`pipeline.critics.llm_prompts` (the messages), :mod:`pipeline.critics.llm_reply` (what
the model must reply and how a reply is parsed) and :mod:`pipeline.security.injection` (the
injection scan, which pattern memory uses too). Rules:

- **Replies.** An unusable reply (:class:`~pipeline.critics.llm_reply.EnvelopeParseError`) is
  re-asked once; a second unusable reply, or an :class:`~pipeline.errors.LLMTransientError`
  (retries already spent in the completer), hands over to the fallback critic (the heuristic)
  with ``fallback_reason``. :class:`~pipeline.errors.LLMPermanentError` propagates. Usage is
  the sum of every reply that arrived.
- **Injection.** :func:`~pipeline.security.injection.detect_injection` scans the whole output (and
  the file names) whatever the LLM says; each hit is a critical ``policy_violation`` defect and any
  hit caps the score at 0.59 (never above the critic's own).
- **Grounding.** After parsing, :func:`~pipeline.critics.grounding.ground_envelope` downgrades
  ``missing_data`` claims about files the snapshot lists (docs/llm.md, "How the LLM critic
  works"); the injection cap is applied after it, so a grounding refund cannot lift an
  injected output.
- **Paired critic.** A second call (the adjudicator) rules on the primary's actionable LLM
  defects by id; rejected ones become ``info`` false positives and the score gets the grounding
  refund. The injection-scan defects are never put to the adjudicator, and an output with an
  injection hit is not adjudicated at all (it could talk the adjudicator out of real defects).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.config import CritiqueConfig
from pipeline.critics.base import Critic, Planner, Reviser, RevisionResult, SizedCritic
from pipeline.critics.grounding import downgrade_defects, ground_envelope
from pipeline.critics.heuristic import HeuristicCritic, HeuristicReviser
from pipeline.critics.llm_prompts import (
    REPAIR_SYSTEM,
    build_adjudicator_messages,
    build_critic_messages,
    build_repair_prompt,
    reask_message,
)
from pipeline.critics.llm_reply import (
    EnvelopeParseError,
    Ruling,
    json_object,
    parse_envelope,
    parse_rulings,
    unfence,
)
from pipeline.errors import LLMTransientError
from pipeline.llm.completion import (
    AllowanceSpent,
    ChatMessage,
    Completer,
    LLMReply,
    LLMRequest,
    complete_within,
    count_prompt_tokens,
)
from pipeline.llm.tokens import (
    CHARS_PER_TOKEN,
    grown_output_tokens,
    repair_reply_tokens,
    text_of,
)
from pipeline.models import CritiqueEnvelope, Defect, RepairAttempt, Submission, Usage
from pipeline.security.injection import INJECTION_MARK, apply_injections, submission_injections

NO_MODEL_REASON = "no critic model configured (set critique.model or the submission's model)"
REASK_ECHO_CHARS = 4000
"""How much of an unusable reply is echoed back (as the assistant turn) when re-asking."""

# --- the critic -----------------------------------------------------------------------------


class LLMCritic:
    """Critique through an LLM (one call, one re-ask), with the heuristic as the fallback."""

    name = "llm"
    token_free = False
    reads_pitfalls = True

    def __init__(
        self,
        config: CritiqueConfig,
        complete: Completer,
        *,
        fallback: Critic | None = None,
    ) -> None:
        self._config = config
        self._complete = complete
        self._fallback: Critic = fallback if fallback is not None else HeuristicCritic()

    def critique(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        pitfalls: str = "",
        round: int = 1,
    ) -> CritiqueEnvelope:
        """Score ``output``; fall back (with ``fallback_reason``) when the LLM cannot answer."""
        hits = submission_injections(text_of(output), submission)
        model = self._config.critic_model(submission.model)
        if model is None:
            return self._fall_back(submission, output, pitfalls, round, NO_MODEL_REASON, hits)
        messages, truncation = build_critic_messages(
            submission,
            output,
            config=self._config,
            pitfalls=pitfalls,
            round=round,
            reply_tokens=self._short_reply(round),
        )
        request = LLMRequest(
            model=model,
            messages=messages,
            json_mode=True,
            max_tokens=self.reply_tokens(round),
            purpose="critic",
        )
        replies: list[LLMReply] = []
        try:
            replies.append(complete_within(self._complete, request))
            try:
                envelope = self._parse(replies[0].text, submission, model)
            except EnvelopeParseError as first:
                retry = request.model_copy(
                    update={
                        "messages": (
                            *messages,
                            ChatMessage(
                                role="assistant", content=replies[0].text[:REASK_ECHO_CHARS]
                            ),
                            ChatMessage(role="user", content=reask_message(first)),
                        )
                    }
                )
                try:
                    replies.append(complete_within(self._complete, retry))
                except LLMTransientError as exc:
                    failed = (
                        f"the re-ask was not made: {exc.message}"
                        if isinstance(exc, AllowanceSpent)
                        else f"the re-ask failed: LLM critic unavailable after retries: {exc}"
                    )
                    reason = f"LLM critic reply unusable ({first}); {failed}; heuristic used"
                    return self._fall_back(
                        submission, output, pitfalls, round, reason, hits, replies
                    )
                try:
                    envelope = self._parse(replies[1].text, submission, model)
                except EnvelopeParseError as second:
                    reason = (
                        f"LLM critic reply unparseable twice (first reply: {first}; after the "
                        f"re-ask: {second}); heuristic used"
                    )
                    return self._fall_back(
                        submission, output, pitfalls, round, reason, hits, replies
                    )
        except AllowanceSpent as exc:
            reason = f"{exc.message}; heuristic used"
            return self._fall_back(submission, output, pitfalls, round, reason, hits, replies)
        except LLMTransientError as exc:
            reason = f"LLM critic unavailable after retries: {exc}; heuristic used"
            return self._fall_back(submission, output, pitfalls, round, reason, hits, replies)
        envelope = apply_injections(ground_envelope(envelope, submission.files), hits)
        return envelope.model_copy(update={"usage": _usage(replies), "truncation": truncation})

    def reply_tokens(self, round: int) -> int:
        """The ``max_tokens`` of a critique call: ``llm.max_tokens`` for the first critique; for
        a re-critique (round ≥ 2: a repaired output, within a repair round's reservation) the
        short envelope bound ``llm.recritique_max_tokens`` (never more than ``max_tokens``)."""
        llm = self._config.llm
        return llm.max_tokens if round < 2 else min(llm.max_tokens, llm.recritique_max_tokens)

    def _short_reply(self, round: int) -> int | None:
        """The reply bound the critic is told of: a re-critique's, else None."""
        return self.reply_tokens(round) if round >= 2 else None

    def critique_bound(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        output_tokens: int,
        pitfalls: str = "",
        round: int = 1,
        reply_tokens: int | None = None,
    ) -> int:
        """Tokens one critique call of a repaired ``output`` may spend: the prompt,
        counted with an empty output of the same kind, plus the output at ``output_tokens``
        (at most what the prompt shows of it, ``llm.max_output_chars``), plus the reply's
        ``max_tokens`` (:meth:`reply_tokens`: a re-critique's short envelope bound; the lower
        ``reply_tokens`` when given: a round sized from what the run's repairs used, whose
        call :func:`~pipeline.llm.completion.complete_within` makes within what is left). 0 when no
        model resolves (the heuristic answers, token-free). A re-ask is not reserved: it is
        made only within what the first call left."""
        model = self._config.critic_model(submission.model)
        if model is None:
            return 0
        empty: str | dict[str, Any] = {} if isinstance(output, dict) else ""
        messages, _ = build_critic_messages(
            submission,
            empty,
            config=self._config,
            pitfalls=pitfalls,
            round=round,
            reply_tokens=self._short_reply(round),
        )
        reply = self.reply_tokens(round)
        request = LLMRequest(model=model, messages=messages, max_tokens=reply)
        shown = min(output_tokens, -(-self._config.llm.max_output_chars // CHARS_PER_TOKEN) + 16)
        if reply_tokens is not None:
            reply = max(1, min(reply, reply_tokens))
        return count_prompt_tokens(request, self._complete) + shown + reply

    def _parse(self, text: str, submission: Submission, model: str) -> CritiqueEnvelope:
        return parse_envelope(
            text,
            worker_id=submission.worker_id,
            model=model,
            categories=self._config.defect_categories,
        )

    def _fall_back(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        pitfalls: str,
        round: int,
        reason: str,
        hits: Sequence[Defect],
        replies: Sequence[LLMReply] = (),
    ) -> CritiqueEnvelope:
        envelope = self._fallback.critique(submission, output, pitfalls=pitfalls, round=round)
        envelope = apply_injections(ground_envelope(envelope, submission.files), hits)
        return envelope.model_copy(
            update={"usage": envelope.usage + _usage(replies), "fallback_reason": reason}
        )


def _usage(replies: Sequence[LLMReply]) -> Usage:
    total = Usage()
    for reply in replies:
        total = total + reply.usage
    return total


# --- the reviser ----------------------------------------------------------------------------


class LLMReviser:
    """Targeted repair through an LLM with the repair prompt (``build_repair_prompt``).

    Model: the submission's (inline repair uses the worker's model), else ``critique.model``;
    none → the fallback reviser, with a note. Rule for an unusable reply (a dict output whose
    reply is not a JSON object, or an empty reply): the previous output is kept unchanged and
    the note says so — the loop's no_improvement / fixpoint rules then stop the repair.
    """

    name = "llm"
    token_free = False
    reads_pitfalls = True

    def __init__(
        self,
        config: CritiqueConfig,
        complete: Completer,
        *,
        fallback: Reviser | None = None,
    ) -> None:
        self._config = config
        self._complete = complete
        self._fallback: Reviser = fallback if fallback is not None else HeuristicReviser()

    def plan(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
    ) -> RevisionResult | None:
        """None (a model may fix anything) when a repair model resolves; without one, the
        fallback reviser's plan, so the loop can stop ``needs_model`` instead of a no-op round."""
        if submission.model or self._config.model:
            return None
        if not isinstance(self._fallback, Planner):
            return None
        return self._fallback.plan(submission, output, envelope)

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str = "",
        attempts: Sequence[RepairAttempt] = (),
        prompt: str | None = None,
        max_tokens: int | None = None,
    ) -> RevisionResult:
        """One repair call; the reply is the complete repaired output. ``prompt``: the repair
        prompt when the runner already rendered it (to size the round), so it is built once;
        ``max_tokens``: the reply's bound the round was sized with, when lower than the
        call's own (:meth:`request`)."""
        request = self.request(
            submission, output, envelope, pitfalls, attempts, prompt=prompt, max_tokens=max_tokens
        )
        if request is None:
            return self._fall_back(
                submission,
                output,
                envelope,
                pitfalls,
                attempts,
                "no repair model (the submission names none and critique.model is not set); "
                f"{self._fallback.name} reviser used",
            )
        try:
            reply = complete_within(self._complete, request)
        except AllowanceSpent as exc:
            return self._fall_back(
                submission,
                output,
                envelope,
                pitfalls,
                attempts,
                f"{exc.message}; {self._fallback.name} reviser used",
            )
        except LLMTransientError as exc:
            return self._fall_back(
                submission,
                output,
                envelope,
                pitfalls,
                attempts,
                f"LLM repair unavailable after retries: {exc}; {self._fallback.name} reviser used",
            )
        new: str | dict[str, Any]
        if isinstance(output, dict):
            try:
                new = json_object(reply.text)
            except EnvelopeParseError as exc:
                return RevisionResult(
                    output=output,
                    usage=reply.usage,
                    note=f"LLM repair reply unusable ({exc}); previous output kept",
                )
        else:
            new = unfence(reply.text, output)
            if not new.strip():
                return RevisionResult(
                    output=output,
                    usage=reply.usage,
                    note="LLM repair reply was empty; previous output kept",
                )
        applied = len(envelope.actionable) if new != output else 0
        return RevisionResult(output=new, usage=reply.usage, suggestions_applied=applied)

    def request(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        pitfalls: str = "",
        attempts: Sequence[RepairAttempt] = (),
        *,
        prompt: str | None = None,
        max_tokens: int | None = None,
    ) -> LLMRequest | None:
        """The repair call :meth:`revise` makes (None without a repair model): the repair
        prompt, and ``max_tokens`` sized to the output (:func:`repair_reply_tokens`), or the
        lower ``max_tokens`` given (a round sized from what the run's repairs used,
        :func:`~pipeline.loop.repair.tight_output_tokens`)."""
        model = submission.model or self._config.model
        if not model:
            return None
        reply = repair_reply_tokens(output, self._config.llm.max_tokens)
        if max_tokens is not None:
            reply = max(1, min(reply, max_tokens))
        is_dict = isinstance(output, dict)
        system = REPAIR_SYSTEM + (" Reply with one JSON object." if is_dict else "")
        return LLMRequest(
            model=model,
            messages=(
                ChatMessage(role="system", content=system),
                ChatMessage(
                    role="user",
                    content=prompt
                    if prompt is not None
                    else build_repair_prompt(submission, output, envelope, pitfalls, attempts),
                ),
            ),
            json_mode=is_dict,
            max_tokens=reply,
            purpose="repair",
        )

    def repair_bound(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str = "",
        attempts: Sequence[RepairAttempt] = (),
        prompt: str | None = None,
        max_tokens: int | None = None,
    ) -> tuple[int, int]:
        """``(tokens, output_tokens)`` of the repair call :meth:`revise` would make (with
        ``max_tokens``, when given): its counted prompt plus its ``max_tokens``, and the
        repaired output's bound (that ``max_tokens``). ``(0, …)`` without a repair model: the
        token-free fallback answers."""
        request = self.request(
            submission, output, envelope, pitfalls, attempts, prompt=prompt, max_tokens=max_tokens
        )
        if request is None or request.max_tokens is None:
            return 0, grown_output_tokens(output)
        counted = count_prompt_tokens(request, self._complete)
        return counted + request.max_tokens, request.max_tokens

    def _fall_back(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
        note: str,
    ) -> RevisionResult:
        result = self._fallback.revise(
            submission, output, envelope, pitfalls=pitfalls, attempts=attempts
        )
        return result.model_copy(update={"note": note})


# --- the paired critic ----------------------------------------------------------------------


def _note(envelope: CritiqueEnvelope, note: str, usage: Usage | None = None) -> CritiqueEnvelope:
    return envelope.model_copy(
        update={
            "summary": f"{envelope.summary} [{note}]".strip(),
            "usage": envelope.usage if usage is None else usage,
        }
    )


class PairedCritic:
    """A primary critic whose actionable LLM defects an adjudicator model rules on.

    Rejected defects become ``info`` with ``false_positive=True`` and the reason appended; the
    score gets back 0.2 per critical and 0.1 per warning (grounding's refunds, at most 1.0).
    An unusable reply or a transient failure keeps the primary envelope (noted in the summary).
    """

    name = "paired"
    token_free = False
    reads_pitfalls = True

    def __init__(self, primary: Critic, config: CritiqueConfig, complete: Completer) -> None:
        self._primary = primary
        self._config = config
        self._complete = complete

    def critique_bound(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        output_tokens: int,
        pitfalls: str = "",
        round: int = 1,
        reply_tokens: int | None = None,
    ) -> int:
        """The primary critic's bound: the adjudication call runs only within what the primary
        call left of the reservation (and is skipped, noted, when that is too little)."""
        if not isinstance(self._primary, SizedCritic):
            return 0
        return int(
            self._primary.critique_bound(
                submission,
                output,
                output_tokens=output_tokens,
                pitfalls=pitfalls,
                round=round,
                reply_tokens=reply_tokens,
            )
        )

    def critique(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        pitfalls: str = "",
        round: int = 1,
    ) -> CritiqueEnvelope:
        """The primary's critique, adjudicated."""
        envelope = self._primary.critique(submission, output, pitfalls=pitfalls, round=round)
        if any(d.description.startswith(INJECTION_MARK) for d in envelope.defects):
            if any(_contested(d) for d in envelope.defects):
                return _note(
                    envelope, "paired critic skipped: the output tries to instruct the critic"
                )
            return envelope
        contested = [d for d in envelope.defects if _contested(d)]
        if not contested:
            return envelope
        model = self._config.paired_model or self._config.critic_model(submission.model)
        if model is None:
            return _note(envelope, "paired critic skipped: no adjudicator model configured")
        messages = build_adjudicator_messages(
            submission, output, contested, config=self._config, pitfalls=pitfalls, round=round
        )
        request = LLMRequest(
            model=model,
            messages=messages,
            json_mode=True,
            max_tokens=self._config.llm.max_tokens,
            purpose="adjudicate",
        )
        try:
            reply = complete_within(self._complete, request)
        except AllowanceSpent as exc:
            return _note(envelope, f"paired critic skipped: {exc.message}; primary critique kept")
        except LLMTransientError as exc:
            return _note(
                envelope,
                f"paired critic unavailable after retries: {exc}; primary critique kept",
            )
        usage = envelope.usage + reply.usage
        try:
            rulings = parse_rulings(reply.text)
        except EnvelopeParseError as exc:
            return _note(
                envelope, f"paired critic reply unusable ({exc}); primary critique kept", usage
            )
        return _apply_rulings(envelope, contested, rulings, model).model_copy(
            update={"usage": usage}
        )


def _contested(d: Defect) -> bool:
    return (
        d.source == "llm"
        and d.severity in ("critical", "warning")
        and not d.false_positive
        and not d.description.startswith(INJECTION_MARK)
    )


def _apply_rulings(
    envelope: CritiqueEnvelope,
    contested: Sequence[Defect],
    rulings: dict[str, Ruling],
    model: str,
) -> CritiqueEnvelope:
    ids = {d.id for d in contested}

    def rewrite(d: Defect) -> str | None:
        ruling = rulings.get(d.id)
        if d.id not in ids or ruling is None or ruling.verdict != "reject":
            return None
        reason = " ".join(ruling.reason.split()) or "no reason given"
        return f"{d.description} [adjudicator {model}: rejected: {reason}]"

    adjudicated, rejected = downgrade_defects(envelope, rewrite)
    summary = (
        f"{envelope.summary} [paired critic {model}: {rejected} of {len(contested)} "
        "defect(s) rejected]"
    ).strip()
    return adjudicated.model_copy(update={"summary": summary})
