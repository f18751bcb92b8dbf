"""Secrets out of error text that managers read.

A provider's error body is written by someone else: a 401 may quote the key it was sent, a
proxy's 400 may echo the request's headers, a 5xx page may quote the prompt (the worker's output,
someone else's task). Such text reaches a manager through a failure reason (``wait()``,
``critique status``) or a fallback note on a verdict, so it is kept only as the error's type, its
HTTP status and a short provider message with anything key-like replaced by ``***``
(:func:`provider_error`, :func:`scrub_provider`); :func:`scrub`, the lighter pass that leaves
ids and digests alone, covers any other error text a manager can read (a failed task's reason,
``workers.steps.scrubbed_line``).

What counts as key-like: the values of the worker's own credentials (every variable
:func:`pipeline.security.model_policy.held_keys` names, the signing secrets, and the key a call
carried), ``Bearer …`` and ``Basic …`` credentials, well-known key shapes (``sk-…``, ``hf_…``,
``AKIA…``, ``AIza…``, ``ghp_…``, ``xox…-``) and a URL's ``user:password@``; in a provider's text
also the value of a ``key=``/``"api_key": …``/``Authorization:`` pair and any run of 32 or more
letters and digits mixed. It errs on the side of hiding: a long request id is hidden too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

from pipeline import settings
from pipeline.security.model_policy import held_keys
from pipeline.text.escaping import one_line

SHOWN = "***"
MAX_PROVIDER_MESSAGE = 200
"""Characters of a provider's own message kept in a failure reason (after scrubbing)."""
MIN_SECRET_CHARS = 8
"""A configured value shorter than this is not searched for (it would hide ordinary words)."""
SIGNING_SECRETS = (settings.SECRET.name, settings.ENTRY_SECRET.name)

_KEY_SHAPES = re.compile(
    r"""(?x)
    \b(?:Bearer|Basic)\s+[A-Za-z0-9._~+/=\-]{8,}    # an Authorization header's credential
    | \b(?:sk|pk|rk)-[A-Za-z0-9_\-]{6,}            # OpenAI, Anthropic (sk-ant-…), Stripe-like
    | \bhf_[A-Za-z0-9]{8,}                         # Hugging Face
    | \b(?:AKIA|ASIA)[0-9A-Z]{12,}                 # AWS access key ids
    | \bAIza[0-9A-Za-z_\-]{20,}                    # Google API keys
    | \bgh[pousr]_[A-Za-z0-9]{16,}                 # GitHub tokens
    | \bxox[abposr]-[A-Za-z0-9\-]{8,}              # Slack tokens
    """
)
_LONG_TOKEN = re.compile(r"[A-Za-z0-9_+/]{32,}={0,2}")
"""A run that may be an opaque token (base64, hex): hidden when it mixes letters and digits, so
a model name (its ``-`` ends the run) or a path without digits stays readable."""
_ASSIGNED = re.compile(
    r"""(?ix)
    ( (?:api[_-]?key|x-api-key|authorization|access[_-]?token|auth[_-]?token|token|secret
        |password|passwd|credential[s]?)
      ["']? \s* [:=] \s* ["']? )
    [^\s"',;}&]+
    """
)
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^\s/@:]*):[^\s@/]*@")


def worker_secrets(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The values this process holds that must never be shown: its provider credentials and its
    signing secrets (each comma-separated key), longest first."""
    env = os.environ if env is None else env
    values = [env.get(name, "") for name in held_keys(env)]
    for name in SIGNING_SECRETS:
        values += env.get(name, "").split(",")
    return _longest_first(values)


def _longest_first(values: Iterable[str | None]) -> tuple[str, ...]:
    kept = {v.strip() for v in values if v and len(v.strip()) >= MIN_SECRET_CHARS}
    return tuple(sorted(kept, key=len, reverse=True))


def scrub(text: str, known: Iterable[str | None] = ()) -> str:
    """``text`` with the worker's own secrets (:func:`worker_secrets`, and ``known``), well-known
    key shapes, ``Bearer``/``Basic`` credentials and URL passwords replaced by ``***``: for any
    error text a manager may read. Ordinary text (ids, digests, field names) is left alone."""
    for value in _longest_first((*known, *worker_secrets())):
        text = text.replace(value, SHOWN)
    text = _URL_PASSWORD.sub(rf"\1:{SHOWN}@", text)
    return _KEY_SHAPES.sub(SHOWN, text)


def scrub_provider(text: str, known: Iterable[str | None] = ()) -> str:
    """:func:`scrub`, and also the value of every ``key=``/``Authorization:`` pair and every
    long run of letters and digits: for text a provider wrote, where hiding a request id costs
    nothing."""
    text = _ASSIGNED.sub(rf"\1{SHOWN}", scrub(text, known))
    return _LONG_TOKEN.sub(_opaque, text)


def _opaque(match: re.Match[str]) -> str:
    run = match.group(0)
    mixed = any(c.isdigit() for c in run) and any(c.isalpha() for c in run)
    return SHOWN if mixed else run


def provider_error(exc: BaseException, known: Iterable[str | None] = ()) -> str:
    """A failed provider call for a manager to read: ``AuthenticationError (HTTP 401): <the
    provider's message, scrubbed, at most MAX_PROVIDER_MESSAGE characters>``. ``known``: the
    key the call carried, when the caller knows it."""
    status = getattr(exc, "status_code", None)
    where = f" (HTTP {status})" if isinstance(status, int) else ""
    text = scrub_provider(one_line(exc), known)
    if len(text) > MAX_PROVIDER_MESSAGE:
        text = text[: MAX_PROVIDER_MESSAGE - 3] + "..."
    return f"{type(exc).__name__}{where}: {text}" if text else f"{type(exc).__name__}{where}"
