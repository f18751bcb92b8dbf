"""What pattern memory may store: structure, never the worker's words (issue 28).

Pattern memory's text reaches later prompts (the Known Pitfalls block) and every later run's
lessons, so nothing a hostile output wrote may travel through it. A field, section or location
name is quoted only when it is a short plain name the injection scan does not flag, else it
becomes a hashed stand-in (:func:`name_token`); stored text is cleaned of control and invisible
characters and capped (:func:`stored_text`, :data:`MAX_NAME_CHARS`, :data:`MAX_RULE_CHARS`,
:data:`MAX_DESCRIPTION_CHARS`); a critic's own reusable pattern is dropped when the injection
scan flags it or when it copies a long output key verbatim (:func:`safe_pattern`,
:func:`long_keys`). The heuristic critic names its defects' locations with :func:`name_token`;
:mod:`pipeline.loop.pitfalls` decides what a critique teaches and renders it with these.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from pipeline.models import ReusablePattern
from pipeline.security.injection import detect_injection
from pipeline.text.escaping import one_line

MAX_NAME_CHARS = 40
"""Longest field, section or location name a stored pattern quotes as written."""
MAX_RULE_CHARS = 200
"""Longest prevention rule pattern memory stores (longer ones are cut, ending in "…")."""
MAX_DESCRIPTION_CHARS = 200
"""Longest pattern description pattern memory stores."""

_PLAIN_NAME = re.compile(r"\w[\w.\-]*(?: [\w.\-]+)*")
"""A plain name: letters, digits, ``_``, ``.``, ``-`` and single spaces between words."""


def stored_text(text: str, limit: int) -> str:
    """``text`` as pattern memory stores it: control and invisible format characters removed
    (line breaks become spaces), whitespace collapsed, cut to ``limit`` characters ("…")."""
    if text.isprintable():  # the common case, checked in C: nothing to remove
        one = one_line(text)
        return one if len(one) <= limit else one[: limit - 1].rstrip() + "…"
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Zl", "Zp"):
            kept.append(" ")
        elif cat not in ("Cf", "Cs", "Co", "Cn"):
            kept.append(ch)
    one = one_line("".join(kept))
    return one if len(one) <= limit else one[: limit - 1].rstrip() + "…"


def _instructs(*texts: str) -> bool:
    """True when the injection scan flags any of ``texts`` (each distinct text scanned once;
    short ones are remembered, as the same rules recur in every critique)."""
    return any(
        _flagged_short(t) if len(t) <= 512 else bool(detect_injection(t))
        for t in dict.fromkeys(texts)
        if t
    )


@lru_cache(maxsize=4096)
def _flagged_short(text: str) -> bool:
    return bool(detect_injection(text))


@lru_cache(maxsize=8192)
def _plain(name: str) -> bool:
    """True for a plain name the injection scan does not flag (only short names are cached)."""
    return bool(_PLAIN_NAME.fullmatch(name)) and not _instructs(re.sub(r"[_.\-]+", " ", name))


def name_token(name: str, kind: str = "field") -> str:
    """The form in which a field, section or location name may appear in stored patterns.

    A plain name (:data:`_PLAIN_NAME`: letters, digits, ``_ . -`` and single spaces, at most
    :data:`MAX_NAME_CHARS` characters) that the injection scan does not flag, read with
    ``_ . -`` as spaces, is kept as written; any other becomes a stand-in ``<kind>#<8 hex>``
    (a hash of the name: distinct names stay distinct defects, and nothing of the text
    travels). Prevention rules quote only plain names: for any other a rule is generic
    ("Never leave a field as an empty string"), so odd names all share one pattern."""
    if len(name) <= MAX_NAME_CHARS and _plain(name):
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{kind}#{digest}"


def long_keys(output: Any) -> frozenset[str]:
    """The first :data:`MAX_NAME_CHARS` characters (whitespace collapsed) of every top-level
    key of a JSON-object output that is longer than that: the openings :func:`_copies_key`
    looks for; empty for any other output."""
    if not isinstance(output, Mapping):
        return frozenset()
    openings = (one_line(str(key)) for key in output)
    return frozenset(o[:MAX_NAME_CHARS] for o in openings if len(o) > MAX_NAME_CHARS)


def _copies_key(text: str, openings: frozenset[str]) -> bool:
    """True when ``text`` holds the opening of a long output key (:func:`long_keys`): a
    critic that copied such a key, even cut short, copied the worker's words. Linear in the
    text."""
    if not openings:
        return False
    one = one_line(text)
    return any(
        one[i : i + MAX_NAME_CHARS] in openings for i in range(len(one) - MAX_NAME_CHARS + 1)
    )


def safe_pattern(
    pattern: ReusablePattern, output_keys: frozenset[str] = frozenset()
) -> ReusablePattern | None:
    """A critic's reusable pattern as pattern memory may store it, or None to drop it.

    Dropped when its rule is empty, when the injection scan flags its rule or description
    (as given or as stored), or when either copies the opening of a long output key
    (:func:`long_keys`); kept ones have their rule and description cleaned and capped
    (:func:`stored_text`, :data:`MAX_RULE_CHARS`, :data:`MAX_DESCRIPTION_CHARS`)."""
    rule = stored_text(pattern.prevention_rule, MAX_RULE_CHARS)
    description = stored_text(pattern.description, MAX_DESCRIPTION_CHARS)
    if not rule:
        return None
    texts = (pattern.prevention_rule, pattern.description, rule, description)
    if _instructs(*texts) or any(_copies_key(t, output_keys) for t in texts[:2]):
        return None
    category = stored_text(pattern.category, MAX_NAME_CHARS * 2)
    return ReusablePattern(category=category, description=description, prevention_rule=rule)
