"""A run's durable record outside Redis, one JSON Lines file per run (docs/operations.md, 'The
run archive').

Redis keeps a run for its TTL only; before the run's keys expire (or when an operator runs
``critique archive RUN``) its full record goes to ``<archive dir>/<run-id>.jsonl``, and
``critique report``/``status`` and the client's ``results()`` read it back once Redis holds
none of the run. The archive directory is ``$CRITIQUE_ARCHIVE_DIR``, else
``<$CRITIQUE_WORKSPACE or ./workspace>/archive``.

One JSON object per line, each with a ``"kind"``, in this order::

    {"kind": "run", "schema": 1, "run_id", "archived_at", "signed_store", "counts", "pending",
     "rejections", "budget"}                     # the header: always the first line
    {"kind": "submission", "key": "<iteration>:<worker>", "task_id", "signature", "at", "sid"}
    {"kind": "result", "latest": true|false, "result": {CritiqueResult}}   # every pass held
    {"kind": "failure", "member", "stage", "error", "reason", "refused", "task_id", "at"}
    {"kind": "completion", "request_id", "decision": {...}}
    {"kind": "trace", "event": {...}}            # every trace stream entry, oldest first
    {"kind": "pattern", "pattern": {Pattern}}    # the run's pattern counts, most frequent first
    {"kind": "lesson", "lesson": {Lesson}}       # the shared lessons as they stood
    {"kind": "end", "run_id", "lines", "sha256", "sig"?}   # always the last line

The ``end`` line counts the lines before it and carries the SHA-256 of their bytes; with
``CRITIQUE_SECRET`` set it is signed (:func:`pipeline.security.signing.sign_record`, kind
``archive``), and a reader holding the secret refuses a file that does not verify, so write
access to the archive directory is not enough to forge a verdict either. Only records that
verified in the store are archived (``signed_store`` says whether the store was signed).

Pure: no Redis here (``workers.archiving`` reads the store); the file is written atomically
(temp file + rename), never through a symlink
(:func:`pipeline.records.artifacts.atomic_write_many`), and read without following one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline import settings
from pipeline.errors import ForgedMessageError, PermanentError
from pipeline.models import CritiqueResult, Lesson, PassRef, Pattern, check_identifier
from pipeline.security import signing

SCHEMA = 1
"""The archive format's version (the header's ``schema``); a reader refuses a newer one."""
SUFFIX = ".jsonl"
"""Every archive file is ``<run-id>.jsonl``."""
RECORD_KIND = "archive"
"""The kind the ``end`` line is signed as (never confused with a store record or a message)."""
MAX_ARCHIVE_BYTES = 1 << 30
"""Largest archive file read back (1 GiB): a bigger one is refused, not loaded into memory."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class ArchiveError(PermanentError):
    """An archive file cannot be read back: malformed, cut short, from a newer version, filed
    under another run, a symlink, or (with ``CRITIQUE_SECRET``) not verifiable."""


@dataclass(frozen=True)
class RunRecord:
    """Everything the archive keeps of one run, as plain values."""

    run_id: str
    archived_at: float
    """Unix time the record was read from the store."""
    signed_store: bool
    """True when every store record was verified with ``CRITIQUE_SECRET`` before archiving."""
    submitted: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``"<iteration>:<worker>"`` -> the registry record (task id, signature, at, pass id)."""
    passes: tuple[CritiqueResult, ...] = ()
    """Every pass result the store held, the latest pass's and superseded ones."""
    latest: frozenset[str] = frozenset()
    """Pass members (``"<iteration>:<worker>:<pass id>"``) of the latest passes' results."""
    failures: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Pass member or ``complete_gate:<request>`` -> the failure a worker recorded."""
    completions: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Completion-gate request id -> its decision."""
    rejections: int = 0
    """Completion-gate rejections counted in the run."""
    trace: tuple[dict[str, Any], ...] = ()
    patterns: tuple[Pattern, ...] = ()
    lessons: tuple[Lesson, ...] = ()
    pending: tuple[str, ...] = ()
    """Pass members still pending when the record was taken (they have no result in it)."""
    budget: dict[str, int] | None = None
    """The run's repair budget (``spent``, ``overrun``), when the store had one."""

    @property
    def results(self) -> list[CritiqueResult]:
        """The latest pass's result of each submission, by iteration and worker."""
        got = [r for r in self.passes if pass_key(r) in self.latest]
        return sorted(got, key=lambda r: (r.iteration, r.worker_id))

    def counts(self) -> dict[str, int]:
        """How many records of each kind the record holds (the header's ``counts``)."""
        return {
            "submissions": len(self.submitted),
            "results": len(self.latest),
            "passes": len(self.passes),
            "failures": len(self.failures),
            "completions": len(self.completions),
            "trace": len(self.trace),
            "patterns": len(self.patterns),
            "lessons": len(self.lessons),
            "pending": len(self.pending),
        }


def pass_key(result: CritiqueResult) -> str:
    """``"<iteration>:<worker>:<pass id>"``: which pass a result is of."""
    return PassRef(result.run_id, result.iteration, result.worker_id, result.pass_id).member


def latest_members(latest: Sequence[CritiqueResult]) -> frozenset[str]:
    """The pass members of the latest results (``RunRecord.latest``)."""
    return frozenset(pass_key(r) for r in latest)


def iso(ts: float) -> str:
    """``2024-05-01T12:00:00Z``: a unix time as shown to people."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- where ---------------------------------------------------------------------------------------


def archive_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$CRITIQUE_ARCHIVE_DIR``, else ``<$CRITIQUE_WORKSPACE or ./workspace>/archive``."""
    env = os.environ if env is None else env
    chosen = settings.given(settings.ARCHIVE_DIR, env)
    if chosen:
        return Path(chosen)
    return Path(settings.given(settings.WORKSPACE, env) or "workspace") / "archive"


def archive_path(directory: Path, run_id: str) -> Path:
    """``<directory>/<run-id>.jsonl`` (the run id is checked: it cannot leave the folder)."""
    return directory / f"{check_identifier(run_id, 'run_id')}{SUFFIX}"


# --- encoding ------------------------------------------------------------------------------------


def _line(doc: Mapping[str, Any]) -> str:
    """One JSON object on one line (JSON escapes every newline inside strings)."""
    return json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def encode(record: RunRecord, secrets: Sequence[bytes] = ()) -> str:
    """The record as JSON Lines (header first, ``end`` last, signed when ``secrets``)."""
    lines = [
        _line(
            {
                "kind": "run",
                "schema": SCHEMA,
                "run_id": record.run_id,
                "archived_at": record.archived_at,
                "archived": iso(record.archived_at),
                "signed_store": record.signed_store,
                "counts": record.counts(),
                "pending": sorted(record.pending),
                "rejections": record.rejections,
                "budget": record.budget,
            }
        )
    ]
    for key in sorted(record.submitted):
        doc = {k: v for k, v in record.submitted[key].items() if k != "message"}
        lines.append(_line({**doc, "kind": "submission", "key": key}))
    for r in sorted(record.passes, key=lambda r: (r.iteration, r.worker_id, pass_key(r))):
        result = r.model_dump(mode="json")
        latest = pass_key(r) in record.latest
        lines.append(_line({"kind": "result", "latest": latest, "result": result}))
    for name in sorted(record.failures):
        lines.append(_line({**record.failures[name], "kind": "failure", "member": name}))
    for request_id in sorted(record.completions):
        decision = record.completions[request_id]
        lines.append(_line({"kind": "completion", "request_id": request_id, "decision": decision}))
    lines += [_line({"kind": "trace", "event": event}) for event in record.trace]
    lines += [
        _line({"kind": "pattern", "pattern": p.model_dump(mode="json")}) for p in record.patterns
    ]
    lines += [
        _line({"kind": "lesson", "lesson": x.model_dump(mode="json")}) for x in record.lessons
    ]
    body = "".join(line + "\n" for line in lines)
    end = {
        "kind": "end",
        "run_id": record.run_id,
        "lines": len(lines),
        "sha256": hashlib.sha256(body.encode("utf-8")).hexdigest(),
    }
    return body + _line(signing.sign_record(RECORD_KIND, end, secrets)) + "\n"


# --- decoding ------------------------------------------------------------------------------------


def decode(
    text: str, secrets: Sequence[bytes] = (), *, run_id: str | None = None, where: str = "archive"
) -> RunRecord:
    """The record in ``text`` (what :func:`encode` wrote); ``ArchiveError`` naming ``where``
    when it is malformed, cut short, from a newer version, of another run than ``run_id``, or
    (with ``secrets``) when its ``end`` line does not verify."""

    def bad(why: str) -> ArchiveError:
        return ArchiveError(
            f"{where}: {why}",
            hint="re-archive the run while Redis still holds it (`critique archive RUN`), "
            "or restore the file from a backup",
        )

    body, sep, tail = text.rstrip("\n").rpartition("\n")
    if not sep:
        body, tail = "", text.rstrip("\n")
    end = _load(tail, bad, "the last line")
    if end.get("kind") != "end":
        raise bad("no end line: the file is cut short")
    if secrets:
        try:
            signing.verify_record(RECORD_KIND, end, secrets)
        except ForgedMessageError as exc:
            raise bad(f"does not verify with CRITIQUE_SECRET: {exc.message}") from None
    raw = [] if not body else body.split("\n")
    digest = hashlib.sha256("".join(line + "\n" for line in raw).encode("utf-8")).hexdigest()
    if end.get("lines") != len(raw) or end.get("sha256") != digest:
        raise bad("its lines do not match its end line (altered or cut short)")
    docs = [_load(line, bad, f"line {i}") for i, line in enumerate(raw, 1)]
    if not docs or docs[0].get("kind") != "run":
        raise bad("no header line")
    head = docs[0]
    schema = head.get("schema")
    if not isinstance(schema, int) or schema > SCHEMA:
        raise bad(f"written in archive schema {schema!r}; this version reads up to {SCHEMA}")
    rid = head.get("run_id")
    if not isinstance(rid, str) or end.get("run_id") != rid or (run_id and rid != run_id):
        raise bad(f"the record is of run {rid!r}, not {run_id or end.get('run_id')!r}")
    try:
        return _record(head, docs[1:], rid)
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"malformed record: {' '.join(str(exc).split())[:300]}") from None


def _load(line: str, bad: Any, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(line)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise bad(f"{what} is not a JSON object")
    return doc


def _record(head: dict[str, Any], docs: list[dict[str, Any]], run_id: str) -> RunRecord:
    submitted: dict[str, dict[str, Any]] = {}
    passes: list[CritiqueResult] = []
    latest: set[str] = set()
    failures: dict[str, dict[str, Any]] = {}
    completions: dict[str, dict[str, Any]] = {}
    trace: list[dict[str, Any]] = []
    patterns: list[Pattern] = []
    lessons: list[Lesson] = []
    for doc in docs:
        kind = doc.pop("kind", None)
        if kind == "submission":
            submitted[str(doc.pop("key"))] = doc
        elif kind == "result":
            result = CritiqueResult.model_validate(doc["result"])
            if result.run_id != run_id:
                raise ValueError(f"a result of run {result.run_id!r}")
            passes.append(result)
            if doc.get("latest") is True:
                latest.add(pass_key(result))
        elif kind == "failure":
            failures[str(doc.pop("member"))] = doc
        elif kind == "completion":
            decision = doc["decision"]
            if not isinstance(decision, dict):
                raise ValueError("a completion decision that is not an object")
            completions[str(doc["request_id"])] = decision
        elif kind == "trace":
            event = doc["event"]
            if not isinstance(event, dict):
                raise ValueError("a trace event that is not an object")
            trace.append(event)
        elif kind == "pattern":
            patterns.append(Pattern.model_validate(doc["pattern"]))
        elif kind == "lesson":
            lessons.append(Lesson.model_validate(doc["lesson"]))
        else:
            raise ValueError(f"an unknown record kind {kind!r}")
    budget = head.get("budget")
    return RunRecord(
        run_id=run_id,
        archived_at=float(head["archived_at"]),
        signed_store=bool(head.get("signed_store")),
        submitted=submitted,
        passes=tuple(passes),
        latest=frozenset(latest),
        failures=failures,
        completions=completions,
        rejections=int(head.get("rejections") or 0),
        trace=tuple(trace),
        patterns=tuple(patterns),
        lessons=tuple(lessons),
        pending=tuple(str(m) for m in head.get("pending") or ()),
        budget=None if budget is None else {str(k): int(v) for k, v in dict(budget).items()},
    )


# --- files ---------------------------------------------------------------------------------------


def write(directory: Path, record: RunRecord, secrets: Sequence[bytes] = ()) -> Path:
    """Write the record to ``<directory>/<run-id>.jsonl`` atomically and durably, replacing
    any earlier archive of the run whole; ``PathEscapeError`` (nothing written) when the file,
    or a folder on the way under ``directory``, is a symlink; ``OSError`` when the directory
    cannot be created or written."""
    # lazy: pipeline.records.artifacts is not loaded by `critique --help`, which imports this module
    # and stays fast
    from pipeline.records.artifacts import atomic_write_many

    path = archive_path(directory, record.run_id)
    if not directory.exists():  # only the worker's user may list or open other runs' archives
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write_many([(path, encode(record, secrets))], root=directory)
    return path


def check_not_older(record: RunRecord, latest_at: float | None, where: str = "archive") -> None:
    """Refuse (``ArchiveError``) a record archived before ``latest_at``, when the archive
    index knows the run's last archive was written then: an older, validly signed archive of
    the run put back in place of the latest one (its ``archived_at`` is signed with the rest)."""
    if latest_at is None or record.archived_at >= latest_at:
        return
    raise ArchiveError(
        f"{where}: an older archive of run {record.run_id!r} (written {iso(record.archived_at)}) "
        f"than its latest ({iso(latest_at)}): refused",
        hint="restore the latest archive of the run, or re-archive it while Redis holds it",
    )


def read(
    directory: Path, run_id: str, secrets: Sequence[bytes] = ()
) -> tuple[Path, RunRecord] | None:
    """The run's archive (path, record), or None when there is no such file. ``ArchiveError``
    when the file is a symlink (never followed), not a regular file, cannot be opened, is
    larger than :data:`MAX_ARCHIVE_BYTES`, or does not decode (:func:`decode`)."""
    path = archive_path(directory, run_id)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if path.is_symlink():
            raise ArchiveError(
                f"refusing to read the archive {str(path)!r}: it is a symlink",
                hint="archives are never read through a symlink; replace it with the file",
            ) from None
        raise ArchiveError(f"cannot read the archive {str(path)!r}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ArchiveError(f"{path}: not a regular file; not read")
    with contextlib.closing(os.fdopen(fd, "rb")) as fh:
        raw = fh.read(MAX_ARCHIVE_BYTES + 1)
    if len(raw) > MAX_ARCHIVE_BYTES:
        raise ArchiveError(f"{path}: larger than {MAX_ARCHIVE_BYTES} bytes; not read")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ArchiveError(f"{path}: not UTF-8 text") from None
    return path, decode(text, secrets, run_id=run_id, where=str(path))
