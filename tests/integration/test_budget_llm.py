"""The repair budget against a provider's reported usage, end to end: a real worker,
real Redis, litellm's real HTTP client and the fake OpenAI-compatible server scripting ``usage``.

Reservations are the counted prompt plus the call's ``max_tokens`` (repair call and re-critique),
the calls are made with that ``max_tokens``, the unused part comes back at commit: so the cap
bounds what the provider reports. A reservation that only held tokens block waits for them
(the task goes back to the broker and asks again), and one whose full bound would pass the cap
is sized from what the run's repairs really used, so a binding budget refuses only near its
end, and demand past the cap still spends nearly all of it."""

from __future__ import annotations

import json
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pipeline.models import CritiqueResult, Submission
from tests.fakes.openai_server import CRITIC, REPAIR, FakeOpenAIServer, system_text, user_text
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url

pytestmark = pytest.mark.integration

MODEL = "openai/critic-model"
MAX_TOKENS = 400
TASK = "Summarise the quarterly sales report: give a summary and the key findings."
WORDS = ["north", "south", "region", "store", "online", "order", "growth", "margin", "price"]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def env(redis_url: str, fake: FakeOpenAIServer) -> Iterator[dict[str, str]]:
    """The LLM transport and ``llm.max_tokens`` are worker-only: the worker's environment
    (with the key, the models submissions may name)."""
    with client_on(
        worker_db_url(redis_url),
        CRITIQUE_LLM_API_KEY="sk-test",
        CRITIQUE_ALLOWED_MODELS=MODEL,
        CRITIQUE_LLM__API_BASE=fake.api_base,
        CRITIQUE_LLM__TIMEOUT_S="10",
        CRITIQUE_LLM__MAX_RETRIES="1",
        CRITIQUE_LLM__BACKOFF_S="0.01",
        CRITIQUE_LLM__MAX_TOKENS=str(MAX_TOKENS),
        CRITIQUE_STALL_S="120",
    ) as e:
        yield e


WORKER = WorkerSpec("budget")


class Provider:
    """Critic and repairer answers for the fake: the critic finds a critical defect in rounds 1
    and 2 (scores 0.4, 0.5; round 1 only with ``one_repair``) and accepts from then on (0.95);
    the repairer writes a fresh output each time. ``usage`` picks the reported usage of a
    reply: default (⌊chars/4⌋ both ways, what the fake reports by itself), or a function of
    the request and the reply text."""

    def __init__(
        self,
        usage: Callable[[dict[str, Any], str], dict[str, int]] | None = None,
        *,
        one_repair: bool = False,
    ) -> None:
        self.usage = usage
        self.one_repair = one_repair
        """Accept from round 2: every output needs exactly one repair."""
        self._lock = threading.Lock()
        self._n = 0

    def _item(self, body: dict[str, Any], text: str) -> dict[str, Any]:
        item: dict[str, Any] = {"reply": text}
        if self.usage is not None:
            item.update(self.usage(body, text))
        return item

    def critic(self, body: dict[str, Any]) -> dict[str, Any]:
        found = re.search(r"Critique round: (\d+)", user_text(body))
        round_no = int(found.group(1)) if found else 1
        score = {1: 0.4} if self.one_repair else {1: 0.4, 2: 0.5}
        score = score.get(round_no, 0.95)
        defects = [
            {
                "category": "incomplete",
                "severity": "critical",
                "location": "findings",
                "description": f"the findings are too thin (round {round_no})",
            }
        ]
        reply = {
            "score": score,
            "defects": defects if score < 0.6 else [],
            "prescriptions": ["Write real findings."] if score < 0.6 else [],
            "reusable_patterns": [],
            "summary": f"round {round_no}",
        }
        return self._item(body, json.dumps(reply))

    def repair(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._n += 1
            rng = random.Random(self._n)
        out = {
            "summary": " ".join(rng.choice(WORDS) for _ in range(20)),
            "findings": " ".join(rng.choice(WORDS) for _ in range(20)),
            "confidence": 0.8,
        }
        return self._item(body, json.dumps(out))

    def install(self, fake: FakeOpenAIServer) -> None:
        fake.reset()
        fake.on(CRITIC, self.critic)
        fake.on(REPAIR, self.repair)


def _sub(run_id: str, i: int) -> Submission:
    rng = random.Random(10_000 + i)
    return Submission(
        run_id=run_id,
        worker_id=f"w{i:03d}",
        task=TASK,
        output={
            "summary": " ".join(rng.choice(WORDS) for _ in range(20)),
            "findings": "thin",
            "confidence": 0.8,
        },
        required_fields=("summary", "findings"),
    )


def _config(cap: int) -> dict[str, Any]:
    return {
        "enabled": True,
        "critic": "llm",
        "model": MODEL,
        "max_repair_attempts": 2,
        "budget": {"total_tokens": round(cap / 0.15) + 1},
    }


def _repair_phase_usage(fake: FakeOpenAIServer) -> int:
    """What the provider reported for repair-phase calls: repairs and re-critiques."""
    total = 0
    for r in fake.requests:
        body, usage = r["body"], r.get("usage")
        if not usage or not r.get("delivered") or not isinstance(body, dict):
            continue
        system = system_text(body)
        found = re.search(r"Critique round: (\d+)", user_text(body))
        if REPAIR in system or (CRITIC in system and found and int(found.group(1)) >= 2):
            total += int(usage["total_tokens"])
    return total


def _refusals(run_id: str) -> list[dict[str, int]]:
    """Every budget refusal of the run, parsed from its round event's reason."""
    from workers.client import CritiqueClient

    out = []
    pattern = (
        r"repair budget refused (\d+) tokens: cap (\d+), spent (\d+), held (\d+) by (\d+) "
        r"repairs in flight(?:, (\d+) asked by \d+ repairs waiting longer)?; (.+)"
    )
    for e in CritiqueClient().trace(run_id):
        if e["type"] == "round" and e.get("stop_reason") == "repair_budget_exhausted":
            m = re.fullmatch(pattern, e["reason"])
            assert m, e["reason"]
            asked, cap, spent, held, holders = (int(g) for g in m.groups()[:5])
            out.append(
                {
                    "asked": asked,
                    "cap": cap,
                    "spent": spent,
                    "held": held,
                    "holders": holders,
                    "queued": int(m.group(6) or 0),
                    "why": m.group(7),
                }
            )
    return out


def _real(r: dict[str, Any]) -> bool:
    """A refusal that had to be: spent + asked past the cap; or, after the wait ran out,
    spent + held + queued + asked still past it. (What was asked may be the round sized from
    what the run's repairs used: the reason then says so after the why, with the full bound.)"""
    if r["why"].startswith("spent + asked would pass the cap"):
        return bool(r["spent"] + r["asked"] > r["cap"])
    return bool(r["why"].startswith("waited")) and (
        r["spent"] + r["held"] + r["queued"] + r["asked"] > r["cap"]
    )


def _check_ledger(run_id: str, fake: FakeOpenAIServer, results: list[CritiqueResult]) -> int:
    """The ledger equals what the provider reported for repair-phase calls and what the
    results say they charged; nothing is held. Returns the spend."""
    from workers import runtime

    budget = runtime.stores().budget
    spent = budget.spent(run_id)
    assert spent == _repair_phase_usage(fake) == sum(r.budget_charged for r in results)
    assert budget.holds(run_id) == {}
    return spent


def test_a_binding_budget_refuses_repairs_only_near_its_end(
    worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """60 submissions, four in flight at a time (a manager fanning out to four workers), a
    provider reporting realistic usage: the first refusal comes with at least 85 % of the cap
    spent, and every refusal is real (spent + held + the repair asked for > cap)."""
    from workers.client import CritiqueClient

    Provider().install(fake)
    cap = 80_000
    run_id = f"bind-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(_config(cap))
    subs = [_sub(run_id, i) for i in range(60)]
    handles, active = [], []
    deadline = time.monotonic() + 150
    while (subs or active) and time.monotonic() < deadline:
        while subs and len(active) < 4:
            h = client.submit(subs.pop(0))
            handles.append(h)
            active.append(h)
        active = [h for h in active if client.result(h) is None]
        time.sleep(0.02)
    results = client.wait_many(handles, timeout=30)
    spent = _check_ledger(run_id, fake, results)
    refusals = _refusals(run_id)
    assert refusals, "the budget never bound"
    first = min(r["spent"] for r in refusals)
    print(
        f"\nbinding budget: cap {cap}, spent {spent} ({spent / cap:.1%}), first refusal at "
        f"{first} spent ({first / cap:.1%}), {len(refusals)} refusals"
    )
    assert first >= 0.85 * cap
    assert all(_real(r) for r in refusals), refusals
    assert spent <= cap


def test_the_cap_holds_when_the_provider_writes_all_it_may(
    worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """Every reply as long as its max_tokens allows (completion = max_tokens), all 24
    submissions at once: what the provider reports for repairs never passes the cap, the
    ledger equals it, no over-report is noted, and every refusal was real."""
    from workers.client import CritiqueClient

    def fill(body: dict[str, Any], text: str) -> dict[str, int]:
        return {"completion_tokens": int(body["max_tokens"])}

    Provider(fill).install(fake)
    cap = 30_000
    run_id = f"fill-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(_config(cap))
    results = client.wait_many(
        client.submit_many([_sub(run_id, i) for i in range(24)]), timeout=120
    )
    spent = _check_ledger(run_id, fake, results)
    assert 0 < spent <= cap
    assert not any("more than the" in n for r in results for n in r.notes)
    refusals = _refusals(run_id)
    assert refusals and all(_real(r) for r in refusals), refusals
    print(f"\nprovider writing all it may: cap {cap}, spent {spent} ({spent / cap:.1%})")


def test_demand_at_twice_the_cap_spends_at_least_90_percent_of_it(
    worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """21 outputs that each need one LLM repair, all submitted at once, with a cap of 10¼
    repairs (demand 2.05× the cap; the fake provider reports accurate usage, and writes what it
    writes whatever ``max_tokens`` says). Repairs blocked only by held tokens wait for them; the
    last one the cap can pay for, whose full bound (1.36 repairs) would pass the cap, is sized
    from what the run's repairs used (about 1.07 repairs) and funded: the run ends with at least
    90 % of the cap spent (the ideal: 10 of 10¼ = 97.6 %), never over it; the ledger equals what
    the provider reported; nothing was reported over a reservation; every refusal names spent,
    held and asked, and had to be.

    Why 10¼ and not 10: with a cap of exactly 10 repairs, what is left for the tenth is one
    repair give or take a few tokens of difference between outputs, and no reservation that
    covers a repair (with any margin) fits it reliably: whether the run ends at 90.0 % or a
    hair under would be decided by that noise, not by the sizing."""
    from workers.client import CritiqueClient

    Provider(one_repair=True).install(fake)
    probe = f"probe-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(_config(1_000_000))
    [alone] = client.wait_many([client.submit(_sub(probe, 999))], timeout=60)
    per_repair = alone.budget_charged  # what one repair phase really costs
    assert alone.status == "repaired" and per_repair > 0
    Provider(one_repair=True).install(fake)  # forget the probe's requests

    cap = 10 * per_repair + per_repair // 4  # 21 repairs: demand 2.05x the cap
    run_id = f"twice-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(_config(cap))
    results = client.wait_many(
        client.submit_many([_sub(run_id, i) for i in range(21)]), timeout=150
    )
    spent = _check_ledger(run_id, fake, results)
    refusals = _refusals(run_id)
    repaired = sum(1 for r in results if r.attempts)
    ideal = (cap // per_repair) * per_repair
    events = list(client.trace(run_id))
    waits = [e["budget_wait_s"] for e in events if e.get("budget_wait_s") is not None]
    tight = [e["budget_full"] for e in events if e.get("budget_full") is not None]
    print(
        f"\ndemand at twice the cap: cap {cap}, spent {spent} ({spent / cap:.1%}; ideal "
        f"{ideal / cap:.1%}), {repaired} repaired ({len(tight)} sized from the run's "
        f"repairs), {len(refusals)} refused, {len(waits)} waited (longest "
        f"{max(waits, default=0):.1f} s)"
    )
    assert 0.90 * cap <= spent <= cap
    assert repaired + len(refusals) == 21
    firsts = [b for b in fake.requests_with(CRITIC) if "Critique round: 1" in user_text(b)]
    assert len(firsts) == 21  # a task that waited replayed its critique, never re-ran it
    assert refusals and all(_real(r) for r in refusals), refusals
    assert waits, "no repair had to wait: the budget was never contended"
    assert tight, "no round was sized from what the run's repairs used"
    assert not any("more than the" in n for r in results for n in r.notes)


def test_a_provider_reporting_more_than_it_may_is_charged_in_full_and_stops_repairs(
    worker: WorkerProcess, fake: FakeOpenAIServer
) -> None:
    """A provider that reports ten times the max_tokens it was allowed: the repair is charged
    what it reported (never under-counted), its result says so, and the run's next repair is
    refused with the reason."""
    from workers import runtime
    from workers.client import CritiqueClient

    def over(body: dict[str, Any], text: str) -> dict[str, int]:
        return {"completion_tokens": 10 * int(body["max_tokens"])}

    Provider(over).install(fake)
    run_id = f"over-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(_config(1_000_000))
    first = client.wait(client.submit(_sub(run_id, 1)), timeout=60)
    note = [n for n in first.notes if "more than the" in n]
    assert note and "all" in note[0] and "no further repairs" in note[0]
    snap = runtime.stores().budget.snapshot(run_id)
    assert snap.overrun > 0 and snap.spent == first.budget_charged
    second = client.wait(client.submit(_sub(run_id, 2)), timeout=60)
    assert second.stop_reason == "repair_budget_exhausted"
    assert second.attempts == ()
    _check_ledger(run_id, fake, [first, second])
    events = list(client.trace(run_id))
    [reason] = [
        e["reason"]
        for e in events
        if e["type"] == "round" and e.get("stop_reason") == "repair_budget_exhausted"
    ]
    assert "closed since providers reported" in reason
