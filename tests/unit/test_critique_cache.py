"""The critique cache (docs/llm.md, "Critique cache: `cache`") in the broker-free loop, with the
in-memory cache."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from pipeline.config import CritiqueConfig
from pipeline.critics.heuristic import HeuristicCritic
from pipeline.loop.critique_cache import critique_cache_key
from pipeline.loop.stages import L0Outcome, run_submission
from pipeline.models import CritiqueEnvelope, Submission, Usage
from pipeline.store.critique_entries import CacheEntryRefused, open_entry, seal_entry
from pipeline.store.memory import MemoryCritiqueCache
from pipeline.wiring import make_context


class CountingCritic:
    """A token-spending critic that counts its calls (optionally slowly)."""

    name = "llm:fake"
    token_free = False
    reads_pitfalls = True

    def __init__(self, delay_s: float = 0.0, fallback: bool = False) -> None:
        self.calls = 0
        self.delay_s = delay_s
        self.fallback = fallback
        self._lock = threading.Lock()

    def critique(
        self, submission: Submission, output: Any, *, pitfalls: str, round: int
    ) -> CritiqueEnvelope:
        with self._lock:
            self.calls += 1
        if self.delay_s:
            threading.Event().wait(self.delay_s)
        env = HeuristicCritic().critique(submission, output, pitfalls=pitfalls, round=round)
        return env.model_copy(
            update={
                "usage": Usage(tokens_in=100, tokens_out=20, calls=1),
                "critic": self.name,
                "fallback_reason": "timeout" if self.fallback else None,
            }
        )


def _no_l0(sub: Submission, output: Any, previous_size: int | None) -> L0Outcome:
    return L0Outcome()


def _sub(worker: str, output: Any = None, run: str = "run-c") -> Submission:
    return Submission(
        run_id=run,
        worker_id=worker,
        task="Report the sales.",
        output=output if output is not None else {"confidence": 0.9},  # missing its summary
        required_fields=("summary",),
    )


def _ctx(critic: CountingCritic, enabled: bool = True) -> Any:
    return make_context(
        CritiqueConfig(enabled=True, max_repair_attempts=0, cache={"enabled": enabled}),
        critic=critic,
        l0=_no_l0,
        fixpoint=lambda a, b: False,
        cache=MemoryCritiqueCache(),
    )


def test_identical_outputs_are_critiqued_once_and_hits_spend_nothing() -> None:
    """Identical prompts share one critique across runs; once the run has learned pitfalls its
    critic's prompt differs, so the same output is critiqued again (never a stale hit)."""
    critic = CountingCritic()
    ctx = _ctx(critic)
    first = run_submission(_sub("w1"), ctx)
    second = run_submission(_sub("w2", run="run-other"), ctx)  # the cache spans runs
    assert critic.calls == 1
    assert first.usage.tokens == 120 and second.usage.tokens == 0
    assert second.envelope.worker_id == "w2" and second.envelope.score == first.envelope.score
    assert any("critique cache hit" in n for n in second.notes)
    assert not any("critique cache hit" in n for n in first.notes)
    third = run_submission(_sub("w3"), ctx)  # run-c's critic now reads w1's pitfalls
    assert critic.calls == 2 and third.usage.tokens == 120
    caches = [e.get("cache") for e in ctx.trace.read("run-c") if e["stage"] == "critic"]
    assert caches == ["miss", "miss"]
    assert [e.get("cache") for e in ctx.trace.read("run-other") if e["stage"] == "critic"] == [
        "hit"
    ]
    # each occurrence still counts in pattern memory
    assert ctx.patterns.top("run-c")[0].frequency == 2


def test_different_outputs_or_cache_off_critique_again() -> None:
    critic = CountingCritic()
    ctx = _ctx(critic)
    run_submission(_sub("w1"), ctx)
    run_submission(_sub("w2", {"summary": "Sales fell.", "confidence": 0.9}), ctx)
    assert critic.calls == 2
    off = CountingCritic()
    ctx_off = _ctx(off, enabled=False)
    run_submission(_sub("w1"), ctx_off)
    run_submission(_sub("w2"), ctx_off)
    assert off.calls == 2
    assert all("cache" not in e for e in ctx_off.trace.read("run-c"))


def test_the_key_ignores_who_sent_it_but_not_what_was_asked() -> None:
    ctx = _ctx(CountingCritic())
    out = {"summary": "x"}

    def key(sub: Submission, output: Any, pitfalls: str = "", round: int = 1) -> str:
        return critique_cache_key(
            ctx.config, ctx.critic, sub, output, pitfalls=pitfalls, round=round
        )

    base = key(_sub("w1", out), out)
    assert key(_sub("w9", out, run="other"), out) == base
    other_task = _sub("w1", out).model_copy(update={"task": "Something else."})
    assert key(other_task, out) != base
    assert key(_sub("w1", out), {"summary": "y"}) != base


def test_the_key_covers_the_pitfalls_and_round_in_the_critics_prompt() -> None:
    """Two runs whose critics read different Known Pitfalls (or a repair round's prompt) never
    share an envelope."""
    ctx = _ctx(CountingCritic())
    out = {"summary": "x"}
    sub = _sub("w1", out)
    base = critique_cache_key(ctx.config, ctx.critic, sub, out, pitfalls="", round=1)
    with_pitfalls = critique_cache_key(
        ctx.config, ctx.critic, sub, out, pitfalls="- [missing_data] Always fill x", round=1
    )
    second_round = critique_cache_key(ctx.config, ctx.critic, sub, out, pitfalls="", round=2)
    assert len({base, with_pitfalls, second_round}) == 3


def test_a_fallback_envelope_is_never_cached() -> None:
    critic = CountingCritic(fallback=True)
    ctx = _ctx(critic)
    run_submission(_sub("w1"), ctx)
    run_submission(_sub("w2"), ctx)
    assert critic.calls == 2


def test_concurrent_identical_critiques_wait_for_the_first() -> None:
    critic = CountingCritic(delay_s=0.3)
    ctx = _ctx(critic)
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(run_submission(_sub(f"w{i}"), ctx)))
        for i in range(5)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert critic.calls == 1 and len(results) == 5


def test_a_submission_may_not_set_the_cache() -> None:
    """cache is worker-only (docs/configuration.md): where critiques are stored and shared across
    runs is the worker's choice, never a submission's."""
    import pytest

    from pipeline.config import check_submission_overrides
    from pipeline.errors import RefusedOverrideError

    with pytest.raises(RefusedOverrideError):
        check_submission_overrides({"cache": {"enabled": True}}, CritiqueConfig())


SECRETS = (b"k" * 32,)


def test_a_sealed_entry_opens_only_under_its_key_and_secret() -> None:
    """A cache entry is a signed record bound to its key: rewritten, unsigned, copied onto
    another key or signed with another secret, it is refused (a miss), never an envelope."""
    env = '{"score": 0.4, "defects": []}'
    sealed = seal_entry("k1", env, SECRETS)
    assert open_entry("k1", sealed, SECRETS) == env
    forged = json.loads(sealed)
    forged["envelope"] = '{"score": 0.97, "defects": []}'
    unsigned = json.dumps({"key": "k1", "envelope": env})
    for raw, key, secrets in [
        (json.dumps(forged), "k1", SECRETS),
        (unsigned, "k1", SECRETS),
        (sealed, "k2", SECRETS),
        (sealed, "k1", (b"o" * 32,)),
        (env, "k1", SECRETS),  # a bare envelope, as older workers stored them
        ("not json", "k1", SECRETS),
    ]:
        with pytest.raises(CacheEntryRefused):
            open_entry(key, raw, secrets)


def test_without_a_secret_entries_are_stored_and_read_unsigned() -> None:
    """Development fleets (no CRITIQUE_SECRET) keep their cache; the key binding still holds."""
    sealed = seal_entry("k1", '{"score": 0.4}', ())
    assert "sig" not in sealed and open_entry("k1", sealed, ()) == '{"score": 0.4}'
    with pytest.raises(CacheEntryRefused):
        open_entry("k2", sealed, ())
