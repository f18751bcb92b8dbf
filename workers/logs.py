"""Worker logs: one line per task at INFO — ids, status, timing — and payloads at DEBUG only.

Celery's own ``Task … succeeded in …: <result>`` line carries the task's return value: for a
stage, the whole stage state with the worker's output (1.4 MB of log for ~210 submissions). It
is demoted to DEBUG here (dropped at INFO, kept with ``-l DEBUG``), as are Celery's other
per-task INFO lines (``received``, ``retry``, ``ignored``: not even built at INFO, see
:data:`QUIET_BELOW_DEBUG`), and every ``critique.*`` task logs one compact line instead, on the
``critique.stages`` logger::

    critique.critic[b4048db1] run=r1 it=1 worker=w1 pass=8cabde8b SUCCESS 6.1 ms
    critique.gate[fd9239fa] run=r1 it=1 worker=w1 pass=8cabde8b SUCCESS 5.4 ms escalated/needs_model
    critique.critic[0c1d2e3f] run=r1 it=1 worker=w2 pass=1f2e3d4c FAILURE 3.0 ms ConfigError: …

The ids come from the message's first bytes (a state carried by reference: the blob's first
KiB), never from the payload as a whole; a failure's reason is one line. Queue probes
(``critique.probe``) log at DEBUG. Installed by :mod:`workers.app` (:func:`install`).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any

from celery.signals import after_setup_logger, task_postrun, task_prerun

from pipeline.store import keys
from pipeline.store.blobs import parse_ref
from pipeline.text.escaping import one_line

log = logging.getLogger("critique.stages")

_ID_PREFIX = re.compile(
    r'^\{"submission":\{"schema_version":\d+,"run_id":("(?:[^"\\]|\\.)*"),'
    r'"iteration":(\d+),"worker_id":("(?:[^"\\]|\\.)*")'
)
HEAD_BYTES = 1024
"""How much of a stage state (inline or blob) is read for its ids."""
REASON_LIMIT = 300

_started: dict[tuple[str, int], float] = {}
_lock = threading.Lock()
_installed = False


class PayloadsAtDebug(logging.Filter):
    """On ``celery.app.trace``: Celery's success line (which prints the task's return value) is
    logged at DEBUG, so it shows only when the logger is enabled for DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        from celery.app import trace

        if record.msg != trace.LOG_SUCCESS:
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def _ids_from_state(head: str) -> dict[str, Any]:
    m = _ID_PREFIX.match(head)
    if m is None:
        return {}
    try:
        return {
            "run": json.loads(m.group(1)),
            "it": int(m.group(2)),
            "worker": json.loads(m.group(3)),
        }
    except ValueError:
        return {}


def _state_head(ref: str) -> str:
    """The first :data:`HEAD_BYTES` of a state blob (``GETRANGE``: never the whole blob)."""
    # lazy: workers.runtime loads redis, which importing workers.logs does not
    from workers import runtime

    raw = runtime.client().getrange(keys.blob_key(parse_ref(ref)), 0, HEAD_BYTES - 1)
    if isinstance(raw, bytes):
        return raw.decode("utf-8", "replace")
    return str(raw or "")


def message_ids(msg: Any) -> dict[str, Any]:
    """``run``, ``it``, ``worker`` and ``pass`` of a stage or gate message, as far as its first
    bytes tell (``{}`` for anything else); never raises."""
    if not isinstance(msg, dict):
        return {}
    out: dict[str, Any] = {}
    try:
        if isinstance(msg.get("run_id"), str):  # a complete_gate request
            out = {"run": msg["run_id"], "it": msg.get("iteration")}
        elif isinstance(msg.get("state"), str):
            out = _ids_from_state(msg["state"][:HEAD_BYTES])
        elif isinstance(msg.get("state_ref"), str):
            out = _ids_from_state(_state_head(msg["state_ref"]))
    except Exception:  # a log line never fails a task
        out = {}
    pass_id = msg.get("sid")
    if isinstance(pass_id, str) and pass_id:
        out["pass"] = pass_id[:16]
    return out


def _one_line(text: str) -> str:
    line = one_line(text)
    return line if len(line) <= REASON_LIMIT else line[: REASON_LIMIT - 1] + "…"


def _outcome(state: str | None, retval: Any) -> str:
    """What the task ended with, in a few words: a gate's verdict, a failure's reason."""
    if state == "IGNORED" or (isinstance(retval, dict) and retval.get("replaced") is True):
        return "replaced"  # Task.replace: the decision handed the chain on to a repair round
    if isinstance(retval, BaseException):
        message = getattr(retval, "message", None) or str(retval)
        return _one_line(f"{type(retval).__name__}: {message}")
    if isinstance(retval, dict) and "stop_reason" in retval:  # the gate's summary
        score = retval.get("best_score")
        shown = f" {score:.2f}" if isinstance(score, int | float) else " no score"
        return f"{retval.get('status')}/{retval.get('stop_reason')}{shown}"
    if isinstance(retval, dict) and "verdict" in retval:  # a completion decision
        return str(retval.get("verdict"))
    return ""


def stage_line(
    name: str, task_id: str, msg: Any, state: str | None, elapsed_ms: float | None, retval: Any
) -> str:
    """The compact INFO line of one finished task."""
    ids = message_ids(msg)
    parts = [f"{name}[{task_id[:8]}]"]
    parts += [f"{k}={_one_line(str(ids[k]))}" for k in ("run", "it", "worker", "pass") if k in ids]
    parts.append(state or "?")
    if elapsed_ms is not None:
        parts.append(f"{elapsed_ms:.1f} ms")
    outcome = _outcome(state, retval)
    if outcome:
        parts.append(outcome)
    return " ".join(parts)


def _run_key(task_id: str) -> tuple[str, int]:
    """One task run's key: a task and the one replacing it share an id (``Task.replace``), and
    may run at once; prerun and postrun of one run happen on the same thread."""
    return task_id, threading.get_ident()


def _on_prerun(task_id: str | None = None, **_: Any) -> None:
    if task_id:
        with _lock:
            _started[_run_key(task_id)] = time.perf_counter()


def _on_postrun(
    task_id: str | None = None,
    task: Any = None,
    args: Any = None,
    retval: Any = None,
    state: str | None = None,
    **_: Any,
) -> None:
    try:
        name = str(getattr(task, "name", "") or "")
        if not name.startswith("critique.") or not task_id:
            return
        with _lock:
            began = _started.pop(_run_key(task_id), None)
        elapsed = None if began is None else (time.perf_counter() - began) * 1000.0
        level = logging.DEBUG if name == "critique.probe" else logging.INFO
        if not log.isEnabledFor(level):
            return
        msg = args[0] if args else None
        log.log(level, "%s", stage_line(name, task_id, msg, state, elapsed, retval))
    except Exception:  # a log line never fails a task
        log.debug("could not log a stage line", exc_info=True)


QUIET_BELOW_DEBUG = ("celery.app.trace", "celery.worker.strategy")
"""Celery loggers whose INFO lines repeat what the stage line says, per task: ``Task …
received`` and ``Task … succeeded in …: <result>`` (the payload), ``… retry: …``, ``… ignored``
(the stage line has the state, the timing and the reason). Held at WARNING unless the worker
logs at DEBUG: Celery then never builds those records (nor the result's repr), and their
warnings and errors still show."""


def _quiet_celery_info(loglevel: Any = None, **_: Any) -> None:
    """After Celery set up logging: at INFO and above, :data:`QUIET_BELOW_DEBUG` at WARNING."""
    try:
        level = int(loglevel) if loglevel is not None else logging.getLogger().level
    except (TypeError, ValueError):
        level = logging.getLevelName(str(loglevel).upper())
    if isinstance(level, int) and level > logging.DEBUG:
        for name in QUIET_BELOW_DEBUG:
            logger = logging.getLogger(name)
            if logger.level < logging.WARNING:
                logger.setLevel(logging.WARNING)


def install() -> None:
    """Demote Celery's payload-carrying success line and log one line per task (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    logging.getLogger("celery.app.trace").addFilter(PayloadsAtDebug())
    after_setup_logger.connect(_quiet_celery_info, weak=False)
    task_prerun.connect(_on_prerun, weak=False)
    task_postrun.connect(_on_postrun, weak=False)
