"""The six default Layer-0 checks (docs/pipeline.md, 'Layer-0 contract'), reading one shared
scan of each document.

Each check is an :class:`~pipeline.contract.models.OutputContractCheck`: called alone it scans
the document itself; inside a :class:`~pipeline.contract.ContractSuite` all built-in checks read
one scan (``evaluate``), so the document is walked once whatever the number of checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from pipeline.config import BUILTIN_CHECK_NAMES
from pipeline.contract import _scan
from pipeline.contract._scan import ScanResult
from pipeline.contract.models import ContractFailure, ContractInput, L0Severity
from pipeline.text import simhash, textnorm

MAX_FAILURES_PER_CHECK = 20
"""Failures listed per check and document; one more failure then says how many were left out."""
SIZE_DELTA_LIMIT = 2.5
SIZE_DELTA_MIN_GROWTH = 1024
"""Growth (bytes) below which ``file_size_delta`` never fires: adding two fields to a 50-byte
JSON result is not a runaway repair, whatever the ratio (docs/design-decisions.md, 'Layer-0 output
contract')."""
LOOP_CONFIRM_MIN_JACCARD = 0.3
"""A simhash near-duplicate is confirmed when the two paragraphs share at least this Jaccard
fraction of their word 3-grams. Chance collisions of unrelated paragraphs (about one pair in
10^9 at Hamming ≤ 9, so a few in a 50 MB document) share almost none; any real repeat that
lands within 9 bits shares far more."""


def doc_mode(doc: ContractInput) -> int:
    """The scan mode of a document (see :func:`pipeline.contract._scan.mode_for`)."""
    return _scan.mode_for(doc.path, doc.claimed_format)


def _context(text: str, start: int, end: int, width: int = 30) -> str:
    """The match with ``width`` characters each side, whitespace collapsed to single spaces."""
    lo, hi = max(0, start - width), min(len(text), end + width)
    snippet = " ".join(text[lo:hi].split())
    return ("…" if lo > 0 else "") + snippet + ("…" if hi < len(text) else "")


class BuiltinCheck:
    """Base of the default checks: declares what it needs from the scan."""

    name: str = ""
    want: int = 0

    def __call__(self, doc: ContractInput) -> Iterable[ContractFailure]:
        mode = doc_mode(doc)
        result = _scan.scan(doc.text, mode, self.want) if self.want else None
        return self.evaluate(doc, mode, result)

    def evaluate(
        self, doc: ContractInput, mode: int, result: ScanResult | None
    ) -> list[ContractFailure]:
        raise NotImplementedError

    def _fail(
        self, doc: ContractInput, reason: str, offset: int | None, severity: L0Severity = "error"
    ) -> ContractFailure:
        return ContractFailure(
            check=self.name, severity=severity, reason=reason, path=doc.path, offset=offset
        )

    def __repr__(self) -> str:
        return f"<check {self.name}>"


def _capped(
    check: BuiltinCheck,
    doc: ContractInput,
    failures: list[ContractFailure],
    total: int,
    what: str,
    next_offset: int | None,
) -> list[ContractFailure]:
    if total > len(failures):
        failures.append(
            check._fail(doc, f"{total - len(failures)} more {what} not listed", next_offset)
        )
    return failures


class NoPlaceholder(BuiltinCheck):
    """Placeholder text (TODO, Lorem ipsum, ???, …) left in the output.

    Also when disguised (ANSI colours, zero-width characters, fullwidth or look-alike letters:
    see :func:`pipeline.text.textnorm.normalize`); the reason then says how it reads, and the
    offset is still the original text's.
    """

    name = "no_placeholder"
    want = _scan.WANT_PLACEHOLDERS

    def evaluate(
        self, doc: ContractInput, mode: int, result: ScanResult | None
    ) -> list[ContractFailure]:
        assert result is not None
        out: list[ContractFailure] = []
        text = doc.text
        for _pid, start, end in result.hits[:MAX_FAILURES_PER_CHECK]:
            found = text[start:end]
            reads = _reads(text, start, end, mode == _scan.MODE_JSON)
            shown = f"{found!r}" if reads == found else f"{found!r} (reads {reads!r})"
            out.append(
                self._fail(doc, f"placeholder {shown} in {_context(text, start, end)!r}", start)
            )
        nxt = (
            result.hits[MAX_FAILURES_PER_CHECK][1]
            if len(result.hits) > MAX_FAILURES_PER_CHECK
            else None
        )
        return _capped(self, doc, out, result.total_hits, "placeholder matches", nxt)


def _reads(text: str, start: int, end: int, json_escapes: bool) -> str:
    """How the placeholder at ``[start, end)`` reads: normalised, and reversed when only
    that shows a placeholder (it was found in a run a bidi override displays reversed)."""
    reads = textnorm.fold(text[start:end], json_escapes=json_escapes)
    if _scan.has_placeholder(reads) or not _scan.has_placeholder(reads[::-1]):
        return reads
    return reads[::-1]


def _shingles(text: str) -> set[tuple[str, str, str]]:
    words = text.lower().split()
    return {(words[i], words[i + 1], words[i + 2]) for i in range(len(words) - 2)}


class NoTextLoop(BuiltinCheck):
    """Two paragraphs of ≥ 20 words (:data:`~pipeline.contract._scan.MIN_PARAGRAPH_WORDS`)
    within simhash Hamming distance 9 (similarity > 0.85).

    Prose formats only (markdown, text, LaTeX): in code, near-identical blocks (tests, handlers)
    are normal. Candidates come from :func:`pipeline.text.simhash.nearest_earlier` (linear); each is
    confirmed by word-3-gram overlap (:data:`LOOP_CONFIRM_MIN_JACCARD`) so that chance
    fingerprint collisions in very long documents are not reported.
    """

    name = "no_text_loop"
    want = _scan.WANT_PARAS

    def evaluate(
        self, doc: ContractInput, mode: int, result: ScanResult | None
    ) -> list[ContractFailure]:
        assert result is not None
        if mode not in (_scan.MODE_MD, _scan.MODE_LATEX) or len(result.paragraphs) < 2:
            return []
        paras = result.paragraphs
        fps = [p[3] for p in paras]
        nearest = simhash.nearest_earlier(fps, simhash.TEXT_LOOP_MAX_DISTANCE)
        text = doc.text
        cache: dict[int, set[tuple[str, str, str]]] = {}

        def confirmed(i: int, j: int) -> bool:
            a, b = text[paras[i][0] : paras[i][1]], text[paras[j][0] : paras[j][1]]
            if a == b:
                return True
            sa = cache.get(i)
            if sa is None:
                sa = cache[i] = _shingles(a)
            sb = cache.get(j)
            if sb is None:
                sb = cache[j] = _shingles(b)
            union = len(sa | sb)
            return union > 0 and len(sa & sb) / union >= LOOP_CONFIRM_MIN_JACCARD

        others = _Candidates(fps)
        out: list[ContractFailure] = []
        total = 0
        next_offset: int | None = None
        for j, i in enumerate(nearest):
            if i < 0:
                continue
            match = i if confirmed(i, j) else others.next_match(j, confirmed)
            if match is None:
                continue
            total += 1
            if len(out) >= MAX_FAILURES_PER_CHECK:
                if next_offset is None:
                    next_offset = paras[j][0]
                continue
            dist = simhash.hamming(fps[match], fps[j])
            sim = simhash.similarity(fps[match], fps[j])
            out.append(
                self._fail(
                    doc,
                    f"paragraph of {paras[j][2]} words repeats the paragraph at offset "
                    f"{paras[match][0]} (simhash similarity {sim:.3f}, "
                    f"Hamming {dist}): the output is looping",
                    paras[j][0],
                )
            )
        return _capped(self, doc, out, total, "repeated paragraphs", next_offset)


class _Candidates:
    """After a chance collision, the other earlier paragraphs within distance 9 (rare: built
    lazily, one vectorised comparison per unconfirmed paragraph)."""

    def __init__(self, fps: list[int]) -> None:
        self.fps = fps
        self._arr: Any = None

    def next_match(self, j: int, confirmed: Callable[[int, int], bool]) -> int | None:
        import numpy as np

        if self._arr is None:
            self._arr = np.array(self.fps, dtype=np.uint64)
        near = np.bitwise_count(self._arr[:j] ^ np.uint64(self.fps[j]))
        for i in np.nonzero(near <= simhash.TEXT_LOOP_MAX_DISTANCE)[0].tolist():
            if confirmed(i, j):
                return int(i)
        return None


class FileSizeDelta(BuiltinCheck):
    """An attempt more than 2.5× the previous attempt's size and over 1 KiB bigger (a runaway
    repair); the absolute floor keeps small outputs that gain a field from tripping it."""

    name = "file_size_delta"

    def evaluate(
        self, doc: ContractInput, mode: int, result: ScanResult | None
    ) -> list[ContractFailure]:
        prev = doc.previous_size
        if prev is None or prev == 0:
            return []
        size = len(doc.text) if doc.text.isascii() else len(doc.text.encode("utf-8", "replace"))
        if size <= SIZE_DELTA_LIMIT * prev or size - prev <= SIZE_DELTA_MIN_GROWTH:
            return []
        return [
            self._fail(
                doc,
                f"{size} bytes is {size / prev:.2f}× the previous attempt's {prev} bytes "
                f"(limit {SIZE_DELTA_LIMIT}× once it grew more than {SIZE_DELTA_MIN_GROWTH} bytes)",
                None,
            )
        ]


class NoDuplicateHeadings(BuiltinCheck):
    """A Markdown ATX heading or LaTeX section title that appears more than once."""

    name = "no_duplicate_headings"
    want = _scan.WANT_HEADINGS

    def evaluate(
        self, doc: ContractInput, mode: int, result: ScanResult | None
    ) -> list[ContractFailure]:
        assert result is not None
        if mode not in (_scan.MODE_MD, _scan.MODE_LATEX):
            return []
        text = doc.text
        seen: dict[str, list[int]] = {}
        titles: dict[str, str] = {}
        for off, ts, te in result.headings:
            title = " ".join(text[ts:te].split())
            if not title:
                continue
            key = title.casefold()
            seen.setdefault(key, []).append(off)
            titles.setdefault(key, title)
        out: list[ContractFailure] = []
        dups = sorted((offs[1], key) for key, offs in seen.items() if len(offs) > 1)
        for second, key in dups[:MAX_FAILURES_PER_CHECK]:
            offs = seen[key]
            out.append(
                self._fail(
                    doc,
                    f"heading {titles[key]!r} appears {len(offs)} times "
                    f"(first at offset {offs[0]})",
                    second,
                )
            )
        nxt = dups[MAX_FAILURES_PER_CHECK][0] if len(dups) > MAX_FAILURES_PER_CHECK else None
        return _capped(self, doc, out, len(dups), "duplicated headings", nxt)


class BalancedDelimiters(BuiltinCheck):
    """Unequal counts of ``()``, ``[]`` or ``{}`` outside strings, comments and code.

    An error in code formats (Python, JSON), a warning in prose, where a smiley or a "1)" list
    item is legitimate.
    """

    name = "balanced_delimiters"
    want = _scan.WANT_DELIMS

    def evaluate(
        self, doc: ContractInput, mode: int, result: ScanResult | None
    ) -> list[ContractFailure]:
        assert result is not None
        if mode == _scan.MODE_OTHER:
            return []
        severity: L0Severity = "error" if mode in (_scan.MODE_PY, _scan.MODE_JSON) else "warning"
        out: list[ContractFailure] = []
        for (op, cl), (opens, closes, rise, unmatched) in zip(
            _scan.DELIMITER_PAIRS, result.delimiters, strict=True
        ):
            if opens == closes:
                continue
            if opens > closes:
                where, offset = f"first unclosed {op!r} at offset {rise}", rise
            else:
                where, offset = f"first unmatched {cl!r} at offset {unmatched}", unmatched
            out.append(
                self._fail(
                    doc,
                    f"unbalanced {op}{cl}: {opens} {op!r} vs {closes} {cl!r}; {where}",
                    offset,
                    severity,
                )
            )
        return out


class JsonValidIfClaimed(BuiltinCheck):
    """A ``.json`` file, or an output claimed to be JSON, that does not parse."""

    name = "json_valid_if_claimed"

    def evaluate(
        self, doc: ContractInput, mode: int, result: ScanResult | None
    ) -> list[ContractFailure]:
        claimed = doc.claimed_format == "json" or mode == _scan.MODE_JSON
        if not claimed and not (doc.path or "").lower().endswith(".json"):
            return []
        try:
            json.loads(doc.text)
        except json.JSONDecodeError as exc:
            return [
                self._fail(
                    doc,
                    f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                    exc.pos,
                )
            ]
        except RecursionError:
            return [self._fail(doc, "not valid JSON: nested too deeply to parse", None)]
        return []


BUILTIN_CHECKS: dict[str, type[BuiltinCheck]] = {
    c.name: c
    for c in (
        NoPlaceholder,
        NoTextLoop,
        FileSizeDelta,
        NoDuplicateHeadings,
        BalancedDelimiters,
        JsonValidIfClaimed,
    )
}
"""The default checks by name, in the order they run."""
if tuple(BUILTIN_CHECKS) != BUILTIN_CHECK_NAMES:  # one vocabulary: the configuration's
    raise ImportError(
        f"pipeline.contract.checks implements {tuple(BUILTIN_CHECKS)} but the configuration "
        f"names {BUILTIN_CHECK_NAMES} (pipeline.config.BUILTIN_CHECK_NAMES)"
    )
