"""The composition root: a :class:`~pipeline.config.CritiqueConfig` in, the objects the loop
runs with out.

Everything that turns configuration into behaviour is here, and only here:

- the critic (:func:`pick_critic`) and the reviser (:func:`pick_reviser`) that ``critique.critic``
  and ``critique.repairer`` name, including the ``auto`` wrappers (:class:`AutoCritic`,
  :class:`AutoReviser`) that pick per submission and a configured ``package.module:function``
  repairer (:func:`load_reviser`);
- the completer the LLM critics and revisers call (:func:`default_completer`: litellm, behind
  the retry policy; :func:`rate_limited_completer`: the same behind a cluster-wide rate limit);
- the real Layer-0 step (:func:`contract_l0`) and fixpoint test (:func:`simhash_fixpoint`);
- the stores: in memory by default (:func:`make_context`), on Redis for a worker
  (:class:`RedisStores`);
- the stage context that holds them all (:func:`make_context`).

:mod:`pipeline.loop.stages` holds only the stages and the loop and imports nothing from here.
Nothing heavy is imported at module level: litellm, the LLM critics, the contract suite, the
simhash scanner and the Redis stores load inside the functions that build them, so
``import pipeline.wiring`` needs neither redis nor litellm.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.config import CritiqueConfig
from pipeline.contract import check_submission
from pipeline.critics.base import Critic, Planner, Reviser, RevisionResult
from pipeline.critics.heuristic import HeuristicCritic, HeuristicReviser
from pipeline.critics.llm import LLMCritic, PairedCritic
from pipeline.critics.rubric import DeterministicReviser, RubricCritic
from pipeline.critics.worker import WorkerReviser
from pipeline.errors import ExtensionLoadError
from pipeline.llm.completion import Completer, LiteLLMCompleter
from pipeline.llm.providers import configured_models
from pipeline.loop.stages import (
    REPAIR_LEASE_TTL_S,
    FixpointFn,
    L0Fn,
    L0Outcome,
    StageContext,
)
from pipeline.models import CritiqueEnvelope, RepairAttempt, Submission
from pipeline.records.files import FileReader, inline_bytes
from pipeline.store.base import BudgetLedger, CritiqueCache, PatternStore, TraceSink
from pipeline.store.blobs import RedisBlobStore
from pipeline.store.leases import process_holder
from pipeline.store.memory import (
    MemoryBudgetLedger,
    MemoryCritiqueCache,
    MemoryPatternStore,
    MemoryTraceSink,
)
from pipeline.text.simhash import is_fixpoint

if TYPE_CHECKING:
    from pipeline.store.redis_common import StoreClient

# --- Layer-0 and the fixpoint test ------------------------------------------------------------


def contract_l0(
    config: CritiqueConfig, read_file: FileReader | None = None, *, eager: bool = False
) -> L0Fn:
    """The real Layer-0 step over :mod:`pipeline.contract`. The suite is built on the first
    call (a context costs nothing until a submission reaches Layer-0), or now with ``eager``
    (a worker builds it before its first message, so a bad contract fails at start).

    Every file of the submission is read through ``read_file`` (default: inline content only,
    so a file held by reference raises :class:`~pipeline.records.files.UnreadableFileError`).
    """
    built: list[Any] = []

    def suite() -> Any:
        if not built:
            # lazy: the contract's scanners load with the first Layer-0 run (or eagerly)
            from pipeline.contract import build_suite

            built.append(build_suite(config.output_contract))
        return built[0]

    def run(
        submission: Submission, output: str | dict[str, Any], previous_size: int | None
    ) -> L0Outcome:
        report = check_submission(
            suite(), submission, output=output, previous_size=previous_size, read_file=read_file
        )
        return L0Outcome(
            defects=tuple(f.to_defect() for f in report.failures),
            gate_events=tuple(
                f.to_gate_event(submission.iteration, submission.worker_id) for f in report.failures
            ),
        )

    if eager:
        suite()
    return run


def simhash_fixpoint(*, eager: bool = False) -> FixpointFn:
    """The real fixpoint test, :func:`pipeline.text.simhash.is_fixpoint` (imported on the first
    call, or now with ``eager``)."""
    if eager:
        # lazy: simhash loads with the first fixpoint test unless a worker asks for it now
        import pipeline.text.simhash  # noqa: F401

    def fixpoint(previous_text: str, current_text: str) -> bool:
        return bool(is_fixpoint(previous_text, current_text))

    return fixpoint


# --- revisers and critics ---------------------------------------------------------------------


class CallableReviser:
    """Adapts a configured ``module:function`` repairer to the :class:`Reviser` protocol.

    The function is called like ``Reviser.revise`` and may return a :class:`RevisionResult`
    (its ``usage`` is what the repair reports and is charged to the budget: a function that
    calls a model returns what its provider reported) or just the new output (usage 0: nothing
    was reported, and the text it handled is not usage). It is taken as
    token-spending and pitfall-reading (nothing says otherwise), so a repair round reserves for
    it; what it does not report is refunded at commit.
    """

    token_free = False
    reads_pitfalls = True

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self._fn = fn
        self.name = name

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        """Call the configured function and normalise its answer."""
        got = self._fn(submission, output, envelope, pitfalls=pitfalls, attempts=attempts)
        if isinstance(got, RevisionResult):
            return got
        if isinstance(got, str | dict):
            return RevisionResult(output=got, suggestions_applied=len(envelope.actionable))
        raise ExtensionLoadError(
            f"repairer {self.name!r} returned {type(got).__name__}; expected a "
            "RevisionResult, a string or a dict"
        )


class ExtensionReviser(CallableReviser):
    """A configured Reviser *object* that does not declare its capabilities: its ``revise``
    behind :class:`CallableReviser`, taken as token-spending and pitfall-reading, and its
    ``plan`` kept when it has one (so ``needs_model`` still works for it)."""

    def __init__(self, obj: Any, name: str) -> None:
        super().__init__(obj.revise, name)
        self._obj = obj
        if isinstance(obj, Planner):
            self.plan = obj.plan


def declares_capabilities(obj: object) -> bool:
    """True when ``obj`` declares both protocol capabilities (``token_free``,
    ``reads_pitfalls``: :mod:`pipeline.critics.base`)."""
    return hasattr(obj, "token_free") and hasattr(obj, "reads_pitfalls")


def load_reviser(spec: str) -> Reviser:
    """Load a ``package.module:function`` repairer: a Reviser object (adapted by
    :class:`ExtensionReviser` when it does not declare its capabilities) or a revise-like
    callable (:class:`CallableReviser`)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
        obj = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise ExtensionLoadError(
            f"cannot load repairer {spec!r}: {exc}", hint="check the 'repairer' setting"
        ) from exc
    if hasattr(obj, "revise"):
        if declares_capabilities(obj):
            reviser: Reviser = obj
            return reviser
        return ExtensionReviser(obj, getattr(obj, "name", spec))
    if callable(obj):
        return CallableReviser(obj, spec)
    raise ExtensionLoadError(f"repairer {spec!r} is neither a Reviser nor callable")


class AutoCritic:
    """``critic: auto``: the LLM critic for a submission whose model resolves
    (``model``, else the worker's own in inline mode); the heuristic otherwise.

    Its own capabilities are the conservative ones; the runner reads those of the critic it
    resolves to (:func:`pipeline.critics.base.resolve_for`)."""

    name = "auto"
    token_free = False
    reads_pitfalls = True

    def __init__(self, config: CritiqueConfig, llm: Critic, heuristic: Critic) -> None:
        self.config = config
        self.llm = llm
        self.heuristic = heuristic

    def resolve(self, submission: Submission) -> Critic:
        """The critic for this submission."""
        return self.llm if self.config.uses_llm_critic(submission.model) else self.heuristic

    def critique(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        *,
        pitfalls: str,
        round: int,
    ) -> CritiqueEnvelope:
        """Critique with the resolved critic."""
        return self.resolve(submission).critique(submission, output, pitfalls=pitfalls, round=round)


class AutoReviser:
    """``repairer: auto``: the LLM reviser (inline: the worker's model) for a submission the
    LLM critic serves, the deterministic reviser that pairs with the critic otherwise.

    Its own capabilities are the conservative ones; the runner reads those of the reviser it
    resolves to (:func:`pipeline.critics.base.resolve_for`)."""

    name = "auto"
    token_free = False
    reads_pitfalls = True

    def __init__(self, config: CritiqueConfig, llm: Reviser, deterministic: Reviser) -> None:
        self.config = config
        self.llm = llm
        self.deterministic = deterministic

    def resolve(self, submission: Submission) -> Reviser:
        """The reviser for this submission."""
        if self.config.critic in ("auto", "llm") and self.config.uses_llm_critic(submission.model):
            return self.llm
        if self.config.critic == "command" and self.config.critic_model(submission.model):
            return self.llm  # a failing test needs a model to fix it (the prompt quotes it)
        return self.deterministic

    def revise(
        self,
        submission: Submission,
        output: str | dict[str, Any],
        envelope: CritiqueEnvelope,
        *,
        pitfalls: str,
        attempts: Sequence[RepairAttempt],
    ) -> RevisionResult:
        """Revise with the resolved reviser."""
        return self.resolve(submission).revise(
            submission, output, envelope, pitfalls=pitfalls, attempts=attempts
        )


# --- the completer ----------------------------------------------------------------------------


def default_completer(config: CritiqueConfig) -> Completer:
    """litellm behind the retry policy of ``config.llm`` (litellm loads on the first call);
    ``CRITIQUE_LLM_API_KEY`` goes only to the configured models' providers."""
    return LiteLLMCompleter(config.llm, key_models=configured_models(config))


def rate_limited_completer(
    config: CritiqueConfig,
    client: StoreClient,
    on_wait: Callable[[str, float], None] | None = None,
) -> Completer | None:
    """litellm behind the cluster-wide rate limit of ``llm.rate_limit``: one
    Redis bucket per model shared by every worker (``on_wait(model, seconds)`` is told of each
    wait); None (the default completer) without one."""
    if config.llm.rate_limit is None:
        return None
    # lazy: pipeline.store.ratelimit loads redis, which importing pipeline.wiring does not
    from pipeline.store.ratelimit import RedisRateLimiter

    limiter = RedisRateLimiter(client)
    return LiteLLMCompleter(
        config.llm,
        key_models=configured_models(config),
        wait_for_slot=limiter.waiter(config.llm.rate_limit_for, on_wait),
    )


def _llm_critic(config: CritiqueConfig, complete: Completer) -> Critic:
    critic: Critic = LLMCritic(config, complete)
    if config.paired_critic:
        critic = PairedCritic(critic, config, complete)
    return critic


def pick_critic(
    config: CritiqueConfig,
    complete: Completer | None = None,
    read_file: FileReader | None = None,
) -> Critic:
    """The critic ``config.critic`` names; ``auto`` resolves per submission (LLM when a model
    resolves, else the heuristic). ``complete`` defaults to litellm. ``command`` runs the
    worker's command on the submission's files (read through ``read_file``), merged with the
    heuristic's envelope (:mod:`pipeline.critics.command`)."""
    if config.critic == "heuristic":
        return HeuristicCritic()
    if config.critic == "rubric":
        return RubricCritic(config.rubric)
    if config.critic == "command":
        # lazy: only a command critic loads the sandbox and subprocess runner
        from pipeline.critics.command import CommandCritic

        return CommandCritic(config, companion=HeuristicCritic(), read_file=read_file)
    llm = _llm_critic(config, complete or default_completer(config))
    if config.critic == "llm":
        return llm
    return AutoCritic(config, llm, HeuristicCritic())


def pick_reviser(config: CritiqueConfig, complete: Completer | None = None) -> Reviser:
    """The reviser ``config.repairer`` names: ``auto`` pairs with the critic (the LLM reviser for
    LLM-critiqued submissions, else the deterministic one), ``llm``, ``deterministic``,
    ``worker`` (the manager's worker repairs: :mod:`pipeline.critics.worker`), or a configured
    ``package.module:function``."""
    deterministic: Reviser = (
        DeterministicReviser() if config.critic == "rubric" else HeuristicReviser()
    )
    if config.repairer == "deterministic":
        return deterministic
    if config.repairer == "worker":
        return WorkerReviser()
    if config.repairer in ("auto", "llm"):
        # lazy: the LLM critic's prompts and reply parsing load only where a model may repair
        from pipeline.critics.llm import LLMReviser

        llm = LLMReviser(config, complete or default_completer(config), fallback=deterministic)
        if config.repairer == "llm":
            return llm
        if config.critic in ("heuristic", "rubric"):
            return deterministic
        return AutoReviser(config, llm, deterministic)
    return load_reviser(config.repairer)


# --- stores -----------------------------------------------------------------------------------


class RedisStores:
    """The Redis stores of one process, on one client (the store modules load here)."""

    def __init__(
        self, client: StoreClient, *, secrets: Callable[[], Sequence[bytes]] | None = None
    ) -> None:
        # lazy: pipeline.store.redis loads redis, which importing pipeline.wiring does not
        from pipeline.store.redis import RedisBudgetLedger, RedisPatternStore, RedisTraceSink

        # lazy: pipeline.store.runs loads redis, which importing pipeline.wiring does not
        from pipeline.store.runs import RedisRunStore

        self.patterns = RedisPatternStore(client)
        # The leases this process is granted are its own, beaten from its own thread, so they
        # come back soon after it dies (pipeline.store.leases).
        self.budget = RedisBudgetLedger(client, holder=process_holder())
        self.trace = RedisTraceSink(client, secrets=secrets)
        self.blobs = RedisBlobStore(client)
        self.runs = RedisRunStore(client, secrets=secrets)


# --- the stage context ------------------------------------------------------------------------


def _require_capabilities(obj: object, role: str) -> None:
    if not declares_capabilities(obj):
        raise TypeError(
            f"{role} {type(obj).__name__} does not declare token_free and reads_pitfalls "
            f"(the {role.capitalize()} protocol, pipeline.critics.base)"
        )


def make_context(
    config: CritiqueConfig,
    *,
    critic: Critic | None = None,
    reviser: Reviser | None = None,
    patterns: PatternStore | None = None,
    budget: BudgetLedger | None = None,
    trace: TraceSink | None = None,
    lease_prefix: str = "",
    l0: L0Fn | None = None,
    fixpoint: FixpointFn | None = None,
    clock: Callable[[], float] | None = None,
    lease_ttl_s: float = REPAIR_LEASE_TTL_S,
    complete: Completer | None = None,
    read_file: FileReader | None = None,
    cache: CritiqueCache | None = None,
) -> StageContext:
    """A context from configuration; anything given explicitly replaces the default.

    Defaults: critic and reviser from ``config.critic`` / ``config.repairer`` (LLM calls through
    ``complete``, litellm by default), in-memory stores, the real L0 and fixpoint functions
    (loaded on first use), ``time.monotonic``, and a file reader that follows no blob reference
    (:func:`pipeline.records.files.inline_bytes`). A critic or reviser given explicitly must declare
    its capabilities (``token_free``, ``reads_pitfalls``); a ``TypeError`` says which is
    missing.
    """
    if critic is not None:
        _require_capabilities(critic, "critic")
    if reviser is not None:
        _require_capabilities(reviser, "reviser")
    reader = read_file if read_file is not None else inline_bytes
    return StageContext(
        config=config,
        critic=critic if critic is not None else pick_critic(config, complete, read_file),
        reviser=reviser if reviser is not None else pick_reviser(config, complete),
        patterns=patterns if patterns is not None else MemoryPatternStore(),
        budget=budget if budget is not None else MemoryBudgetLedger(),
        trace=trace if trace is not None else MemoryTraceSink(),
        l0=l0 if l0 is not None else contract_l0(config, reader),
        fixpoint=fixpoint if fixpoint is not None else simhash_fixpoint(),
        lease_prefix=lease_prefix,
        clock=clock if clock is not None else time.monotonic,
        lease_ttl_s=lease_ttl_s,
        read_file=reader,
        cache=cache if cache is not None else MemoryCritiqueCache(),
    )
