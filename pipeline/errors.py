"""One error tree for the whole product.

Outcomes (a failed check, a rejected gate, a low score) are *data*, never exceptions.
An exception means "could not evaluate", and its branch says whether trying again can help::

    CritiqueError                      base; carries ``hint`` (what the user should do)
    ├── PermanentError                 never retried: the input or the setup is wrong
    │   ├── ConfigError                bad workflow / env configuration (names the key)
    │   ├── SubmissionError            a malformed submission (names the field)
    │   │   ├── ForgedMessageError     a broker message failed its signature check
    │   │   │                          (unsigned, altered, wrong key): refused, never run
    │   │   └── RefusedOverrideError   a submission sets a worker-only field or passes the
    │   │                              worker's limits (names the dotted field, says why)
    │   ├── PathEscapeError            a file reference leaves the workspace
    │   ├── ExtensionLoadError         a configured extension (check, callable) cannot load
    │   └── LLMPermanentError          authentication / bad request: retrying cannot help
    └── TransientError                 retried with backoff (Celery ``autoretry_for``)
        ├── LLMTransientError          timeout, 429, 5xx, connection reset
        └── StoreUnavailableError      Redis unreachable or timing out
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.text.escaping import one_line


class CritiqueError(Exception):
    """Base of every error this product raises on purpose."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} (hint: {self.hint})"
        return self.message


class PermanentError(CritiqueError):
    """Retrying cannot help: the input or the configuration has to change."""


class TransientError(CritiqueError):
    """A retry with backoff may succeed."""


class ConfigError(PermanentError):
    """Configuration is invalid; ``key`` names the offending field (dotted path)."""

    def __init__(self, message: str, *, key: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.key = key


class SubmissionError(PermanentError):
    """A submission is malformed; nothing else in the run is affected."""


class ForgedMessageError(SubmissionError):
    """A broker message is unsigned, altered, or signed with another key while
    ``CRITIQUE_SECRET`` is set (or its blob does not hash to its reference): the worker refuses
    it, records the refusal, and never turns it into a result. The message never quotes the
    payload."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        if hint is None and "CRITIQUE_SECRET" not in message:
            hint = "every worker and client must share the same CRITIQUE_SECRET"
        super().__init__(message, hint=hint)


class RefusedOverrideError(SubmissionError):
    """A submission's configuration crosses the trust boundary (docs/security.md, 'Who may set
    what'): it sets a worker-only field (one that reaches a network address, a secret or code), asks
    for more than the worker allows (``max_repair_attempts``, ``max_output_bytes``), or names
    a model outside the worker's ``allowed_models``. ``key`` is the dotted field. Refused at
    submit by the client and again by the worker before anything is imported or called."""

    def __init__(self, message: str, *, key: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.key = key


class PathEscapeError(PermanentError):
    """A file reference resolves outside the submission's workspace."""


class ExtensionLoadError(PermanentError):
    """A configured ``module:Callable`` extension could not be imported or is not callable."""


class LLMPermanentError(PermanentError):
    """The LLM provider refused the request for a reason retrying will not fix."""


class LLMTransientError(TransientError):
    """The LLM call failed in a way that may succeed later (timeout, 429, 5xx)."""


class StoreUnavailableError(TransientError):
    """The Redis store could not be reached."""


def did_you_mean(word: str, choices: Mapping[str, str] | Sequence[str], cutoff: float = 0.6) -> str:
    """``"did you mean X? "`` for the choice closest to ``word`` (difflib, case-insensitive,
    at least ``cutoff`` alike), else ``""``: the one helper behind every unknown-name message
    (environment variables, ``--set`` keys, workflow-file keys). A mapping is compared by its
    keys and answers with its values (``{"concurrency": "CRITIQUE_CONCURRENCY"}``)."""
    named = dict(choices) if isinstance(choices, Mapping) else {c: c for c in choices}
    lowered = {k.lower(): v for k, v in named.items()}
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=cutoff)
    return f"did you mean {lowered[close[0]]}? " if close else ""


def error_line(exc: BaseException, limit: int | None = 500) -> str:
    """What ``exc`` says, on one line of at most ``limit`` characters (None: all of it): a
    :class:`CritiqueError`'s own message (without its hint), another error's ``str``; its
    type's name when that is empty."""
    message = exc.message if isinstance(exc, CritiqueError) else exc
    return one_line(message, limit) or type(exc).__name__


def validation_problems(exc: Any, shown: int = 3, whole: str = "submission") -> str:
    """A pydantic ``ValidationError`` in one line: the first ``shown`` problems as ``field
    'a.b': <message>`` (``whole``: the name of a problem with the value itself) and how many
    more, never the input values (a payload is not echoed)."""
    errors = exc.errors(include_input=False, include_url=False)
    parts = [
        f"field '{'.'.join(str(p) for p in e['loc']) or whole}': {one_line(e['msg'], 200)}"
        for e in errors[:shown]
    ]
    more = len(errors) - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
