"""Filesystem grounding: the workspace snapshot is the truth a critic must respect.

The snapshot is the submission's ``files`` (path, size, sha256): the worker's workspace as the
manager sent it. Two jobs: render it into the critic prompt as authoritative
(:func:`render_ground_truth`), and overrule a critic that claims a file is missing when the
snapshot lists it with content (a hallucination: downgraded to ``info``,
:func:`ground_envelope`).

Confinement is enforced where a path enters: :class:`~pipeline.models.FileRef` refuses an
empty, absolute or ``..`` path (and control characters) when a submission is validated, so
every path here is already relative to the workspace. Files travel by content (inline or as
a blob), never as a path on the worker's disk, so there is no symlink to follow; where they are
written out again (the command critic's sandbox, :func:`pipeline.security.sandbox.write_workspace`)
a symlink or an escaping path raises :class:`~pipeline.errors.PathEscapeError`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import PurePosixPath

from pipeline.models import CritiqueEnvelope, Defect, FileRef

# Score handed back per downgraded claim: what a critical / warning defect typically cost.
CRITICAL_REFUND = 0.2
WARNING_REFUND = 0.1
# Stems shorter than this never count as naming a file ("a", "x", "db" appear everywhere).
MIN_STEM_LEN = 3
GROUNDING_MARK = "[grounding: false positive]"

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
    downgraded = envelope.model_copy(update={"defects": tuple(defects), "score": score})
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
