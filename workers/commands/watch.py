"""``critique watch RUN``: follow a run's trace stream live until every submission has a result.

Replays the run's stream from its start, then blocks for new events (``XREAD BLOCK``), one line
per event: ``<iteration>:<worker> <stage> …`` with the round, score, verdict or result. It ends
when every submission registered for the run has a result (submissions that arrive while it
watches are picked up). ``--json`` prints each trace event as one JSON object per line, then a
last line ``{"type": "watch", "done", "submitted", "finished", "pending"}``.

Exit codes: 0 everything finished; 1 ``--timeout`` passed with submissions still pending (they
are listed); 2 bad usage or an unknown run; 3 Redis unreachable; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from workers.commands.status import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    key_of,
    load_snapshot,
    printable,
    service_guard,
)

HELP = "follow a run's progress live from its trace stream until every submission finished"

EXIT_INTERRUPTED = 130
BLOCK_MS = 500


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="RUN", help="the run id")
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="give up after S seconds (exit 1, listing what is pending); default: wait",
    )
    parser.add_argument("--json", action="store_true", help="one JSON event per line")


def _num(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "?"


def format_event(event: dict[str, Any]) -> str:
    """One human-readable line for a trace event (untrusted text made terminal-safe)."""
    who = f"{event.get('iteration', '?')}:{event.get('worker_id') or '-'}"
    kind, stage = event.get("type"), event.get("stage", "?")
    rnd = event.get("round")
    if kind == "result":
        text = (
            f"RESULT  {event.get('status')} ({event.get('stop_reason')}) "
            f"{_num(event.get('original_score'))} → {_num(event.get('best_score'))}, "
            f"{event.get('attempts', 0)} repair(s)"
        )
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
    """The state of one watch: what was submitted, which results were seen."""

    def __init__(self, run_id: str, as_json: bool) -> None:
        snap = load_snapshot(run_id, chain_errors=False)
        self.run_id = run_id
        self.as_json = as_json
        self.submitted = set(snap.submitted)
        self.stored = snap.finished
        self.seen: set[str] = set()
        """Results whose event was shown: a finished run replays in full before the end."""

    @property
    def finished(self) -> set[str]:
        return self.seen | self.stored

    @property
    def pending(self) -> list[str]:
        return sorted(self.submitted - self.finished)

    def done(self, caught_up: bool) -> bool:
        """True when every submission has a result.

        While replaying, only results whose event was shown count; once the stream is caught
        up, results in the store count too (a stream trimmed by MAXLEN lost their events).
        """
        if not caught_up and self.submitted - self.seen:
            return False
        snap = load_snapshot(self.run_id, chain_errors=False)
        self.submitted = set(snap.submitted)
        self.stored = snap.finished
        every = self.submitted | self.stored
        return not every - (self.finished if caught_up else self.seen)

    def show(self, event: dict[str, Any]) -> None:
        if self.as_json:
            print(json.dumps(event, ensure_ascii=False, sort_keys=True), flush=True)
        else:
            print(format_event(event), flush=True)
        if event.get("type") == "result":
            self.seen.add(key_of(int(event.get("iteration", 1)), str(event.get("worker_id"))))

    def end(self, done: bool) -> None:
        every = self.submitted | self.finished
        if self.as_json:
            doc = {
                "type": "watch",
                "done": done,
                "submitted": len(every),
                "finished": len(self.finished),
                "pending": self.pending,
            }
            print(json.dumps(doc, ensure_ascii=False), flush=True)
        elif done:
            print(f"watch: all {len(every)} submission(s) of run {self.run_id} finished")
        else:
            print(
                f"watch: timed out with {len(self.pending)} of {len(every)} submission(s) "
                f"pending: {', '.join(self.pending)}"
            )


def watch(run_id: str, *, as_json: bool, timeout: float | None, block_ms: int = BLOCK_MS) -> int:
    """Follow the run; returns the exit code."""
    from workers import runtime

    w = _Watch(run_id, as_json)
    sink = runtime.stores().trace
    deadline = None if timeout is None else time.monotonic() + timeout
    last_id = "0-0"
    while True:
        for entry_id, event in sink.iterate(run_id, block_ms, last_id, idle_limit=1):
            last_id = entry_id
            w.show(event)
            if event.get("type") == "result" and w.done(caught_up=False):
                w.end(True)
                return EXIT_OK
            if deadline is not None and time.monotonic() >= deadline:
                break
        if w.done(caught_up=True):
            w.end(True)
            return EXIT_OK
        if deadline is not None and time.monotonic() >= deadline:
            w.end(False)
            return EXIT_FAILED


def run(args: argparse.Namespace) -> int:
    if args.timeout is not None and args.timeout <= 0:
        print("critique watch: --timeout must be > 0", file=sys.stderr)
        return EXIT_USAGE
    try:
        return service_guard(
            "watch", lambda: watch(args.run_id, as_json=args.json, timeout=args.timeout)
        )
    except KeyboardInterrupt:
        print("critique watch: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
