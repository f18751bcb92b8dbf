"""Text edits a token-free reviser can vouch for (the deterministic reviser invents nothing).

Each Layer-0 defect of a text output is either fixed by one of these edits or refused with the
reason; no edit writes a word the output did not already hold (a renamed heading gains only its
numeric suffix):

    no_text_loop           delete a verbatim repeat of an earlier paragraph (whitespace aside);
                           the first copy stays
    no_placeholder         drop the line(s) holding nothing but the placeholder and punctuation
                           (``TODO``, ``- TBD: ...``); never text around a placeholder
    no_duplicate_headings  rename the 2nd, 3rd, … occurrence: ``## Results (2)``
    json_valid_if_claimed  remove what keeps exact JSON from parsing: a surrounding code fence,
                           a byte-order mark, trailing commas; the JSON text is otherwise kept
                           byte for byte

Refused: a near-duplicate paragraph (which version is right needs judgement), a placeholder
inside a sentence, a heading or a code block, an edit that would leave a section (or the whole
output) empty — that would hide a missing section rather than fix it —, unbalanced delimiters,
JSON that is not recoverable exactly, defects in a submission's files (only the output is
edited) and any check these rules do not know.

Defects are read as :meth:`pipeline.contract.models.ContractFailure.to_defect` writes them:
the check in :attr:`~pipeline.models.Defect.check`, location ``output:<character offset>``.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.contract import _scan
from pipeline.critics.base import Refusal
from pipeline.models import Defect

_OUTPUT_LOCATION = re.compile(r"^output(?::(?P<offset>\d+))?$")
_FENCED_JSON = re.compile(
    r"(?P<fence>`{3,}|~{3,})[ \t]*(?:json)?[ \t]*\r?\n(?P<body>.*?)\r?\n[ \t]*(?P=fence)[ \t]*",
    re.DOTALL | re.IGNORECASE,
)

NOT_OUTPUT = "the defect is in a file of the submission; only the output is edited"
NEAR_DUPLICATE = (
    "the paragraph is a near-duplicate, not a verbatim repeat: choosing which version is right "
    "needs a model"
)
IN_SENTENCE = (
    "the placeholder stands in a line with other text: cutting it would change what that text "
    "says, and writing the missing part needs a model"
)
IN_HEADING = "the placeholder is a heading's title: naming the section needs a model"
IN_CODE = "the placeholder is inside a code block: editing code needs a model"
NOT_PROSE = "the placeholder is in code or JSON: removing a line could break it; a model must act"
UNBALANCED = "where the missing or extra delimiter belongs needs a model"
BAD_JSON = (
    "the JSON is not recoverable exactly (only a code fence, a byte-order mark and trailing "
    "commas are removed); completing it needs a model"
)
UNKNOWN_CHECK = "the deterministic reviser has no exact fix for this check"
STALE = "no matching text at that offset (the defect does not describe this output)"


def empties(what: str) -> str:
    """The reason an edit was refused because it would leave ``what`` empty."""
    return f"removing it would leave {what} empty, hiding the gap instead of filling it"


@dataclass
class TextOutcome:
    """What :func:`revise_text` did: the new text, each fix with what was done, each refusal."""

    text: str
    fixed: list[tuple[Defect, str]] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)


def l0_check(defect: Defect) -> str | None:
    """The Layer-0 check that reported ``defect`` (None for other sources)."""
    return defect.check if defect.source == "l0" else None


def output_offset(defect: Defect) -> tuple[bool, int | None]:
    """(is it about the output itself, the character offset if given)."""
    m = _OUTPUT_LOCATION.match(defect.location or "output")
    if m is None:
        return False, None
    off = m.group("offset")
    return True, int(off) if off is not None else None


def _norm(text: str) -> str:
    return " ".join(text.split())


class _Doc:
    """A text output as lines, with the Layer-0 scan's headings, paragraphs and code fences."""

    def __init__(self, text: str, mode: int) -> None:
        self.text = text
        self.mode = mode
        self.lines = text.split("\n")
        self.starts: list[int] = []
        pos = 0
        for line in self.lines:
            self.starts.append(pos)
            pos += len(line) + 1
        self.scan = _scan.scan(text, mode, _scan.WANT_ALL)
        self.heading_at = {h[0]: h for h in self.scan.headings}
        self.heading_lines = {self.line_at(h[0]): h for h in self.scan.headings}
        self.fenced = self._fenced_lines() if mode == _scan.MODE_MD else set()
        self._before = self._content(frozenset())

    def line_at(self, offset: int) -> int:
        return max(0, bisect.bisect_right(self.starts, offset) - 1)

    def blank(self, i: int) -> bool:
        return not self.lines[i].strip()

    def title(self, heading: tuple[int, int, int]) -> str:
        return _norm(self.text[heading[1] : heading[2]])

    def _fenced_lines(self) -> set[int]:
        inside: set[int] = set()
        fence: tuple[str, int] | None = None
        for i, line in enumerate(self.lines):
            if fence is not None:
                inside.add(i)
                if _scan._fence_close(line, *fence):
                    fence = None
            else:
                fence = _scan._fence_open(line)
                if fence is not None:
                    inside.add(i)
        return inside

    def _content(self, deleted: frozenset[int]) -> tuple[dict[int, bool], bool]:
        """Per heading line: does its section body hold text; does the output hold any."""
        has: dict[int, bool] = {}
        current: int | None = None
        anything = False
        for i, line in enumerate(self.lines):
            if i in deleted:
                continue
            if i in self.heading_lines:
                current = i
                has.setdefault(i, False)
                continue
            if line.strip():
                anything = True
                if current is not None:
                    has[current] = True
        return has, anything

    def emptied(self, deleted: frozenset[int]) -> str | None:
        """What deleting ``deleted`` would leave empty that held text before, if anything."""
        before, anything_before = self._before
        after, anything_after = self._content(deleted)
        for line, had in sorted(before.items()):
            if had and line not in deleted and not after.get(line, False):
                return f"section {self.title(self.heading_lines[line])!r}"
        if anything_before and not anything_after:
            return "the output"
        return None

    def block(self, first: int, last: int) -> set[int]:
        """Lines ``first..last`` plus one blank neighbour, so no double gap is left behind."""
        lines = set(range(first, last + 1))
        before_blank = first == 0 or self.blank(first - 1)
        if last + 1 < len(self.lines) and self.blank(last + 1) and before_blank:
            lines.add(last + 1)
        elif last + 1 == len(self.lines) and first > 0 and self.blank(first - 1):
            lines.add(first - 1)
        return lines


def _placeholder_lines(doc: _Doc, offset: int) -> set[int] | str:
    if doc.mode not in (_scan.MODE_MD, _scan.MODE_LATEX):
        return NOT_PROSE
    hit = next((h for h in doc.scan.hits if h[1] == offset), None)
    if hit is None:
        return STALE
    first, last = doc.line_at(hit[1]), doc.line_at(max(hit[1], hit[2] - 1))
    span = range(first, last + 1)
    if any(i in doc.fenced for i in span):
        return IN_CODE
    if any(i in doc.heading_lines for i in span):
        return IN_HEADING
    chunk = "\n".join(doc.lines[first : last + 1])
    rest = _scan._PLACEHOLDER_RE.sub("", chunk)
    if any(c.isalnum() for c in rest):
        return IN_SENTENCE
    return doc.block(first, last)


def _repeat_lines(doc: _Doc, offset: int) -> set[int] | str:
    paras = doc.scan.paragraphs
    index = next((i for i, p in enumerate(paras) if p[0] == offset), None)
    if index is None:
        return STALE
    start, end = paras[index][0], paras[index][1]
    body = _norm(doc.text[start:end])
    if not any(_norm(doc.text[p[0] : p[1]]) == body for p in paras[:index]):
        return NEAR_DUPLICATE
    return doc.block(doc.line_at(start), doc.line_at(max(start, end - 1)))


def _heading_suffixes(doc: _Doc, offset: int) -> dict[int, str] | str:
    heading = doc.heading_at.get(offset)
    if heading is None:
        return STALE
    key = doc.title(heading).casefold()
    same = [h for h in doc.scan.headings if doc.title(h).casefold() == key]
    taken = {doc.title(h).casefold() for h in doc.scan.headings}
    inserts: dict[int, str] = {}
    n = 2
    for h in same[1:]:
        while f"{key} ({n})" in taken:
            n += 1
        taken.add(f"{key} ({n})")
        inserts[h[2]] = f" ({n})"
        n += 1
    return inserts


def _drop_trailing_commas(text: str) -> str:
    """``text`` without the commas that stand (whitespace aside) right before ``}`` or ``]``
    outside strings."""
    out: list[str] = []
    in_string = escaped = False
    n = len(text)
    for i, c in enumerate(text):
        if in_string:
            out.append(c)
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c == ",":
            j = i + 1
            while j < n and text[j] in " \t\r\n":
                j += 1
            if j < n and text[j] in "}]":
                continue
        out.append(c)
    return "".join(out)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def recover_json(text: str) -> str | None:
    """The text with only a surrounding code fence, a byte-order mark and trailing commas
    removed, when that parses as JSON; else None (anything more would be a guess)."""
    candidates = [text.removeprefix("\ufeff")]
    fenced = _FENCED_JSON.fullmatch(candidates[0].strip())
    if fenced is not None:
        candidates.append(fenced.group("body"))
    for candidate in candidates:
        for version in (candidate, _drop_trailing_commas(candidate)):
            if _parses(version):
                return version
    return None


def _json_outcome(text: str, defects: Sequence[Defect]) -> TextOutcome:
    outcome = TextOutcome(text)
    for d in defects:
        check = l0_check(d)
        if check == "json_valid_if_claimed":
            recovered = recover_json(text)
            if recovered is None:
                outcome.refused.append(Refusal(defect=d, reason=BAD_JSON))
            else:
                outcome.text = recovered
                outcome.fixed.append((d, "made the JSON parse by removing only fence/BOM/commas"))
        elif check == "no_placeholder":
            outcome.refused.append(Refusal(defect=d, reason=NOT_PROSE))
        elif check == "balanced_delimiters":
            outcome.refused.append(Refusal(defect=d, reason=UNBALANCED))
        else:
            outcome.refused.append(Refusal(defect=d, reason=UNKNOWN_CHECK))
    return outcome


def revise_text(text: str, claimed_format: str | None, defects: Sequence[Defect]) -> TextOutcome:
    """Fix what can be fixed exactly among ``defects`` (Layer-0 defects of the text output
    ``text``); refuse the rest. The input text is read, never changed in place."""
    outside = [d for d in defects if not output_offset(d)[0]]
    mine = [d for d in defects if output_offset(d)[0]]
    mode = _scan.mode_for(None, claimed_format)
    if mode == _scan.MODE_JSON:
        outcome = _json_outcome(text, mine)
        outcome.refused.extend(Refusal(defect=d, reason=NOT_OUTPUT) for d in outside)
        return outcome
    doc = _Doc(text, mode)
    outcome = TextOutcome(text)
    deleted: frozenset[int] = frozenset()
    inserts: dict[int, str] = {}
    for d in defects:
        if d in outside:
            outcome.refused.append(Refusal(defect=d, reason=NOT_OUTPUT))
            continue
        check = l0_check(d)
        offset = output_offset(d)[1]
        edit: set[int] | dict[int, str] | str
        if check == "no_placeholder" and offset is not None:
            edit, what = _placeholder_lines(doc, offset), "dropped a placeholder-only line"
        elif check == "no_text_loop" and offset is not None:
            edit, what = _repeat_lines(doc, offset), "deleted a repeated paragraph"
        elif check == "no_duplicate_headings" and offset is not None:
            edit, what = _heading_suffixes(doc, offset), "renamed a duplicate heading"
        elif check == "balanced_delimiters":
            edit, what = UNBALANCED, ""
        elif check == "json_valid_if_claimed":
            edit, what = BAD_JSON, ""
        else:
            edit, what = UNKNOWN_CHECK, ""
        if isinstance(edit, str):
            outcome.refused.append(Refusal(defect=d, reason=edit))
        elif isinstance(edit, dict):
            inserts.update(edit)
            outcome.fixed.append((d, what))
        else:
            trial = deleted | edit
            gap = doc.emptied(trial)
            if gap is not None:
                outcome.refused.append(Refusal(defect=d, reason=empties(gap)))
            else:
                deleted = trial
                outcome.fixed.append((d, what))
    new = text
    for at in sorted(inserts, reverse=True):
        new = new[:at] + inserts[at] + new[at:]
    if deleted:
        new = "\n".join(line for i, line in enumerate(new.split("\n")) if i not in deleted)
    outcome.text = new
    return outcome


def numeric_confidence(value: Any) -> float | None:
    """A confidence given as a plain decimal string in [0, 1] (``"0.8"``) as that number."""
    if not isinstance(value, str):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*", value)
    if m is None:
        return None
    number = float(m.group(1))
    return number if 0.0 <= number <= 1.0 else None
