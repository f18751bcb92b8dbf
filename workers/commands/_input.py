"""Reading the CLI's inputs safely: every bad input is one clear line and exit 2, never a
traceback (see docs/operations.md, 'Exit codes of every `critique` command').

Inputs are read with a byte cap (``max_output_bytes`` for submissions and checked files, a
smaller one for configuration files), so ``/dev/zero`` or a pipe that never ends is refused
after the cap instead of filling memory. A directory, a missing or unreadable path, bytes that
are not UTF-8, JSON nested past Python's recursion limit or with errors (line and column named)
all raise :class:`InputError` with a message that names the input.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any

from pipeline.text.escaping import escape_controls, one_line

CONFIG_LIMIT = 1024 * 1024
"""Largest configuration file (``--config``) the commands read, in bytes."""


class InputError(Exception):
    """An input cannot be used; the message names where and why (one line)."""


def terminal_line(message: object) -> str:
    """``message`` on one line (newlines and runs of spaces folded), for stderr; control
    characters (a file name's ESC sequence) shown as escapes (:mod:`workers.commands._text`)."""
    return escape_controls(one_line(message))


def label_of(path: str) -> str:
    """How messages name ``path`` (``<stdin>`` for ``-``)."""
    return "<stdin>" if path == "-" else path


def read_bytes(path: str, limit: int, what: str = "max_output_bytes") -> bytes:
    """At most ``limit`` bytes of ``path`` (``-`` = stdin); :class:`InputError` when it holds
    more (``what`` names the limit), is a directory, or cannot be opened or read."""
    label = label_of(path)
    if path == "-":
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text stream (tests replace sys.stdin with StringIO)
            data = sys.stdin.read(limit + 1).encode("utf-8", "surrogateescape")
        else:
            data = stream.read(limit + 1)
        return _within(data, limit, label, what)
    try:
        if stat.S_ISDIR(os.stat(path).st_mode):
            raise InputError(f"{label}: is a directory, not a file")
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except InputError:
        raise
    except OSError as exc:
        raise InputError(f"cannot read {label}: {exc.strerror or exc}") from None
    return _within(data, limit, label, what)


def _within(data: bytes, limit: int, label: str, what: str) -> bytes:
    if len(data) > limit:
        raise InputError(
            f"{label}: input is over {what} ({limit}): stopped reading after {limit} bytes; "
            f"split it into smaller inputs or raise {what}"
        )
    return data


def read_text(path: str, limit: int, what: str = "max_output_bytes") -> str:
    """:func:`read_bytes` decoded as UTF-8 (strict); :class:`InputError` names the byte."""
    data = read_bytes(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{label_of(path)}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


def loads(text: str, where: str) -> Any:
    """``json.loads(text)``; :class:`InputError` for JSON nested too deep to parse, and
    ``json.JSONDecodeError`` (a ValueError) as it is for a syntax error."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InputError(
            f"{where}: JSON nested too deeply to parse (Python's recursion limit); flatten it"
        ) from None


def check_config_file(path: str) -> None:
    """Refuse a ``--config`` path that is not a readable regular UTF-8 file of at most
    :data:`CONFIG_LIMIT` bytes (a FIFO, ``/dev/zero``, a directory)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise InputError(f"--config {path}: {kind}; expected a workflow or JSON file")
    read_text(path, CONFIG_LIMIT, "the configuration file limit")
