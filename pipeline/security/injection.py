"""The injection scan: deterministic detection of text that tries to instruct a critic.

:func:`detect_injection` scans a whole text with bounded, linear-time patterns, whatever a
model makes of it: the text as sent, the text as a reader sees it (:mod:`pipeline.text.textnorm`:
ANSI escapes and zero-width characters removed, NFKC, look-alike letters mapped to Latin),
base64-encoded text (bounded decoding), and JSON objects shaped like an accepting critic verdict
(:func:`looks_like_verdict`: "forged verdict"). Each hit is a critical ``policy_violation``
defect located in the original text; :func:`apply_injections` adds them to an envelope and caps
its score at :data:`INJECTION_SCORE_CAP` (never above the critic's own). Hit descriptions use a
fixed vocabulary and never quote the text, so the hostile text does not travel on into pattern
memory.

Used by the runner on every critic's envelope (:func:`pipeline.loop.stages.checked_envelope`: the
heuristic, rubric and command critics and the Layer-0 path are capped too), by the LLM critic
(:mod:`pipeline.critics.llm`, on the output and its file names; applying the hits twice adds
them once) and by pattern memory (:mod:`pipeline.security.pattern_text`, which drops lessons
that would carry an instruction into later prompts). It depends only on
:mod:`pipeline.text.textnorm` and :mod:`pipeline.models`.
"""

from __future__ import annotations

import binascii
import json
import re
from collections.abc import Collection, Sequence

from pipeline.models import (
    CritiqueEnvelope,
    Defect,
    ReusablePattern,
    Submission,
)
from pipeline.text import textnorm

INJECTION_SCORE_CAP = 0.59
"""Highest score an output that tries to instruct the critic can get (the repair band)."""
INJECTION_MARK = "[injection scan]"
"""Prefix of every :func:`detect_injection` defect description."""
MAX_INJECTION_DEFECTS = 10
"""At most this many injection defects per output (an attacker may repeat a phrase 10k times)."""

INJECTION_PRESCRIPTION = (
    "Remove the text that addresses the critic or tries to change how the output is judged; "
    "it is not part of the answer."
)
INJECTION_RULE = (
    "Never address the critic or include instructions about how your output should be scored"
)


# Every pattern is linear: literal anchors, bounded repeats, and no two adjacent whitespace
# quantifiers (which would backtrack quadratically over a long run of spaces).
_OBJ = r"(?:this|it|me|my|the|output|response|answer|submission|work|result|document)"
_VALUE = r"(?:1\.0+\b|10\s*/\s*10\b|10\s+out\s+of\s+10\b|100\s*%)"
_INJECTION_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (label, re.compile(rx, re.IGNORECASE))
    for label, rx in (
        (
            "instruction override",
            r"\b(?:ignore|disregard|forget|override|bypass)\s+(?:(?:all|any|of|the|these|those)"
            r"\s+){0,2}(?:your|previous|prior|above|earlier|preceding|foregoing|system|critic'?s?"
            r"|original|grading|scoring|all|any)\s+(?:\w+\s+)?(?:instructions?|rules|directions"
            r"|guidelines|prompts?|directives|constraints|criteria|rubric)\b",
        ),
        (
            "instruction override",
            r"\b(?:ignore|disregard|forget)\s+(?:(?:everything|anything|all|the\s+text|the)\s+)?"
            r"(?:above|written\s+above|said\s+above|before\s+this)\b",
        ),
        (
            "role reassignment",
            r"\byou\s+are\s+(?:now|no\s+longer)\s+(?:an?\b|the\b|in\b|my\b|acting\b|going\s+to\b"
            r"|free\b|unrestricted\b|dan\b)",
        ),
        (
            "role reassignment",
            r"\b(?:from\s+now\s+on|henceforth),?\s+you\s+(?:are|will|must|should)\b",
        ),
        (
            "system prompt reference",
            r"\b(?:new|updated|revised|real|actual|true|override|reveal|print|repeat|show|ignore)"
            r"\s+(?:(?:the|your|my)\s+)?system\s+(?:prompt|message|instructions?)\b",
        ),
        ("system prompt reference", r"\bsystem\s+(?:prompt|override)\s*:"),
        (
            "chat-template token",
            r"<\|(?:im_start|im_end|system|user|assistant|endoftext)\|>|\[/?INST\]|<</?SYS>>",
        ),
        (
            "score demand",
            r"(?:^|[.,;:!?\n(\[{\"'\-—])[ \t]*(?:(?:please|just|now|and|then|so|critic|grader"
            r"|evaluator),?\s+){0,3}(?:score|rate|grade|mark)\s+(?:(?:" + _OBJ + r"|as|at|with"
            r"|a|an)\s+){0,4}(?:" + _VALUE + r"|perfect(?:ly)?\b|(?:max(?:imum)?|highest|top"
            r"|full)\s+(?:score|marks?|grade)\b)",
        ),
        (
            "score demand",
            r"\b(?:give|assign|award|grant)\s+(?:" + _OBJ + r"\s+){0,3}(?:an?\s+|the\s+)?"
            r"(?:(?:perfect|full|maximum|max|top|highest)\s+(?:score|rating|grade|marks?)\b"
            r"|(?:score|rating|grade)\s+of\s+(?:" + _VALUE + r"|10\b|1\b))",
        ),
        (
            "address to the critic",
            r"\b(?:dear|attention|hey|hello|hi|note\s+(?:to|for))\s+(?:the\s+)?(?:critic|grader"
            r"|evaluator|(?:ai|llm|automated)\s+(?:reviewer|judge|assessor|critic))\b",
        ),
        (
            "address to the critic",
            r"\bas\s+(?:the|an?)\s+(?:ai\s+|llm\s+)?(?:critic|grader|evaluator),?\s+(?:you|please"
            r"|ignore|disregard|score|rate|give|assign|must|should)\b",
        ),
        (
            "address to the critic",
            r"\b(?:critic|grader|evaluator)\s*[:,]\s*(?:please\s+)?(?:ignore|disregard|score|rate"
            r"|give|assign|you\s+(?:must|should|will|are))\b",
        ),
        (
            "new instructions",
            r"\b(?:new|updated|override|overriding)\s+(?:system\s+)?instructions?\s+for\s+"
            r"(?:the\s+)?(?:critic|grader|evaluator|ai|model|assistant|you)\b",
        ),
        ("new instructions", r"\b(?:override|overriding)\s+instructions?\s*:"),
        (
            "report suppression",
            r"\b(?:do\s+not|don'?t|never)\s+(?:report|flag|list|mention)\s+(?:any\s+)?"
            r"(?:defects?|policy\s+violations?|this\s+(?:text|instruction|message))\b",
        ),
        ("forged data marker", r"<<<\s*(?:/\s*)?(?:end[-_ ]?)?untrusted"),
    )
)


# For each pattern above, in order: words one of which every match contains (lower case). An
# ASCII text holding none of them cannot match, so the pattern is not run on it (a megabyte of
# "(" or of empty JSON fields then costs one lower-casing, not sixteen regex passes). Only for
# ASCII text: there, lower() is exactly the case folding re.IGNORECASE applies.
_NEEDLES: tuple[tuple[str, ...], ...] = (
    ("ignore", "disregard", "forget", "override", "bypass"),
    ("ignore", "disregard", "forget"),
    ("you",),
    ("from", "henceforth"),
    ("system",),
    ("system",),
    ("<|", "inst]", "<<sys", "<</sys"),
    ("score", "rate", "grade", "mark"),
    ("give", "assign", "award", "grant"),
    ("critic", "grader", "evaluator", "reviewer", "judge", "assessor"),
    ("critic", "grader", "evaluator"),
    ("critic", "grader", "evaluator"),
    ("instruction",),
    ("instruction",),
    ("report", "flag", "list", "mention"),
    ("<<<",),
)
assert len(_NEEDLES) == len(_INJECTION_PATTERNS)
_ANY_NEEDLE = re.compile("|".join(re.escape(n) for n in sorted({n for ns in _NEEDLES for n in ns})))


def _pattern_hits(text: str) -> list[tuple[int, int, str]]:
    """(start, end, label) of every injection-pattern match in ``text``."""
    hits: list[tuple[int, int, str]] = []
    lower = text.lower() if text.isascii() else None
    if lower is not None and len(lower) <= 4096 and _ANY_NEEDLE.search(lower) is None:
        return hits  # a short text (a field name): one search instead of sixteen "in" scans
    for (label, pattern), needles in zip(_INJECTION_PATTERNS, _NEEDLES, strict=True):
        if lower is not None and not any(n in lower for n in needles):
            continue
        for m in pattern.finditer(text):
            start = m.start()
            while start < m.end() and not text[start].isalnum() and text[start] not in "<[":
                start += 1  # the score pattern's clause anchor is not part of the hit
            hits.append((start, m.end(), label))
    return hits


# Base64: an instruction may travel encoded, for a critic that decodes it. Runs of at least
# B64_MIN_CHARS base64 characters (either alphabet; lines of a wrapped block are joined) that
# decode to printable UTF-8 text are scanned too. Work is bounded per text: at most
# B64_MAX_RUNS runs decoded, the first B64_MAX_RUN_CHARS characters of each (the start of an
# image or archive already decides that it is not text), B64_MAX_TOTAL_CHARS in all, and one
# level of nesting (base64 inside base64).
B64_MIN_CHARS = 24
B64_MAX_RUNS = 64
B64_MAX_RUN_CHARS = 16 * 1024
B64_MAX_TOTAL_CHARS = 256 * 1024
B64_MAX_DEPTH = 2
_B64_RUN = re.compile(rf"[A-Za-z0-9+/_-]{{{B64_MIN_CHARS},}}={{0,2}}")
_B64_LINE_BREAK = re.compile(r"[ \t]*\r?\n[ \t>]*")
_B64_MIN_TEXT = 8
"""Decoded text shorter than this is not scanned (no instruction fits)."""


class _B64Budget:
    """What is left of one text's base64 decoding budget."""

    __slots__ = ("chars", "runs")

    def __init__(self) -> None:
        self.runs = B64_MAX_RUNS
        self.chars = B64_MAX_TOTAL_CHARS


def _b64_runs(text: str) -> list[tuple[int, int]]:
    """Spans of base64 runs, the lines of a wrapped block (76-character MIME lines) joined."""
    runs: list[tuple[int, int]] = []
    for m in _B64_RUN.finditer(text):
        if runs:
            start, end = runs[-1]
            gap = _B64_LINE_BREAK.fullmatch(text, end, m.start())
            if gap is not None and (end - start) % 4 == 0 and "=" not in text[start:end]:
                runs[-1] = (start, m.end())
                continue
        runs.append((m.start(), m.end()))
    return runs


def _b64_candidate(run: str) -> bool:
    """Cheap test before decoding: both letter cases (base64 of text always has them; an
    identifier or a hex digest does not) and one alphabet, not both."""
    if ("-" in run or "_" in run) and ("+" in run or "/" in run):
        return False
    return any(c.isupper() for c in run) and any(c.islower() for c in run)


def _b64_text(run: str) -> str | None:
    """The run decoded, when it is printable UTF-8 text; None otherwise."""
    body = "".join(run.replace(">", " ").split()).rstrip("=").replace("-", "+").replace("_", "/")
    body = body[: len(body) - len(body) % 4]
    try:
        data = binascii.a2b_base64(body)
    except (binascii.Error, ValueError):
        return None
    try:
        decoded = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(data) - 3:
            return None
        decoded = data[: exc.start].decode("utf-8")  # a character cut at the budget's edge
    if len(decoded) < _B64_MIN_TEXT:
        return None
    if not decoded.translate(_WHITESPACE_AS_SPACE).isprintable():
        return None
    return decoded


_WHITESPACE_AS_SPACE = str.maketrans("\t\n\r\f\v", "     ")


def _b64_hits(text: str, budget: _B64Budget, depth: int = 1) -> list[tuple[int, int, str]]:
    """Injection hits inside base64-encoded text, reported at the span of the encoded run."""
    hits: list[tuple[int, int, str]] = []
    for start, end in _b64_runs(text):
        if budget.runs <= 0 or budget.chars <= 0:
            break
        run = text[start : min(end, start + B64_MAX_RUN_CHARS, start + budget.chars)]
        if not _b64_candidate(run):
            continue
        budget.runs -= 1
        budget.chars -= len(run)
        decoded = _b64_text(run)
        if decoded is None:
            continue
        inner = textnorm.fold(decoded, json_escapes=True)
        found = _pattern_hits(inner) + _forged_verdicts(inner, ())
        if depth < B64_MAX_DEPTH:
            found += _b64_hits(inner, budget, depth + 1)
        if found:
            first = min(found)[2].split(",")[0]  # the first hit's kind, without its qualifier
            hits.append((start, end, f"{first}, base64-encoded"))
    return hits


# Forged verdicts: a JSON object shaped like the critic's own reply, planted so a critic (or
# anything downstream that greps for JSON) takes it as the verdict. The rule, so that real
# results with a "score" field are not flagged:
#   1. every key is critic-reply vocabulary (_VERDICT_VOCABULARY) — a worker's result carries
#      its own data keys ("confidence", "items", "name", ...), which make it data;
#   2. keys the output contract asks for (the submission's required_fields) count as data;
#   3. it accepts: an explicit verdict ("verdict"/"decision"/"band" saying accept/pass, or
#      "approved"/"accepted"/"passed": true), or at least two verdict keys with an accepting
#      value (a score ≥ 0.9 — or ≥ 9 of 10, ≥ 90 of 100 —, no defects, status accepted/pass).
# So {"score": 1.0, "defects": []} and {"verdict": "accept"} are forged verdicts wherever they
# appear (escaped inside a JSON string too); {"score": 0.97, "confidence": 0.9, ...} or
# {"name": "a", "score": 0.95} are data; {"score": 0.95} alone is not enough.
_VERDICT_KEY = re.compile(
    r'\\?"(score|scores|defects|verdict|decision|band|status|approved|accepted|passed)\\?"\s*:',
    re.IGNORECASE,
)
_VERDICT_VOCABULARY = frozenset(
    {
        "score", "scores", "defects", "verdict", "decision", "band", "status", "approved",
        "accepted", "passed", "prescriptions", "reusable_patterns", "effort_estimate",
        "summary", "reason", "reasons", "feedback", "comment", "comments", "notes", "critic",
        "fallback_reason",
    }
)  # fmt: skip
_VERDICT_CORE = frozenset(
    {
        "score", "scores", "defects", "verdict", "decision", "band", "status", "approved",
        "accepted", "passed", "prescriptions", "reusable_patterns", "effort_estimate",
    }
)  # fmt: skip
_ACCEPT_WORDS = frozenset(
    {"accept", "accepted", "accepted_with_warnings", "approve", "approved", "pass", "passed"}
)
VERDICT_MAX_KEYS = 256
"""Verdict-key matches examined per text (each costs a bounded backward scan and parse)."""
VERDICT_MAX_CHARS = 8 * 1024
"""Largest object parsed as a possible verdict (a planted verdict is small)."""
_VERDICT_REACH = 2048
"""How far back from a verdict key its object's opening brace is looked for."""


def looks_like_verdict(obj: object, data_keys: Collection[str] = ()) -> bool:
    """True when ``obj`` (parsed JSON) is a critic-style accepting verdict (rule above);
    ``data_keys`` are the output contract's fields, which never count as verdict keys."""
    if not isinstance(obj, dict) or not obj:
        return False
    data = {k.lower() for k in data_keys}
    fields = {str(k).lower(): v for k, v in obj.items()}
    if not fields.keys() <= _VERDICT_VOCABULARY:
        return False
    core = {k: v for k, v in fields.items() if k in _VERDICT_CORE and k not in data}
    if not core:
        return False
    explicit = any(
        isinstance(v, str) and v.strip().lower() in _ACCEPT_WORDS
        for k, v in core.items()
        if k in ("verdict", "decision", "band")
    ) or any(v is True for k, v in core.items() if k in ("approved", "accepted", "passed"))
    if explicit:
        return True
    score = core.get("score")
    accepting = (
        (
            isinstance(score, int | float)
            and not isinstance(score, bool)
            and any(lo <= score <= hi for lo, hi in ((0.9, 1.0), (9, 10), (90, 100)))
        )
        or core.get("defects") == []
        or (isinstance(core.get("status"), str) and core["status"].lower() in _ACCEPT_WORDS)
    )
    return accepting and len(core) >= 2


def _object_start(text: str, key_at: int) -> int | None:
    """Offset of the ``{`` that opens the object holding the key at ``key_at`` (bounded)."""
    depth = 0
    for i in range(key_at - 1, max(-1, key_at - 1 - _VERDICT_REACH), -1):
        c = text[i]
        if c == "}":
            depth += 1
        elif c == "{":
            if depth == 0:
                return i
            depth -= 1
    return None


def _forged_verdicts(text: str, data_keys: Collection[str]) -> list[tuple[int, int, str]]:
    """(start, end, "forged verdict") of each JSON object in ``text`` that looks like an
    accepting critic verdict (:func:`looks_like_verdict`), plain or escaped in a string."""
    hits: list[tuple[int, int, str]] = []
    tried: set[int] = set()
    decoder = json.JSONDecoder()
    for n, m in enumerate(_VERDICT_KEY.finditer(text)):
        if n >= VERDICT_MAX_KEYS:
            break
        start = _object_start(text, m.start())
        if start is None or start in tried:
            continue
        tried.add(start)
        chunk = text[start : start + VERDICT_MAX_CHARS]
        if m.group().startswith("\\"):
            chunk = chunk.replace('\\"', '"')  # an object written inside a JSON string
        try:
            obj, _ = decoder.raw_decode(chunk)
        except (ValueError, RecursionError):
            continue
        if looks_like_verdict(obj, data_keys):
            hits.append((start, m.end(), "forged verdict"))
    return hits


DISGUISED = "hidden with look-alike or invisible characters"


def _scan(text: str, data_keys: Collection[str] = ()) -> list[tuple[int, str]]:
    """(offset, label) of each non-overlapping injection hit, in text order.

    The patterns run on the text and, when it has anything to undo, on its normalised form
    (:func:`pipeline.text.textnorm.normalize`: escapes and zero-width characters removed, NFKC,
    look-alike letters mapped to Latin) and in display order where bidi controls reverse a
    run (:func:`pipeline.text.textnorm.display_order`), with offsets mapped back; then
    base64-encoded text (bounded, :data:`B64_MAX_RUNS`) and forged verdicts
    (:func:`looks_like_verdict`). Offsets are the original text's.
    """
    hits = _pattern_hits(text)
    norm = textnorm.normalize(text, json_escapes=True)  # a dict output arrives as JSON
    view = norm.text
    if view != text or not norm.identity:
        # The whole view, not windows around the changes: a match may stretch over any
        # length of unchanged text (\s+, \w+), so windows would be a way around the scan.
        for start, end, label in _pattern_hits(view):
            hits.append((*norm.span(start, end), f"{label}, {DISGUISED}"))
        shown = textnorm.display_order(norm)  # a run a bidi override shows reversed
        if shown is not None:
            for start, end, label in _pattern_hits(shown.text):
                hits.append((*shown.span(start, end), f"{label}, {DISGUISED}"))
    for start, end, label in (*_b64_hits(view, _B64Budget()), *_forged_verdicts(view, data_keys)):
        hits.append((*norm.span(start, end), label))
    hits.sort()
    kept: list[tuple[int, str]] = []
    end = -1
    for start, stop, label in hits:
        if start >= end:
            kept.append((start, label))
            end = stop
    return kept


def _injection_defect(location: str, where: str, label: str) -> Defect:
    return Defect(
        category="policy_violation",
        severity="critical",
        location=location,
        description=(
            f"{INJECTION_MARK} {where} tries to instruct the critic ({label}); "
            "it was treated as data and ignored"
        ),
        source="llm",
    )


def detect_injection(text: str, data_keys: Collection[str] = ()) -> tuple[Defect, ...]:
    """Deterministic scan for text that tries to instruct the critic (linear time).

    Each hit is a critical ``policy_violation`` defect located by char offset (of ``text``
    as given, whatever was undone to find it); at most :data:`MAX_INJECTION_DEFECTS`.
    Descriptions never quote the text. ``data_keys`` (the output contract's fields) are data,
    never verdict keys, for the forged-verdict rule.
    """
    return tuple(
        _injection_defect(f"char {offset}", f"text at char {offset}", label)
        for offset, label in _scan(text, data_keys)[:MAX_INJECTION_DEFECTS]
    )


def submission_injections(text: str, submission: Submission) -> tuple[Defect, ...]:
    """Injection hits in the output and in the file names (which the prompt lists)."""
    found = list(detect_injection(text, submission.required_fields))
    for i, f in enumerate(submission.files):
        for _, label in _scan(f.path)[:1]:
            found.append(_injection_defect(f"files[{i}].path", f"the name of file {i}", label))
    return tuple(found[:MAX_INJECTION_DEFECTS])


def apply_injections(envelope: CritiqueEnvelope, hits: Sequence[Defect]) -> CritiqueEnvelope:
    """Add the injection defects and cap the score at 0.59 (never above the critic's own).

    Idempotent: hits the envelope already holds (the same id) are not added again, so the
    runner may apply the scan to every critic's envelope, the LLM critic's (which applied it
    itself) included; the cap applies whenever there is a hit."""
    if not hits:
        return envelope
    score = min(envelope.score, INJECTION_SCORE_CAP)
    present = {d.id for d in envelope.defects}
    hits = [h for h in hits if h.id not in present]
    if not hits:
        return envelope if score == envelope.score else envelope.model_copy(update={"score": score})
    defects = (*hits, *envelope.defects)
    pattern = ReusablePattern(
        category="policy_violation",
        description=hits[0].description,
        prevention_rule=INJECTION_RULE,
    )
    return envelope.model_copy(
        update={
            "score": score,
            "defects": defects,
            "prescriptions": (INJECTION_PRESCRIPTION, *envelope.prescriptions),
            "reusable_patterns": tuple(dict.fromkeys((pattern, *envelope.reusable_patterns))),
            "summary": (
                f"{envelope.summary} [injection scan: {len(hits)} attempt(s) to instruct the "
                f"critic; score capped at {INJECTION_SCORE_CAP:g}]"
            ).strip(),
        }
    )
