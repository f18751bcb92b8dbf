"""The asyncio client: :class:`AsyncCritiqueClient`, the sync client's verdicts on an event loop.

A manager written in an async framework awaits many verdicts at once. Waiting here holds no
thread: every ``wait`` of a client is one future, and one poller task per client reads all the
waited passes' records together (one ``HMGET`` of results and of failures per run and round,
through ``redis.asyncio``), decodes and verifies them exactly as the sync client does
(:meth:`pipeline.store.runs.RedisRunStore.decode_outcome`: signed results, recorded failures),
and resolves the futures. It polls every 10 ms while verdicts arrive and backs off to 250 ms
when none do.

Submitting, cancelling and the pitfalls are the sync client's calls (validation, admission,
signing, the fleet's posture, the publish), run in the loop's default executor: each is one
short call, not a wait. Errors are the sync client's: ``SubmissionError`` for a pass a worker
recorded as failed, :class:`~workers.client.CritiqueTimeout` at the deadline,
``StoreUnavailableError`` (one line, saying for how long) when Redis stays away past a wait's
timeout: an outage shorter than that (a Sentinel failover, a restart) is ridden out
(:mod:`workers.riding`), as the sync client does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import redis
import redis.asyncio

from pipeline.errors import StoreUnavailableError, SubmissionError
from pipeline.models import CritiqueResult, Submission
from pipeline.store import keys
from pipeline.store.redis_common import is_unavailable, sentinel_kwargs, store_socket_options
from pipeline.store.runs import Failure
from pipeline.store.urls import (
    cannot_reach,
    is_cluster_url,
    is_sentinel_url,
    parse_cluster_url,
    parse_sentinel_url,
    sentinel_master,
)
from workers import riding, runtime
from workers.cancelling import CancelReport
from workers.client import CritiqueClient, CritiqueTimeout, Handle, failure_text

FAST_POLL_S = 0.01
"""The poller's interval while verdicts keep arriving."""
SLOW_POLL_S = 0.25
"""The longest interval it backs off to when none do."""

Outcome = CritiqueResult | SubmissionError


def async_store_client(url: str) -> Any:
    """An asyncio client of the store at ``url`` (the sync client's URL forms): ``redis://``,
    ``rediss://``, ``unix://``; ``sentinel://`` (the master named by ``CRITIQUE_REDIS_MASTER``);
    a Redis Cluster URL. Bytes replies, the sync client's timeouts."""
    import os

    opts = store_socket_options()
    setting = runtime.store_setting()
    if is_cluster_url(url):
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        parsed = parse_cluster_url(url, setting=setting)
        if parsed.ssl:
            opts["ssl"] = True
        nodes = [ClusterNode(h, p) for h, p in parsed.nodes]
        return RedisCluster(startup_nodes=nodes, **parsed.auth(), **opts)
    if is_sentinel_url(url):
        from redis.asyncio.sentinel import Sentinel

        sent = parse_sentinel_url(url, setting=setting)
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(sent.sentinels), sentinel_kwargs=sentinel_kwargs(os.environ)
        )
        master = sentinel_master(os.environ, setting=setting)
        return sentinel.master_for(master, db=sent.db, **sent.auth(), **opts)
    return redis.asyncio.from_url(url, **opts)


class AsyncCritiqueClient:
    """Submit worker outputs and await their verdicts on asyncio (see the module docstring).

    ``async with AsyncCritiqueClient(config) as client:`` closes its connections at the end
    (or call :meth:`aclose`)."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.sync = CritiqueClient(config)
        """The sync client the submits, cancels and reads other than waits go through."""
        self._redis: Any = None
        self._waiting: dict[Handle, list[asyncio.Future[Outcome]]] = {}
        self._poller: asyncio.Task[None] | None = None
        self._outage = riding.Outage()

    async def __aenter__(self) -> AsyncCritiqueClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the poller (pending waits get ``asyncio.CancelledError``) and close Redis."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        for futures in self._waiting.values():
            for f in futures:
                f.cancel()
        self._waiting.clear()
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    # -- submitting ---------------------------------------------------------------------------
    async def submit(self, submission: Submission | Mapping[str, Any]) -> Handle:
        """Enqueue one submission's chain (:meth:`CritiqueClient.submit`)."""
        return (await self.submit_many([submission]))[0]

    async def submit_many(
        self, submissions: Sequence[Submission | Mapping[str, Any]]
    ) -> list[Handle]:
        """Enqueue many (:meth:`CritiqueClient.submit_many`: one bad one enqueues none)."""
        return await asyncio.to_thread(self.sync.submit_many, list(submissions))

    async def submit_repair(
        self, result: CritiqueResult, submission: Submission | Mapping[str, Any], *, tokens: int = 0
    ) -> Handle:
        """A worker's re-run output for a ``worker_repair`` verdict
        (:meth:`CritiqueClient.submit_repair`)."""
        return await asyncio.to_thread(self.sync.submit_repair, result, submission, tokens=tokens)

    async def release_repair(self, result: CritiqueResult) -> bool:
        """A ``worker_repair`` request its worker will not answer: refund its hold
        (:meth:`CritiqueClient.release_repair`)."""
        return await asyncio.to_thread(self.sync.release_repair, result)

    async def cancel(self, target: Handle | str, **kwargs: Any) -> CancelReport:
        """Cancel a handle's pass or a run's unfinished passes (:meth:`CritiqueClient.cancel`)."""
        return await asyncio.to_thread(self.sync.cancel, target, **kwargs)

    async def pitfalls(self, run_id: str, limit: int = 10) -> str:
        """The run's Known Pitfalls text (:meth:`CritiqueClient.pitfalls`)."""
        return await asyncio.to_thread(self.sync.pitfalls, run_id, limit)

    # -- waiting ------------------------------------------------------------------------------
    async def wait(self, handle: Handle, timeout: float | None = 60.0) -> CritiqueResult:
        """The verdict of the handle's pass, awaited without a thread; ``SubmissionError`` when a
        worker recorded the pass as failed, ``CritiqueTimeout`` after ``timeout`` seconds (the
        submission keeps running), ``StoreUnavailableError`` when Redis cannot be reached."""
        if not handle.pass_id:
            raise ValueError("wait needs a handle with its pass id (one that submit returned)")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        self._waiting.setdefault(handle, []).append(future)
        if self._poller is None or self._poller.done():
            self._poller = loop.create_task(self._poll(), name="critique-wait-poller")
        try:
            got = await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            if self._outage.since is not None:  # the store is away: say so, not "no result"
                raise self._outage.error(riding.gave_up("wait", timeout)) from None
            raise CritiqueTimeout(
                f"no result for {handle.worker_id} of run {handle.run_id} after {timeout} s "
                "(is a worker consuming critique.cpu and critique.llm?)"
            ) from None
        finally:
            self._forget(handle, future)
        if isinstance(got, SubmissionError):
            raise got
        return got

    async def wait_many(
        self, handles: Sequence[Handle], timeout: float | None = 300.0
    ) -> list[CritiqueResult]:
        """Every handle's verdict, in order, under one shared deadline."""
        return list(await asyncio.gather(*(self.wait(h, timeout) for h in handles)))

    async def as_completed(
        self, handles: Sequence[Handle], timeout: float | None = 300.0
    ) -> AsyncIterator[CritiqueResult]:
        """Each verdict as it arrives (a failed pass raises its ``SubmissionError`` in turn)."""
        tasks = [asyncio.ensure_future(self.wait(h, timeout)) for h in handles]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for t in tasks:
                t.cancel()

    def _forget(self, handle: Handle, future: asyncio.Future[Outcome]) -> None:
        futures = self._waiting.get(handle)
        if futures is None:
            return
        with contextlib.suppress(ValueError):
            futures.remove(future)
        if not futures:
            del self._waiting[handle]

    async def _poll(self) -> None:
        """Resolve waited passes until none is waited for: one round reads every waited pass.
        A store outage is ridden out (:mod:`workers.riding`): each wait's own timeout bounds
        it; past ``CRITIQUE_OUTAGE_S`` every pending wait gets the outage's error."""
        delay = FAST_POLL_S
        while self._waiting:
            try:
                found = await self._round()
                self._outage.ok()
            except StoreUnavailableError as exc:
                pause = self._outage.failed(exc)
                if self._outage.left(None) <= 0:
                    error = self._outage.error(riding.gave_up("wait", None))
                    for futures in list(self._waiting.values()):
                        for f in futures:
                            if not f.done():
                                f.set_exception(error)
                    self._waiting.clear()
                    self._outage.ok()
                    return
                await asyncio.sleep(pause)
                continue
            delay = FAST_POLL_S if found else min(SLOW_POLL_S, delay * 1.5)
            await asyncio.sleep(delay)

    async def _round(self) -> int:
        """Read every waited pass's result and failure fields (per run: one pipeline of two
        ``HMGET``); resolve those that ended. Returns how many did."""
        if self._redis is None:
            self._redis = async_store_client(runtime.store_url())
        runs = runtime.stores().runs
        by_run: dict[str, list[Handle]] = defaultdict(list)
        for h in list(self._waiting):
            by_run[h.run_id].append(h)
        found = 0
        for run_id, handles in by_run.items():
            fields = [h.ref.member for h in handles]
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.hmget(runs.key(run_id, keys.PASS_RESULTS), fields)
                    pipe.hmget(runs.key(run_id, keys.FAILURES), fields)
                    results, failures = await pipe.execute()
            except (redis.RedisError, OSError) as exc:
                if not is_unavailable(exc):
                    raise
                raise StoreUnavailableError(
                    cannot_reach("Redis", runtime.store_url(), exc),
                    hint=f"start Redis there, or point {runtime.store_setting()} at a running one",
                ) from exc
            for h, field, raw, failed in zip(handles, fields, results, failures, strict=True):
                got = runs.decode_outcome(run_id, field, raw, failed)
                if got is None:
                    continue
                outcome: Outcome = (
                    SubmissionError(f"submission {h.worker_id} of run {run_id} {failure_text(got)}")
                    if isinstance(got, Failure)
                    else got
                )
                for f in self._waiting.pop(h, []):
                    if not f.done():
                        f.set_result(outcome)
                found += 1
        return found
