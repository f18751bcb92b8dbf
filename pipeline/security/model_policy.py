"""Which models a submission may make the worker call, and where the product's key may go
(docs/security.md, 'Models, addresses and keys'; issue 28, item 3).

A model name chooses more than a model: litellm routes ``ollama/x`` to ``localhost:11434``,
``llamafile/x`` to ``127.0.0.1:8080``, ``bedrock/x`` through the worker's AWS credentials and
``huggingface/https://host/v1`` to that host. So a model that a *submission* names (its own
``model``, or a ``model`` / ``paired_model`` override) and the operator did not list in
``allowed_models`` is refused (:func:`model_refusal`) when

1. the worker holds an API key (:func:`held_keys`): then only ``allowed_models`` may be named;
2. the name carries an address or a path (:func:`carries_address`);
3. its provider is not a hosted one (:data:`HOSTED_PROVIDERS`): a local or self-hosted server
   (:data:`LOCAL_PROVIDERS`) is allowed only when the operator configured its endpoint
   (``llm.api_base`` or the provider's own base variable); a provider that signs in with the
   worker's ambient credentials or runs on the worker itself (:data:`AMBIENT_PROVIDERS`), an
   unknown prefix or no prefix at all is refused.

``CRITIQUE_LLM_API_KEY`` (:data:`pipeline.settings.LLM_API_KEY`) belongs to the providers of
the models the operator configured (:func:`key_scope`, used by
:class:`pipeline.llm.completion.LiteLLMCompleter`). Pure: names and the environment only, no litellm
(``tests/unit/test_provider_keys.py`` pins these tables against litellm's own provider list).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from pipeline import settings

KEY_SUFFIXES: tuple[str, ...] = (
    "_API_KEY",
    "_APIKEY",
    "_API_TOKEN",
    "_TOKEN",
    "_ACCESS_KEY",
    "_ACCESS_KEY_ID",
    "_SECRET_ACCESS_KEY",
    "_SECRET_KEY",
    "_CLIENT_SECRET",
)
"""Name endings of variables that hold a provider credential (``OPENAI_API_KEY``,
``HF_TOKEN``, ``AWS_ACCESS_KEY_ID``, ``WATSONX_APIKEY``, ``AZURE_CLIENT_SECRET`` …)."""

KEY_NAMES: frozenset[str] = frozenset(
    {
        "GOOGLE_APPLICATION_CREDENTIALS",
        "VERTEXAI_CREDENTIALS",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_NAME",
        "AZURE_AD_TOKEN",
    }
)
"""Credential variables whose names do not end like a key."""

HOSTED_PROVIDERS: frozenset[str] = frozenset(
    {
        "ai21",
        "ai21_chat",
        "anthropic",
        "baseten",
        "cerebras",
        "codestral",
        "cohere",
        "cohere_chat",
        "dashscope",
        "deepinfra",
        "deepseek",
        "featherless_ai",
        "fireworks_ai",
        "friendliai",
        "gemini",
        "github",
        "groq",
        "huggingface",
        "hyperbolic",
        "jina_ai",
        "lambda_ai",
        "meta_llama",
        "mistral",
        "moonshot",
        "nebius",
        "novita",
        "nvidia_nim",
        "openai",
        "openrouter",
        "perplexity",
        "replicate",
        "sambanova",
        "text-completion-openai",
        "together_ai",
        "voyage",
        "xai",
        "zai",
    }
)
"""Providers a submission may name without ``allowed_models`` (on a worker that holds no key):
public hosted APIs, reached at litellm's default https endpoint or at the operator's
``llm.api_base``."""

LOCAL_PROVIDERS: Mapping[str, tuple[str, ...]] = {
    "custom": (),
    "custom_openai": (),
    "docker_model_runner": ("DOCKER_MODEL_RUNNER_API_BASE",),
    "hosted_vllm": ("HOSTED_VLLM_API_BASE",),
    "infinity": ("INFINITY_API_BASE",),
    "langflow": ("LANGFLOW_API_BASE",),
    "langgraph": ("LANGGRAPH_API_BASE",),
    "lemonade": ("LEMONADE_API_BASE",),
    "litellm_proxy": ("LITELLM_PROXY_API_BASE",),
    "llamafile": ("LLAMAFILE_API_BASE",),
    "lm_studio": ("LM_STUDIO_API_BASE",),
    "ollama": ("OLLAMA_API_BASE",),
    "ollama_chat": ("OLLAMA_API_BASE",),
    "oobabooga": (),
    "openai_like": ("OPENAI_LIKE_API_BASE",),
    "ragflow": ("RAGFLOW_API_BASE",),
    "triton": (),
    "xinference": ("XINFERENCE_API_BASE",),
}
"""Local or self-hosted servers (litellm's default address is on the worker's own machine, or
there is none) → the variables that configure their endpoint besides ``llm.api_base``."""

AMBIENT_PROVIDERS: frozenset[str] = frozenset(
    {
        "amazon_nova",
        "azure",
        "azure_text",
        "bedrock",
        "bedrock_mantle",
        "chatgpt",
        "databricks",
        "gdc",
        "github_copilot",
        "oci",
        "petals",
        "sagemaker",
        "sagemaker_chat",
        "sagemaker_nova",
        "sap",
        "snowflake",
        "vertex_ai",
        "vertex_ai_beta",
        "vllm",
        "watsonx",
        "watsonx_text",
    }
)
"""Providers that sign in with the worker's own credentials (cloud SDK chains, instance
metadata, token files, device logins) or run the model inside the worker: never chosen by a
submission, only listed by the operator."""

_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,199}")
ALLOWED_MODELS_ENV = "CRITIQUE_ALLOWED_MODELS"
ALLOW_HINT = f"the operator may list it in allowed_models ({ALLOWED_MODELS_ENV})"


def is_key_var(name: str) -> bool:
    """True when an environment variable named ``name`` holds an LLM provider credential
    (``CRITIQUE_LLM_API_KEY``, or a name like one; other ``CRITIQUE_*`` variables are not)."""
    if name == settings.LLM_API_KEY.name:
        return True
    if name.startswith("CRITIQUE_"):
        return False
    return name in KEY_NAMES or name.endswith(KEY_SUFFIXES)


def held_keys(env: Mapping[str, str]) -> tuple[str, ...]:
    """The credential variables set (non-empty) in ``env``, ``CRITIQUE_LLM_API_KEY`` first."""
    names = sorted(n for n, v in env.items() if v and is_key_var(n))
    return tuple(sorted(names, key=lambda n: n != settings.LLM_API_KEY.name))


def provider_of(model: str) -> str:
    """The provider prefix of a litellm model name (``ollama`` for ``ollama/llama3``); ``""``
    when the name has none (litellm would guess the provider from the model)."""
    prefix, sep, _ = model.partition("/")
    return prefix if sep else ""


def key_scope(models: Iterable[str]) -> frozenset[str]:
    """Where ``CRITIQUE_LLM_API_KEY`` goes: the providers of ``models`` (an unprefixed name
    stands for itself alone)."""
    return frozenset(provider_of(m) or m for m in models)


def in_key_scope(model: str, scope: frozenset[str]) -> bool:
    """True when a call to ``model`` may carry ``CRITIQUE_LLM_API_KEY`` under ``scope``."""
    return (provider_of(model) or model) in scope


def carries_address(model: str) -> bool:
    """True when ``model`` could name an address or a path rather than a model: a scheme
    (``://``), ``//``, ``..``, or a character outside letters, digits and ``. _ : @ + / -``."""
    if "//" in model or ".." in model:
        return True
    return _MODEL_NAME.fullmatch(model) is None


def _shown(value: str) -> str:
    return repr(value if len(value) <= 100 else value[:100] + "…")


def model_refusal(
    model: str,
    *,
    allowed: tuple[str, ...],
    api_base: str | None,
    env: Mapping[str, str],
) -> str | None:
    """Why a submission may not name ``model`` on a worker with these ``allowed_models``,
    ``llm.api_base`` and environment, completing "model '…' …"; None when it may."""
    if model in allowed:
        return None
    if allowed:
        return f"is not in the worker's allowed_models {list(allowed)}"
    held = held_keys(env)
    if held:
        return (
            f"is not in the worker's allowed_models, which is empty while an API key is set "
            f"({held[0]}); set allowed_models ({ALLOWED_MODELS_ENV}) on the worker to "
            "the models a submission may name"
        )
    if carries_address(model):
        return (
            "carries an address or a path, not a model name (use a litellm name such as "
            "'openai/gpt-4o-mini'; the endpoint is the operator's llm.api_base)"
        )
    provider = provider_of(model)
    if provider in HOSTED_PROVIDERS:
        return None
    if provider in LOCAL_PROVIDERS:
        bases = LOCAL_PROVIDERS[provider]
        if api_base or any(env.get(b) for b in bases):
            return None
        where = " or ".join(("llm.api_base", *bases))
        return (
            f"is served by {provider!r}, a local or self-hosted server, and the operator "
            f"configured no endpoint for it ({where}); {ALLOW_HINT}"
        )
    if provider in AMBIENT_PROVIDERS:
        return (
            f"uses {provider!r}, which signs in with the worker's own credentials or runs on "
            f"the worker itself; {ALLOW_HINT}"
        )
    what = (
        f"has the prefix {_shown(provider)}, not a hosted provider a submission may choose"
        if provider
        else "names no provider"
    )
    return f"{what} (use 'provider/model', e.g. 'openai/gpt-4o-mini'); {ALLOW_HINT}"
