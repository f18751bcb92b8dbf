"""One module per ``critique`` sub-command.

Each module exposes ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``
(the exit code). Modules import only light things at top level so ``critique --help`` and
``critique l0`` start fast; heavy imports (litellm, celery) happen inside ``run``.
"""
