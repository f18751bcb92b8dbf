"""``critique watch RUN``: follow a run's trace stream live until nothing is pending.

Replays the run's stream from its start, then blocks for new events (``XREAD BLOCK``), one line
per event: ``<iteration>:<worker> <stage> …`` with the round, score, verdict or result. A note
repeated by many submissions (``no budget.total_tokens configured``) is shown once. About every
second the run's submissions are checked: a chain that failed (refused by a worker, a stage
that raised) is shown as ``FAILED`` with a one-line reason and counts as done. The watch ends
when every submission registered for the run is finished or failed (submissions that arrive
while it watches are picked up), with a tally. A submission finishes with its latest pass's
result: a resubmitted one's earlier result is shown, marked ``(an earlier pass, superseded by a
resubmission)``, and finishes nothing. On a terminal a live counter runs on stderr.

``--json`` prints each trace event as one JSON object per line, a ``{"type": "failed",
"iteration", "worker_id", "error"}`` line per failed chain, then a last line ``{"type":
"watch", "done", "submitted", "finished", "failed", "pending", "counts"}``.

Exit codes (the table of ``critique --help``): 0 every submission finished (whatever its
verdict); 1 a chain failed, or ``--timeout`` passed with submissions still pending (listed);
2 bad usage or an unknown run; 3 Redis unreachable; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from typing import Any

from pipeline.errors import StoreUnavailableError
from pipeline.models import UNCHECKED_LINE, UNSCORED, PassRef
from pipeline.text.escaping import escape_controls
from workers import riding
from workers.commands._common import above, add_json_argument, add_run_argument, service_guard
from workers.commands._progress import Progress
from workers.commands._runs import chain_failures, load_snapshot, split_key
from workers.commands._text import json_line, printable
from workers.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK

HELP = "follow a run's progress live until no submission is pending (failed ones end too)"

BLOCK_MS = 500
CHECK_S = 1.0
"""How often the run's submissions and failed chains are checked while events flow."""
SUPERSEDED = "an earlier pass, superseded by a resubmission"
"""Said after a result event of a pass the submission was resubmitted over."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_argument(parser)
    parser.add_argument(
        "--timeout",
        type=above(0),
        metavar="S",
        help="give up after S seconds (exit 1, listing what is pending); default: wait",
    )
    add_json_argument(parser, "one JSON event per line")


def _num(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "?"


def _result_text(event: dict[str, Any]) -> str:
    """``RESULT  repaired (accepted) 0.42 → 0.91, 1 repair(s)``; an unchecked or cancelled
    result says ``no score`` (an unchecked one, that nothing was checked)."""
    status = event.get("status")
    head = f"RESULT  {status} ({event.get('stop_reason')})"
    if status == "unchecked":
        return f"{head} no score: {UNCHECKED_LINE}"
    if status in UNSCORED:
        return f"{head} no score"
    scores = f"{_num(event.get('original_score'))} → {_num(event.get('best_score'))}"
    return f"{head} {scores}, {event.get('attempts', 0)} repair(s)"


def format_event(event: dict[str, Any]) -> str:
    """One human-readable line for a trace event (untrusted text made terminal-safe)."""
    who = f"{event.get('iteration', '?')}:{event.get('worker_id') or '-'}"
    kind, stage = event.get("type"), event.get("stage", "?")
    rnd = event.get("round")
    if kind == "result":
        text = _result_text(event)
    elif kind == "cancelled":
        text = f"CANCEL  by {event.get('by', '?')}"
    elif kind == "refused":
        text = f"REFUSED {stage}: {event.get('reason', '')}"
    elif kind == "round":
        text = f"decide  round {rnd}: score {_num(event.get('score'))}, "
        text += f"verdict {event.get('verdict')}"
        if event.get("stop_reason"):
            text += f", stop {event.get('stop_reason')}"
    elif kind == "gate":
        text = (
            f"gate    {event.get('gate', stage)} {event.get('verdict')}: {event.get('reason', '')}"
        )
    elif stage == "critic":
        text = (
            f"critic  round {rnd}: score {_num(event.get('score'))}, "
            f"{event.get('defects', 0)} defect(s) ({event.get('critic', '?')})"
        )
    elif stage == "l0":
        text = f"l0      {event.get('errors', 0)} error(s), {event.get('warnings', 0)} warning(s)"
    elif stage == "repair":
        text = f"repair  attempt {event.get('attempt')} ({event.get('reviser', '?')})"
    else:
        extra = event.get("note") or ""
        text = f"{stage:<7} {extra}"
    return printable(f"{who:<20} {text}".rstrip(), limit=400)


class _Watch:
    """The state of one watch: what was submitted, which results were seen, what failed."""

    def __init__(self, run_id: str, as_json: bool) -> None:
        snap = load_snapshot(run_id, chain_errors=False)
        self.run_id = run_id
        self.as_json = as_json
        self.submitted = set(snap.submitted)
        self.records = dict(snap.submitted)
        self.stored = snap.finished
        self.statuses: dict[str, str] = {
            PassRef.field_of(r.iteration, r.worker_id): r.status for r in snap.results
        }
        self.passes_seen: dict[str, set[str]] = {}
        """Key -> the passes whose result event was shown (``""``: an event naming none); a
        finished run replays in full before the end."""
        self.failed: dict[str, str] = {}
        self.notes: set[str] = set()
        self.hidden_notes = 0
        self.progress = Progress(f"watch {run_id}")
        self.next_check = 0.0

    def latest_pass(self, key: str) -> str:
        """The pass the run's registry names as the submission's latest (``""``: none named)."""
        return str(self.records.get(key, {}).get("sid") or "")

    def is_current(self, key: str, pass_id: str) -> bool:
        """Whether a result event of ``pass_id`` is the submission's latest pass's: a result of
        an earlier pass (the submission was resubmitted since) finishes nothing."""
        latest = self.latest_pass(key)
        return not latest or pass_id == latest

    @property
    def seen(self) -> set[str]:
        """Submissions whose latest pass's result event was shown."""
        got = self.passes_seen.items()
        return {k for k, passes in got if any(self.is_current(k, p) for p in passes)}

    @property
    def finished(self) -> set[str]:
        return self.seen | self.stored

    @property
    def pending(self) -> list[str]:
        return sorted(self.submitted - self.finished - set(self.failed), key=split_key)

    def check(self, force: bool = False) -> None:
        """Refresh submissions and results from the store, and look for failed chains
        (about every :data:`CHECK_S`, or now with ``force``)."""
        now = time.monotonic()
        if not force and now < self.next_check:
            return
        self.next_check = now + CHECK_S
        snap = load_snapshot(self.run_id, chain_errors=False)
        self.submitted = set(snap.submitted)
        self.records.update(snap.submitted)
        self.stored = snap.finished
        self.statuses.update(
            {PassRef.field_of(r.iteration, r.worker_id): r.status for r in snap.results}
        )
        unfinished = {k: self.records[k] for k in self.pending if k in self.records}
        for key, reason in sorted(chain_failures(unfinished, self.run_id).items()):
            self.failed[key] = reason
            self._show_failure(key, reason)
        self._count()

    def done(self, caught_up: bool) -> bool:
        """True when every submission is finished or failed.

        While replaying, only results whose event was shown count; once the stream is caught
        up, results in the store count too (a stream trimmed by MAXLEN lost their events).
        """
        if not caught_up and self.submitted - self.seen - set(self.failed):
            return False
        self.check(force=True)
        every = self.submitted | self.stored
        ended = (self.finished if caught_up else self.seen) | set(self.failed)
        return not every - ended

    def show(self, event: dict[str, Any]) -> None:
        superseded = event.get("type") == "result" and not self._saw_result(event)
        if self.as_json:
            self.progress.line(json_line(event, sort_keys=True))
        else:
            note = event.get("note")
            if note:
                said = f"{event.get('stage')}:{note}"
                if said in self.notes:
                    self.hidden_notes += 1
                    return
                self.notes.add(said)
            line = format_event(event)
            self.progress.line(f"{line}  ({SUPERSEDED})" if superseded else line)
        self._count()

    def _saw_result(self, event: dict[str, Any]) -> bool:
        """Note a result event; False when it is an earlier pass's than the registry's latest
        (read again first: the event may be of a pass begun since the last check)."""
        # lazy: workers.runtime loads celery; `critique --help` imports this module
        from workers import runtime

        iteration, worker_id = int(event.get("iteration", 1)), str(event.get("worker_id"))
        key, pass_id = PassRef.field_of(iteration, worker_id), str(event.get("pass_id") or "")
        self.passes_seen.setdefault(key, set()).add(pass_id)
        if not self.is_current(key, pass_id):
            latest = runtime.stores().runs.latest_pass(self.run_id, iteration, worker_id)
            if latest and key in self.records:
                self.records[key] = {**self.records[key], "sid": latest}
        if not self.is_current(key, pass_id):
            return False
        self.statuses[key] = str(event.get("status"))
        return True

    def _show_failure(self, key: str, reason: str) -> None:
        iteration, worker = split_key(key)
        if self.as_json:
            doc = {"type": "failed", "iteration": iteration, "worker_id": worker, "error": reason}
            self.progress.line(json_line(doc))
        else:
            self.progress.line(printable(f"{key:<20} FAILED  {reason}", limit=400))

    def _count(self) -> None:
        done = len(self.finished & (self.submitted | self.stored))
        self.progress.update(done, len(self.failed), len(self.pending))

    def end(self, done: bool) -> int:
        """Print the last line; returns the exit code."""
        self.progress.close()
        every = self.submitted | self.finished
        counts = Counter(self.statuses[k] for k in self.finished if k in self.statuses)
        if self.as_json:
            doc = {
                "type": "watch",
                "done": done,
                "submitted": len(every),
                "finished": len(self.finished),
                "failed": sorted(self.failed, key=split_key),
                "pending": self.pending,
                "counts": dict(sorted(counts.items())),
            }
            print(json_line(doc), flush=True)
        else:
            verdicts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            line = (
                f"watch: run {self.run_id}: {len(every)} submission(s): "
                f"{len(self.finished)} finished"
                + (f" ({verdicts})" if verdicts else "")
                + f", {len(self.failed)} failed, {len(self.pending)} pending"
            )
            if self.hidden_notes:
                line += f"; {self.hidden_notes} repeated note(s) not shown"
            print(escape_controls(line))
            if not done:
                print(
                    escape_controls(
                        f"watch: timed out with {len(self.pending)} of {len(every)} "
                        f"submission(s) pending: {', '.join(self.pending)}"
                    )
                )
        return EXIT_FAILED if self.failed or not done else EXIT_OK


def watch(run_id: str, *, as_json: bool, timeout: float | None, block_ms: int = BLOCK_MS) -> int:
    """Follow the run; returns the exit code."""
    # lazy: workers.runtime loads celery; `critique --help` imports this module
    from workers import runtime

    w = _Watch(run_id, as_json)
    sink = runtime.stores().trace
    deadline = None if timeout is None else time.monotonic() + timeout
    last_id = "0-0"
    outage = riding.Outage(
        notice=lambda line: print(f"critique watch: warning: {line}", file=sys.stderr)
    )
    try:
        while True:
            try:
                for entry_id, event in sink.iterate(run_id, block_ms, last_id, idle_limit=1):
                    outage.ok()
                    last_id = entry_id
                    w.show(event)
                    if event.get("type") == "refused":
                        w.next_check = 0.0  # its chain has failed: look now
                    if event.get("type") == "result" and w.done(caught_up=False):
                        return w.end(True)
                    w.check()
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                finished = w.done(caught_up=True)
                outage.ok()
            except StoreUnavailableError as exc:  # a failover, a restart: go on after last_id
                outage.back_off(exc, deadline, riding.gave_up("watch", timeout))
                continue
            if finished:
                return w.end(True)
            if deadline is not None and time.monotonic() >= deadline:
                return w.end(False)
    finally:
        w.progress.close()


def run(args: argparse.Namespace) -> int:
    try:
        return service_guard(
            "watch", lambda: watch(args.run_id, as_json=args.json, timeout=args.timeout)
        )
    except KeyboardInterrupt:
        print("critique watch: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
