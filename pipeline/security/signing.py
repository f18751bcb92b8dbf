"""HMAC signatures on broker messages, so write access to the broker cannot forge a verdict.

A message is a JSON dict; its signature is HMAC-SHA256 over the canonical JSON encoding of every
field except ``sig`` (keys sorted, no whitespace, UTF-8 without ``\\u`` escapes), stored in the
message as ``"sig": "hmac-sha256:<hex>"``. Keys rotate: ``CRITIQUE_SECRET`` may hold several
comma-separated secrets; the first signs, any of them verifies (deploy the new secret second
everywhere, then first, then drop the old one). Pure: no I/O, no environment reads here.

Two keys: ``CRITIQUE_SECRET`` signs stage messages, gate requests and records (workers only,
and the Python client's own path); ``CRITIQUE_ENTRY_SECRET``, when set, signs entry messages
only, so a manager that holds just that key can submit but never forge a stage or a record.
Its keys may be named (``alice=<key>,bob=<key>``, :func:`parse_named_secrets`): the key that
verified an entry message names the manager who sent it, and a run is bound to the identity
that opened it (:func:`entry_identity`, :data:`FLEET_IDENTITY`).

What a signature proves: the message was built by a holder of a secret, and not one byte of it
changed since. It does not prove freshness: a validly signed message can be replayed.

A message also names the Celery task it is addressed to (``task_name`` and ``task_id``, signed):
:func:`check_addressed` refuses it under any other task or id, so a signed message sent again
under a victim's task id (or to another task) cannot act as that task.

Records a worker writes to the store (a pass's result, a failure, a completion-gate decision)
are signed the same way under a *kind* (:func:`sign_record`, :func:`verify_record`): the kind
goes into the MAC first, so a record of one kind never verifies as another, nor as a message.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline import settings
from pipeline.errors import ConfigError, ForgedMessageError

SIG_FIELD = "sig"
"""The message field that carries the signature."""
SCHEME = "hmac-sha256:"
"""The signature's prefix: the algorithm, so another one can be introduced later."""
# The keys' variables, CRITIQUE_SECRET and CRITIQUE_ENTRY_SECRET: pipeline.settings. The managers'
# key(s) (comma-separated like the secrets), when set, verify entry messages only, and stage
# messages and records verify only with CRITIQUE_SECRET, a key the managers never hold; unset,
# entry messages are signed with CRITIQUE_SECRET (one-secret setups).
MIN_SECRET_CHARS = 16
"""Shortest secret accepted: a guessable key would make the signature worthless."""
TASK_FIELD = "task_name"
"""The message field naming the Celery task (its name) the message is addressed to."""
TASK_ID_FIELD = "task_id"
"""The message field naming the Celery task id the message is addressed to."""
RECORD_DOMAIN = b"critique-record:"
"""What the MAC input of a stored record starts with (then its kind and a newline): a message's
canonical JSON starts with ``{``, so the two can never be confused."""


def parse_secrets(raw: str | None, env: str = settings.SECRET.name) -> tuple[bytes, ...]:
    """The secrets in ``raw`` (comma-separated, the signing one first); ``()`` when unset/blank.

    Raises ``ConfigError`` (naming ``env``, never its value) for a secret shorter than
    :data:`MIN_SECRET_CHARS`.
    """
    if raw is None:
        return ()
    parts = [p.strip() for p in raw.split(",")]
    secrets = [p for p in parts if p]
    for i, secret in enumerate(secrets):
        if len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(
                f"{env}: secret #{i + 1} is {len(secret)} characters; at least "
                f"{MIN_SECRET_CHARS} are needed",
                key=env,
                hint="generate one with `openssl rand -hex 32`",
            )
    return tuple(s.encode("utf-8") for s in secrets)


FLEET_IDENTITY = "fleet"
"""Who signed with ``CRITIQUE_SECRET`` (the workers' key; the Python client's own path, and
entry messages of one-secret setups): the identity a run opened that way is bound to."""
ENTRY_IDENTITY = "entry"
"""Who signed with an unnamed managers' key (a bare item of
:data:`~pipeline.settings.ENTRY_SECRET`)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def entry_identity(name: str) -> str:
    """The identity of a managers' key named ``name`` (``""``: the single unnamed one), as a
    run's owner records it: never equal to :data:`FLEET_IDENTITY`."""
    return f"{ENTRY_IDENTITY}:{name}" if name else ENTRY_IDENTITY


def parse_named_secrets(
    raw: str | None, env: str = settings.ENTRY_SECRET.name
) -> tuple[tuple[str, bytes], ...]:
    """The ``(name, secret)`` items of ``raw``: comma-separated, each ``name=secret`` or a bare
    secret (name ``""``: one unnamed manager, as before names existed); a name may repeat, for
    rotation. An item is named only when what precedes its first ``=`` is a name (letters,
    digits, ``._-``, at most 64) and what follows is more than ``=`` padding, so a bare base64
    key (``…=``) stays bare. Each secret is checked as :func:`parse_secrets` checks them."""
    if raw is None:
        return ()
    items: list[tuple[str, str]] = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, rest = part.partition("=")
        if sep and _NAME.fullmatch(name.strip()) and rest.strip().strip("="):
            items.append((name.strip(), rest.strip()))
        else:
            items.append(("", part))
    secrets = parse_secrets(",".join(secret for _, secret in items), env)
    return tuple((name, secret) for (name, _), secret in zip(items, secrets, strict=True))


KEY_ID_DOMAIN = b"critique-key-id"
"""What a key id's MAC covers: no message (``{`` first) nor record (:data:`RECORD_DOMAIN`)
starts with it, so a key id is never a signature of anything."""
KEY_ID_CHARS = 8
"""Hex characters of a key id: enough to tell a fleet's few keys apart, too few to matter."""


def key_id(secret: bytes) -> str:
    """A short, non-secret name of ``secret``: the first :data:`KEY_ID_CHARS` hex characters of
    HMAC-SHA256(secret, :data:`KEY_ID_DOMAIN`). The same secret always has the same id, in any
    language, so a client can tell whether it holds a key the workers accept without either
    side showing the key (the fleet's posture, :mod:`pipeline.security.posture`)."""
    return hmac.new(secret, KEY_ID_DOMAIN, hashlib.sha256).hexdigest()[:KEY_ID_CHARS]


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
    return _mac(canonical(message), secret)


def _mac(body: bytes, secret: bytes) -> str:
    return SCHEME + hmac.new(secret, body, hashlib.sha256).hexdigest()


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
    _verify(message, secrets, b"", "message")


def verify_signer(message: Mapping[str, Any], secrets: Sequence[bytes]) -> int:
    """:func:`verify`, returning the index in ``secrets`` of the key that signed ``message``
    (the first that matches, every one still tried in constant time): which key holder sent
    it, so a run can be bound to its manager (:func:`parse_named_secrets`)."""
    return _verify(message, secrets, b"", "message")


def _verify(message: Mapping[str, Any], secrets: Sequence[bytes], prefix: bytes, what: str) -> int:
    """:func:`verify` of a message (``prefix`` empty) or of a record (its domain and kind);
    returns the index of the matching secret."""
    if not secrets:
        raise ForgedMessageError(f"no secret to verify the {what} with")
    sig = message.get(SIG_FIELD)
    if sig is None:
        raise ForgedMessageError(f"unsigned {what}: it carries no 'sig' field")
    if not isinstance(sig, str) or not sig.startswith(SCHEME):
        raise ForgedMessageError(f"malformed signature: expected '{SCHEME}<hex>'")
    try:
        body = prefix + canonical(message)
    except (ValueError, TypeError) as exc:
        raise ForgedMessageError(f"{what} cannot be canonically encoded: {exc}") from None
    given = sig.encode("utf-8", "replace")
    matched = -1
    for i, secret in enumerate(secrets):
        if hmac.compare_digest(_mac(body, secret).encode("ascii"), given) and matched < 0:
            matched = i
    if matched < 0:
        raise ForgedMessageError(
            f"bad signature: the {what} was altered or signed with another key (compare the "
            "manager's CRITIQUE_SECRET with the workers': they must be the same)"
        )
    return matched


def address(message: Mapping[str, Any], task: str, task_id: str) -> dict[str, Any]:
    """A copy of ``message`` addressed to the Celery task ``task`` running as ``task_id``
    (unsigned: sign it after)."""
    out = {k: v for k, v in message.items() if k != SIG_FIELD}
    out[TASK_FIELD] = task
    out[TASK_ID_FIELD] = task_id
    return out


def addressee(message: Mapping[str, Any]) -> tuple[str, str]:
    """``(task, task_id)`` a message is addressed to; ``("", "")`` for what it does not name."""
    task, task_id = message.get(TASK_FIELD), message.get(TASK_ID_FIELD)
    return (task if isinstance(task, str) else "", task_id if isinstance(task_id, str) else "")


def check_addressed(message: Mapping[str, Any], task: str, task_id: str) -> None:
    """Return when a (verified) message names ``task`` and ``task_id``, the task and id it is
    running as; else raise ``ForgedMessageError``: its signature does not cover that id, so it
    is another message replayed (or a message sent to the wrong task)."""
    named_task, named_id = addressee(message)
    if not named_id or not named_task:
        raise ForgedMessageError(
            "the message's signature covers no task id: it cannot be attributed to the task "
            f"it arrived as ({task} {task_id[:64]!r})"
        )
    if named_task != task or not hmac.compare_digest(named_id.encode(), task_id.encode()):
        raise ForgedMessageError(
            f"the message's signature covers task {named_task[:64]!r} with id {named_id[:64]!r}, "
            f"not {task} {task_id[:64]!r}: a signed message replayed under another task or id"
        )


def _record_prefix(kind: str) -> bytes:
    if not kind or "\n" in kind:
        raise ValueError(f"bad record kind {kind!r}")
    return RECORD_DOMAIN + kind.encode("utf-8") + b"\n"


def sign_record(kind: str, record: Mapping[str, Any], secrets: Sequence[bytes]) -> dict[str, Any]:
    """A copy of ``record`` (a JSON object a worker stores) signed as a record of ``kind`` with
    the first secret; unchanged, unsigned, when there is none."""
    out = {k: v for k, v in record.items() if k != SIG_FIELD}
    if secrets:
        out[SIG_FIELD] = _mac(_record_prefix(kind) + canonical(out), secrets[0])
    return out


def verify_record(kind: str, record: Mapping[str, Any], secrets: Sequence[bytes]) -> None:
    """Return when ``record`` carries a valid signature as a record of ``kind`` under one of
    ``secrets``; else raise ``ForgedMessageError`` saying why (never quoting the record)."""
    _verify(record, secrets, _record_prefix(kind), f"{kind} record")


TRACE_MAC_CHARS = 32
"""Hex characters of a trace event's MAC (HMAC-SHA256 cut to 128 bits): a trace stream holds
many small events, so their tags are kept short."""


def _trace_body(run_id: str, payload: bytes) -> bytes:
    return RECORD_DOMAIN + b"trace\n" + run_id.encode("utf-8") + b"\n" + payload


def trace_mac(run_id: str, payload: bytes, secret: bytes) -> str:
    """The tag of one encoded trace event of ``run_id`` (its JSON bytes) under ``secret``: a
    record of kind ``trace`` bound to the run, so an event copied into another run's trace, or
    any other record, never verifies."""
    return hmac.new(secret, _trace_body(run_id, payload), hashlib.sha256).hexdigest()[
        :TRACE_MAC_CHARS
    ]


def trace_mac_ok(
    run_id: str, payload: bytes, tag: str | bytes | None, secrets: Sequence[bytes]
) -> bool:
    """Whether ``tag`` is :func:`trace_mac` of the event under one of ``secrets`` (constant-time
    comparisons, every secret tried)."""
    if tag is None:
        return False
    given = tag if isinstance(tag, bytes) else tag.encode("utf-8", "replace")
    matched = False
    for secret in secrets:
        matched |= hmac.compare_digest(trace_mac(run_id, payload, secret).encode("ascii"), given)
    return matched
