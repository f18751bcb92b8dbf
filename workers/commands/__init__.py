"""One module per ``critique`` sub-command, and the ``_``-prefixed modules they share.

Each command module exposes ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit code). A command that cannot go on raises
:class:`~workers.commands._common.CommandError`; ``run`` wraps its body in
:func:`~workers.commands._common.service_guard`, which maps every error to the one exit-code
table of :mod:`workers.cli`. No command imports another command's private names:

- ``_common``: ``CommandError``, the guard, the shared options (``RUN``, ``--json``,
  ``--iteration``, the ``at_least``/``above`` number types) and the one Redis check;
- ``_runs``: a run's snapshot from Redis or its archive (status, watch, report, resume, archive);
- ``_pipeline``: the embedded Redis and in-process worker, or the running workers (demo, ab);
- ``_input``, ``_text``, ``_progress``: safe input reading, terminal-safe text, progress lines;
- ``_samples`` (the demo's data) and ``_report_html`` (the run's HTML report): pure data and
  rendering, each used by one command.

Modules import only light things at top level so ``critique --help`` and ``critique l0`` start
fast; heavy imports (litellm, celery) happen inside ``run``.
"""
