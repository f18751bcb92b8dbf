"""The manager's client (docs/client.md): submit outputs, wait for results, read the run.

Usage::

    from workers.client import CritiqueClient
    client = CritiqueClient()                       # REDIS_URL, or redis://127.0.0.1:6379/0
    handle = client.submit(submission)              # a pipeline.models.Submission (or a dict)
    result = client.wait(handle, timeout=60)        # a pipeline.models.CritiqueResult
    print(client.pitfalls(submission.run_id))       # Known Pitfalls for the next workers

A manager in another language submits with one JSON message to the entry task
``critique.submit`` instead (docs/entry.md, :mod:`workers.entry`), which does on a worker what
``submit`` does here, and reads the verdict from Celery's result backend.
The broker is the same Redis unless ``CELERY_BROKER_URL`` says otherwise.

What the client believes comes from the store, never from Celery's result backend: a pass's
result, or the failure a worker recorded for it (both signed with ``CRITIQUE_SECRET`` set, and
ignored unless they verify). A task id's ``FAILURE`` or ``SUCCESS`` state in the backend is no
verdict: anyone who can write to the broker can set it, e.g. by sending garbage under a task
id read from the run's ``submitted`` hash.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipeline import settings
from pipeline.config import check_submission_model
from pipeline.errors import (
    ConfigError,
    CritiqueError,
    StoreUnavailableError,
    SubmissionError,
    error_line,
    validation_problems,
)
from pipeline.loop.admission import admit
from pipeline.loop.gates import CompletionDecision, redundancy_guard
from pipeline.loop.pitfalls import render_pitfalls
from pipeline.loop.stages import start
from pipeline.models import CritiqueResult, FileRef, GateEvent, Lesson, PassRef, Pattern, Submission
from pipeline.records.artifacts import manager_summary
from pipeline.records.run_scores import mean_best_score
from pipeline.security import signing
from pipeline.security.posture import refusal
from pipeline.store import keys
from pipeline.store.base import BudgetSnapshot
from pipeline.store.fleet import RedisFleetPosture
from pipeline.store.runs import DoneListener, Failure, announces
from pipeline.store.urls import cannot_reach, check_urls, new_lookalike_warnings
from pipeline.text.escaping import one_line
from workers import cancelling, riding, runtime, telemetry
from workers.archiving import results_if_expired
from workers.cancelling import CancelReport
from workers.recovery.redriving import redrive
from workers.unreachable import BrokerUnavailableError, is_unreachable, unreachable_errors

log = logging.getLogger(__name__)


def _check_secret_matches(subs: Sequence[Submission]) -> None:
    """Refuse to resubmit over a finished result this process cannot verify: it was signed
    with another ``CRITIQUE_SECRET`` (or none), so the workers would refuse this process's
    messages too, and the new pass would supersede that result with one no worker will run."""
    by_run: dict[str, list[str]] = {}
    for sub in subs:
        by_run.setdefault(sub.run_id, []).append(PassRef.field_of(sub.iteration, sub.worker_id))
    for run_id, fields in by_run.items():
        bad = runtime.stores().runs.unverifiable(run_id, list(dict.fromkeys(fields)))
        if bad:
            raise ConfigError(
                f"run {run_id}'s stored result for {bad[0]}"
                + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                + " does not verify with this process's CRITIQUE_SECRET: the workers sign with "
                "another secret (or none), so they would refuse these messages too; nothing "
                "was submitted",
                key=settings.SECRET.name,
                hint="compare the manager's CRITIQUE_SECRET with the workers': they must be "
                "the same",
            )


def _enter_runs(subs: Sequence[Submission]) -> None:
    """Bind each run submitted into to the workers' key, ``fleet`` (the identity this path
    signs as, :data:`pipeline.security.signing.FLEET_IDENTITY`), as an entry message binds a run to
    its manager's key; a run another manager opened through ``critique.submit`` is refused
    (:class:`pipeline.store.runs.RunOwnedError`) before anything is sent. Without
    ``CRITIQUE_SECRET`` no run has an owner."""
    if not runtime.secrets():
        return
    for run_id in dict.fromkeys(sub.run_id for sub in subs):
        runtime.stores().runs.enter_run(run_id, signing.FLEET_IDENTITY)


@dataclass(frozen=True)
class Handle:
    """What ``submit`` returns: enough to find the result of that submit (its pass) again.

    Each submit of a submission (run, iteration, worker) is a new pass with a fresh ``pass_id``
    (docs/client.md, 'Passes'): ``wait`` and ``result`` answer with this pass's result, never an
    earlier or later pass's. A handle without a pass id (one rebuilt from ``run_id``, ``iteration``,
    ``worker_id`` and ``task_id`` only) reads the latest pass's result.
    """

    run_id: str
    iteration: int
    worker_id: str
    task_id: str
    pass_id: str = ""

    @property
    def ref(self) -> PassRef:
        """The pass this handle names (its ``pass_id`` empty for a handle without one)."""
        return PassRef(self.run_id, self.iteration, self.worker_id, self.pass_id)


class CritiqueTimeout(TimeoutError):
    """``wait`` gave up before the result arrived (the submission keeps running)."""


class CritiqueClient:
    """Submit worker outputs to the pipeline and read their results and the run's trace."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        # Every URL setting first: a scheme-less REDIS_URL is one ConfigError naming it here,
        # not a traceback from redis-py (or kombu) at the first submit.

        check_urls()
        for warning in new_lookalike_warnings():  # REDIS_ULR: the default would be used
            log.warning("%s", warning)
        # Fail fast on a bad configuration, and on one a submission may not carry (a
        # worker-only field, a limit above this process's own configuration); see
        # docs/security.md, 'Who may set what'.
        runtime.config_for(self.config)
        # One trace per submit when the environment asks for tracing (workers.telemetry).
        telemetry.setup("critique-client")
        # When check_fleet last found nothing to refuse, and for which secrets.
        self._fleet_checked: tuple[float, Sequence[bytes]] = (-math.inf, ())

    # -- submitting -----------------------------------------------------------------------------
    def submit(self, submission: Submission | Mapping[str, Any]) -> Handle:
        """Enqueue one submission's chain; returns at once."""
        return self.submit_many([submission])[0]

    def submit_repair(
        self,
        result: CritiqueResult,
        submission: Submission | Mapping[str, Any],
        *,
        tokens: int = 0,
    ) -> Handle:
        """Submit a worker's re-run output for a ``worker_repair`` verdict (``repairer:
        worker``; docs/client.md, "The worker repairs"): ``submission`` is the original one
        with the re-run's output, ``tokens`` what the re-run spent as its provider reported it.
        The service checks it as that pass's next repair attempt (re-critique, keep-best, the
        fixpoint test, the attempt cap, the run's repair budget) and ``wait`` on the handle
        answers with the verdict, another ``worker_repair`` included. ``ValueError`` when
        ``result`` asked for no repair or is another submission's."""
        request = result.repair_request
        if request is None:
            raise ValueError(
                f"{result.worker_id}: the verdict is {result.status} ({result.stop_reason}), "
                "not worker_repair: it asked for no repair"
            )
        sub = Submission.model_validate(submission)
        if (sub.run_id, sub.iteration, sub.worker_id) != (
            result.run_id,
            result.iteration,
            result.worker_id,
        ):
            raise ValueError(
                f"the repaired submission is {sub.run_id}/{sub.iteration}/{sub.worker_id}, the "
                f"verdict {result.run_id}/{result.iteration}/{result.worker_id}: they must match"
            )
        return self.submit(
            sub.model_copy(update={"repair_of": request.of_pass, "repair_tokens": int(tokens)})
        )

    def release_repair(self, result: CritiqueResult) -> bool:
        """Say a ``worker_repair`` verdict will not be answered (the manager keeps the output,
        or drops it): the service forgets the pass's kept state and refunds the run's budget
        hold for the re-run at once, instead of after ``repair_request.expires_s``. True when
        it was still waiting."""
        self.check_fleet()
        return cancelling.release_worker_repair(result)

    def submit_many(self, submissions: Sequence[Submission | Mapping[str, Any]]) -> list[Handle]:
        """Enqueue many submissions; one bad one enqueues none.

        Every submission is validated (a ``Submission`` instance too), admitted (size limit,
        blob files readable) and serialised — its first message and chain built — before any
        is sent. Each failure is a :class:`SubmissionError` that names the submission (its
        index and ``worker_id``) and what is wrong. A fleet that would refuse this process's
        messages is a ``ConfigError`` before any pass begins (:meth:`check_fleet`).
        """
        # lazy: workers.routing imports workers.app, which configures Celery, logging and os.environ
        # on import; importing workers.client does not. workers.tasks registers the stage tasks
        # (app.tasks) the signature is built from.
        import workers.tasks  # noqa: F401
        from workers.routing import submission_signature

        config = runtime.config_for(self.config)
        unavailable = unreachable_errors()
        subs = [_as_submission(value, index) for index, value in enumerate(submissions)]
        _check_secret_matches(subs)
        self.check_fleet()
        prepared: list[tuple[Submission, dict[str, Any], Any]] = []
        for index, sub in enumerate(subs):
            try:
                admit(sub, config, runtime.file_bytes)
                check_submission_model(sub.model, runtime.own_config())
                msg = runtime.encode(
                    start(sub, runtime.new_pass_id()),
                    self.config,
                    task=keys.TASK_L0,
                    task_id=uuid.uuid4().hex,  # the chain's first task runs under this id
                )
                json.dumps(msg, allow_nan=False)  # the broker's JSON must carry it as it is
                prepared.append((sub, msg, submission_signature(msg, config, sub)))
            except unavailable:
                raise
            except Exception as exc:
                named = _naming(exc, index, sub.worker_id)
                if named is exc:
                    raise
                raise named from exc
        _enter_runs(subs)
        return [self._enqueue(sub, msg, chain) for sub, msg, chain in prepared]

    def check_fleet(self) -> None:
        """Raise ``ConfigError`` (one line naming ``CRITIQUE_SECRET``, nothing sent) when the
        live workers' posture (:mod:`pipeline.security.posture`, which every worker publishes) says
        they would refuse what this process sends, or write results it cannot verify: they require a
        secret this process lacks or holds another of, or this process holds one they lack.
        ``submit``, ``complete_gate`` and ``resume`` call it before they send anything; with no
        posture in the store (an older fleet, no worker started yet) there is nothing to check. A
        check that found nothing to refuse stands for :data:`POSTURE_CHECK_S` in this client while
        its secrets stay the same (the posture is advisory: each worker refuses what it cannot
        verify itself)."""
        now, secrets = time.monotonic(), runtime.secrets()
        checked_at, checked_for = self._fleet_checked
        if now - checked_at < POSTURE_CHECK_S and checked_for == secrets:
            return
        wall = time.time()
        refused = refusal(RedisFleetPosture(runtime.client()).read(wall), secrets, wall)
        if refused is not None:
            raise refused
        self._fleet_checked = (now, secrets)

    def _enqueue(self, sub: Submission, msg: dict[str, Any], chain: Any) -> Handle:
        """Record one prepared submission's pass (``msg`` is its first message) and send its
        chain. The record comes first, in one store round trip (this pass is the submission's
        latest, pending from now, re-drivable from ``msg``); a send that fails withdraws it."""
        pass_id = str(msg["sid"])
        task_id = str(chain.freeze().id)  # the id the chain's result lands under
        runtime.stores().runs.open_submission(
            sub, pass_id, task_id=task_id, message=msg
        )  # a store that cannot be reached names Redis itself: nothing was sent
        try:
            with telemetry.span(
                "critique submit",
                run_id=sub.run_id,
                iteration=sub.iteration,
                worker_id=sub.worker_id,
                pass_id=pass_id,
            ):
                chain.apply_async()
        except Exception as exc:
            withdrawn = self._withdraw(sub, pass_id)
            refused = _queue_refused(exc)
            if refused is not None:
                raise refused from exc
            if not is_unreachable(exc):
                raise
            # lazy: workers.app configures Celery, logging and os.environ on import; importing
            # workers.client does not
            from workers.app import app

            broker = str(app.conf.broker_url or runtime.redis_url())
            hint = (
                "start the broker there, or point CELERY_BROKER_URL (or REDIS_URL, which it "
                "defaults to) at a running one"
            )
            if not withdrawn:
                hint += (
                    f"; {sub.worker_id}'s pass stays recorded (the store was unreachable too): "
                    "the workers' sweeper may still run it once both are back"
                )
            raise BrokerUnavailableError(
                cannot_reach("the broker", broker, exc), hint=hint
            ) from exc
        return Handle(sub.run_id, sub.iteration, sub.worker_id, task_id, pass_id)

    @staticmethod
    def _withdraw(sub: Submission, pass_id: str) -> bool:
        """Withdraw a pass whose send failed (:meth:`RedisRunStore.withdraw`); False when the
        store could not be reached either (then the pass stays recorded)."""
        try:
            runtime.stores().runs.withdraw(PassRef.of(sub, pass_id))
        except StoreUnavailableError as exc:
            log.warning("could not withdraw %s's unsent pass %s: %s", sub.worker_id, pass_id, exc)
            return False
        return True

    # -- reading --------------------------------------------------------------------------------
    def result(self, handle: Handle) -> CritiqueResult | None:
        """The result of the handle's pass if it is there, else None (a handle without a pass
        id: the submission's latest pass's). Rides out a store outage (:mod:`workers.riding`)."""
        return riding.ride(lambda: self._result(handle))

    def _result(self, handle: Handle) -> CritiqueResult | None:
        runs = runtime.stores().runs
        if handle.pass_id:
            return runs.pass_result(
                handle.run_id, handle.iteration, handle.worker_id, handle.pass_id
            )
        return runs.result(handle.run_id, handle.iteration, handle.worker_id)

    def outcome(self, handle: Handle) -> CritiqueResult | SubmissionError | None:
        """The handle's pass's result, else the :class:`SubmissionError` for the failure a
        worker recorded for that pass (a handle without a pass id: the latest pass), else None.
        Celery's state for the task id is not consulted: a broker writer can forge it. Rides
        out a store outage (:mod:`workers.riding`)."""
        return riding.ride(lambda: self._outcome(handle))

    def _outcome(self, handle: Handle) -> CritiqueResult | SubmissionError | None:
        runs = runtime.stores().runs
        h = handle
        if h.pass_id:
            got = runs.pass_outcome(h.run_id, h.iteration, h.worker_id, h.pass_id)
        else:
            got = runs.result(h.run_id, h.iteration, h.worker_id)
            pass_id = (
                None if got is not None else runs.latest_pass(h.run_id, h.iteration, h.worker_id)
            )
            if pass_id:
                got = runs.failure(h.run_id, replace(h.ref, pass_id=pass_id).member)
        if isinstance(got, Failure):
            return SubmissionError(
                f"submission {h.worker_id} of run {h.run_id} {failure_text(got)}"
            )
        return got

    def wait(self, handle: Handle, timeout: float | None = 60.0) -> CritiqueResult:
        """Block until the result of the handle's pass is stored (polling Redis), or time out.

        A resubmission's handle never gets the earlier pass's result: until its own pass has
        finished, ``wait`` keeps waiting (and times out with :class:`CritiqueTimeout`).

        ``wait`` only waits: a pass whose chain was lost (a killed worker, a broker that lost
        its message) is re-driven by the workers' sweeper (:mod:`workers.recovery.sweeper`), or
        by hand with :meth:`resume`; its result then ends the wait.

        Raises :class:`SubmissionError` when a worker recorded that the pass failed (refused
        by the worker, a stage that raised); only such a record counts, never the state of the
        chain's task id in Celery's result backend.

        A store outage (a Sentinel failover, a Redis restart) is ridden out within ``timeout``
        (:mod:`workers.riding`): ``StoreUnavailableError``, saying for how long the store was
        away, only when it outlasts the timeout (or ``CRITIQUE_OUTAGE_S`` with no timeout).
        """
        answers = self.as_completed([handle], timeout)
        try:
            _, got = next(answers)
        except CritiqueTimeout:
            raise CritiqueTimeout(
                f"no result for {handle.worker_id} of run {handle.run_id} after "
                f"{timeout} s (is a worker consuming critique.cpu and critique.llm?)"
            ) from None
        finally:
            answers.close()  # its subscription with it
        if isinstance(got, SubmissionError):
            raise got
        return got

    def resume(self, handle: Handle) -> str:
        """Re-drive a submission from its last recorded step (or from the start).

        Safe at any time: every stage replays its recorded output and every effect is
        idempotent, so a chain that was only slow, not lost, ends in the same result. Returns
        the stage it resumed at (``done``: only the gate was missing). The same re-drive as the
        workers' stall sweeper (:func:`workers.recovery.redriving.redrive`), traced ``by: client``.
        """
        self.check_fleet()
        return redrive(handle.run_id, handle.iteration, handle.worker_id, by="client")

    def cancel(
        self,
        target: Handle | str,
        *,
        workers: Sequence[str] | None = None,
        iteration: int | None = None,
        by: str | None = None,
    ) -> CancelReport:
        """Cancel a handle's pass, or every unfinished pass of a run id (of ``workers`` and
        ``iteration`` when given): each ends ``cancelled`` (its result, which ``wait`` returns),
        a stage in flight stops before its next model call, queued messages of it do nothing,
        its budget leases are refunded, and the trace names ``by`` (default ``client``). A pass
        that finished first is left alone. Returns what it did (:class:`CancelReport`);
        ``SubmissionError`` for a run, worker or iteration with no submission
        (docs/operations.md, "Cancelling a run"); ``ConfigError`` naming ``CRITIQUE_SECRET``
        when the workers sign with a key this process lacks (its results would not verify)."""
        self.check_fleet()
        who = cancelling.who(by, "client")
        if isinstance(target, str):
            return cancelling.cancel_run(target, workers=workers, iteration=iteration, by=who)
        h = target
        pass_id = h.pass_id or runtime.stores().runs.latest_pass(h.run_id, h.iteration, h.worker_id)
        if not pass_id:
            raise SubmissionError(f"run {h.run_id!r} has no pass of {h.worker_id} to cancel")
        return cancelling.cancel_pass(h.run_id, h.iteration, h.worker_id, pass_id, by=who)

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

    def as_completed(
        self,
        handles: Sequence[Handle],
        timeout: float | None = 300.0,
        *,
        on_poll: Callable[[], None] | None = None,
    ) -> Generator[tuple[Handle, CritiqueResult | SubmissionError], None, None]:
        """Yield every handle once, as soon as it has an answer: its result, or the
        :class:`SubmissionError` saying why its chain failed (refused by a worker, a stage that
        raised: as a worker recorded it for the pass, as in :meth:`wait`). One failure never
        hides the others' results. Raises :class:`CritiqueTimeout` at ``timeout`` (one shared
        deadline) while some are still pending; as :meth:`wait`, it re-drives nothing.
        ``on_poll`` is called after each round of polls while some are pending
        (at least every 0.25 s): a caller's progress line or hint, however quiet the wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        left = dict(enumerate(handles))
        where: dict[tuple[str, int, str], list[int]] = {}
        for i, h in enumerate(handles):
            where.setdefault((h.run_id, h.iteration, h.worker_id), []).append(i)
        delay = 0.01
        outage = riding.Outage()
        listener = _Listener(*dict.fromkeys(h.run_id for h in handles))
        due: list[int] | None = None  # None: read every pending handle (a full round)
        round_end = 0.0
        try:
            while left:
                full = due is None
                began = time.monotonic()
                try:
                    for i in list(left) if due is None else [i for i in due if i in left]:
                        h = left[i]
                        got = self._outcome(h)
                        outage.ok()
                        listener.answered()
                        if got is not None:
                            del left[i]
                            yield h, got
                except StoreUnavailableError as exc:  # ridden out: the round starts again
                    listener.lost()
                    due = None
                    outage.back_off(exc, deadline, riding.gave_up("wait", timeout), began)
                    continue
                if not left:
                    return
                if listener.due():
                    # Subscribe, then read again: a result landing after that read is
                    # announced to us (verdicts already there cost no subscription).
                    listener.open()
                    due = None
                    continue
                if on_poll is not None:
                    on_poll()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    pending = ", ".join(h.worker_id for h in left.values())
                    raise CritiqueTimeout(
                        f"no result after {timeout} s for: {pending} "
                        "(is a worker consuming critique.cpu and critique.llm?)"
                    )
                due = None
                if not listener.listening:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.25)
                    continue
                # Listening: sleep until an announcement for a pending handle (read just those)
                # or the next full round (the backstop), whichever comes first.
                if full:
                    round_end = now + BACKSTOP_POLL_S
                if deadline is not None:
                    round_end = min(round_end, deadline)
                woke = listener.sleep(round_end - now, list(left.values()))
                if woke:
                    due = [i for h in woke for i in where[(h.run_id, h.iteration, h.worker_id)]]
        finally:
            listener.close()

    def results(self, run_id: str, iteration: int | None = None) -> list[CritiqueResult]:
        """Every stored result of the run (or of one iteration). Once Redis holds no
        submission and no result of the run (its keys expired), the run's archive answers
        (``$CRITIQUE_ARCHIVE_DIR``; ``ArchiveError`` when it is there but cannot be trusted)."""
        got = riding.ride(lambda: runtime.stores().runs.results(run_id, iteration))
        if got:
            return got

        return results_if_expired(run_id, iteration)

    def summary(self, run_id: str, iteration: int = 1) -> dict[str, Any]:
        """The manager summary of one iteration: per-worker scores and defect counts, top
        prescriptions, known patterns with frequencies, repair history."""
        stores = runtime.stores()
        return manager_summary(
            run_id,
            iteration,
            riding.ride(lambda: stores.runs.results(run_id, iteration)),
            riding.ride(lambda: stores.patterns.top(run_id, 50)),
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
        """Ask the completion gate whether the manager may COMPLETE the run.

        Runs ``critique.complete_gate`` on a worker over the run's stored results (of
        ``iteration``; default the latest one) and returns its decision: ``complete``,
        ``rejected`` (with reasons and the placeholders to replace) or, after
        ``max_rejected_completions`` rejections, ``partial``. Every gate is in the trace.

        The request is addressed to the task id it is sent under, and the decision is read from
        the store as the worker recorded it (signed with ``CRITIQUE_SECRET``), not from
        Celery's result backend; a refusal the worker recorded raises :class:`SubmissionError`.
        """
        # lazy: workers.app configures Celery, logging and os.environ on import; importing
        # workers.client does not
        from workers.app import app

        self.check_fleet()
        if iteration is None:
            done = runtime.stores().runs.results(run_id)
            iteration = max((r.iteration for r in done), default=1)
        try:
            refs = [f if isinstance(f, FileRef) else FileRef.model_validate(dict(f)) for f in files]
        except Exception as exc:
            raise SubmissionError(f"malformed file reference: {exc}") from exc
        request_id = uuid.uuid4().hex
        task_id = uuid.uuid4().hex
        msg = {
            "v": runtime.MESSAGE_VERSION,
            "request_id": request_id,
            "run_id": run_id,
            "iteration": iteration,
            "final_result": dict(final_result)
            if isinstance(final_result, Mapping)
            else final_result,
            "task": task,
            "files": [f.model_dump(mode="json") for f in refs],
            "deliverable_expected": deliverable_expected,
            "config": self.config,
            "task_name": keys.TASK_COMPLETE_GATE,
            "task_id": task_id,
        }
        msg = runtime.sign(msg)  # with CRITIQUE_SECRET set: workers refuse unsigned requests
        runtime.decode_gate_request(msg)  # fail here, not on a worker, when it is malformed
        app.send_task(keys.TASK_COMPLETE_GATE, args=(msg,), task_id=task_id)
        runs = runtime.stores().runs
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            got = runs.completion_outcome(run_id, request_id)
            if isinstance(got, Failure):
                raise SubmissionError(f"completion gate of run {run_id} {failure_text(got)}")
            if got is not None:
                return CompletionDecision.model_validate(got)
            if time.monotonic() >= deadline:
                raise CritiqueTimeout(
                    f"no completion-gate answer for run {run_id} after {timeout} s "
                    "(is a worker consuming critique.cpu?)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def delegate_guard(
        self,
        run_id: str,
        subtask_signature: str,
        *,
        iteration: int = 1,
        worker_id: str | None = None,
    ) -> GateEvent:
        """The redundancy guard: may the manager DELEGATE this subtask again?

        ``reject`` when the signature was already dispatched in this run and the mean critique
        score is under ``min_score_to_complete``; the event is written to the trace.
        """
        stores = runtime.stores()
        dispatched = {d.get("signature", "") for d in stores.runs.submitted(run_id).values()}
        event = redundancy_guard(
            subtask_signature,
            dispatched,
            mean_best_score(stores.runs.results(run_id)),
            runtime.config_for(self.config),
            iteration=iteration,
            worker_id=worker_id,
        )
        stores.trace.emit(
            run_id, {"type": "gate", "stage": "delegate", **event.model_dump(mode="json")}
        )
        return event

    def pitfalls(self, run_id: str, limit: int = 10) -> str:
        """The Known Pitfalls text for the workers the manager dispatches next."""
        return render_pitfalls(self.patterns(run_id, limit))

    def patterns(self, run_id: str, limit: int = 10) -> list[Pattern]:
        """The run's pattern memory as records (most frequent first): what
        :meth:`pitfalls` renders."""
        return riding.ride(lambda: runtime.stores().patterns.top(run_id, limit))

    def budget(self, run_id: str) -> BudgetSnapshot:
        """The run's repair budget now: tokens charged (``spent``), held by repairs in flight or
        waiting for a worker's repair (``held``, ``holders``), and charged past reservations."""
        return riding.ride(lambda: runtime.stores().budget.snapshot(run_id))

    def lessons(
        self, limit: int = 50, min_runs: int = 2, *, run_id: str | None = None
    ) -> list[Lesson]:
        """The lessons ``run_id`` may see: by default (``CRITIQUE_LESSONS_SCOPE=run``) the
        patterns that run taught, none without a run id; with ``fleet``, the patterns that
        recurred in at least ``min_runs`` runs (kept without the run TTL), most first, counted
        and never naming a run (:meth:`pipeline.store.redis.RedisPatternStore.lessons`)."""
        return riding.ride(
            lambda: runtime.stores().patterns.lessons(limit, min_runs, run_id=run_id)
        )

    def trace(
        self, run_id: str, *, follow: bool = False, block_ms: int = 1000
    ) -> Iterator[dict[str, Any]]:
        """The run's trace events, oldest first; with ``follow`` keep waiting for new ones. Both
        ride out a store outage (:mod:`workers.riding`): a followed trace goes on after the
        last event it yielded, none twice."""
        sink = runtime.stores().trace
        if not follow:
            yield from riding.ride(lambda: sink.read(run_id))
            return
        for _entry_id, event in riding.ride_iter(
            lambda after: sink.iterate(run_id, block_ms=block_ms, last_id=after)
        ):
            yield event


POSTURE_CHECK_S = 1.0
"""How long a fleet posture check that refused nothing stands in a client
(:meth:`CritiqueClient.check_fleet`): a manager submitting one output at a time reads the
posture once a second, not once per submit."""

BACKSTOP_POLL_S = 0.25
"""While a wait listens for its pass's announcement, it still reads the store this often: an
announcement lost to a reconnect costs at most this much."""


class _Listener:
    """A wait's subscription to its runs' ``done`` announcements
    (:class:`pipeline.store.runs.DoneListener`), opened after a wait's first read found some
    answers missing (then read again), and again after an outage once the store answers (a
    broken one falls back to polling)."""

    def __init__(self, *run_ids: str) -> None:
        self.run_ids = run_ids
        self.inner: DoneListener | None = None
        self.tried = False
        self.away = False

    @property
    def listening(self) -> bool:
        return self.inner is not None and self.inner.listening

    def open(self) -> None:
        """Subscribe unless subscribed, or tried already, or the store is away (a subscription
        attempt per outage round would double what riding it out costs)."""
        if self.tried or self.away:
            return
        self.tried = True
        self.inner = runtime.stores().runs.listen(*self.run_ids)

    def due(self) -> bool:
        """Whether :meth:`open` would subscribe now."""
        return not (self.tried or self.away)

    def lost(self) -> None:
        """The store failed a read: subscribe again once it answers (:meth:`answered`)."""
        self.close()
        self.away = True

    def answered(self) -> None:
        """The store answered a read: after an outage, the next :meth:`open` subscribes."""
        if self.away:
            self.away = False
            self.tried = False

    def sleep(self, seconds: float, handles: Sequence[Handle]) -> list[Handle]:
        """Sleep up to ``seconds``, returning early with the ``handles`` announced meanwhile."""
        end = time.monotonic() + seconds
        while self.inner is not None and self.inner.listening:
            left = end - time.monotonic()
            if left <= 0:
                return []
            got = self.inner.wait(left)
            mine = [
                h
                for h in handles
                if any(r == h.run_id and announces(m, h.iteration, h.worker_id) for r, m in got)
            ]
            if mine:
                return mine
        # The subscription broke (a reconnect, a failover): read now, subscribe again next.
        self.close()
        self.tried = False
        return []

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None


def failure_text(failure: Failure) -> str:
    """A recorded failure in one line, as :func:`_failure_reason` words an exception: "was
    refused by the worker: …" for a refusal, else "failed: <Error>: …"."""
    line = one_line(failure.reason, 500) or failure.error
    if failure.refused:
        return f"was refused by the worker: {line}"
    return f"failed: {failure.error}: {line}"


def _failure_reason(exc: Any) -> str:
    """Why a chain failed, in one line: "was refused by the worker: …" when the submission or
    its configuration was refused (``SubmissionError``, ``ConfigError``), else "failed: …"."""
    line = error_line(exc)
    if isinstance(exc, (SubmissionError, ConfigError)):
        return f"was refused by the worker: {line}"
    return f"failed: {type(exc).__name__}: {line}"


def _queue_refused(exc: BaseException) -> Exception | None:
    """The configuration error for a publish RabbitMQ refused because a pipeline queue exists
    with another type (``PRECONDITION_FAILED`` on its declare), else None."""
    try:
        from amqp.exceptions import PreconditionFailed
    except ImportError:  # pragma: no cover - py-amqp comes with Celery
        return None
    if not isinstance(exc, PreconditionFailed) or "x-queue-type" not in str(exc.reply_text):
        return None
    # lazy: workers.app configures Celery, logging and os.environ on import; importing
    # workers.client does not
    from workers.app import amqp_queue_refused, app

    vhost = str(app.conf.broker_url or "").rpartition("/")[2] or "/"
    refused: Exception = amqp_queue_refused(str(exc.reply_text), vhost)
    return refused


def _as_submission(value: Submission | Mapping[str, Any], index: int = 0) -> Submission:
    """``value`` validated as a :class:`Submission` (an instance is validated again: one built
    with ``model_construct`` skipped every check); a :class:`SubmissionError` naming it."""
    from pydantic import ValidationError

    try:
        data = value.model_dump() if isinstance(value, Submission) else dict(value)
        return Submission.model_validate(data)
    except ValidationError as exc:
        worker = _worker_of(value)
        raise SubmissionError(
            f"submission {index}{worker} is malformed: {validation_problems(exc)}", hint=_FIX_HINT
        ) from None
    except (TypeError, ValueError) as exc:
        raise SubmissionError(
            f"submission {index}{_worker_of(value)} is malformed: {error_line(exc, 300)}"
        ) from None


_FIX_HINT = "fix it and submit the batch again: nothing was enqueued"


def _worker_of(value: Any) -> str:
    """`` (worker_id 'w1')`` when ``value`` names one, else ``''``."""
    worker = getattr(value, "worker_id", None)
    if worker is None and isinstance(value, Mapping):
        worker = value.get("worker_id")
    if not isinstance(worker, str):
        return ""
    return f" (worker_id {worker[:80]!r})"


def _naming(exc: BaseException, index: int, worker_id: str) -> SubmissionError:
    """``exc`` as a :class:`SubmissionError` whose message starts with the submission it is
    about; a ``SubmissionError`` (or subclass) keeps its class and fields."""
    what = f"submission {index} (worker_id {worker_id!r})"
    if isinstance(exc, SubmissionError):
        exc.message = f"{what}: {exc.message}"
        exc.args = (exc.message, *exc.args[1:])
        return exc
    if isinstance(exc, CritiqueError):
        return SubmissionError(f"{what}: {exc.message}", hint=exc.hint or _FIX_HINT)
    return SubmissionError(
        f"{what} cannot be serialised for the broker: {error_line(exc, 300)}", hint=_FIX_HINT
    )
