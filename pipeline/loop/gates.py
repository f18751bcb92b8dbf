"""Completion gates: may the manager COMPLETE, or DELEGATE this subtask again?

The chain is :data:`COMPLETION_GATES`, a tuple of small functions, one per gate — L0 → critique
score → deliverable presence → placeholder scan → file validator → evaluation — each reading
one :class:`Completion` (the facts several gates share, worked out once by
:func:`completion_facts`). :func:`evaluate_completion` runs them in order with a short loop and
returns a :class:`CompletionDecision`; :data:`GATE_ORDER` is derived from the tuple. Every gate
emits a :class:`~pipeline.models.GateEvent` (pass / reject / bypass / skip); a
rejection is data, never an exception. Exceptions mean a gate could not evaluate (e.g. a
broken evaluation hook). After ``max_rejected_completions`` the answer is ``partial``.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import PurePosixPath
from typing import Any, Literal

from pipeline.config import CritiqueConfig, OutputContractConfig
from pipeline.errors import SubmissionError
from pipeline.models import ClaimedFormat, CritiqueResult, FileRef, Frozen, GateEvent
from pipeline.records.files import FileReader, file_text, inline_bytes, read_file
from pipeline.records.run_scores import latest_per_worker, mean_best_score, not_counted

DELIVERABLE_MIN_BYTES = 512
# A mean exactly at the threshold passes even when float arithmetic lands a hair below it.
_SCORE_EPSILON = 1e-9
_MAX_LISTED = 10

DELIVERABLE_KEYWORDS: tuple[str, ...] = (
    "image",
    "chart",
    "plot",
    "pdf",
    "csv",
    "tsv",
    "dataset",
    "report",
    "spreadsheet",
    "figure",
    "diagram",
    "png",
    "jpg",
    "jpeg",
    "svg",
    "gif",
    "xlsx",
    "excel",
    "docx",
    "pptx",
    "slide",
    "presentation",
    "infographic",
    "histogram",
    "heatmap",
    "visualization",
    "visualisation",
    "screenshot",
    "photo",
    "picture",
)
_KEYWORD_RE = re.compile(
    r"\b(" + "|".join(re.escape(k) for k in DELIVERABLE_KEYWORDS) + r")(?:s|es)?\b",
    re.IGNORECASE,
)
# Verb uses of keywords that ask for no file ("figure out", "report back").
_NOT_A_FILE: dict[str, re.Pattern[str]] = {
    "figure": re.compile(r"\s+out\b", re.IGNORECASE),
    "report": re.compile(r"\s+back\b", re.IGNORECASE),
}

GATE_L0 = "l0"
GATE_CRITIQUE = "critique_score"
GATE_DELIVERABLE = "deliverable_presence"
GATE_PLACEHOLDER = "placeholder"
GATE_FILE = "file_validator"
GATE_EVALUATION = "evaluation"
GATE_REDUNDANCY = "redundancy"

_FORMAT_BY_SUFFIX: dict[str, ClaimedFormat] = {
    ".json": "json",
    ".md": "markdown",
    ".markdown": "markdown",
    ".tex": "latex",
    ".py": "python",
    ".txt": "text",
}

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class TextItem(Frozen):
    """One text the Layer-0 contract should check (the final result or a text output file)."""

    text: str
    path: str | None = None
    claimed_format: ClaimedFormat | None = None


class L0Finding(Frozen):
    """One Layer-0 failure, as the gates need it (mirrors ``pipeline.contract.ContractFailure``)."""

    check: str
    severity: str
    reason: str
    path: str | None = None
    offset: int | None = None


L0Runner = Callable[[OutputContractConfig, Sequence[TextItem]], Sequence[L0Finding]]
"""Runs the configured Layer-0 checks over texts; injectable so the gates stay testable."""


class PlaceholderHit(Frozen):
    """A stub the manager must replace: where it is, which pattern, the text matched."""

    where: str
    pattern: str
    match: str
    offset: int | None = None


class GateContext(Frozen):
    """What an evaluation hook gets to judge a completion."""

    run_id: str
    iteration: int
    task: str
    final_result: str | dict[str, Any]
    files: tuple[FileRef, ...] = ()
    mean_score: float | None = None


EvaluationHook = Callable[[GateContext], GateEvent]
BytesReader = FileReader
"""Reads a file's bytes (:mod:`pipeline.records.files`): inline content, else its blob."""


class CompletionDecision(Frozen):
    """The gate chain's answer to a manager COMPLETE."""

    verdict: Literal["complete", "rejected", "partial"]
    events: tuple[GateEvent, ...]
    reasons: tuple[str, ...] = ()
    """Why it was not ``complete`` (one line per rejecting gate, the l0 gate's placeholder
    findings left to the placeholder gate's line); empty when complete."""
    rejected_count: int = 0
    """Rejected completions so far, this one included: pass it back as ``previous_rejections``."""
    mean_score: float | None = None
    placeholder_hits: tuple[PlaceholderHit, ...] = ()
    """Exactly which stubs to replace, for the manager's next iteration."""

    def __str__(self) -> str:
        """``rejected: placeholder: 1 placeholder(s) to replace: …``: the verdict and its
        reasons as sentences (``print(decision)``), not a tuple's repr."""
        return f"{self.verdict}: {'; '.join(self.reasons)}" if self.reasons else self.verdict


def contract_runner(contract: OutputContractConfig, items: Sequence[TextItem]) -> list[L0Finding]:
    """The default L0 runner: ``pipeline.contract``'s suite built from ``contract``."""
    # lazy: pipeline.contract is not loaded by `critique --help`, which imports this module and
    # stays fast
    from pipeline.contract import build_suite, run_contract

    # lazy: pipeline.contract.models is not loaded by `critique --help`, which imports this module
    # and stays fast
    from pipeline.contract.models import ContractInput

    suite = build_suite(contract)
    inputs = [
        ContractInput(text=i.text, path=i.path, claimed_format=i.claimed_format) for i in items
    ]
    report = run_contract(suite, inputs)
    return [
        L0Finding(
            check=str(f.check),
            severity=str(f.severity),
            reason=str(f.reason),
            path=f.path,
            offset=f.offset,
        )
        for f in report.failures
    ]


def deliverable_keywords(task: str) -> tuple[str, ...]:
    """The file-deliverable keywords ``task`` uses as whole words, lower-cased, in order."""
    seen: dict[str, None] = {}
    for m in _KEYWORD_RE.finditer(task):
        word = m.group(1).lower()
        if _NOT_A_FILE.get(word) and _NOT_A_FILE[word].match(task, m.end()):
            continue
        seen.setdefault(word, None)
    return tuple(seen)


def implies_deliverable(task: str, deliverable_expected: bool | None) -> bool:
    """Does the task ask for a file? An explicit flag wins over the keyword inference."""
    if deliverable_expected is not None:
        return deliverable_expected
    return bool(deliverable_keywords(task))


def _png_size(content: bytes) -> tuple[int, int] | None:
    """(width, height) from the IHDR chunk, or None when the bytes are not a PNG header."""
    if len(content) < 24 or not content.startswith(_PNG_SIGNATURE) or content[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", content[16:24])
    return int(width), int(height)


def _pdf_problem(content: bytes, *, whole: bool) -> str | None:
    """Why a PDF has nothing to show, or None when it looks like it has pages."""
    if not content.lstrip().startswith(b"%PDF-"):
        return "is not a PDF (no %PDF- header)"
    if re.search(rb"/Type\s*/Pages\b.{0,200}?/Count\s+0\b", content, re.DOTALL) or re.search(
        rb"/Count\s+0\b.{0,200}?/Type\s*/Pages\b", content, re.DOTALL
    ):
        return "is an empty PDF (its page tree counts 0 pages)"
    has_page = re.search(rb"/Type\s*/Page(?![a-zA-Z])", content) is not None
    # Page objects may sit compressed inside object streams, where we cannot see them.
    if whole and not has_page and b"/ObjStm" not in content:
        return "is an empty PDF (no page objects)"
    return None


def validate_deliverable(file: FileRef, content: bytes | None) -> str | None:
    """Why ``file`` is a placeholder rather than a deliverable, or None when it looks real.

    Any file under 512 B is rejected; with the bytes known, also 1×1 PNGs, empty PDFs and
    blank files.
    """
    size = file.size if content is None else max(file.size, len(content))
    if size < DELIVERABLE_MIN_BYTES:
        return (
            f"{file.path!r} is {size} B; a deliverable must be at least "
            f"{DELIVERABLE_MIN_BYTES} B (this looks like a placeholder)"
        )
    if content is None:
        return None
    # Readers may load only a prefix of a large file: judge only what a prefix can show.
    whole = len(content) >= file.size
    suffix = PurePosixPath(file.path).suffix.lower()
    if suffix == ".png" or content.startswith(_PNG_SIGNATURE):
        dims = _png_size(content)
        if dims is None:
            return f"{file.path!r} is not a valid PNG (bad signature or missing IHDR)"
        if dims[0] <= 1 and dims[1] <= 1:
            return f"{file.path!r} is a {dims[0]}×{dims[1]} PNG: a placeholder image"
    if suffix == ".pdf" or content.startswith(b"%PDF-"):
        problem = _pdf_problem(content, whole=whole)
        if problem is not None:
            return f"{file.path!r} {problem}"
    if whole and not content.strip(b" \t\r\n\x00"):
        return f"{file.path!r} is blank (only whitespace or NUL bytes)"
    return None


DELIVERABLE_SUFFIXES: frozenset[str] = frozenset(
    {
        ".png",
        ".jpg",
        ".jpeg",
        ".gif",
        ".bmp",
        ".tif",
        ".tiff",
        ".webp",
        ".svg",
        ".pdf",
        ".csv",
        ".tsv",
        ".xlsx",
        ".xls",
        ".ods",
        ".docx",
        ".doc",
        ".odt",
        ".pptx",
        ".ppt",
        ".odp",
        ".parquet",
        ".feather",
        ".html",
        ".mp4",
        ".wav",
        ".mp3",
    }
)


def is_deliverable_file(file: FileRef, *, task_wants_file: bool) -> bool:
    """Files the validator judges: every output when the task asks for a file, otherwise
    only files of a deliverable type (images, PDFs, tables, documents); never hidden files,
    logs or lock files.
    """
    name = PurePosixPath(file.path).name
    if name.startswith(".") or name.endswith((".log", ".lock")):
        return False
    return task_wants_file or PurePosixPath(name).suffix.lower() in DELIVERABLE_SUFFIXES


# The gate's own stub patterns. Each runs over a lower-cased copy of the text (same offsets)
# and starts with a literal, so a 10 MB output scans in well under a second; the context a
# regex lookbehind would need is checked in Python on the (few) candidate matches.
_OUTPUT_HERE = re.compile(
    r"(?:final|your)\s+(?:output|answer|result|response|text|content|summary)"
    r"\s+(?:goes\s+)?here\b"
)
_INSERT_HERE = re.compile(r"insert\s+[\w ,'-]{1,40}?\s+here\b")
_PERCENT = re.compile(r"xx+(?:\.x+)?\s?%")
_ANGLE = re.compile(r"<\s*(?:your|insert|placeholder)[-_ ][^<>\n]{0,60}>")
_STUB_KEY_JSON = re.compile(r"\"(?:your|your_[\w-]+|field_name|fieldname)\"\s*:")
_STUB_KEY_LINE = re.compile(r"(?:your|your_[\w-]+|field_name)[ \t]*[:=]")
_ELLIPSIS = re.compile(r":\s*\"(?:\.\.\.|…)\"")


def _lowered(text: str) -> str:
    """``text.lower()`` with the offsets of ``text`` (characters that lower to two are kept)."""
    low = text.lower()
    if len(low) == len(text):
        return low
    return "".join(lc if len(lc := c.lower()) == 1 else c for c in text)


def _line_prefix(low: str, start: int) -> str:
    """The text between the start of the line and ``start``."""
    return low[low.rfind("\n", 0, start) + 1 : start]


def scan_placeholders(text: str, where: str) -> list[PlaceholderHit]:
    """The completion gate's own stub patterns (on top of L0's ``no_placeholder``).

    "final output here" / "your answer here", "[insert … here]", "XX%", "<your-…>", stub keys
    (``"your":``, ``field_name:``) and ``"..."`` values.
    """
    low = _lowered(text)
    found: list[tuple[str, int, int]] = []

    def word_before(i: int, *, dot: bool = False) -> bool:
        prev = low[i - 1] if i > 0 else " "
        return prev.isalnum() or prev == "_" or (dot and prev == ".")

    for m in _OUTPUT_HERE.finditer(low):
        if not word_before(m.start()):
            found.append(("output_here", m.start(), m.end()))
    for m in _INSERT_HERE.finditer(low):
        lead = _line_prefix(low, m.start()).rstrip(" \t")
        if not lead or lead[-1] in "[(<{":
            found.append(("insert_here", m.start(), m.end()))
    for m in _PERCENT.finditer(low):
        if not word_before(m.start(), dot=True):
            found.append(("percent_stub", m.start(), m.end()))
    found += [("angle_stub", m.start(), m.end()) for m in _ANGLE.finditer(low)]
    # Stub keys are case-sensitive: "Your:" opening a line of prose is not a key.
    found += [("stub_key", m.start(), m.end()) for m in _STUB_KEY_JSON.finditer(text)]
    for m in _STUB_KEY_LINE.finditer(text):
        if not _line_prefix(text, m.start()).strip(" \t-"):
            found.append(("stub_key", m.start(), m.end()))
    found += [("ellipsis_value", m.start(), m.end()) for m in _ELLIPSIS.finditer(text)]
    found.sort(key=lambda h: (h[1], h[0]))
    return [
        PlaceholderHit(where=where, pattern=name, match=text[a:b], offset=a) for name, a, b in found
    ]


def _final_text(final_result: str | dict[str, Any]) -> TextItem:
    if isinstance(final_result, dict):
        text = json.dumps(final_result, indent=2, sort_keys=True, ensure_ascii=False)
        return TextItem(text=text, path=None, claimed_format="json")
    return TextItem(text=final_result, path=None, claimed_format=None)


def _text_items(
    final: TextItem, files: Sequence[FileRef], content: dict[str, bytes | None]
) -> list[TextItem]:
    """The final result and every text file (inline or read;
    :func:`pipeline.records.files.file_text`)."""
    items = [final]
    for f in files:
        text = file_text(f, content.get(f.path))
        if text is not None:
            fmt = _FORMAT_BY_SUFFIX.get(PurePosixPath(f.path).suffix.lower())
            items.append(TextItem(text=text, path=f.path, claimed_format=fmt))
    return items


def _read_all(
    final_text: str, files: Sequence[FileRef], reader: FileReader, limit: int
) -> tuple[dict[str, bytes | None], list[tuple[str, str]]]:
    """Every file's bytes through ``reader``, within ``limit`` bytes in all (the final result
    included), and ``(path, why)`` for each file that could not be read or was not read
    because the limit was reached. Never skips a file in silence."""
    content: dict[str, bytes | None] = {}
    problems: list[tuple[str, str]] = []
    total = len(final_text.encode("utf-8", "surrogatepass"))
    for f in files:
        if total > limit:
            content[f.path] = None
            problems.append(
                (
                    f.path,
                    f"not read: the final result and files already total {total} bytes, "
                    f"over max_output_bytes ({limit})",
                )
            )
            continue
        try:
            data = read_file(f, reader)
        except SubmissionError as exc:
            content[f.path] = None
            problems.append((f.path, exc.message))
            continue
        content[f.path] = data
        if f.content is not None:
            total += len(f.content.encode("utf-8", "surrogatepass"))
        elif data is not None:
            total += len(data)
    if total > limit and not problems:
        problems.append(
            (
                "",
                f"the final result and files total {total} bytes, over max_output_bytes ({limit})",
            )
        )
    return content, problems


def _listing(items: Sequence[str]) -> str:
    shown = "; ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return f"{shown}; … and {more} more" if more > 0 else shown


def _l0_events(
    findings: Sequence[L0Finding],
    iteration: int,
    n_items: int,
    unread: Sequence[tuple[str, str]] = (),
) -> list[GateEvent]:
    errors = [f for f in findings if f.severity == "error"]
    unread_events = [
        GateEvent(
            gate=GATE_L0,
            verdict="reject",
            reason=f"cannot check {path or 'the submission'}: {why}",
            iteration=iteration,
            violating_path=path or None,
        )
        for path, why in unread
    ]
    if unread_events and not errors:
        return unread_events
    if not errors:
        warned = len(findings)
        note = f" ({warned} warning(s))" if warned else ""
        return [
            GateEvent(
                gate=GATE_L0,
                verdict="pass",
                reason=f"Layer-0 contract passed on {n_items} text(s){note}",
                iteration=iteration,
            )
        ]
    return [
        GateEvent(
            gate=GATE_L0,
            verdict="reject",
            reason=f"L0 {f.check} failed on {f.path or 'the final result'}: {f.reason}",
            iteration=iteration,
            l0_check=f.check,
            l0_reason=f.reason,
            violating_path=f.path,
        )
        for f in errors
    ] + unread_events


@dataclass(frozen=True, eq=False)
class Completion:
    """One manager COMPLETE as every completion gate reads it: what was asked, and the facts
    several gates share, worked out once (every file read once, the mean score, whether a file
    is expected and which real ones exist). Built by :func:`completion_facts`."""

    run_id: str
    iteration: int
    final_result: str | dict[str, Any]
    results: Sequence[CritiqueResult]
    files: Sequence[FileRef]
    task: str
    deliverable_expected: bool | None
    config: CritiqueConfig
    evaluate: EvaluationHook | None
    run_l0: L0Runner
    items: tuple[TextItem, ...]
    """The final result and every text file, as Layer-0 and the placeholder scan check them."""
    content: dict[str, bytes | None]
    """Each file's bytes by path (None: not read, or unreadable)."""
    unread: tuple[tuple[str, str], ...]
    """``(path, why)`` for each file that was not or could not be read."""
    wants_file: bool
    """Does the task ask for a file (an explicit flag wins over the keywords)?"""
    why_file: str
    big: tuple[FileRef, ...]
    """Output files of at least :data:`DELIVERABLE_MIN_BYTES` that may be the deliverable."""
    valid: tuple[FileRef, ...]
    """Those of :attr:`big` that look like real deliverables."""
    mean: float | None
    """Mean best score over the run's workers
    (:func:`~pipeline.records.run_scores.mean_best_score`)."""

    @cached_property
    def placeholder_hits(self) -> tuple[PlaceholderHit, ...]:
        """Every stub to replace: L0's ``no_placeholder`` plus the gate's own patterns."""
        return tuple(_placeholder_hits(self.final_result, self.items, self.run_l0))


def completion_facts(
    *,
    run_id: str,
    iteration: int,
    final_result: str | dict[str, Any],
    results: Sequence[CritiqueResult],
    files: Sequence[FileRef],
    task: str,
    deliverable_expected: bool | None,
    config: CritiqueConfig,
    evaluate: EvaluationHook | None = None,
    l0: L0Runner | None = None,
    read_bytes: BytesReader | None = None,
) -> Completion:
    """The :class:`Completion` the gates read; reads every file once, within
    ``max_output_bytes`` for the final result and files together."""
    final = _final_text(final_result)
    content, unread = _read_all(
        final.text, files, read_bytes or inline_bytes, config.max_output_bytes
    )
    keywords = deliverable_keywords(task)
    why_file = (
        f"the task mentions {', '.join(repr(k) for k in keywords)}"
        if deliverable_expected is None
        else f"deliverable_expected={deliverable_expected}"
    )
    # Logs, lock files and hidden files never count as the deliverable.
    big = tuple(
        f
        for f in files
        if f.size >= DELIVERABLE_MIN_BYTES and is_deliverable_file(f, task_wants_file=True)
    )
    return Completion(
        run_id=run_id,
        iteration=iteration,
        final_result=final_result,
        results=results,
        files=files,
        task=task,
        deliverable_expected=deliverable_expected,
        config=config,
        evaluate=evaluate,
        run_l0=l0 or contract_runner,
        items=tuple(_text_items(final, files, content)),
        content=content,
        unread=tuple(unread),
        wants_file=implies_deliverable(task, deliverable_expected),
        why_file=why_file,
        big=big,
        valid=tuple(f for f in big if validate_deliverable(f, content[f.path]) is None),
        mean=mean_best_score(results),
    )


def l0_gate(c: Completion) -> list[GateEvent]:
    """The Layer-0 contract on the final result and every text output; a file it could not
    read rejects, named."""
    findings = c.run_l0(c.config.output_contract, c.items)
    return _l0_events(findings, c.iteration, len(c.items), c.unread)


def critique_score_gate(c: Completion) -> list[GateEvent]:
    """The mean best score over the run's workers against ``min_score_to_complete``; a real
    deliverable on disk overrules a low score (the ground-truth bypass, advisory). Unchecked
    and cancelled outputs are not counted; when no output was checked at all the gate rejects
    (there is no score to vouch for the run), unless the threshold is 0.0."""
    threshold = c.config.min_score_to_complete
    mean = c.mean
    if threshold <= 0.0:
        return [_event(GATE_CRITIQUE, "skip", "min_score_to_complete is 0.0", c.iteration)]
    unscored = not_counted(c.results)
    if mean is None and unscored:
        return [_event(GATE_CRITIQUE, "reject", _nothing_checked(unscored), c.iteration)]
    if mean is None:
        return [_event(GATE_CRITIQUE, "skip", "no worker critiques to average", c.iteration)]
    over = f"{_n_workers(c.results)}{unscored}"
    if mean + _SCORE_EPSILON >= threshold:
        reason = f"mean critique score {mean:.3f} ≥ {threshold:.2f} over {over}"
        return [_event(GATE_CRITIQUE, "pass", reason, c.iteration)]
    if c.wants_file and c.valid:
        first = c.valid[0]
        reason = (
            f"mean critique score {mean:.3f} < {threshold:.2f} over {over} overruled: the "
            f"deliverable {first.path!r} ({first.size} B) exists on disk (filesystem ground "
            "truth; advisory — placeholder and file gates still apply)"
        )
        return [_event(GATE_CRITIQUE, "bypass", reason, c.iteration)]
    reason = (
        f"mean critique score {mean:.3f} < min_score_to_complete {threshold:.2f} over "
        f"{over}: repair or re-delegate before completing"
    )
    return [_event(GATE_CRITIQUE, "reject", reason, c.iteration)]


def _nothing_checked(unscored: str) -> str:
    """Why a COMPLETE is refused when no worker output was critiqued."""
    return (
        f"no worker output was critiqued{unscored}: nothing vouches for this run; resubmit "
        "with critique on (remove enabled: false), or set min_score_to_complete: 0.0 to "
        "complete without a critique score"
    )


def deliverable_gate(c: Completion) -> list[GateEvent]:
    """When the task asks for a file: does an output file of at least 512 B exist?"""
    if not c.wants_file:
        return [
            _event(GATE_DELIVERABLE, "skip", "the task implies no file deliverable", c.iteration)
        ]
    if c.big:
        names = _listing([f"{f.path} ({f.size} B)" for f in c.big])
        reason = f"{c.why_file}; output file(s) ≥ {DELIVERABLE_MIN_BYTES} B exist: {names}"
        return [_event(GATE_DELIVERABLE, "pass", reason, c.iteration)]
    have = _listing([f"{f.path} ({f.size} B)" for f in c.files]) or "no output files"
    reason = (
        f"{c.why_file}, but no output file of at least {DELIVERABLE_MIN_BYTES} B exists "
        f"(have: {have}); produce the deliverable before completing"
    )
    return [_event(GATE_DELIVERABLE, "reject", reason, c.iteration)]


def placeholder_gate(c: Completion) -> list[GateEvent]:
    """The placeholder scan: L0's ``no_placeholder`` plus the gate's own stub patterns; it
    cannot vouch for a file it did not scan."""
    hits = c.placeholder_hits
    if hits:
        # An L0 finding's match is its sentence (quotes inside); a stub pattern's is raw text.
        listed = _listing(
            [
                f"{h.where}: {h.match if h.pattern == 'no_placeholder' else repr(h.match)} "
                f"({h.pattern})"
                for h in hits
            ]
        )
        reason = f"{len(hits)} placeholder(s) to replace: {listed}"
        return [_event(GATE_PLACEHOLDER, "reject", reason, c.iteration)]
    if c.unread:
        listed = _listing([path or "the submission" for path, _ in c.unread])
        reason = (
            f"cannot vouch for what it did not scan: {listed} (unreadable, or past "
            "max_output_bytes: see the l0 gate)"
        )
        return [_event(GATE_PLACEHOLDER, "reject", reason, c.iteration)]
    reason = f"no placeholders in the final result or {len(c.items) - 1} text output(s)"
    return [_event(GATE_PLACEHOLDER, "pass", reason, c.iteration)]


def file_validator_gate(c: Completion) -> list[GateEvent]:
    """Every judged output file (:func:`is_deliverable_file`) looks like a real deliverable
    (:func:`validate_deliverable`)."""
    judged = [f for f in c.files if is_deliverable_file(f, task_wants_file=c.wants_file)]
    problems = [p for f in judged if (p := validate_deliverable(f, c.content[f.path])) is not None]
    if not judged:
        return [_event(GATE_FILE, "skip", "no output files to validate", c.iteration)]
    if problems:
        return [_event(GATE_FILE, "reject", _listing(problems), c.iteration)]
    reason = f"{len(judged)} output file(s) look like real deliverables"
    return [_event(GATE_FILE, "pass", reason, c.iteration)]


def evaluation_gate(c: Completion) -> list[GateEvent]:
    """The configured evaluation hook's verdict (skipped when there is none)."""
    if c.evaluate is None:
        return [_event(GATE_EVALUATION, "skip", "no evaluation configured", c.iteration)]
    ctx = GateContext(
        run_id=c.run_id,
        iteration=c.iteration,
        task=c.task,
        final_result=c.final_result,
        files=tuple(c.files),
        mean_score=c.mean,
    )
    return [c.evaluate(ctx).model_copy(update={"iteration": c.iteration})]


@dataclass(frozen=True)
class Gate:
    """One completion gate: its name (the ``gate`` of the events it emits) and its check."""

    name: str
    check: Callable[[Completion], list[GateEvent]]


COMPLETION_GATES: tuple[Gate, ...] = (
    Gate(GATE_L0, l0_gate),
    Gate(GATE_CRITIQUE, critique_score_gate),
    Gate(GATE_DELIVERABLE, deliverable_gate),
    Gate(GATE_PLACEHOLDER, placeholder_gate),
    Gate(GATE_FILE, file_validator_gate),
    Gate(GATE_EVALUATION, evaluation_gate),
)
"""The completion gate chain, in the order :func:`evaluate_completion` runs it."""
GATE_ORDER: tuple[str, ...] = tuple(g.name for g in COMPLETION_GATES)
"""The gates' names in chain order, derived from :data:`COMPLETION_GATES`."""


def evaluate_completion(
    *,
    run_id: str,
    iteration: int,
    final_result: str | dict[str, Any],
    results: Sequence[CritiqueResult],
    files: Sequence[FileRef],
    task: str,
    deliverable_expected: bool | None,
    config: CritiqueConfig,
    previous_rejections: int = 0,
    evaluate: EvaluationHook | None = None,
    l0: L0Runner | None = None,
    read_bytes: BytesReader | None = None,
) -> CompletionDecision:
    """Run the completion gate chain (:data:`COMPLETION_GATES`) in order and decide: complete,
    rejected or partial.

    ``files`` are the run's output files (``content`` set for small text files, ``blob`` for
    large ones); ``read_bytes`` loads a file's bytes (default: its inline content only; a
    worker passes one that follows blob references). Every file is read once, within
    ``max_output_bytes`` for the final result and files together, and a text file read by
    reference is checked by Layer-0 and the placeholder scan exactly like an inline one. A file
    that cannot be read (missing or expired blob) or was not read (over the limit) rejects the
    L0 and placeholder gates, naming it: the gates never vouch for what they did not see.
    ``l0`` runs Layer-0 checks (default: :func:`contract_runner`).
    """
    completion = completion_facts(
        run_id=run_id,
        iteration=iteration,
        final_result=final_result,
        results=results,
        files=files,
        task=task,
        deliverable_expected=deliverable_expected,
        config=config,
        evaluate=evaluate,
        l0=l0,
        read_bytes=read_bytes,
    )
    events: list[GateEvent] = []
    for gate in COMPLETION_GATES:
        events += gate.check(completion)
    return _decide(
        events, completion.placeholder_hits, completion.mean, previous_rejections, config
    )


def _n_workers(results: Sequence[CritiqueResult]) -> str:
    """``2 workers``: those whose latest result was checked (the ones the mean is over)."""
    n = sum(1 for r in latest_per_worker(results) if r.checked)
    return f"{n} worker{'s' if n != 1 else ''}"


def _event(
    gate: str, verdict: Literal["pass", "reject", "bypass", "skip"], reason: str, iteration: int
) -> GateEvent:
    return GateEvent(gate=gate, verdict=verdict, reason=reason, iteration=iteration)


def _placeholder_hits(
    final_result: str | dict[str, Any], items: Sequence[TextItem], run_l0: L0Runner
) -> list[PlaceholderHit]:
    hits: list[PlaceholderHit] = []
    if (isinstance(final_result, dict) and not final_result) or (
        isinstance(final_result, str) and not final_result.strip()
    ):
        hits.append(PlaceholderHit(where="final_result", pattern="empty", match=""))
    for item in items:
        hits += scan_placeholders(item.text, item.path or "final_result")
    only_placeholder = OutputContractConfig(checks=("no_placeholder",))
    for f in run_l0(only_placeholder, items):
        if f.severity == "error" and f.check == "no_placeholder":
            where = f.path or "final_result"
            hits.append(
                PlaceholderHit(where=where, pattern=f.check, match=f.reason, offset=f.offset)
            )
    return hits


def _decide(
    events: Sequence[GateEvent],
    hits: Sequence[PlaceholderHit],
    mean: float | None,
    previous_rejections: int,
    config: CritiqueConfig,
) -> CompletionDecision:
    rejects = [e for e in events if e.verdict == "reject"]
    if any(e.gate == GATE_PLACEHOLDER for e in rejects):
        # The placeholder gate lists every L0 no_placeholder finding too: say each stub once.
        rejects = [e for e in rejects if not (e.gate == GATE_L0 and e.l0_check == "no_placeholder")]
    reasons = [f"{e.gate}: {e.reason}" for e in rejects]
    if not reasons:
        return CompletionDecision(
            verdict="complete",
            events=tuple(events),
            rejected_count=previous_rejections,
            mean_score=mean,
            placeholder_hits=tuple(hits),
        )
    count = previous_rejections + 1
    verdict: Literal["rejected", "partial"] = "rejected"
    if count >= config.max_rejected_completions:
        verdict = "partial"
        reasons.append(
            f"partial: {count} rejected completion(s) reached max_rejected_completions="
            f"{config.max_rejected_completions}; the best result so far is returned as partial"
        )
    return CompletionDecision(
        verdict=verdict,
        events=tuple(events),
        reasons=tuple(reasons),
        rejected_count=count,
        mean_score=mean,
        placeholder_hits=tuple(hits),
    )


def redundancy_guard(
    signature: str,
    dispatched: Collection[str],
    mean_score: float | None,
    config: CritiqueConfig,
    *,
    iteration: int = 1,
    worker_id: str | None = None,
) -> GateEvent:
    """Refuse a DELEGATE that re-issues a dispatched subtask while the mean score is low.

    The manager should diagnose or repair instead of re-running the same subtask.
    """

    def out(verdict: Literal["pass", "reject", "skip"], reason: str) -> GateEvent:
        return GateEvent(
            gate=GATE_REDUNDANCY,
            verdict=verdict,
            reason=reason,
            iteration=iteration,
            worker_id=worker_id,
        )

    threshold = config.min_score_to_complete
    if threshold <= 0.0:
        return out("skip", "min_score_to_complete is 0.0: the redundancy guard is off")
    if not signature:
        return out("skip", "no subtask_signature to compare")
    if signature not in dispatched:
        return out("pass", f"subtask {signature!r} has not been dispatched before")
    if mean_score is None:
        return out("pass", f"subtask {signature!r} re-issued, but no critique scores exist yet")
    if mean_score + _SCORE_EPSILON >= threshold:
        return out(
            "pass",
            f"subtask {signature!r} re-issued with mean score {mean_score:.3f} ≥ {threshold:.2f}",
        )
    return out(
        "reject",
        f"subtask {signature!r} was already dispatched and the mean critique score "
        f"{mean_score:.3f} is under {threshold:.2f}: diagnose or repair the existing output "
        "instead of re-delegating it",
    )
