"""A submission's files as bytes and text, read through an injected reader (the outside world is
passed in, so tests and the worker read files the same way).

A :class:`~pipeline.models.FileRef` carries its content inline (``content``) or by reference
(``blob``, a content-addressed store key), or neither (metadata only). The pure domain never
opens a store itself: Layer-0, the completion gates and :func:`pipeline.loop.stages.admit` take a
:data:`FileReader` — ``workers.runtime.file_bytes`` on a worker (inline content, else the blob),
:func:`inline_bytes` by default — and read every file through it, so a file sent by reference is
checked exactly like one sent inline.

Reader contract: return the file's bytes, or ``None`` when there is nothing to read (a
metadata-only file); raise a :class:`~pipeline.errors.PermanentError` when the content exists
but cannot be had (a missing or expired blob), a :class:`~pipeline.errors.TransientError` when
the store is unreachable (retried). :func:`read_file` turns "has a ``blob`` but nothing came
back" and every permanent reader error into :class:`UnreadableFileError`, naming the file:
a file is never skipped silently.

Text rule: bytes that decode as UTF-8 (strict) are text and are scanned like inline content.
Anything else is binary: not scanned, but counted toward ``max_output_bytes``. One exception so
that a single bad byte cannot hide a file from the checks: a file whose name says it is text
(:data:`TEXT_SUFFIXES`) is scanned anyway, decoded with replacement characters.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePosixPath

from pipeline.errors import PermanentError, SubmissionError
from pipeline.models import FileRef

FileReader = Callable[[FileRef], "bytes | None"]
"""``read(file) -> bytes | None``: a file's bytes (see the module docstring for the contract)."""

TEXT_SUFFIXES: frozenset[str] = frozenset(
    {
        ".md",
        ".markdown",
        ".txt",
        ".text",
        ".rst",
        ".json",
        ".jsonl",
        ".tex",
        ".py",
        ".csv",
        ".tsv",
        ".html",
        ".htm",
        ".xml",
        ".svg",
        ".yaml",
        ".yml",
        ".toml",
        ".ini",
        ".cfg",
    }
)
"""Suffixes of files that are text by name: scanned even when they are not valid UTF-8."""


class UnreadableFileError(SubmissionError):
    """A file's content exists (inline or by reference) but cannot be read: a missing or
    expired blob, a malformed reference, or a reader that cannot follow references.

    Constructed from its message alone (like every error here) so that it survives Celery's
    JSON result serialisation; :func:`unreadable` builds the message from a path and a reason.
    """

    def __init__(self, message: str, *, hint: str | None = None, path: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


def unreadable(path: str, why: str) -> UnreadableFileError:
    """The error for ``path`` whose content cannot be read because ``why``."""
    return UnreadableFileError(
        f"file {path!r} cannot be read: {why}; the submission cannot be checked without it "
        "(blobs expire with their run: upload the content again and resubmit)",
        path=path,
    )


def inline_bytes(file: FileRef) -> bytes | None:
    """The default reader: inline ``content`` as UTF-8, else None (it cannot follow a blob)."""
    return None if file.content is None else file.content.encode("utf-8", "surrogatepass")


def read_file(file: FileRef, reader: FileReader | None = None) -> bytes | None:
    """``file``'s bytes through ``reader`` (default :func:`inline_bytes`).

    ``None`` only for a metadata-only file. Raises :class:`UnreadableFileError` when the file
    has a ``blob`` the reader returned nothing for, or when the reader raises a permanent
    error; transient errors (store unreachable) propagate unchanged so they are retried.
    """
    read = reader or inline_bytes
    try:
        data = read(file)
    except UnreadableFileError:
        raise
    except PermanentError as exc:
        raise unreadable(file.path, exc.message) from None
    if data is None and file.blob is not None:
        raise unreadable(
            file.path,
            f"it is held by reference ({file.blob}) and this reader cannot follow references",
        )
    return data


def file_text(file: FileRef, data: bytes | None) -> str | None:
    """The text to scan for ``file`` whose bytes are ``data``; None for binary or no content.

    Inline ``content`` is text as it is. Bytes are text when they decode as UTF-8 (strict), or
    when the name says text (:data:`TEXT_SUFFIXES`), then decoded with replacement characters.
    """
    if file.content is not None:
        return file.content
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        if PurePosixPath(file.path).suffix.lower() in TEXT_SUFFIXES:
            return data.decode("utf-8", "replace")
        return None
