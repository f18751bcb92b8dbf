"""The critique cache (critiques shared by identical outputs) on a real Redis and through real
workers: 20 identical outputs submitted at once reach the (fake) LLM once."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from pipeline.models import Submission
from pipeline.store.critique_entries import RedisCritiqueCache
from tests.fakes.openai_server import FakeOpenAIServer
from tests.support import wait_until
from tests.support.workers import ACCEPTING_CRITIQUE, WorkerStarter, llm_env

CRITIC_MODEL = "openai/critic-model"


def test_redis_cache_get_put_ttl_and_claims(redis_client: redis.Redis) -> None:
    a = RedisCritiqueCache(redis_client, prefix="t")
    b = RedisCritiqueCache(redis_client, prefix="t")
    assert a.get("k") is None
    assert a.claim("k", 5) and not b.claim("k", 5)
    a.put("k", '{"x": 1}', 60)
    a.release("k")
    assert b.get("k") == '{"x": 1}' and b.claim("k", 5)
    assert 0 < redis_client.pttl("t:cache:critique:k") <= 60_000
    assert 0 < redis_client.pttl("t:cache:claim:k") <= 5_000


@pytest.fixture()
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        server.set_default(ACCEPTING_CRITIQUE)
        yield server


@pytest.fixture()
def env(redis_url: str, fake: FakeOpenAIServer) -> Iterator[dict[str, str]]:
    """This process's client on the workers' database; the environment of workers whose LLM
    calls go to the fake."""
    with llm_env(
        redis_url,
        fake.api_base,
        CRITIQUE_CACHE__ENABLED="true",
        CRITIQUE_ALLOWED_MODELS=CRITIC_MODEL,
    ) as env:
        yield env


@pytest.mark.integration
def test_twenty_identical_outputs_one_llm_critique(
    env: dict[str, str], start_worker: WorkerStarter, fake: FakeOpenAIServer
) -> None:
    from workers.client import CritiqueClient

    for i in range(2):  # two worker processes (threads × 4)
        start_worker(f"cc{i}", env)
    run_id = f"cc-{uuid.uuid4().hex[:8]}"
    subs = [
        Submission(
            run_id=run_id,
            worker_id=f"w{i:02d}",
            task="Summarise the report.",
            output={"summary": "Sales rose 4%.", "confidence": 0.9},
            required_fields=("summary",),
        )
        for i in range(20)
    ]
    client = CritiqueClient({"enabled": True, "critic": "llm", "model": CRITIC_MODEL})
    results = client.wait_many(client.submit_many(subs), timeout=90)
    assert len(fake.completions) == 1
    assert all(r.envelope.critic == f"llm:{CRITIC_MODEL}" for r in results)
    hits = [r for r in results if any("critique cache hit" in n for n in r.notes)]
    assert len(hits) == 19 and all(r.usage.tokens == 0 for r in hits)
    assert sum(r.usage.tokens for r in results) > 0
    # The fleet metrics (critique exporter) count the same: 19 hits, the one critique's tokens.
    from pipeline.store.metrics import FleetMetrics
    from workers import runtime

    fleet = FleetMetrics(runtime.client())
    tokens = sum(r.usage.tokens for r in results)
    counted = wait_until(
        lambda: (c := fleet.read()[0]).get("outputs:accepted") == 20 and c,
        10,
        what="the workers' metrics flush",
    )
    assert (counted["cache_hits"], counted["tokens:critique"]) == (19, tokens)
