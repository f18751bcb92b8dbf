"""Archiving runs before Redis lets them go, and reading them back after (docs/operations.md,
'The run archive'; the file format: :mod:`pipeline.records.archive_file`).

:func:`archive_run` reads a run's full record from the store (every verified result with its
rounds, attempts and notes, failures, completion-gate decisions, the trace, the pattern counts
and the shared lessons) and writes ``<archive dir>/<run-id>.jsonl``. ``critique archive RUN``
calls it; so does :func:`archive_due_runs`, which a worker's sweeper calls: it archives each run
once it has settled (no pending pass) and stayed quiet for ``$CRITIQUE_ARCHIVE_AFTER_S``
(default 600 s; 0: this worker archives nothing), and again before its keys expire if it
changed since. A run whose keys expired unarchived is logged as an error.

:func:`read_archived` and :func:`results_if_expired` are the read side: ``critique status``,
``critique report`` and ``CritiqueClient.results`` use them once Redis holds no submission and
no result of the run.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipeline import settings
from pipeline.errors import ConfigError, CritiqueError, PathEscapeError
from pipeline.models import CritiqueResult
from pipeline.records import archive_file
from pipeline.records.archive_file import ArchiveError, RunRecord
from pipeline.store import keys
from pipeline.store.archive_index import RedisArchiveIndex, RunState
from pipeline.store.base import MAX_LESSONS, MAX_PATTERNS_PER_RUN
from pipeline.text.escaping import one_line
from pipeline.wiring import RedisStores
from workers import runtime

log = logging.getLogger(__name__)

DEFAULT_ARCHIVE_AFTER_S = settings.number(settings.ARCHIVE_AFTER_S, {})
MARGIN_MAX_S = 3600.0
"""A changed run is archived again once its first record key expires within this (or within a
quarter of the run TTL, if that is shorter)."""
RECHECK_MIN_S = 5.0
"""A run is looked at again no sooner than this."""
RETRY_S = 300.0
"""After a failed write the run is tried again this much later."""
LOCK_S = 10.0
"""One archiving pass per this many seconds, fleet-wide (the pass holds the archive lock)."""


class NothingToArchiveError(LookupError):
    """Redis holds no record of the run: never submitted, another store, or its keys expired."""


@dataclass(frozen=True)
class Archived:
    """What one archiving step did for a run."""

    run_id: str
    path: Path | None
    """The archive written (None when nothing was written)."""
    why: str
    """``requested`` (``critique archive``), ``settled`` (quiet, no pending pass),
    ``expiring`` (its keys expire soon), ``expired unarchived`` (lost: too late), or
    ``failed: <reason>``."""
    record: RunRecord | None = None


def archive_after_s() -> float:
    """``$CRITIQUE_ARCHIVE_AFTER_S`` (≥ 0; 0 turns this worker's archiving off), default 600."""
    raw = settings.given(settings.ARCHIVE_AFTER_S)
    if not raw:
        return DEFAULT_ARCHIVE_AFTER_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ConfigError(
            f"{settings.ARCHIVE_AFTER_S.name}={raw!r} is not a number of seconds ≥ 0",
            key=settings.ARCHIVE_AFTER_S.name,
            hint="unset it for the 600 s default; 0 turns this worker's archiving off",
        )
    return value


def expiry_margin_s() -> float:
    """How long before a run's keys expire a changed run is archived again."""
    return min(MARGIN_MAX_S, keys.run_ttl_s() / 4)


def default_index() -> RedisArchiveIndex:
    """The archive index over this process's Redis client."""
    return RedisArchiveIndex(runtime.client())


# --- writing -------------------------------------------------------------------------------------


def collect(
    run_id: str,
    *,
    stores: RedisStores | None = None,
    now: float | None = None,
    index: RedisArchiveIndex | None = None,
) -> RunRecord | None:
    """The run's full record as the store holds it now (verified records only), or None when
    the store holds no submission, result, failure or trace event of it."""
    stores = stores or runtime.stores()
    idx = index or default_index()
    submitted = stores.runs.submitted(run_id)
    latest = stores.runs.results(run_id)
    passes = stores.runs.pass_results(run_id)
    held = {archive_file.pass_key(r) for r in passes}
    # and the latest results stored without a pass id (in no pass's record)
    passes += [r for r in latest if archive_file.pass_key(r) not in held]
    failures = {m: dataclasses.asdict(f) for m, f in stores.runs.failures(run_id).items()}
    trace = stores.trace.read(run_id)
    if not (submitted or passes or failures or trace):
        return None
    budget = stores.budget.snapshot(run_id)
    return RunRecord(
        run_id=run_id,
        archived_at=time.time() if now is None else now,
        signed_store=bool(runtime.secrets()),
        submitted={k: {f: v for f, v in d.items() if f != "message"} for k, d in submitted.items()},
        passes=tuple(passes),
        latest=archive_file.latest_members(latest),
        failures=failures,
        completions=stores.runs.completions(run_id),
        rejections=stores.runs.rejections(run_id),
        trace=tuple(trace),
        patterns=tuple(stores.patterns.top(run_id, MAX_PATTERNS_PER_RUN)),
        lessons=tuple(stores.patterns.lessons(MAX_LESSONS, run_id=run_id)),
        pending=tuple(idx.pending(run_id)),
        budget={"spent": budget.spent, "overrun": budget.overrun},
    )


def archive_run(
    run_id: str,
    *,
    directory: Path | None = None,
    stores: RedisStores | None = None,
    index: RedisArchiveIndex | None = None,
    now: float | None = None,
    why: str = "requested",
) -> Archived:
    """Write the run's full record to ``<directory>/<run-id>.jsonl`` (default
    :func:`pipeline.records.archive_file.archive_dir`), replacing an earlier archive of it whole,
    and record that this state of the run is archived. ``NothingToArchiveError`` when the store
    holds nothing of the run; ``PathEscapeError`` or ``OSError`` when the file cannot be
    written (nothing is written then)."""
    idx = index or default_index()
    now = time.time() if now is None else now
    state = idx.state(run_id)  # read first: a change while collecting makes it due again
    record = collect(run_id, stores=stores, now=now, index=idx)
    if record is None:
        raise NothingToArchiveError(
            f"Redis at {runtime.store_url()} holds nothing of run {run_id!r} to archive "
            f"(a mistyped run id, another {runtime.store_setting()}, or the run's keys expired)"
        )
    folder = archive_file.archive_dir() if directory is None else directory
    path = archive_file.write(folder, record, runtime.secrets())
    doc = {"token": state.token, "path": str(path.absolute()), "host": socket.gethostname()}
    idx.mark(run_id, {**doc, "at": now}, state.lives_s)
    return Archived(run_id, path, why, record)


def archive_due_runs(
    now: float | None = None,
    *,
    directory: Path | None = None,
    stores: RedisStores | None = None,
    index: RedisArchiveIndex | None = None,
    quiet_s: float | None = None,
    margin_s: float | None = None,
    limit: int = 100,
    max_archives: int = 20,
    lock_s: float = LOCK_S,
) -> list[Archived]:
    """One archiving pass (a worker's sweeper calls it every sweep): archive the indexed runs
    that are due, at most ``max_archives`` of them, looking at up to ``limit`` runs.

    A run is due when its current state is not archived yet and it has settled (no pending
    pass) and stayed quiet ``quiet_s`` (default :func:`archive_after_s`; 0 turns archiving off
    here: nothing is done), or its first record key expires within ``margin_s`` (default
    :func:`expiry_margin_s`). A run whose keys are gone leaves the index (logged as an error
    when it was never archived). One pass per ``lock_s`` runs fleet-wide (0: no lock). A write
    that fails is logged and retried :data:`RETRY_S` later; ``StoreUnavailableError`` ends the
    pass. Returns what was done, run by run.
    """
    quiet = archive_after_s() if quiet_s is None else quiet_s
    if quiet <= 0:
        return []
    margin = expiry_margin_s() if margin_s is None else margin_s
    idx = index or default_index()
    now = time.time() if now is None else now
    if lock_s > 0 and not idx.try_lock(uuid.uuid4().hex, lock_s):
        return []
    done: list[Archived] = []
    written = 0
    for run_id in idx.due(now, limit):
        state = idx.state(run_id)
        if state.gone:
            idx.forget(run_id)
            if state.marker is None:
                log.error(
                    "run %s expired from Redis before it was archived: its history is lost "
                    "(is a worker archiving? see CRITIQUE_ARCHIVE_AFTER_S)",
                    run_id,
                )
                done.append(Archived(run_id, None, "expired unarchived"))
            continue
        why = _due(state, now, quiet, margin)
        if not why:
            if state.archived:
                idx.keep_marker(run_id, state.lives_s)
            idx.later(run_id, _next_look(state, now, quiet, margin))
            continue
        if written >= max_archives:
            continue  # still due: the next pass takes it
        written += 1
        try:
            got = archive_run(
                run_id, directory=directory, stores=stores, index=idx, now=now, why=why
            )
        except NothingToArchiveError:
            idx.forget(run_id)  # only keys without a record are left (a budget, a lease)
            continue
        except (OSError, PathEscapeError, ArchiveError) as exc:
            reason = one_line(exc, 300)
            log.error("cannot archive run %s: %s (tried again in %.0f s)", run_id, reason, RETRY_S)
            done.append(Archived(run_id, None, f"failed: {reason}"))
            idx.later(run_id, now + RETRY_S)
            continue
        done.append(got)
        archived = dataclasses.replace(state, marker={"token": state.token})
        idx.later(run_id, _next_look(archived, now, quiet, margin))
    return done


def _due(state: RunState, now: float, quiet: float, margin: float) -> str:
    """Why the run is to be archived now (``settled`` or ``expiring``), or ``""``."""
    if state.archived:
        return ""
    if state.expires_in_s is not None and state.expires_in_s <= margin:
        return "expiring"
    if state.pending == 0 and now - state.last_activity >= quiet:
        return "settled"
    return ""


def _next_look(state: RunState, now: float, quiet: float, margin: float) -> float:
    """When to look at the run again. Archived: when its first record key is about to expire
    (to archive what changed since), or just after it expired (to see it gone). Not yet: when
    it will have been quiet long enough, and before it comes near its expiry."""
    soon = now + RECHECK_MIN_S
    expires = None if state.expires_in_s is None else now + state.expires_in_s
    if state.archived:
        if expires is None:
            return now + max(state.lives_s, 0.0) + 1
        return expires - margin if expires - margin > now else max(expires + 1, soon)
    later = max((state.last_activity or now) + quiet, soon)
    return later if expires is None else min(later, max(expires - margin, soon))


# --- reading back --------------------------------------------------------------------------------


def read_archived(run_id: str, directory: Path | None = None) -> tuple[Path, RunRecord] | None:
    """The run's archive (path, record) in ``directory`` (default
    :func:`pipeline.records.archive_file.archive_dir`), or None when there is none; ``ArchiveError``
    when it exists but cannot be trusted or read (with ``CRITIQUE_SECRET``: it must verify), or is
    older than the run's last archive the archive index knows of."""
    folder = archive_file.archive_dir() if directory is None else directory
    got = archive_file.read(folder, run_id, runtime.secrets())
    if got is not None:
        archive_file.check_not_older(got[1], _latest_archived_at(run_id), str(got[0]))
    return got


def _latest_archived_at(run_id: str) -> float | None:
    """When the archive index says the run was last archived (its marker lives a day past
    the run's keys); None when it does not know or cannot be reached (the signature alone
    then vouches for the file)."""
    try:
        marker = default_index().marker(run_id)
    except CritiqueError as exc:
        log.warning("run %s: archive index not read (%s); archive age not checked", run_id, exc)
        return None
    at = None if marker is None else marker.get("at")
    return float(at) if isinstance(at, int | float) and not isinstance(at, bool) else None


def in_redis(run_id: str, stores: RedisStores | None = None) -> bool:
    """Redis still holds a submission or a result of the run (then it, not the archive,
    answers)."""
    stores = stores or runtime.stores()
    return bool(stores.runs.submitted(run_id)) or bool(stores.runs.results(run_id))


def results_if_expired(run_id: str, iteration: int | None = None) -> list[CritiqueResult]:
    """The run's results from its archive when Redis holds no submission and no result of it;
    ``[]`` while it does (the run is in flight) or when there is no archive."""
    if in_redis(run_id):
        return []
    got = read_archived(run_id)
    if got is None:
        return []
    path, record = got
    log.info("results of run %s read from the archive %s", run_id, path)
    return [r for r in record.results if iteration is None or r.iteration == iteration]
