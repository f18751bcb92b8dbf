"""Provider API keys, and how litellm is loaded and called.

A configured model whose key is missing is a configuration error, never a reason to fall back
to the heuristic critic (docs/llm.md, "Which models a submission may name, and where the key
goes").

litellm knows which environment variables each provider reads (``OPENAI_API_KEY``,
``ANTHROPIC_API_KEY``, ``AWS_ACCESS_KEY_ID`` …) and names the missing ones
(``litellm.validate_environment``). ``CRITIQUE_LLM_API_KEY`` — the product's own variable —
belongs to the providers of the models the operator configured (``model``, ``paired_model``,
``allowed_models``: :func:`configured_models`, :func:`pipeline.security.model_policy.key_scope`): it
counts as a key for those providers only, and a call to another provider never carries it
(:class:`pipeline.llm.completion.LiteLLMCompleter`). ``llm.api_base`` counts where litellm says an
address is what the provider needs (e.g. ``ollama``). litellm is imported only when there is a model
to check, so commands without one stay fast. A variable set to the empty string counts as set
(litellm's rule).

Where it is checked:

- ``critique worker``, at start: every model the worker's own configuration names
  (:func:`configured_models`); exit 2 naming the variable;
- ``critique submit``, before anything is enqueued: the models the submissions would call
  (:func:`llm_models`), against the *client's* environment — the best information a client
  has, since the workers' environment cannot be seen from it (``--no-key-check`` when only the
  workers hold the keys);
- on a worker, before every litellm call (:class:`pipeline.llm.completion.LiteLLMCompleter`): the
  stage fails permanently with the same message (the chain ends ``failed``, never a silent heuristic
  verdict).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from pipeline import settings
from pipeline.config import CritiqueConfig
from pipeline.errors import ConfigError
from pipeline.security.model_policy import in_key_scope, key_scope

_log = logging.getLogger(__name__)


def llm_models(config: CritiqueConfig, submission_model: str | None) -> tuple[str, ...]:
    """The litellm models a submission whose own model is ``submission_model`` would call
    under ``config``: the LLM critic's (and the adjudicator's, with ``paired_critic``) when an
    LLM critiques it, and the repair model when an LLM repairs it (the pairing of
    :func:`pipeline.wiring.pick_reviser`). Empty for token-free configurations."""
    models: list[str] = []
    if config.uses_llm_critic(submission_model):
        critic = config.critic_model(submission_model)
        if critic:
            models.append(critic)
            if config.paired_critic:
                models.append(config.paired_model or critic)
    if _repairs_with_llm(config, submission_model):
        repair = submission_model or config.model
        if repair:
            models.append(repair)
    return tuple(dict.fromkeys(models))


def _repairs_with_llm(config: CritiqueConfig, submission_model: str | None) -> bool:
    if config.repairer == "llm":
        return True
    if config.repairer != "auto":
        return False  # the deterministic reviser, or a module:function the operator owns
    if config.critic in ("auto", "llm"):
        return config.uses_llm_critic(submission_model)
    if config.critic == "command":
        return config.critic_model(submission_model) is not None
    return False


def configured_models(config: CritiqueConfig) -> tuple[str, ...]:
    """Every model a worker's own configuration names (``model``, ``paired_model``,
    ``allowed_models``): the operator named them, so each must be callable."""
    named = [config.model, config.paired_model, *config.allowed_models]
    return tuple(dict.fromkeys(m for m in named if m))


def missing_keys(
    model: str,
    *,
    api_base: str | None = None,
    api_key: str | None = None,
    key_models: Iterable[str] | None = None,
) -> tuple[str, ...]:
    """The environment variables ``model``'s provider needs and this process lacks, as litellm
    names them; ``()`` when its keys are there, ``api_key`` is given, ``CRITIQUE_LLM_API_KEY``
    is set and ``model``'s provider is one of ``key_models``' (None: any provider, a client's
    estimate), or litellm cannot tell (an unknown provider: the call reports its own error)."""
    key = api_key
    if key is None and (key_models is None or in_key_scope(model, key_scope(key_models))):
        key = settings.raw(settings.LLM_API_KEY)
    if key:
        return ()
    litellm = load_litellm()
    try:
        info = litellm.validate_environment(model=model, api_base=api_base)
    except Exception:  # litellm could not parse the model name: nothing to say about keys
        return ()
    missing = info.get("missing_keys") if isinstance(info, dict) else None
    if not missing or info.get("keys_in_environment"):
        return ()
    return tuple(str(k) for k in missing)


def check_keys(
    models: Iterable[str],
    *,
    api_base: str | None = None,
    api_key: str | None = None,
    key_models: Iterable[str] | None = None,
    where: str = "this environment",
) -> None:
    """Raise :class:`ConfigError` naming the first model whose provider key is missing and the
    variable(s) to set (``key`` = the first variable). ``where`` says whose environment it is;
    ``key_models`` scopes ``CRITIQUE_LLM_API_KEY`` as in :func:`missing_keys`."""
    scope = None if key_models is None else tuple(key_models)
    for model in models:
        missing = missing_keys(model, api_base=api_base, api_key=api_key, key_models=scope)
        if missing:
            names = " and ".join(missing)
            shown = model if len(model) <= 100 else model[:100] + "…"
            raise ConfigError(
                f"model {shown!r} needs {names}, which {'is' if len(missing) == 1 else 'are'} "
                f"not set in {where}",
                key=missing[0],
                hint=f"set {names} (or {settings.LLM_API_KEY.name}, sent to the configured "
                "models' providers) "
                "where the workers run, or configure another model",
            )


def load_litellm() -> Any:
    """Import litellm quietly: offline cost map, no telemetry, no debug banners, no per-call
    INFO logs (idempotent; a worker on an LLM queue calls it while it starts)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm: Any = importlib.import_module("litellm")
    litellm.telemetry = False
    litellm.suppress_debug_info = True
    litellm.set_verbose = False
    # Token counts (the repair budget) must never download a tokenizer from inside a task:
    # models without a bundled one are counted with tiktoken (and never below chars / 4).
    litellm.disable_hf_tokenizer_download = True
    # Nothing of a call (messages, replies) is kept for logging callbacks, and litellm's
    # per-call INFO lines (a record and a handler run on every call, in a worker at INFO)
    # are off: its warnings and errors still show.
    litellm.turn_off_message_logging = True
    for name in LITELLM_LOGGERS:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.WARNING:
            logger.setLevel(logging.WARNING)
    return litellm


WARM_UP_MESSAGES = ({"role": "user", "content": "warm-up"},)
"""What :func:`warm_up` counts and sends to litellm's mock (never to a provider)."""


def warm_up(models: Iterable[str]) -> None:
    """Load litellm and what its first calls would otherwise load inside the tasks: the
    tokenizer of each model in ``models`` (litellm's default one when none is named: what it
    counts an unknown model with) and the modules litellm imports on its first completion.

    Measured on the LLM-bound bench: without it, a worker's first repairs built the tokenizer
    once per thread that reached it at the same moment, and the first calls imported a few dozen
    modules: ~1 s of CPU per worker process inside its first tasks (bench/README.md). The
    completion is litellm's own mock (``mock_response``: no request leaves the process), run in
    :func:`call_scope`; it is skipped when a success callback is configured, which would record
    a call that never was. Nothing here may stop a worker: a model litellm cannot count, or a
    litellm whose mock differs, only leaves that part cold."""
    litellm = load_litellm()
    named = list(dict.fromkeys(m for m in models if m)) or ["openai/critique-warm-up"]
    messages = [dict(m) for m in WARM_UP_MESSAGES]
    for model in named:
        try:
            litellm.token_counter(model=model, messages=messages)
        except Exception as exc:  # a cold tokenizer is slower, never an error
            _log.debug("no warm tokenizer for %s: %s", model, exc)
    if success_callbacks_configured(litellm):
        return
    try:
        with call_scope(litellm):
            litellm.completion(model=named[0], messages=messages, mock_response="ok")
    except Exception as exc:  # the first real call loads it instead
        _log.debug("litellm's completion path not warmed: %s", exc)


LITELLM_LOGGERS = ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy")
"""litellm's loggers, held at WARNING (it logs every call at INFO)."""

SUCCESS_CALLBACK_LISTS = ("callbacks", "success_callback", "_async_success_callback")
"""litellm's module-level lists whose entries receive a finished call (its success handler
reads them; ``callbacks`` is copied into the others when a call starts)."""


def success_callbacks_configured(litellm: Any) -> bool:
    """Whether anything in this process receives litellm's record of a successful call: an
    entry in any of :data:`SUCCESS_CALLBACK_LISTS` (an operator's Langfuse, OpenTelemetry …)."""
    return any(getattr(litellm, name, None) for name in SUCCESS_CALLBACK_LISTS)


def call_scope(litellm: Any | None) -> contextlib.AbstractContextManager[Any]:
    """The scope one ``litellm.completion`` runs in.

    With no success callback configured, litellm's success handler would still build its
    logging payload and redact the messages from it (``turn_off_message_logging``), on its
    logging thread pool, for no one: about 2 ms of CPU per call, a fifth of the call.
    The call then runs in litellm's scope for calls whose caller does the logging and billing
    itself (``internal_sub_call``): this is such a caller, the reply's usage and cost go into
    the result, and the request, its HTTP client, timeouts, error mapping and the response
    parsing are unchanged. With any callback configured, the call is an ordinary one, so the
    callback still sees it (with its messages redacted). A litellm without that scope: always
    ordinary.
    """
    if litellm is None:  # a test's completion: litellm is not even loaded
        return contextlib.nullcontext()
    scope = _quiet_scope()
    if scope is None or success_callbacks_configured(litellm):
        return contextlib.nullcontext()
    return scope()


_QUIET_SCOPE: list[Callable[[], contextlib.AbstractContextManager[Any]] | None] = []
"""litellm's ``internal_sub_call`` once looked up (``[None]``: this litellm has none)."""


def _quiet_scope() -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    if not _QUIET_SCOPE:
        try:
            from litellm._internal_context import internal_sub_call
        except ImportError:  # another litellm: every call takes the ordinary path
            _QUIET_SCOPE.append(None)
        else:
            _QUIET_SCOPE.append(internal_sub_call)
    return _QUIET_SCOPE[0]
