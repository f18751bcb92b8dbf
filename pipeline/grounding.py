"""Filesystem grounding (SPEC §5.5): the workspace snapshot is the truth a critic must respect.

Three jobs: confine every file reference to the submission's workspace (``..``, absolute paths
and symlinks that leave it raise :class:`~pipeline.errors.PathEscapeError`); snapshot the
workspace (path, size, sha256) for the critic prompt; and overrule a critic that claims a file
is missing when the snapshot lists it with content (a hallucination: downgraded to ``info``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

from pipeline.errors import PathEscapeError, SubmissionError
from pipeline.models import CritiqueEnvelope, Defect, FileRef, Frozen, band_for, effort_for

log = logging.getLogger(__name__)

# Score handed back per downgraded claim: what a critical / warning defect typically cost.
CRITICAL_REFUND = 0.2
WARNING_REFUND = 0.1
# Stems shorter than this never count as naming a file ("a", "x", "db" appear everywhere).
MIN_STEM_LEN = 3
GROUNDING_MARK = "[grounding: false positive]"

_CHUNK = 1 << 16
_DRIVE = re.compile(r"^[A-Za-z]:")
# Whole-name tokens of a claim, and the ones that look like a file name (name.ext).
_TOKEN = re.compile(r"[\w./\\-]+")
_FILE_LIKE = re.compile(r"\w\.[a-z][a-z0-9]{0,7}$")
_NOT_FILENAMES = frozenset({"e.g", "i.e", "a.k.a", "etc", "vs", "cf"})
# Words that make a plain-word stem ("report", "chart") read as a file rather than a field.
_FILE_WORDS = re.compile(
    r"\b(?:files?|images?|charts?|plots?|figures?|diagrams?|pdfs?|csvs?|pngs?|jpe?gs?|svgs?|"
    r"spreadsheets?|documents?|datasets?|deliverables?|artifacts?|attachments?|saved|written|"
    r"disk|director(?:y|ies)|folders?|paths?|filesystem|workspace)\b",
    re.IGNORECASE,
)
# Words that make a claim about what is inside a file ("report.pdf lacks a summary section"),
# not about the file being absent: such claims are never overruled by the snapshot.
_CONTENT_WORDS = re.compile(
    r"\b(?:fields?|keys?|columns?|rows?|sections?|values?|entry|entries|propert(?:y|ies)|"
    r"attributes?|headings?|records?|cells?|pages?|chapters?|paragraphs?)\b",
    re.IGNORECASE,
)


class Snapshot(Frozen):
    """A workspace listing plus what was left out of it and why."""

    files: tuple[FileRef, ...] = ()
    skipped: tuple[str, ...] = ()
    """One line per entry not listed: escaping or broken symlinks, special files, unreadable."""
    truncated: bool = False
    """True when ``max_files`` stopped the walk early."""


def _reject_form(rel: str) -> None:
    """Refuse references that are outside the workspace by their very form."""
    if not rel or not rel.strip():
        raise PathEscapeError("empty file path", hint="name a file relative to the workspace")
    if "\x00" in rel:
        raise PathEscapeError(f"file path {rel!r} contains a NUL byte")
    if rel.startswith(("/", "\\")) or _DRIVE.match(rel):
        raise PathEscapeError(
            f"file path {rel!r} is absolute; paths must be relative to the workspace",
            hint="drop the leading '/' or drive letter",
        )
    if ".." in re.split(r"[\\/]", rel):
        raise PathEscapeError(
            f"file path {rel!r} contains '..' and could leave the workspace",
            hint="name the file by its path inside the workspace",
        )


def resolve_in_workspace(root: Path, rel: str) -> Path:
    """Resolve ``rel`` under ``root``, following symlinks, and refuse anything that leaves it.

    Returns the real (symlink-free) path. The target need not exist; a symlink on the way
    whose target is outside ``root`` raises :class:`PathEscapeError` naming both paths.
    """
    _reject_form(rel)
    base = root.resolve()
    real = (base / rel).resolve()
    if real != base and not real.is_relative_to(base):
        raise PathEscapeError(
            f"file path {rel!r} resolves to {str(real)!r}, outside the workspace {str(base)!r}",
            hint="a symlink in the path points outside the workspace",
        )
    return real


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _inline_text(path: Path, size: int, limit: int) -> str | None:
    """The file as text when it is small and valid UTF-8 without NUL bytes, else None."""
    if limit <= 0 or size > limit:
        return None
    data = path.read_bytes()
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def scan_workspace(root: Path, *, max_files: int = 10_000, inline_text_max: int = 0) -> Snapshot:
    """Walk ``root`` deterministically and describe every regular file inside it.

    Symlinks to files inside the workspace are listed under the link's path; symlinks that
    leave it, broken links and special files are skipped and named in ``skipped``. Symlinked
    directories are not followed (their targets inside the workspace are walked anyway).
    Text files up to ``inline_text_max`` bytes carry their ``content``.
    """
    if not root.is_dir():
        raise SubmissionError(
            f"workspace {str(root)!r} is not a directory", hint="check the workspace path"
        )
    base = root.resolve()
    found: list[FileRef] = []
    skipped: list[str] = []
    truncated = False
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        dirnames.sort()
        here = Path(dirpath)
        for name in dirnames:
            link = here / name
            if link.is_symlink() and not link.resolve().is_relative_to(base):
                rel = link.relative_to(base).as_posix()
                skipped.append(f"{rel}/: symlinked directory leaves the workspace")
        for name in sorted(filenames):
            if len(found) >= max_files:
                truncated = True
                break
            path = here / name
            rel = path.relative_to(base).as_posix()
            try:
                real = path.resolve(strict=True)
            except (OSError, RuntimeError):
                skipped.append(f"{rel}: broken symlink")
                continue
            if not real.is_relative_to(base):
                skipped.append(f"{rel}: symlink leaves the workspace")
                continue
            try:
                st = real.stat()
                if not stat.S_ISREG(st.st_mode):
                    skipped.append(f"{rel}: not a regular file")
                    continue
                content = _inline_text(real, st.st_size, inline_text_max)
                found.append(
                    FileRef(path=rel, size=st.st_size, sha256=_sha256(real), content=content)
                )
            except OSError as exc:
                skipped.append(f"{rel}: unreadable ({exc.strerror or exc})")
            except ValueError:
                skipped.append(f"{rel}: name cannot be a workspace-relative path")
        if truncated:
            break
    for line in skipped:
        log.warning("snapshot of %s skipped %s", base, line)
    if truncated:
        log.warning("snapshot of %s stopped at max_files=%d", base, max_files)
    found.sort(key=lambda f: f.path)
    return Snapshot(files=tuple(found), skipped=tuple(skipped), truncated=truncated)


def snapshot(root: Path, *, max_files: int = 10_000) -> tuple[FileRef, ...]:
    """(path, size, sha256) of every regular file under ``root``, sorted by path.

    Skipped entries are logged; call :func:`scan_workspace` to get them as data.
    """
    return scan_workspace(root, max_files=max_files).files


def read_workspace_bytes(root: Path, rel: str, *, max_bytes: int = 1 << 20) -> bytes | None:
    """The first ``max_bytes`` of a confined workspace file, or None when it is not a file."""
    real = resolve_in_workspace(root, rel)
    if not real.is_file():
        return None
    with real.open("rb") as fh:
        return fh.read(max_bytes)


def render_ground_truth(files: Sequence[FileRef], *, limit: int = 200) -> str:
    """The authoritative snapshot block for a critic prompt.

    Paths are JSON-quoted so a hostile file name cannot break out of the listing.
    """
    lines = [
        "## Filesystem ground truth (authoritative)",
        "",
        "These files exist in the worker's workspace right now. The listing is authoritative:",
        "a file listed here with a size above 0 bytes is present, and claiming it is missing",
        "is a hallucination. A file listed with 0 bytes exists but is empty.",
        "",
    ]
    ordered = sorted(files, key=lambda f: f.path)
    if not ordered:
        lines.append("(no files: the workspace is empty)")
        return "\n".join(lines) + "\n"
    for f in ordered[:limit]:
        digest = f"sha256 {f.sha256[:16]}" if f.sha256 else "sha256 unknown"
        lines.append(f"- {_quote(f.path)} — {f.size} bytes — {digest}")
    rest = ordered[limit:]
    if rest:
        total = sum(f.size for f in rest)
        lines.append(f"- … and {len(rest)} more files ({total} bytes in all)")
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    """JSON string quoting (escapes newlines, quotes and control characters)."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F or ch in "\u2028\u2029":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _distinctive(stem: str) -> bool:
    """A stem that cannot be an ordinary word: it has a digit, '_', '-' or '.'."""
    return bool(re.search(r"[\d_.\-]", stem))


class _Index:
    """Lookup tables over the non-empty snapshot files: relative path, name, stem (lower-case).

    Claims are split into whole-name tokens (maximal runs of word characters, ``.``, ``/``,
    ``\\`` and ``-``), so a term never matches inside a longer word, name or extension, and
    each token costs a few dictionary lookups however large the snapshot is.
    """

    def __init__(self, files: Sequence[FileRef]) -> None:
        self.paths: dict[str, FileRef] = {}
        self.names: dict[str, FileRef] = {}
        self.stems: dict[str, FileRef] = {}
        for f in sorted((f for f in files if f.size > 0), key=lambda f: f.path):
            pure = PurePosixPath(f.path.lower())
            if pure.suffix:
                self.paths.setdefault(pure.as_posix(), f)
                self.names.setdefault(pure.name, f)
            stem = pure.stem
            if len(stem) >= MIN_STEM_LEN and re.search(r"[a-z]", stem) and stem[0] != ".":
                self.stems.setdefault(stem, f)

    def __bool__(self) -> bool:
        return bool(self.paths or self.stems)

    def by_path(self, token: str) -> FileRef | None:
        """The file whose relative path is the token or a trailing part of it (``…/out/a.png``)."""
        parts = token.split("/")
        for i in range(len(parts)):
            hit = self.paths.get("/".join(parts[i:]))
            if hit is not None:
                return hit
        return None

    def by_name(self, token: str) -> FileRef | None:
        return None if "/" in token else self.names.get(token)


def _tokens(text: str) -> list[str]:
    raw = _TOKEN.findall(text.lower())
    return [t for t in (r.replace("\\", "/").rstrip(".") for r in raw) if t]


def _contradicted(defect: Defect, index: _Index) -> FileRef | None:
    if defect.category != "missing_data" or defect.false_positive or not index:
        return None
    text = f"{defect.location or ''}\n{defect.description}"
    if _CONTENT_WORDS.search(text):
        return None
    tokens = _tokens(text)
    for tok in tokens:
        absent = index.by_path(tok) is None and index.by_name(tok) is None
        if absent and _FILE_LIKE.search(tok) and tok not in _NOT_FILENAMES:
            return None  # names a file the snapshot does not have: the claim stands
    named = [hit for tok in tokens if (hit := index.by_path(tok) or index.by_name(tok))]
    if named:
        return named[0]
    file_context = _FILE_WORDS.search(text) is not None
    for tok in tokens:
        hit = index.stems.get(tok)
        if hit is not None and (_distinctive(tok) or file_context):
            return hit
    return None


def contradicted_by(defect: Defect, files: Sequence[FileRef]) -> FileRef | None:
    """The non-empty snapshot file a ``missing_data`` claim names, or None if the claim stands.

    A file is named by its relative path, its name, or its stem (≥ 3 characters; a plain-word
    stem such as "report" only next to a file word such as "file" or "chart"). A claim that
    also names a file-like token absent from the snapshot (or present but empty) stands: it
    is at least partly true. So does a claim about a file's content (a missing field, column
    or section), which the snapshot cannot contradict.
    """
    return _contradicted(defect, _Index(files))


def downgrade_defects(
    envelope: CritiqueEnvelope, rewrite: Callable[[Defect], str | None]
) -> tuple[CritiqueEnvelope, int]:
    """Turn each defect ``rewrite`` gives a new description into a marked false positive.

    The defect becomes ``info`` with ``false_positive=True`` and that description; the score
    gets back 0.2 per critical and 0.1 per warning (at most 1.0); band and effort follow.
    Returns the new envelope and how many defects changed (``envelope`` itself when none).
    Shared by grounding (the snapshot contradicts a claim) and the paired critic (the
    adjudicator rejects one).
    """
    refund = 0.0
    changed = 0
    defects: list[Defect] = []
    for d in envelope.defects:
        description = rewrite(d)
        if description is None:
            defects.append(d)
            continue
        if d.severity == "critical":
            refund += CRITICAL_REFUND
        elif d.severity == "warning":
            refund += WARNING_REFUND
        changed += 1
        defects.append(
            d.model_copy(
                update={"severity": "info", "false_positive": True, "description": description}
            )
        )
    if not changed:
        return envelope, 0
    score = round(min(1.0, envelope.score + refund), 6)
    actionable = sum(1 for d in defects if d.severity in ("critical", "warning"))
    downgraded = envelope.model_copy(
        update={
            "defects": tuple(defects),
            "score": score,
            "band": band_for(score),
            "effort_estimate": effort_for(actionable),
        }
    )
    return downgraded, changed


def ground_envelope(envelope: CritiqueEnvelope, files: Sequence[FileRef]) -> CritiqueEnvelope:
    """Downgrade ``missing_data`` claims that the snapshot contradicts; adjust score and band.

    Each downgraded defect becomes ``info`` with ``false_positive=True`` and an annotated
    description; the score gets back 0.2 per critical and 0.1 per warning (at most 1.0).
    Returns ``envelope`` itself when nothing changed.
    """
    index = _Index(files)

    def rewrite(d: Defect) -> str | None:
        hit = _contradicted(d, index)
        if hit is None:
            return None
        note = f"{GROUNDING_MARK} {hit.path!r} exists in the workspace snapshot ({hit.size} B)."
        return f"{note} Critic claimed: {d.description}"

    grounded, changed = downgrade_defects(envelope, rewrite)
    if not changed:
        return envelope
    summary = (
        f"{envelope.summary} [grounding: {changed} missing-file claim(s) contradicted by the "
        "workspace snapshot were downgraded to info]"
    ).strip()
    return grounded.model_copy(update={"summary": summary})
