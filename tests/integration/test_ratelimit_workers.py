"""Cluster-wide LLM rate limits through real workers: two worker processes
sharing ``llm.rate_limit: {rpm: 120}`` never send the (fake) provider more than 10 requests
in any 5-second window, plus the bucket's burst of 2."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from pipeline.models import Submission
from tests.fakes.openai_server import FakeOpenAIServer
from tests.support.workers import ACCEPTING_CRITIQUE, WorkerStarter, llm_env

pytestmark = pytest.mark.integration

CRITIC_MODEL = "openai/critic-model"
RPM = 120
WINDOW_S = 5.0
BURST = 2  # rpm 120 × burst_s 1.0


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
        CRITIQUE_LLM__RATE_LIMIT=json.dumps({"rpm": RPM}),
        CRITIQUE_ALLOWED_MODELS=CRITIC_MODEL,
    ) as env:
        yield env


def test_two_workers_share_one_rpm_bucket(
    env: dict[str, str], start_worker: WorkerStarter, fake: FakeOpenAIServer
) -> None:
    from workers.client import CritiqueClient

    for i in range(2):  # two worker processes (threads × 4)
        start_worker(f"rl{i}", env)
    run_id = f"rl-{uuid.uuid4().hex[:8]}"
    subs = [
        Submission(
            run_id=run_id,
            worker_id=f"w{i:02d}",
            task="Summarise the report.",
            output={"summary": f"Sales rose {i}%.", "confidence": 0.9},
            required_fields=("summary",),
        )
        for i in range(24)
    ]
    client = CritiqueClient({"enabled": True, "critic": "llm", "model": CRITIC_MODEL})
    results = client.wait_many(client.submit_many(subs), timeout=90)
    assert all(r.envelope.critic == f"llm:{CRITIC_MODEL}" for r in results)
    times = sorted(r["at"] for r in fake.requests if r["path"] == "/chat/completions")
    assert len(times) == len(subs)
    busiest = max(sum(1 for t in times if start <= t < start + WINDOW_S) for start in times)
    assert busiest <= RPM / 60 * WINDOW_S + BURST, busiest
    # and the limiter did make them queue: 24 calls at 2/s take at least ~11 s
    assert times[-1] - times[0] >= (len(times) - BURST) / (RPM / 60) - 0.5
