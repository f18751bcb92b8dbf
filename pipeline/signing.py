"""HMAC signatures on broker messages, so write access to the broker cannot forge a verdict.

A message is a JSON dict; its signature is HMAC-SHA256 over the canonical JSON encoding of every
field except ``sig`` (keys sorted, no whitespace, UTF-8 without ``\\u`` escapes), stored in the
message as ``"sig": "hmac-sha256:<hex>"``. Keys rotate: ``CRITIQUE_SECRET`` may hold several
comma-separated secrets; the first signs, any of them verifies (deploy the new secret second
everywhere, then first, then drop the old one). Pure: no I/O, no environment reads here.

What a signature proves: the message was built by a holder of a secret, and not one byte of it
changed since. It does not prove freshness: a validly signed message can be replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.errors import ConfigError, ForgedMessageError

SIG_FIELD = "sig"
"""The message field that carries the signature."""
SCHEME = "hmac-sha256:"
"""The signature's prefix: the algorithm, so another one can be introduced later."""
SECRET_ENV = "CRITIQUE_SECRET"
"""The environment variable holding the secret(s), comma-separated, the signing one first."""
MIN_SECRET_CHARS = 16
"""Shortest secret accepted: a guessable key would make the signature worthless."""


def parse_secrets(raw: str | None) -> tuple[bytes, ...]:
    """The secrets in ``raw`` (comma-separated, the signing one first); ``()`` when unset/blank.

    Raises ``ConfigError`` (naming ``CRITIQUE_SECRET``, never its value) for a secret shorter
    than :data:`MIN_SECRET_CHARS`.
    """
    if raw is None:
        return ()
    parts = [p.strip() for p in raw.split(",")]
    secrets = [p for p in parts if p]
    for i, secret in enumerate(secrets):
        if len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(
                f"{SECRET_ENV}: secret #{i + 1} is {len(secret)} characters; at least "
                f"{MIN_SECRET_CHARS} are needed",
                key=SECRET_ENV,
                hint="generate one with `openssl rand -hex 32`",
            )
    return tuple(s.encode("utf-8") for s in secrets)


def canonical(message: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: every field but ``sig``, as canonical JSON in UTF-8.

    Raises ``ValueError`` or ``TypeError`` for a value JSON cannot carry exactly (NaN, a lone
    surrogate, a non-JSON type, nesting too deep to encode).
    """
    body = {k: v for k, v in message.items() if k != SIG_FIELD}
    try:
        text = json.dumps(
            body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except RecursionError as exc:
        raise ValueError("message nested too deeply to encode") from exc
    return text.encode("utf-8")


def signature(message: Mapping[str, Any], secret: bytes) -> str:
    """``hmac-sha256:<hex>`` of ``message`` under ``secret`` (its ``sig`` field excluded)."""
    return SCHEME + hmac.new(secret, canonical(message), hashlib.sha256).hexdigest()


def sign(message: Mapping[str, Any], secrets: Sequence[bytes]) -> dict[str, Any]:
    """A copy of ``message`` signed with the first secret (unchanged, unsigned, when none)."""
    out = {k: v for k, v in message.items() if k != SIG_FIELD}
    if secrets:
        out[SIG_FIELD] = signature(out, secrets[0])
    return out


def verify(message: Mapping[str, Any], secrets: Sequence[bytes]) -> None:
    """Return when ``message`` carries a valid signature under one of ``secrets``; else raise
    ``ForgedMessageError`` saying why (missing, malformed, not matching). The reason never
    quotes the message. Every secret is tried with a constant-time comparison."""
    if not secrets:
        raise ForgedMessageError("no secret to verify the message with")
    sig = message.get(SIG_FIELD)
    if sig is None:
        raise ForgedMessageError("unsigned message: it carries no 'sig' field")
    if not isinstance(sig, str) or not sig.startswith(SCHEME):
        raise ForgedMessageError(f"malformed signature: expected '{SCHEME}<hex>'")
    try:
        body = canonical(message)
    except (ValueError, TypeError) as exc:
        raise ForgedMessageError(f"message cannot be canonically encoded: {exc}") from None
    given = sig.encode("utf-8", "replace")
    matched = False
    for secret in secrets:
        expected = (SCHEME + hmac.new(secret, body, hashlib.sha256).hexdigest()).encode("ascii")
        matched |= hmac.compare_digest(expected, given)
    if not matched:
        raise ForgedMessageError(
            "bad signature: the message was altered or signed with another key"
        )
