"""The exit codes of every ``critique`` command, and the table every ``--help`` prints.

    0  ran: every output has a verdict (accepted, repaired, escalated, unchecked, cancelled
       and the verdict ``failed`` are outcomes)
    1  a chain failed: a stage errored or a worker refused it (no verdict), or an output was
       still pending at --timeout; for ``l0``, a check failed
    2  bad usage or configuration (nothing was enqueued, the worker did not start)
    3  a service could not be reached (Redis, the broker, a worker)
  130  interrupted (Ctrl-C); ``critique worker`` after its warm shutdown (SIGTERM: 0)
  141  the reader of stdout went away (``critique status RUN | head -1``): a quiet end

The CLI (:mod:`workers.cli`), its sub-commands and the worker's Celery app import these
constants from here; no module defines its own. A module of its own so that the dispatcher and
the commands it dispatches to both import it, and not each other.
"""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT), as a shell reports a process it interrupted."""
EXIT_BROKEN_PIPE = 141
"""The reader of stdout went away (``critique status RUN --json | head``): as SIGPIPE would."""

EXIT_CODES = """\
exit codes (every command):
  0  ran: every output has a verdict: accepted, repaired, escalated, unchecked, cancelled,
     and the verdict `failed` (the critique judged the output failed) are outcomes, not
     errors; escalated is the manager's cue to act
  1  a chain failed: a stage errored or a worker refused the message, so there is no
     verdict; or an output was still pending at --timeout; for `l0`, a check failed
  2  bad usage or configuration: nothing was enqueued, the worker did not start
  3  a service could not be reached: Redis, the broker, a worker
  130  interrupted (Ctrl-C); `critique worker`: after its warm shutdown (SIGTERM: 0)
  141  the reader of the output went away (`critique status RUN | head -1`): ended quietly,
       as a tool killed by SIGPIPE, with no message
"""
