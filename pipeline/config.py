"""Configuration: the AWP workflow block → one typed, validated, frozen object.

Sources, later ones win: defaults < ``workflow.awp.yaml``
(``orchestration.delegation_loop.critique`` and ``observability.output_contract``)
< environment (``CRITIQUE_<FIELD>``, nested fields with a double underscore:
``CRITIQUE_RUBRIC__TARGET_SCORE``) < explicit overrides (the client's).

The trust boundary (docs/security.md, 'Who may set what'): the workflow file and the environment are
the operator's; overrides that come with a *submission* (the client's config, ``critique submit
--set``, a stage message's ``config``) are the manager's request and may only set policy.
:data:`WORKER_ONLY` lists the fields that reach a network address, a secret or code, and
:func:`check_submission_overrides` refuses a submission that sets one (or passes the worker's
limits) before anything is built from it.

An unknown key or a bad value raises :class:`~pipeline.errors.ConfigError` naming the key and
what is allowed. Nothing here reads the network or imports heavy libraries.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline import settings
from pipeline.errors import ConfigError, RefusedOverrideError, did_you_mean
from pipeline.models import DEFAULT_DEFECT_CATEGORIES
from pipeline.security.model_policy import model_refusal

BUILTIN_CHECK_NAMES: tuple[str, ...] = (
    "no_placeholder",
    "no_text_loop",
    "file_size_delta",
    "no_duplicate_headings",
    "balanced_delimiters",
    "json_valid_if_claimed",
)
"""The built-in Layer-0 checks by name, in the order they run (``pipeline.contract.checks``
implements them and refuses to import if its registry ever differs from this list)."""

RUBRIC_DIMENSIONS: tuple[str, ...] = (
    "clarity",
    "novelty",
    "evidence",
    "methodology",
    "related_work",
)

ENV_PREFIX = "CRITIQUE_"
ENV_NON_FIELDS: frozenset[str] = settings.NAMES
"""Variables that share the prefix but are not configuration fields: :mod:`pipeline.settings`."""


class _Block(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RubricConfig(_Block):
    """The rubric critic's dimensions and convergence rules."""

    dimensions: tuple[str, ...] = RUBRIC_DIMENSIONS
    weights: dict[str, float] | None = None
    target_score: float = Field(8.0, ge=0.0, le=10.0)
    plateau_epsilon: float = Field(0.1, ge=0.0)
    plateau_window: int = Field(2, ge=1)
    max_rounds: int = Field(5, ge=1)

    @model_validator(mode="after")
    def _weights_match(self) -> RubricConfig:
        if not self.dimensions:
            raise ValueError("rubric.dimensions must name at least one dimension")
        if self.weights is not None:
            unknown = sorted(set(self.weights) - set(self.dimensions))
            if unknown:
                raise ValueError(
                    f"rubric.weights names unknown dimension(s) {unknown}; "
                    f"allowed: {list(self.dimensions)}"
                )
            if any(w < 0 for w in self.weights.values()):
                raise ValueError("rubric.weights must be ≥ 0")
            if sum(self.weights.get(d, 1.0) for d in self.dimensions) <= 0:
                raise ValueError("rubric.weights must not all be zero")
        return self

    def weight(self, dimension: str) -> float:
        """Weight of a dimension (1.0 when no weights are configured or it is not listed)."""
        if self.weights is None:
            return 1.0
        return self.weights.get(dimension, 1.0)


class BudgetConfig(_Block):
    """The run's total token budget; repairs may spend ``repair_budget_fraction`` of it."""

    total_tokens: int | None = Field(None, ge=1)
    wait_s: float = Field(60.0, ge=0.0, le=3600.0)
    """How long a repair whose reservation fits what is left of the cap once held tokens settle
    waits for them, instead of being refused (most held tokens come back at commit); a worker waits
    at most half its soft time limit. 0: refuse at once. A submission may lower it, never raise
    it."""
    size_from_usage: bool = True
    """When a repair round's full reservation would pass the cap, size it from what the run's
    committed repairs really used (their largest growth and re-critique reply, with a margin)
    and make its calls within that smaller reservation, instead of refusing it
    (docs/pipeline.md, "The repair budget"). False: refuse, as the full bound says."""


class RateLimit(_Block):
    """A cluster-wide LLM rate limit: requests and tokens per minute, one Redis
    bucket per model shared by every worker process (:mod:`pipeline.store.ratelimit`)."""

    rpm: int | None = Field(None, gt=0)
    """Requests per minute (None: no request limit)."""
    tpm: int | None = Field(None, gt=0)
    """Tokens per minute, counted at reservation: the prompt's tokens + the call's max_tokens."""
    burst_s: float = Field(1.0, gt=0, le=60)
    """Bucket depth in seconds of the rate: how far a quiet fleet may burst ahead (at rpm 120
    and 1 s, 2 requests at once). A single call over the token depth waits for a full bucket."""
    max_wait_s: float = Field(120.0, ge=0)
    """How long a call may wait for its slot; past that it fails as a transient LLM error."""


RateLimits = RateLimit | dict[str, RateLimit]


class LLMConfig(_Block):
    """How LLM calls are made through litellm (critic, repairer, adjudicator)."""

    api_base: str | None = None
    """Endpoint override, e.g. ``http://127.0.0.1:8000/v1`` for an OpenAI-compatible server."""
    timeout_s: float = Field(60.0, gt=0)
    """Per-call timeout."""
    max_retries: int = Field(3, ge=0)
    """Retries after the first call, for transient errors only (timeout, 429, 5xx, connection)."""
    backoff_s: float = Field(1.0, ge=0)
    """First retry delay; doubles each retry, with full jitter, up to ``backoff_max_s``."""
    backoff_max_s: float = Field(20.0, ge=0)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    max_tokens: int = Field(2048, ge=1)
    """Cap on each reply's tokens (a repair of a long output needs more: raise it)."""
    recritique_max_tokens: int = Field(512, ge=1)
    """Cap on a re-critique's reply (the critique of a repaired output, at most ``max_tokens``):
    an envelope of a few hundred tokens. A repair round reserves this for it, not the whole
    ``max_tokens``, and the critic is told the limit; raise it if re-critiques of outputs with
    many defects come back cut (their notes say "critic fallback … unparseable")."""
    max_output_chars: int = Field(24_000, ge=1000)
    """Outputs longer than this reach the critic cut to head (3/4) + tail (1/4), and say so."""
    rate_limit: RateLimits | None = None
    """Cluster-wide limits: ``{rpm, tpm}`` for every model, or per model
    ``{model: {rpm, tpm}}`` (key ``"*"``: every model not named). Worker-only."""

    def rate_limit_for(self, model: str) -> RateLimit | None:
        """The limit that applies to calls to ``model`` (None: unlimited)."""
        limits = self.rate_limit
        if limits is None or isinstance(limits, RateLimit):
            return limits
        return limits.get(model, limits.get("*"))


class CacheConfig(_Block):
    """``cache``: identical outputs critiqued once, the envelope kept in Redis."""

    enabled: bool = False
    ttl_s: int = Field(86_400, gt=0)
    """How long a cached critique lives."""
    lock_s: float = Field(120.0, gt=0)
    """How long the first of several concurrent identical critiques holds the others off (they
    wait for its envelope, then critique themselves if none came)."""


class ExtraCheck(_Block):
    """A workflow-specific Layer-0 check: ``{name, implementation: "module:Callable"}``."""

    name: str = Field(min_length=1)
    implementation: str

    @field_validator("implementation")
    @classmethod
    def _module_callable(cls, v: str) -> str:
        module, sep, attr = v.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"implementation {v!r} must look like 'package.module:Callable'")
        return v


class OutputContractConfig(_Block):
    """``observability.output_contract``: which Layer-0 checks run."""

    checks: tuple[str, ...] = ("default",)
    extra: tuple[ExtraCheck, ...] = ()


REPAIRER_NAMES = ("auto", "llm", "deterministic", "worker")
"""The named repair strategies (policy: a submission may pick one); anything else is a
``package.module:function`` (worker-only code)."""


class CritiqueConfig(_Block):
    """``orchestration.delegation_loop.critique`` plus the output contract
    (docs/configuration.md)."""

    enabled: bool = True
    """On unless the operator's or the submission's configuration turns it off explicitly (AWP's
    own default is false; a service exists to check). Off: outputs end ``unchecked``."""
    mode: Literal["inline", "dedicated"] = "inline"
    model: str | None = None
    max_repair_attempts: int = Field(2, ge=0)
    repair_budget_fraction: float = Field(0.15, ge=0.0, le=1.0)
    min_score_to_complete: float = Field(0.6, ge=0.0, le=1.0)
    pattern_memory: bool = True
    defect_categories: tuple[str, ...] = DEFAULT_DEFECT_CATEGORIES
    critic: Literal["auto", "llm", "heuristic", "rubric", "command"] = "auto"
    repairer: str = "auto"
    """``auto`` | ``llm`` | ``deterministic`` | ``worker`` | ``package.module:function``.
    ``worker``: the service repairs nothing itself; a due repair ends the pass ``worker_repair``
    and the manager re-runs its worker (docs/client.md, "The worker repairs")."""
    rubric: RubricConfig = Field(default_factory=RubricConfig)
    command: tuple[str, ...] = ()
    """argv of a test/lint command for code outputs (command critic)."""
    command_timeout_s: float = Field(60.0, gt=0)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    """Worker-only: the critique cache (docs/llm.md, 'Critique cache')."""
    paired_critic: bool = False
    """A second critic call adjudicates the first one's defects before repair."""
    paired_model: str | None = None
    """The adjudicator's model; null uses the critic's."""
    allowed_models: tuple[str, ...] = ()
    """Worker-only: the models a submission may name (``model``, ``paired_model``, the
    submission's own ``model``). Empty, on a worker that holds no API key, allows a hosted
    provider's model only (:mod:`pipeline.security.model_policy`); empty on a worker that holds one
    allows none."""
    max_output_bytes: int = Field(16 * 1024 * 1024, ge=1)
    max_rejected_completions: int = Field(3, ge=1)
    output_contract: OutputContractConfig = Field(default_factory=OutputContractConfig)

    @field_validator("repairer")
    @classmethod
    def _repairer(cls, v: str) -> str:
        if v in REPAIRER_NAMES:
            return v
        module, sep, attr = v.partition(":")
        if sep and module and attr:
            return v
        raise ValueError(
            f"repairer {v!r} is not allowed; use 'auto', 'llm', 'deterministic', 'worker' or "
            "'package.module:function'"
        )

    @field_validator("defect_categories")
    @classmethod
    def _categories(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("defect_categories must not be empty")
        return v

    @model_validator(mode="after")
    def _dedicated_needs_model(self) -> CritiqueConfig:
        if self.mode == "dedicated" and not self.model:
            raise ValueError(
                "mode 'dedicated' needs 'model' (the critic's litellm model name, "
                "e.g. 'openai/gpt-4o-mini'); use mode 'inline' to critique with the worker's model"
            )
        return self

    def critic_model(self, worker_model: str | None) -> str | None:
        """The critic's litellm model for a submission: ``dedicated`` → ``model``; ``inline`` →
        ``model``, else the worker's own model; None when there is no model at all."""
        if self.mode == "dedicated":
            return self.model
        return self.model or worker_model or None

    def uses_llm_critic(self, worker_model: str | None) -> bool:
        """True when a submission with ``worker_model`` is critiqued by an LLM
        (``auto`` means the LLM when a model resolves, else the heuristic)."""
        if self.critic == "llm":
            return True
        return self.critic == "auto" and self.critic_model(worker_model) is not None

    @property
    def repair_token_cap(self) -> int | None:
        """Tokens the whole run may spend on repairs, or None when no total budget is set."""
        if self.budget.total_tokens is None:
            return None
        return int(self.budget.total_tokens * self.repair_budget_fraction)


def _fields_help(model: type[BaseModel]) -> str:
    return ", ".join(sorted(model.model_fields))


def _env_names() -> dict[str, str]:
    """Every ``CRITIQUE_*`` name the product reads, keyed by its name after the prefix:
    configuration fields and the settings of :data:`ENV_NON_FIELDS` (worker, store, tests)."""
    names = {f: f"{ENV_PREFIX}{f.upper()}" for f in CritiqueConfig.model_fields}
    names.update({n[len(ENV_PREFIX) :].lower(): n for n in ENV_NON_FIELDS})
    return names


def _explain(err: ValidationError, prefix: str) -> ConfigError:
    """Turn pydantic's error into one ConfigError naming the first bad key and what is allowed."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if p != "__root__")
    key = f"{prefix}.{loc}" if loc else prefix
    if first["type"] == "extra_forbidden":
        parent: type[BaseModel] = CritiqueConfig
        for part in first["loc"][:-1]:
            field = parent.model_fields.get(str(part))
            ann = field.annotation if field else None
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                parent = ann
        guess = did_you_mean(str(first["loc"][-1]), list(parent.model_fields))
        if guess:
            where = ".".join([prefix, *(str(p) for p in first["loc"][:-1])])
            guess = guess.replace("did you mean ", f"did you mean {where}.", 1)
        return ConfigError(
            f"unknown configuration key {key!r}; {guess}allowed here: {_fields_help(parent)}",
            key=key,
        )
    return ConfigError(f"bad value for {key!r}: {first['msg']}", key=key)


def _dig(doc: Mapping[str, Any], path: tuple[str, ...], source: str) -> dict[str, Any]:
    node: Any = doc
    for part in path:
        if not isinstance(node, Mapping):
            raise ConfigError(f"{source}: {'.'.join(path)} must be a mapping", key=".".join(path))
        node = node.get(part)
        if node is None:
            return {}
    if not isinstance(node, Mapping):
        raise ConfigError(f"{source}: {'.'.join(path)} must be a mapping", key=".".join(path))
    return dict(node)


def read_workflow(path: str | Path) -> dict[str, Any]:
    """Read the two configuration blocks of an AWP workflow file into one flat mapping."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(
            f"cannot read workflow file {str(p)!r}: {exc.strerror}", hint="check the path"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"workflow file {str(p)!r} is not valid YAML: {exc}") from exc
    if not isinstance(doc, Mapping):
        raise ConfigError(f"workflow file {str(p)!r} must hold a mapping at the top level")
    critique = _dig(doc, ("orchestration", "delegation_loop", "critique"), str(p))
    contract = _dig(doc, ("observability", "output_contract"), str(p))
    if contract:
        if "output_contract" in critique:
            raise ConfigError(
                "output_contract is set twice (critique block and observability block)",
                key="observability.output_contract",
            )
        critique["output_contract"] = contract
    return critique


def _parse_env_value(name: str, raw: str) -> Any:
    """Env values: JSON when it parses (numbers, booleans, lists, null), else the raw string."""
    if name in ("command",):
        return shlex.split(raw)
    if name in ("defect_categories", "allowed_models") and not raw.lstrip().startswith("["):
        return [c.strip() for c in raw.split(",") if c.strip()]
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def read_env(env: Mapping[str, str]) -> dict[str, Any]:
    """Collect ``CRITIQUE_*`` variables into a nested mapping; unknown names are errors."""
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name in ENV_NON_FIELDS:
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        top = parts[0]
        if top not in CritiqueConfig.model_fields:
            guess = did_you_mean(name[len(ENV_PREFIX) :], _env_names())
            raise ConfigError(
                f"unknown environment variable {name}; {guess}configuration fields are "
                f"{_fields_help(CritiqueConfig)} (as CRITIQUE_<FIELD>)",
                key=name,
            )
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_env_value(parts[-1], raw)
    return out


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(merged.get(k), Mapping):
            merged[k] = _merge(dict(merged[k]), v)
        else:
            merged[k] = v
    return merged


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> CritiqueConfig:
    """Build the configuration from a workflow file, the environment and overrides.

    ``path`` defaults to ``$CRITIQUE_CONFIG`` when set. ``env`` defaults to ``os.environ``.
    ``overrides`` are trusted here (operator-side uses: ``critique loop``, tests); overrides
    that come with a submission must pass :func:`check_submission_overrides` first.
    """
    environ = os.environ if env is None else env
    if path is None:
        path = settings.raw(settings.CONFIG, environ) or None
    data: dict[str, Any] = read_workflow(path) if path else {}
    source = "orchestration.delegation_loop.critique"
    try:
        if data:
            CritiqueConfig.model_validate(data)
    except ValidationError as exc:
        raise _explain(exc, source) from None
    data = _merge(data, read_env(environ))
    if overrides:
        data = _merge(data, overrides)
    try:
        return CritiqueConfig.model_validate(data)
    except ValidationError as exc:
        raise _explain(exc, "critique") from None


# -- the trust boundary (docs/security.md, 'Who may set what') ---------------------------------


@dataclass(frozen=True)
class WorkerOnly:
    """A field only the operator sets (workflow file or ``CRITIQUE_`` environment).

    ``path`` is dotted and covers everything below it; ``reaches`` says what it reaches (shown
    in the refusal); ``policy_values`` are values of it a submission may still choose.
    """

    path: str
    reaches: str
    policy_values: frozenset[str] = frozenset()


WORKER_ONLY: tuple[WorkerOnly, ...] = (
    # The whole LLM transport: api_base is where the worker sends its API key; timeouts,
    # retries, backoff, temperature, the token / size caps and ``llm.rate_limit`` spend the
    # operator's money and time.
    WorkerOnly("llm", "the LLM endpoint that receives the worker's API key, and its limits"),
    # argv the command critic executes on the worker.
    WorkerOnly("command", "a command the worker executes"),
    # How long the worker lets that command run.
    WorkerOnly("command_timeout_s", "how long the worker's command may run"),
    # ``module:Callable`` extension checks: code the worker imports and calls.
    WorkerOnly("output_contract.extra", "code the worker imports and calls"),
    # A ``module:function`` repairer is code the worker imports and calls; the named
    # strategies are policy.
    WorkerOnly(
        "repairer",
        "a module:function repairer is code the worker imports and calls",
        policy_values=frozenset(REPAIRER_NAMES),
    ),
    # The models the operator allows (and pays for): a submission cannot widen its allowance.
    WorkerOnly("allowed_models", "the models the operator allows"),
    # Where critiques are stored and shared across runs, and for how long.
    WorkerOnly("cache", "where critiques are stored and shared across runs"),
)
"""Fields a submission may never set: they reach a network address, a secret or code."""

POLICY: frozenset[str] = frozenset(
    {
        "enabled",
        "mode",
        "critic",
        "model",  # within the worker's allowed_models, when it sets them
        "paired_model",  # within the worker's allowed_models, when it sets them
        "paired_critic",
        "max_repair_attempts",  # at most the worker's
        "repair_budget_fraction",
        "min_score_to_complete",
        "max_rejected_completions",
        "pattern_memory",
        "defect_categories",
        "rubric",
        "budget",  # budget.wait_s: lower only, at most the worker's
        "max_output_bytes",  # lower only: at most the worker's
        "output_contract.checks",  # built-in checks only
    }
)
"""Fields a submission may set (the manager's policy), within the limits above."""

WORKER_ONLY_WHY = "worker-only (it reaches a network address, a secret or code"


def _env_name(path: str) -> str:
    return ENV_PREFIX + path.upper().replace(".", "__")


def _worker_only(path: str) -> WorkerOnly | None:
    for w in WORKER_ONLY:
        if path == w.path or path.startswith(w.path + "."):
            return w
    return None


def _is_policy(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in POLICY)


def _is_branch(path: str) -> bool:
    """True when declared fields lie below ``path`` (``output_contract``)."""
    below = [w.path for w in WORKER_ONLY] + list(POLICY)
    return any(p.startswith(path + ".") for p in below)


def _is_field(path: str) -> bool:
    """True when ``path`` names a field of :class:`CritiqueConfig` (or a block below one)."""
    model: type[BaseModel] = CritiqueConfig
    for part in path.split("."):
        field = model.model_fields.get(part)
        if field is None:
            return False
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return True
    return True


def _leaf(path: str, value: Any) -> str:
    """The dotted name of the first field ``value`` sets under ``path`` (``llm.api_base``)."""
    while isinstance(value, Mapping) and value:
        key = next(iter(value))
        path, value = f"{path}.{key}", value[key]
    return path


def _refuse_worker_only(path: str, entry: WorkerOnly, value: Any) -> RefusedOverrideError:
    field = _leaf(path, value)
    return RefusedOverrideError(
        f"submission may not set {field!r}: {WORKER_ONLY_WHY}: {entry.reaches}); set it in "
        f"the worker's workflow file or CRITIQUE_ environment ({_env_name(field)})",
        key=field,
    )


def _check_paths(node: Mapping[str, Any], prefix: str) -> None:
    for raw_key, value in node.items():
        path = f"{prefix}{raw_key}"
        entry = _worker_only(path)
        if entry is not None:
            if isinstance(value, str) and value in entry.policy_values:
                continue
            raise _refuse_worker_only(path, entry, value)
        if _is_policy(path):
            continue
        if _is_branch(path):
            if not isinstance(value, Mapping):
                raise RefusedOverrideError(
                    f"submission may not replace {path!r} whole: it holds worker-only fields; "
                    f"set its policy fields one by one (e.g. '{path}.checks')",
                    key=path,
                )
            _check_paths(value, f"{path}.")
            continue
        if _is_field(path):  # a field nobody declared: refused until it is (fail closed)
            raise RefusedOverrideError(
                f"submission may not set {path!r}: it is not declared as policy",
                key=path,
            )
        # not a field at all: load_config names it as an unknown key


def _shown_model(model: str) -> str:
    return model if len(model) <= 100 else model[:100] + "…"


def submitted_model_refusal(
    model: str, worker: CritiqueConfig, env: Mapping[str, str] | None = None
) -> str | None:
    """Why a submission may not name ``model`` (its own, or as ``model`` / ``paired_model``)
    on a worker with configuration ``worker`` and environment ``env`` (default: this
    process's), completing "model '…' …"; None when it may (:mod:`pipeline.security.model_policy`:
    ``allowed_models`` when the worker holds a key; never an address, a local server without
    a configured endpoint, or the worker's own credentials)."""
    return model_refusal(
        model,
        allowed=worker.allowed_models,
        api_base=worker.llm.api_base,
        env=os.environ if env is None else env,
    )


def check_submission_overrides(
    overrides: Mapping[str, Any],
    worker: CritiqueConfig,
    env: Mapping[str, str] | None = None,
) -> None:
    """Refuse configuration overrides a submission may not carry (docs/security.md, 'Who may set
    what').

    ``worker`` is the worker's own configuration (workflow file + environment, no overrides),
    ``env`` its environment (default: this process's). Raises
    :class:`~pipeline.errors.RefusedOverrideError` naming the dotted field for a worker-only
    field (:data:`WORKER_ONLY`), a ``max_repair_attempts``, ``max_output_bytes`` or
    ``budget.wait_s`` above the worker's, a ``model`` / ``paired_model`` the worker does not
    let a submission name (:func:`submitted_model_refusal`), or an ``output_contract.checks``
    entry that is not a built-in; ``ConfigError`` for a value the configuration cannot take.
    Pure: it imports and calls nothing the overrides name.
    """
    if not isinstance(overrides, Mapping):
        raise RefusedOverrideError(
            f"submission configuration must be an object, not {type(overrides).__name__}"
        )
    _check_paths(overrides, "")
    try:
        merged = CritiqueConfig.model_validate(_merge(worker.model_dump(), overrides))
    except ValidationError as exc:
        raise _explain(exc, "critique") from None
    if merged.max_repair_attempts > worker.max_repair_attempts:
        raise RefusedOverrideError(
            f"submission may not set 'max_repair_attempts': max_repair_attempts "
            f"{merged.max_repair_attempts} exceeds the worker's {worker.max_repair_attempts} "
            "(a submission may lower it, never raise it)",
            key="max_repair_attempts",
        )
    if merged.budget.wait_s > worker.budget.wait_s:
        raise RefusedOverrideError(
            f"submission may not set 'budget.wait_s': the repair budget's wait may only be "
            f"lowered (asked for {merged.budget.wait_s:g} s, the worker's is "
            f"{worker.budget.wait_s:g} s)",
            key="budget.wait_s",
        )
    if merged.max_output_bytes > worker.max_output_bytes:
        raise RefusedOverrideError(
            f"submission may not set 'max_output_bytes': max_output_bytes may only be lowered "
            f"(asked for {merged.max_output_bytes}, the worker's is {worker.max_output_bytes})",
            key="max_output_bytes",
        )
    for field in ("model", "paired_model"):
        model = getattr(merged, field)
        if field not in overrides or model is None:
            continue
        reason = submitted_model_refusal(model, worker, env)
        if reason is not None:
            raise RefusedOverrideError(
                f"submission may not set {field!r}: model {_shown_model(model)!r} {reason}",
                key=field,
            )
    if "output_contract" in overrides:
        for name in merged.output_contract.checks:
            if name != "default" and name not in BUILTIN_CHECK_NAMES:
                raise RefusedOverrideError(
                    f"submission may not set 'output_contract.checks': {name[:100]!r} is not "
                    f"a built-in check (allowed: default, {', '.join(BUILTIN_CHECK_NAMES)})",
                    key="output_contract.checks",
                )


def check_submission_model(
    model: str | None, worker: CritiqueConfig, env: Mapping[str, str] | None = None
) -> None:
    """Refuse a submission whose own ``model`` (the worker's model, which the inline critic and
    the repairer call) the worker does not let a submission name (:func:`submitted_model_refusal`:
    outside ``allowed_models`` when those are set or the worker holds a key, an address, a
    local server without a configured endpoint, the worker's own credentials)."""
    if model is None:
        return
    reason = submitted_model_refusal(model, worker, env)
    if reason is not None:
        raise RefusedOverrideError(
            f"submission's model {_shown_model(model)!r} {reason}", key="submission.model"
        )
