"""``AsyncCritiqueClient`` against a real Redis and a real worker: 1,000 waits in one event loop
hold no thread and get the sync client's verdicts; failures, timeouts and an unreachable Redis
surface as the sync client's errors."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pipeline.errors import StoreUnavailableError, SubmissionError
from pipeline.models import Submission
from tests.support.workers import WorkerProcess, WorkerSpec, client_on, worker_db_url
from workers.aclient import AsyncCritiqueClient
from workers.client import CritiqueClient, CritiqueTimeout, Handle
from workers.embedded import free_port

pytestmark = pytest.mark.integration

WORKER = WorkerSpec("async-client", concurrency=4)
CONFIG = {"critic": "heuristic"}
N = 1000


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    with client_on(worker_db_url(redis_url)) as e:
        yield e


def _sub(run_id: str, i: int) -> Submission:
    output: dict[str, Any] = {"summary": f"Region {i} grew.", "confidence": 0.9}
    if i % 3:
        output["findings"] = f"Store {i} opened."
    return Submission(
        run_id=run_id,
        worker_id=f"w{i:04d}",
        task="Summarise the region.",
        output=output,
        required_fields=("summary", "findings"),
    )


def test_a_thousand_waits_hold_no_thread_and_match_the_sync_verdicts(
    env: dict[str, str], worker: WorkerProcess
) -> None:
    """1,000 concurrent waits in one loop: the thread count never rises while they wait, and
    each verdict (status, score, pass) equals what the sync client reads for that handle."""
    run_id = f"ac-{uuid.uuid4().hex[:8]}"
    handles = CritiqueClient(CONFIG).submit_many([_sub(run_id, i) for i in range(N)])
    before = threading.active_count()
    seen: list[int] = []

    async def main() -> list[Any]:
        async with AsyncCritiqueClient(CONFIG) as client:
            done = asyncio.Event()

            async def watch() -> None:
                while not done.is_set():
                    seen.append(threading.active_count())
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            results = await client.wait_many(handles, timeout=240)
            done.set()
            await watcher
            return results

    got = asyncio.run(main())
    assert seen and max(seen) <= before, (before, max(seen))
    sync = CritiqueClient(CONFIG)
    for h, r in zip(handles, got, strict=True):
        s = sync.wait(h, timeout=5)
        assert (r.pass_id, r.status, r.best_score, r.stop_reason) == (
            s.pass_id,
            s.status,
            s.best_score,
            s.stop_reason,
        )
    assert {r.status for r in got} == {"accepted", "escalated"}


def test_as_completed_yields_every_verdict_and_a_failure_raises_its_error(
    env: dict[str, str], worker: WorkerProcess
) -> None:
    """as_completed yields each verdict once; a pass a worker recorded as failed (a repair_of
    with nothing waiting) raises SubmissionError from wait, as in the sync client."""
    run_id = f"ac-{uuid.uuid4().hex[:8]}"

    async def main() -> tuple[list[str], str]:
        async with AsyncCritiqueClient(CONFIG) as client:
            handles = await client.submit_many([_sub(run_id, i) for i in range(5)])
            seen = [r.worker_id async for r in client.as_completed(handles, timeout=60)]
            bad = _sub(run_id, 1).model_copy(update={"repair_of": "nothing-waits"})
            handle = await client.submit(bad)
            with pytest.raises(SubmissionError) as err:
                await client.wait(handle, timeout=60)
            return seen, str(err.value)

    seen, message = asyncio.run(main())
    assert sorted(seen) == [f"w{i:04d}" for i in range(5)]
    assert "repair_of 'nothing-waits'" in message


def test_a_wait_times_out_with_the_sync_clients_error(env: dict[str, str]) -> None:
    """A pass that never ends: CritiqueTimeout after the timeout, the client still usable."""

    async def main() -> None:
        async with AsyncCritiqueClient(CONFIG) as client:
            with pytest.raises(CritiqueTimeout, match="no result for nobody"):
                await client.wait(Handle("ac-none", 1, "nobody", "", "p-none"), timeout=0.3)

    asyncio.run(main())


def test_an_unreachable_redis_is_ridden_out_then_one_store_unavailable_error(
    env: dict[str, str],
) -> None:
    """A Redis that stays away is retried until the wait's timeout, then the waiter gets one
    StoreUnavailableError naming what could not be reached and for how long."""

    async def main() -> None:
        async with AsyncCritiqueClient(CONFIG) as client:
            client._redis = redis.asyncio.Redis(  # no retries of redis-py's own: fail fast
                port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
            )
            began = time.monotonic()
            with pytest.raises(StoreUnavailableError) as caught:
                await client.wait(Handle("ac-none", 1, "w", "", "p1"), timeout=1.5)
            assert time.monotonic() - began >= 1.5
            text = str(caught.value)
            assert "cannot reach Redis at " in text and "unreachable for 1." in text
            assert "timeout of 1.5 s" in text

    asyncio.run(main())
