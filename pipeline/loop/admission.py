"""Admission: the size limit a submission must be within before anything processes it.

``max_output_bytes`` bounds the whole submission, not only its output (see docs/pipeline.md,
"Files by reference and the size limit"). The client checks it before it enqueues; the worker
checks it again at the first Layer-0 stage of every pass (:func:`pipeline.loop.stages.l0_stage`), so
a chain sent without the client is bounded too.
"""

from __future__ import annotations

from pipeline.config import CritiqueConfig
from pipeline.errors import SubmissionError
from pipeline.llm.tokens import text_of
from pipeline.models import Submission
from pipeline.records.files import FileReader
from pipeline.records.files import read_file as read_file_bytes


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def admit(
    submission: Submission, config: CritiqueConfig, read_file: FileReader | None = None
) -> None:
    """Refuse a submission the pipeline must not take (``max_output_bytes`` bounds the whole
    submission, not only its output; see docs/pipeline.md, "Files by reference and the size
    limit"): a :class:`SubmissionError` naming the limit and the sizes.

    Counted in UTF-8 bytes: the output's canonical text, the task, every inline file's content,
    every other file's bytes as ``read_file`` returns them (a blob's real length, never its
    claimed ``size``), and every other field a sender can make long (:func:`field_bytes`:
    ``subtask_signature``, ``required_fields``, ``model``, file paths and digests), since each
    is carried and stored with the submission too. Files are read only while the total is
    within the limit, so an oversized submission costs at most one read past it. A file that
    cannot be read raises :class:`~pipeline.records.files.UnreadableFileError`. The client calls
    this before it enqueues; the worker calls it again at the first Layer-0 stage of every pass
    (:func:`pipeline.loop.stages.l0_stage`), so a chain sent without the client is bounded too.
    """
    limit = config.max_output_bytes
    output = _utf8_len(text_of(submission.output))
    task = _utf8_len(submission.task)
    inline = sum(_utf8_len(f.content) for f in submission.files if f.content is not None)
    fields = field_bytes(submission)
    total = output + task + inline + fields
    referenced = 0
    unread = 0
    for i, f in enumerate(submission.files):
        if f.content is not None:
            continue
        if total > limit:
            unread = sum(1 for g in submission.files[i:] if g.content is None)
            break
        size = len(read_file_bytes(f, read_file) or b"")
        referenced += size
        total += size
    if total <= limit:
        return
    lower = "at least " if unread else ""
    not_read = f"; {unread} file(s) by reference not read" if unread else ""
    other = f", other fields {fields} B" if fields else ""
    raise SubmissionError(
        f"submission of worker {submission.worker_id!r} (run {submission.run_id!r}) is "
        f"{lower}{total} bytes, over max_output_bytes ({limit}): output {output} B, "
        f"task {task} B, inline files {inline} B, files by reference {referenced} B"
        f"{other}{not_read}; nothing was processed",
        hint="split the work, send less, or raise max_output_bytes on the workers",
    )


def field_bytes(submission: Submission) -> int:
    """UTF-8 bytes of the submission's fields besides the output, the task and file content:
    ``subtask_signature``, each of ``required_fields``, ``model``, and each file's ``path``,
    ``sha256`` and ``blob`` reference. (``run_id`` and ``worker_id`` are identifiers of at most
    128 characters and not counted.)"""
    texts = [submission.subtask_signature, submission.model or "", *submission.required_fields]
    for f in submission.files:
        texts += [f.path, f.sha256, f.blob or ""]
    return sum(_utf8_len(t) for t in texts)
