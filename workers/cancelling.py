"""Cancelling submission passes: what ``critique cancel`` and ``CritiqueClient.cancel`` do
(docs/operations.md, "Cancelling a run").

Each unfinished pass gets its result now, ``cancelled`` (:func:`pipeline.models.cancelled_result`),
through the same store script as a gate's (:meth:`pipeline.store.runs.RedisRunStore.put_result`),
with a ``cancelled`` trace event naming who cancelled it and the pass's ``result`` event. That
one write is what stops the pass everywhere: ``status``, ``wait`` and ``results`` read it; the
pass leaves the pending index (the sweeper never re-drives it); a stage message of it that
arrives later finds the result and ends its chain; a stage in flight asks before its next model
call (:attr:`pipeline.loop.stages.StageContext.cancelled`) and stops; and no later result replaces
it (a result is stored once per pass). Then the budget leases the cancelled passes hold, or wait
for, are refunded, and the summary is stored under the pass's task id in Celery's result
backend, so a manager reading ``AsyncResult(entry id).get()`` gets ``cancelled`` too.

A pass that finished first (a result or a recorded failure) is left alone and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline import settings
from pipeline.errors import ConfigError, ForgedMessageError, SubmissionError
from pipeline.loop.stages import pass_lease_prefix
from pipeline.models import CritiqueResult, PassRef, cancelled_result
from pipeline.security import signing
from pipeline.store.base import encode_event
from pipeline.text.escaping import one_line
from workers import runtime

log = logging.getLogger(__name__)

BY_CHARS = 64
"""Longest ``by`` (who cancelled) kept in the trace and the result's note."""
MESSAGE_TRIES = 5
"""Passes whose first message is looked for to check this process signs as the workers do."""


@dataclass(frozen=True)
class CancelReport:
    """What a cancel did: the passes it cancelled and the ones that had finished already
    (pass members ``"<iteration>:<worker_id>:<pass id>"``), and who cancelled."""

    run_id: str
    by: str
    cancelled: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    released: tuple[str, ...] = ()
    """Finished passes that were waiting for their worker's repair (``worker_repair``): their
    parked state is dropped and their budget hold refunded, so a repaired output sent later
    is refused."""

    def as_json(self) -> dict[str, Any]:
        """The report as ``critique cancel --json`` prints it."""
        return {
            "run_id": self.run_id,
            "by": self.by,
            "cancelled": [_pass_json(m) for m in self.cancelled],
            "already_finished": [_pass_json(m) for m in self.finished],
            "released_worker_repairs": [_pass_json(m) for m in self.released],
        }

    def __str__(self) -> str:
        head = f"cancelled {len(self.cancelled)} in run {self.run_id} (by {self.by})"
        tail = f", {len(self.released)} waiting worker repair(s) released" if self.released else ""
        return f"{head}, already finished {len(self.finished)}{tail}"


def _pass_json(pass_field: str) -> dict[str, Any]:
    ref = PassRef.parse("", pass_field)
    if ref is None:
        return {"iteration": 0, "worker_id": pass_field, "pass_id": ""}
    return {"iteration": ref.iteration, "worker_id": ref.worker_id, "pass_id": ref.pass_id}


def who(by: str | None, default: str) -> str:
    """``by`` on one line, at most :data:`BY_CHARS` characters; ``default`` when empty."""
    line = one_line(by or "", BY_CHARS)
    return "".join(c for c in line if c.isprintable()) or default


def cancel_run(
    run_id: str,
    *,
    workers: Sequence[str] | None = None,
    iteration: int | None = None,
    by: str,
) -> CancelReport:
    """Cancel every unfinished pass of ``run_id`` (of ``workers`` and ``iteration`` when
    given). ``SubmissionError`` for a run the store holds nothing of, or a worker or iteration
    with no submission in it; ``ConfigError`` when this process cannot sign as the workers do."""
    open_, finished = runtime.stores().runs.open_passes(run_id)
    if not open_ and not finished and not runtime.stores().runs.submitted(run_id):
        raise SubmissionError(
            f"no submission of run {run_id!r} in the store at {runtime.store_url()} (a mistyped "
            f"run id, another {runtime.store_setting()}, or the run's keys expired): nothing "
            "was cancelled"
        )
    open_ = _narrowed(run_id, open_, finished, workers, iteration)
    finished = _narrowed(run_id, finished, open_, workers, iteration, check=False)
    return _cancel(run_id, open_, finished, by)


def cancel_pass(
    run_id: str, iteration: int, worker_id: str, pass_id: str, *, by: str
) -> CancelReport:
    """Cancel one pass (a handle's), unless it has finished: then it is reported as such."""
    field = PassRef(run_id, iteration, worker_id, pass_id).member
    if runtime.stores().runs.pass_outcome(run_id, iteration, worker_id, pass_id) is not None:
        return CancelReport(
            run_id, by, finished=(field,), released=_release_waiting(run_id, [field])
        )
    return _cancel(run_id, [field], [], by)


def _narrowed(
    run_id: str,
    fields: list[str],
    others: list[str],
    workers: Sequence[str] | None,
    iteration: int | None,
    *,
    check: bool = True,
) -> list[str]:
    """The pass members of ``fields`` of the given workers and iteration; with ``check``, a
    worker or iteration that names no pass of the run (in ``fields`` or ``others``) is a
    ``SubmissionError``."""
    parsed = {f: PassRef.parse(run_id, f) for f in fields}
    if check:
        others_parsed = (PassRef.parse(run_id, f) for f in others)
        known = [p for p in (*parsed.values(), *others_parsed) if p is not None]
        unknown = sorted(set(workers or ()) - {p.worker_id for p in known})
        if unknown:
            raise SubmissionError(f"run {run_id!r} has no submission from {unknown}")
        if iteration is not None and all(p.iteration != iteration for p in known):
            raise SubmissionError(f"run {run_id!r} has no submission in iteration {iteration}")
    return [
        f
        for f, p in parsed.items()
        if p is not None
        and (not workers or p.worker_id in workers)
        and (iteration is None or p.iteration == iteration)
    ]


def _cancel(run_id: str, open_: list[str], finished: list[str], by: str) -> CancelReport:
    """Write the cancelled result of each pass of ``open_`` (one that finished meanwhile is
    counted as finished), then refund their leases and store their summaries."""
    if open_:
        _check_signer(run_id, open_)
    runs = runtime.stores().runs
    done: list[CritiqueResult] = []
    raced: list[str] = []
    for field in open_:
        ref = PassRef.parse(run_id, field) or PassRef(run_id, 0, "", "")
        result = cancelled_result(
            run_id=run_id,
            iteration=ref.iteration,
            worker_id=ref.worker_id,
            pass_id=ref.pass_id,
            by=by,
        )
        events = [
            encode_event(_event(result, by)),
            encode_event(result.trace_event(round=0, stage="cancel")),
        ]
        if runs.put_result(result, pass_id=ref.pass_id, events=events):
            done.append(result)
        else:
            raced.append(field)
    if done:
        _release(run_id, done)
    cancelled = tuple(PassRef(run_id, r.iteration, r.worker_id, r.pass_id).member for r in done)
    ended = (*finished, *raced)
    return CancelReport(run_id, by, cancelled, ended, _release_waiting(run_id, ended))


def _event(result: CritiqueResult, by: str) -> dict[str, Any]:
    """The ``cancelled`` trace event of one pass: who cancelled it."""
    return {
        "type": "cancelled",
        "stage": "cancel",
        "worker_id": result.worker_id,
        "iteration": result.iteration,
        "pass_id": result.pass_id,
        "by": by,
    }


def release_worker_repair(result: CritiqueResult) -> bool:
    """Drop a ``worker_repair`` pass's parked state and refund its budget hold (the manager
    will not send the repaired output, or the run was cancelled); True when it was waiting."""
    if result.stop_reason != "worker_repair" or not result.pass_id:
        return False
    stores = runtime.stores()
    waiting = stores.runs.unpark(result.run_id, result.pass_id)
    prefix = pass_lease_prefix(result.worker_id, result.iteration, result.pass_id) + ":"
    stores.budget.refund_passes(result.run_id, [prefix])
    return waiting


def _release_waiting(run_id: str, fields: Sequence[str]) -> tuple[str, ...]:
    """Release every pass of ``fields`` (finished ones) that waits for its worker's repair."""
    runs = runtime.stores().runs
    released = []
    for field in fields:
        ref = PassRef.parse(run_id, field)
        result = (
            runs.pass_result(run_id, ref.iteration, ref.worker_id, ref.pass_id)
            if ref is not None and ref.pass_id
            else None
        )
        if result is not None and release_worker_repair(result):
            released.append(field)
    return tuple(released)


def _release(run_id: str, done: list[CritiqueResult]) -> None:
    """After the results landed: refund the cancelled passes' leases (a stage that reserves
    one later finds the result and refunds its own), count them, and store each summary under
    its submission's task id."""
    prefixes = [pass_lease_prefix(r.worker_id, r.iteration, r.pass_id) + ":" for r in done]
    runtime.stores().budget.refund_passes(run_id, prefixes)
    metrics = runtime.metrics()
    metrics.add("outputs:cancelled", len(done))
    metrics.flush()
    _store_summaries(run_id, done)


def _store_summaries(run_id: str, done: list[CritiqueResult]) -> None:
    """The cancelled summary under the task id each cancelled latest pass was submitted under,
    in Celery's result backend: what a manager that submitted through the entry task reads
    (best effort: the store holds the verdict; a backend that cannot be written is logged)."""
    # lazy: workers.app configures Celery, logging and os.environ on import; importing
    # workers.cancelling does not
    from workers.app import app

    # lazy: workers.steps imports workers.app, which configures Celery, logging and os.environ on
    # import; importing workers.cancelling does not
    from workers.steps import pass_summary

    submitted = runtime.stores().runs.submitted(run_id)
    for result in done:
        doc = submitted.get(PassRef.field_of(result.iteration, result.worker_id)) or {}
        task_id = str(doc.get("task_id") or "")
        if not task_id or doc.get("sid") != result.pass_id:
            continue  # a superseded pass: its submission's task id is the newer pass's
        try:
            app.backend.store_result(task_id, pass_summary(result), "SUCCESS", request=None)
        except Exception as exc:
            log.warning("could not store the cancelled summary of task %s: %s", task_id, exc)


def _first_message(run_id: str, open_: list[str]) -> dict[str, Any] | None:
    """The first stage message of the first pass of ``open_`` the store still holds one of."""
    runs = runtime.stores().runs
    for field in open_[:MESSAGE_TRIES]:
        ref = PassRef.parse(run_id, field) or PassRef(run_id, 0, "", "")
        doc = runs.submission(run_id, ref.iteration, ref.worker_id) or {}
        if doc.get("sid") == ref.pass_id and isinstance(doc.get("message"), dict):
            message: dict[str, Any] = doc["message"]
            return message
    return None


def _check_signer(run_id: str, open_: list[str]) -> None:
    """Refuse (``ConfigError`` naming ``CRITIQUE_SECRET``) to cancel passes whose first message
    this process could not have signed: the workers sign with a key it lacks (or another one),
    so its cancelled results would not verify, and would read as no result at all."""
    message = _first_message(run_id, open_)
    if message is None:
        return
    hint = "set CRITIQUE_SECRET to the workers' secret"
    if not runtime.secrets():
        if signing.SIG_FIELD in message:
            raise ConfigError(
                f"run {run_id}'s passes are signed by workers that hold CRITIQUE_SECRET, and "
                "this process has none: nothing was cancelled",
                key=settings.SECRET.name,
                hint=hint,
            )
        return
    try:
        runtime.verify(message)
    except ForgedMessageError:
        raise ConfigError(
            f"run {run_id}'s passes are not signed with this process's CRITIQUE_SECRET (the "
            "workers use another one, or none): nothing was cancelled",
            key=settings.SECRET.name,
            hint=hint,
        ) from None
