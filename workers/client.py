"""The manager's client (SPEC §6): submit outputs, wait for results, read the run.

Usage::

    from workers.client import CritiqueClient
    client = CritiqueClient()                       # REDIS_URL, or redis://127.0.0.1:6379/0
    handle = client.submit(submission)              # a pipeline.models.Submission (or a dict)
    result = client.wait(handle, timeout=60)        # a pipeline.models.CritiqueResult
    print(client.pitfalls(submission.run_id))       # Known Pitfalls for the next workers

Any Celery client can do the same with plain messages: see ``workers.tasks`` for the task names.
The broker is the same Redis unless ``CELERY_BROKER_URL`` says otherwise.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.config import CritiqueConfig
from pipeline.errors import StoreUnavailableError, SubmissionError
from pipeline.gates import CompletionDecision, mean_best_score, redundancy_guard
from pipeline.models import CritiqueResult, FileRef, GateEvent, Lesson, Submission
from pipeline.pitfalls import render_pitfalls
from pipeline.runner import admit, start
from pipeline.store import keys
from workers import runtime


@dataclass(frozen=True)
class Handle:
    """What ``submit`` returns: enough to find the submission's result again."""

    run_id: str
    iteration: int
    worker_id: str
    task_id: str


class CritiqueTimeout(TimeoutError):
    """``wait`` gave up before the result arrived (the submission keeps running)."""


class CritiqueClient:
    """Submit worker outputs to the pipeline and read their results and the run's trace."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        runtime.config_for(self.config)  # fail fast on a bad configuration

    # -- submitting -----------------------------------------------------------------------------
    def submit(self, submission: Submission | Mapping[str, Any]) -> Handle:
        """Enqueue one submission's chain; returns at once."""
        return self.submit_many([submission])[0]

    def submit_many(self, submissions: Sequence[Submission | Mapping[str, Any]]) -> list[Handle]:
        """Enqueue many submissions (validated all first: one bad one enqueues none)."""
        subs = [_as_submission(s) for s in submissions]
        config = runtime.config_for(self.config)
        for s in subs:
            admit(s, config)
        return [self._enqueue(s, config) for s in subs]

    def _enqueue(self, sub: Submission, config: CritiqueConfig) -> Handle:
        """Send one validated, admitted submission's chain and register it in the run."""
        from workers.tasks import submission_chain

        msg = runtime.encode(start(sub), self.config)
        try:
            res = submission_chain(msg, config, sub).apply_async()
            runtime.stores().runs.mark_submitted(
                sub.run_id,
                sub.iteration,
                sub.worker_id,
                res.id,
                sub.subtask_signature,
                sid=str(msg["sid"]),
                message=msg,
            )
        except StoreUnavailableError:
            raise
        except Exception as exc:  # kombu/redis connection errors
            if "connect" in str(exc).lower() or "refused" in str(exc).lower():
                raise StoreUnavailableError(
                    f"cannot reach the broker: {exc}",
                    hint=f"is Redis running at {runtime.redis_url()}? set REDIS_URL",
                ) from exc
            raise
        return Handle(sub.run_id, sub.iteration, sub.worker_id, res.id)

    # -- reading --------------------------------------------------------------------------------
    def result(self, handle: Handle) -> CritiqueResult | None:
        """The result if it is there, else None."""
        return runtime.stores().runs.result(handle.run_id, handle.iteration, handle.worker_id)

    def wait(self, handle: Handle, timeout: float | None = 60.0) -> CritiqueResult:
        """Block until the submission's result is stored (polling Redis), or time out.

        A submission whose chain made no progress for :func:`stall_after_s` (no new step
        recorded) is resumed from its last recorded step (:meth:`resume`): the Redis broker can
        lose a message that a killed worker had popped but not yet registered as unacked.
        """
        from celery.result import AsyncResult

        from workers.app import app

        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        progress = _Progress(self, handle, stall_after_s())
        while True:
            got = self.result(handle)
            if got is not None:
                return got
            progress.check()
            ar = AsyncResult(handle.task_id, app=app)
            if ar.state == "FAILURE":
                raise SubmissionError(
                    f"submission {handle.worker_id} of run {handle.run_id} failed: {ar.result!r}"
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise CritiqueTimeout(
                    f"no result for {handle.worker_id} of run {handle.run_id} after {timeout} s "
                    "(is a worker consuming critique.cpu and critique.llm?)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def resume(self, handle: Handle) -> str:
        """Re-drive a submission from its last recorded step (or from the start).

        Safe at any time: every stage replays its recorded output and every effect is
        idempotent, so a chain that was only slow, not lost, ends in the same result. Returns
        the stage it resumed at (``done``: only the gate was missing).
        """
        from workers.tasks import continuation

        runs = runtime.stores().runs
        doc = runs.submitted(handle.run_id).get(f"{handle.iteration}:{handle.worker_id}")
        if not doc or "message" not in doc:
            raise SubmissionError(
                f"cannot resume {handle.worker_id} of run {handle.run_id}: no first message "
                "recorded for it (was it submitted by this client version?)"
            )
        latest = runs.latest_step(handle.run_id, handle.iteration, handle.worker_id, doc["sid"])
        msg: dict[str, Any] = doc["message"] if latest is None else dict(json.loads(latest[1]))
        state, overrides = runtime.decode(msg)
        config = runtime.config_for(overrides)
        continuation(msg, config, state.submission, doc["task_id"]).apply_async()
        runtime.stores().trace.emit(
            handle.run_id,
            {
                "type": "resume",
                "stage": state.next,
                "worker_id": handle.worker_id,
                "iteration": handle.iteration,
                "round": state.round,
                "after_step": None if latest is None else latest[0],
            },
        )
        return state.next

    def wait_many(
        self, handles: Sequence[Handle], timeout: float | None = 300.0
    ) -> list[CritiqueResult]:
        """Wait for every handle (one shared deadline), in order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for h in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            out.append(self.wait(h, left))
        return out

    def results(self, run_id: str, iteration: int | None = None) -> list[CritiqueResult]:
        """Every stored result of the run (or of one iteration)."""
        return runtime.stores().runs.results(run_id, iteration)

    def summary(self, run_id: str, iteration: int = 1) -> dict[str, Any]:
        """The manager summary of one iteration (SPEC §5.8)."""
        from pipeline.artifacts import manager_summary

        s = runtime.stores()
        return manager_summary(
            run_id, iteration, s.runs.results(run_id, iteration), s.patterns.top(run_id, 50)
        )

    # -- gates ----------------------------------------------------------------------------------
    def complete_gate(
        self,
        run_id: str,
        final_result: str | Mapping[str, Any],
        *,
        iteration: int | None = None,
        task: str = "",
        files: Sequence[FileRef | Mapping[str, Any]] = (),
        deliverable_expected: bool | None = None,
        timeout: float = 60.0,
    ) -> CompletionDecision:
        """Ask the completion gate (SPEC §5.6) whether the manager may COMPLETE the run.

        Runs ``critique.complete_gate`` on a worker over the run's stored results (of
        ``iteration``; default the latest one) and returns its decision: ``complete``,
        ``rejected`` (with reasons and the placeholders to replace) or, after
        ``max_rejected_completions`` rejections, ``partial``. Every gate is in the trace.
        """
        from workers.app import app

        if iteration is None:
            done = runtime.stores().runs.results(run_id)
            iteration = max((r.iteration for r in done), default=1)
        try:
            refs = [f if isinstance(f, FileRef) else FileRef.model_validate(dict(f)) for f in files]
        except Exception as exc:
            raise SubmissionError(f"malformed file reference: {exc}") from exc
        msg = {
            "v": runtime.MESSAGE_VERSION,
            "request_id": uuid.uuid4().hex,
            "run_id": run_id,
            "iteration": iteration,
            "final_result": dict(final_result)
            if isinstance(final_result, Mapping)
            else final_result,
            "task": task,
            "files": [f.model_dump(mode="json") for f in refs],
            "deliverable_expected": deliverable_expected,
            "config": self.config,
        }
        runtime.decode_gate_request(msg)  # fail here, not on a worker, when it is malformed
        res = app.send_task(keys.TASK_COMPLETE_GATE, args=(msg,))
        try:
            got = res.get(timeout=timeout)
        except TimeoutError as exc:  # celery.exceptions.TimeoutError subclasses it
            raise CritiqueTimeout(
                f"no completion-gate answer for run {run_id} after {timeout} s "
                "(is a worker consuming critique.cpu?)"
            ) from exc
        return CompletionDecision.model_validate(got)

    def delegate_guard(
        self,
        run_id: str,
        subtask_signature: str,
        *,
        iteration: int = 1,
        worker_id: str | None = None,
    ) -> GateEvent:
        """The redundancy guard (SPEC §5.6): may the manager DELEGATE this subtask again?

        ``reject`` when the signature was already dispatched in this run and the mean critique
        score is under ``min_score_to_complete``; the event is written to the trace.
        """
        s = runtime.stores()
        dispatched = {d.get("signature", "") for d in s.runs.submitted(run_id).values()}
        event = redundancy_guard(
            subtask_signature,
            dispatched,
            mean_best_score(s.runs.results(run_id)),
            runtime.config_for(self.config),
            iteration=iteration,
            worker_id=worker_id,
        )
        s.trace.emit(run_id, {"type": "gate", "stage": "delegate", **event.model_dump(mode="json")})
        return event

    def pitfalls(self, run_id: str, limit: int = 10) -> str:
        """The Known Pitfalls text for the workers the manager dispatches next."""
        return render_pitfalls(runtime.stores().patterns.top(run_id, limit))

    def lessons(self, limit: int = 50, min_runs: int = 2) -> list[Lesson]:
        """Failure patterns that recurred across runs (kept without the run TTL), most first."""
        return runtime.stores().patterns.lessons(limit, min_runs)

    def trace(
        self, run_id: str, *, follow: bool = False, block_ms: int = 1000
    ) -> Iterator[dict[str, Any]]:
        """The run's trace events, oldest first; with ``follow`` keep waiting for new ones."""
        sink = runtime.stores().trace
        if not follow:
            yield from sink.read(run_id)
            return
        for _entry_id, event in sink.iterate(run_id, block_ms=block_ms):
            yield event


def stall_after_s() -> float:
    """Seconds without progress after which ``wait`` resumes a submission.

    ``$CRITIQUE_STALL_S``; by default well past the broker's own redelivery of an unacked
    message (the app's visibility timeout + two restore sweeps + 30 s, as ``celeryconfig``
    set them), so ``resume`` only rescues what the broker itself lost.
    """
    raw = os.environ.get("CRITIQUE_STALL_S")
    if raw:
        return float(raw)
    from workers.app import app

    options = app.conf.broker_transport_options or {}
    visibility = float(options.get("visibility_timeout", 3600))
    restore = float(options.get("unacked_restore_interval", 10))
    return visibility + 2 * restore + 30


class _Progress:
    """Watches one submission's recorded steps while ``wait`` polls; resumes it when stalled."""

    def __init__(self, client: CritiqueClient, handle: Handle, stall_s: float) -> None:
        self.client = client
        self.handle = handle
        self.stall_s = stall_s
        self.every = max(0.5, stall_s / 4)
        self.last_seen: str | None = None
        self.since = time.monotonic()
        self.next_check = self.since + self.every
        self.sid: str | None = None

    def check(self) -> None:
        """Called on every poll; reads the store only every ``stall_s / 4``."""
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + self.every
        runs = runtime.stores().runs
        h = self.handle
        if self.sid is None:
            doc = runs.submitted(h.run_id).get(f"{h.iteration}:{h.worker_id}") or {}
            self.sid = str(doc.get("sid", ""))
        if not self.sid:
            return
        latest = runs.latest_step(h.run_id, h.iteration, h.worker_id, self.sid)
        step = None if latest is None else latest[0]
        if step != self.last_seen:
            self.last_seen, self.since = step, now
        elif now - self.since >= self.stall_s:
            self.client.resume(h)
            self.since = now


def _as_submission(value: Submission | Mapping[str, Any]) -> Submission:
    if isinstance(value, Submission):
        return value
    try:
        return Submission.model_validate(dict(value))
    except Exception as exc:
        raise SubmissionError(f"malformed submission: {exc}") from exc
