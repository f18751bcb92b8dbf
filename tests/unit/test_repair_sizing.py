"""The sizing rule of a round sized from what the run's repairs used (docs/pipeline.md, "The
repair budget"): pure functions of the observed usage, never above the full bound, none without
history; and :func:`pipeline.loop.repair_sizing.order_repair` applying it with the LLM reviser and
critic, whose calls are then made within the smaller bound."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pipeline.config import CritiqueConfig
from pipeline.critics.heuristic import HeuristicCritic
from pipeline.critics.llm import LLMCritic, LLMReviser
from pipeline.llm.completion import LLMReply, LLMRequest, count_prompt_tokens
from pipeline.llm.tokens import estimate_tokens, text_of
from pipeline.loop.repair import (
    TIGHT_MARGIN,
    TIGHT_SLACK_TOKENS,
    RepairBound,
    repair_growth,
    tight_output_tokens,
    tight_reply_tokens,
)
from pipeline.loop.repair_sizing import order_repair, tight_bound
from pipeline.models import CritiqueEnvelope, Defect, Submission, Usage
from pipeline.store.base import RepairUsage

# --- the pure rule -----------------------------------------------------------------------------


def test_growth_is_the_repaired_outputs_tokens_per_token_of_the_output_it_repaired() -> None:
    """Thousandths, rounded up; the repaired output counts as the larger of what the provider
    reported writing and its own estimate; nothing when no model wrote it."""
    before = "x" * 400  # 100 tokens
    assert repair_growth(before, "y" * 600, written=150) == 1500
    assert repair_growth(before, "y" * 600, written=120) == 1500  # the estimate is larger
    assert repair_growth(before, "y" * 600, written=180) == 1800  # what was written is larger
    assert repair_growth(before, "y" * 2, written=1) == 10
    assert repair_growth("x" * 3, "y" * 10, written=7) == 7000  # 1 token before
    assert repair_growth(before, "y" * 600, written=0) == 0  # a token-free fallback's output
    assert repair_growth({"a": "x" * 40}, {"a": "x" * 80}, written=5) == math.ceil(
        1000 * estimate_tokens(text_of({"a": "x" * 80})) / estimate_tokens(text_of({"a": "x" * 40}))
    )


def test_the_tight_output_bound_follows_the_largest_growth_with_a_margin() -> None:
    """The output's tokens × the largest growth × the margin, plus the slack; never above the
    full bound; none without history."""
    output = "x" * 400  # 100 tokens
    grown = math.ceil(100 * 1.5 * TIGHT_MARGIN) + TIGHT_SLACK_TOKENS
    assert tight_output_tokens(output, 1500, full=10_000) == grown
    assert tight_output_tokens(output, 1500, full=100) == 100  # never above the full bound
    assert tight_output_tokens(output, 10, full=10_000) == 2 + TIGHT_SLACK_TOKENS
    assert tight_output_tokens(output, 0, full=10_000) is None  # no history
    assert tight_output_tokens("", 1000, full=1) == 1


@pytest.mark.parametrize("growth", [1, 500, 1000, 1600, 2500, 40_000])
@pytest.mark.parametrize("chars", [0, 7, 400, 9_000])
def test_the_tight_output_bound_is_never_above_the_full_one(growth: int, chars: int) -> None:
    for full in (1, 50, 306, 2048):
        tight = tight_output_tokens("z" * chars, growth, full)
        assert tight is not None and 1 <= tight <= full


def test_the_tight_reply_bound_follows_the_longest_reply_with_a_margin() -> None:
    assert tight_reply_tokens(40) == math.ceil(40 * TIGHT_MARGIN) + TIGHT_SLACK_TOKENS
    assert tight_reply_tokens(40, full=512) == 66
    assert tight_reply_tokens(500, full=512) == 512  # never above the critic's own
    assert tight_reply_tokens(0) is None
    assert tight_reply_tokens(0, full=512) is None


def _resize_recorder(
    repair_per_token: int = 1, critique_per_token: int = 1, fixed: int = 100
) -> tuple[list[tuple[int, int | None]], Any]:
    seen: list[tuple[int, int | None]] = []

    def resize(out: int, reply: int | None) -> RepairBound:
        seen.append((out, reply))
        return RepairBound(
            repair=fixed + repair_per_token * out,
            critique=fixed + critique_per_token * out + (reply or 0),
            output_tokens=out,
        )

    return seen, resize


FULL = RepairBound(repair=100 + 306, critique=100 + 306 + 512, output_tokens=306)
OUTPUT = "x" * 200  # 50 tokens


def test_tight_bound_resizes_with_the_tight_output_and_reply() -> None:
    seen, resize = _resize_recorder()
    usage = RepairUsage(rounds=3, growth=1600, reply=40)
    tight = tight_bound(OUTPUT, FULL, usage, resize)
    out = tight_output_tokens(OUTPUT, 1600, 306)
    reply = tight_reply_tokens(40)
    assert seen == [(out, reply)]
    assert tight == RepairBound(repair=100 + out, critique=100 + out + reply, output_tokens=out)
    assert tight.repair <= FULL.repair and tight.critique <= FULL.critique
    assert tight.total < FULL.total


def test_tight_bound_needs_history_of_each_part_it_sizes() -> None:
    """None without a model-written repair committed; none without a re-critique reply when
    the round has a re-critique; a round without one needs no reply history."""
    _, resize = _resize_recorder()
    assert tight_bound(OUTPUT, FULL, RepairUsage(), resize) is None
    assert tight_bound(OUTPUT, FULL, RepairUsage(rounds=1, growth=0, reply=40), resize) is None
    assert tight_bound(OUTPUT, FULL, RepairUsage(rounds=1, growth=1600, reply=0), resize) is None
    no_critique = RepairBound(repair=406, critique=0, output_tokens=306)

    def repair_only(out: int, reply: int | None) -> RepairBound:
        assert reply is None
        return RepairBound(repair=100 + out, critique=0, output_tokens=out)

    tight = tight_bound(OUTPUT, no_critique, RepairUsage(rounds=1, growth=1600), repair_only)
    assert tight is not None and tight.critique == 0 and tight.repair < 406
    token_free = RepairBound(repair=0, critique=918, output_tokens=306)
    usage = RepairUsage(rounds=1, growth=1600, reply=40)
    assert tight_bound(OUTPUT, token_free, usage, resize) is None


def test_tight_bound_is_never_above_the_full_one() -> None:
    """A round that would not be smaller (a provider that wrote all it was allowed) keeps the
    full bound; a part that would come out larger is never taken."""
    _, resize = _resize_recorder()
    filled = RepairUsage(rounds=4, growth=10_000, reply=512)
    assert tight_bound(OUTPUT, FULL, filled, resize) is None
    _, bigger = _resize_recorder(critique_per_token=10)
    assert tight_bound(OUTPUT, FULL, RepairUsage(rounds=1, growth=1600, reply=40), bigger) is None


# --- order_repair with the LLM reviser and critic ----------------------------------------------

MODEL = "openai/critic"


class Completer:
    def __call__(self, request: LLMRequest) -> LLMReply:  # never called: sizing only
        return LLMReply(text="", usage=Usage())


def _parts() -> tuple[CritiqueConfig, LLMReviser, LLMCritic, Submission, CritiqueEnvelope]:
    config = CritiqueConfig.model_validate(
        {"enabled": True, "critic": "llm", "model": MODEL, "llm": {"max_tokens": 400}}
    )
    complete = Completer()
    sub = Submission(
        run_id="run-1",
        worker_id="w1",
        task="Summarise the quarterly sales report: a summary and the findings.",
        output={"summary": "north south region store online " * 4, "findings": "thin"},
        required_fields=("summary", "findings"),
    )
    defect = Defect(
        category="incomplete",
        severity="critical",
        location="findings",
        description="the findings are too thin",
        source="llm",
    )
    envelope = CritiqueEnvelope(worker_id="w1", score=0.4, defects=(defect,))
    return config, LLMReviser(config, complete), LLMCritic(config, complete), sub, envelope


def _order(usage: RepairUsage | None, critic: Any = None) -> Any:
    _, reviser, llm_critic, sub, envelope = _parts()
    return order_repair(
        sub,
        sub.output,
        envelope,
        (),
        round_no=2,
        reviser=reviser,
        critic=critic if critic is not None else llm_critic,
        pitfalls=lambda reader: "",
        usage=usage,
    )


def test_without_history_the_order_is_the_full_one() -> None:
    full = _order(None)
    assert full.full_bound is None and full.reply_tokens is None
    assert _order(RepairUsage()) == full
    assert _order(RepairUsage(rounds=1, growth=1500)) == full  # no re-critique reply yet


def test_with_history_the_order_is_sized_from_it_and_the_call_made_within_it() -> None:
    """The bound is the tight one, each part no larger than the full one's; the repair call the
    order describes is made with the tight ``max_tokens``, and the repair part is its counted
    prompt plus that; the re-critique's part counts the output at that size and the reply at
    the longest one seen, with the margin."""
    _, reviser, critic, sub, envelope = _parts()
    full = _order(None).bound
    usage = RepairUsage(rounds=2, growth=1600, reply=40)
    order = _order(usage)
    assert order.full_bound == full
    tight = order.bound
    assert tight.repair < full.repair and tight.critique < full.critique
    assert (
        order.reply_tokens
        == tight.output_tokens
        == tight_output_tokens(sub.output, 1600, full.output_tokens)
    )
    request = reviser.request(
        sub, sub.output, envelope, "", (), prompt=order.prompt, max_tokens=order.reply_tokens
    )
    assert request is not None and request.max_tokens == order.reply_tokens
    assert tight.repair == count_prompt_tokens(request) + order.reply_tokens
    reply = tight_reply_tokens(40)
    assert reply is not None
    assert tight.critique == full.critique - (full.output_tokens - tight.output_tokens) - (
        critic.reply_tokens(2) - reply
    )


def test_a_provider_that_wrote_all_it_may_gets_the_full_order() -> None:
    full = _order(None)
    assert _order(RepairUsage(rounds=5, growth=50_000, reply=512)) == full


def test_a_token_free_critic_needs_no_reply_history() -> None:
    """The heuristic re-critique costs nothing: only the repair call is sized tighter."""
    order = _order(RepairUsage(rounds=1, growth=1600), critic=HeuristicCritic())
    assert order.full_bound is not None and order.bound.critique == 0
    assert order.bound.repair < order.full_bound.repair


def test_a_critic_that_cannot_size_its_calls_keeps_the_full_order() -> None:
    """A critic sized by estimate makes its calls outside the reservation's reach: a smaller
    reservation would not bound it, so the round is never sized tighter."""

    class Estimated:
        name = "estimated"
        token_free = False
        reads_pitfalls = False

        def critique(self, *args: Any, **kwargs: Any) -> CritiqueEnvelope:
            raise AssertionError("not called")

    order = _order(RepairUsage(rounds=3, growth=1600, reply=40), critic=Estimated())
    assert order.full_bound is None and order.reply_tokens is None
