"""LLM calls: the LLM is an injected completion callable.

Critics and revisers never import litellm: they take a :class:`Completer` — a callable from an
:class:`LLMRequest` to an :class:`LLMReply` — and the worker hands them the litellm-backed one.
Tests hand them a fake callable, or the real one pointed at a fake OpenAI-compatible server.

Error contract of every completer:

- a transient failure (timeout, 429, 5xx, connection error) is retried inside the completer,
  with exponential backoff and full jitter, at most ``max_retries`` times; when every try failed
  it raises :class:`~pipeline.errors.LLMTransientError` (callers fall back to the heuristic);
- a permanent failure (authentication, bad request, unknown model) raises
  :class:`~pipeline.errors.LLMPermanentError` at once, with a message that says what to fix;
- a provider key missing from the environment (litellm's own completion only) raises
  :class:`~pipeline.errors.ConfigError` naming the variable before any call is made
  (:mod:`pipeline.llm.providers`): a configuration error, never a transient one.

An empty reply (content ``""`` or ``null``, or no choices at all) is *not* an error: the reply's
text is ``""`` and the caller decides what that means.

**Token allowances** (the repair budget: docs/pipeline.md, "The repair budget"). A repair
round runs its LLM calls inside :func:`token_allowance`, the tokens its budget reservation has
left. Critics and revisers make their calls through :func:`complete_within`, which counts the
prompt (:func:`count_prompt_tokens`), lowers the call's ``max_tokens`` to what the allowance
leaves after it, and raises
:class:`AllowanceSpent` (an :class:`~pipeline.errors.LLMTransientError`: callers fall back to a
token-free answer) instead of making a call whose prompt alone does not fit. A provider that
honours ``max_tokens`` and counts the prompt as we do can therefore never bill a repair more
than was reserved for it. Outside an allowance (the first critique) calls are unchanged.

:class:`LiteLLMCompleter` is the production completer. How it classifies litellm's exceptions
(litellm maps every provider's errors onto the OpenAI SDK's classes):

    transient (retried)   Timeout, RateLimitError (429), InternalServerError (500, also a
                          response body that is not JSON), BadGatewayError (502),
                          ServiceUnavailableError (503), APIConnectionError; any other
                          APIError with status ≥ 500, 408 or 429
    permanent (at once)   AuthenticationError (401), PermissionDeniedError (403),
                          NotFoundError (404), BadRequestError (400, incl.
                          ContextWindowExceededError), UnprocessableEntityError (422); any other
                          APIError with a 4xx status or none
    anything else         propagates unchanged (a bug, not a provider failure)

What litellm does besides the call is kept to what someone reads: with no litellm success
callback configured, its success logging is skipped (:func:`pipeline.llm.providers.call_scope`),
and a model its cost map does not price is looked up once per process, not per call
(:class:`CostMapMisses`); litellm's own HTTP client, timeouts, error mapping and response
parsing are what runs in every case.
"""

from __future__ import annotations

import contextlib
import contextvars
import email.utils
import random
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import Field

from pipeline import settings
from pipeline.config import LLMConfig
from pipeline.errors import LLMPermanentError, LLMTransientError
from pipeline.llm.providers import call_scope, check_keys, load_litellm
from pipeline.llm.tokens import CHARS_PER_TOKEN, estimate_tokens
from pipeline.models import Frozen, Usage
from pipeline.security.model_policy import in_key_scope, key_scope
from pipeline.security.redaction import provider_error

Purpose = Literal["critic", "repair", "adjudicate", "generate"]


class ChatMessage(Frozen):
    """One chat message."""

    role: Literal["system", "user", "assistant"]
    content: str


class LLMRequest(Frozen):
    """One chat completion to make."""

    model: str
    """A litellm model name, e.g. ``openai/gpt-4o-mini`` or ``anthropic/claude-3-5-haiku``."""
    messages: tuple[ChatMessage, ...]
    json_mode: bool = False
    """Ask for a JSON object reply (``response_format``) where the provider supports it."""
    max_tokens: int | None = None
    purpose: Purpose = "critic"
    """What the call is for (logged, and visible to a test's fake server)."""


class LLMReply(Frozen):
    """A completion's text and what it cost."""

    text: str
    usage: Usage = Field(default_factory=Usage)
    """Tokens in/out as the provider reported them, cost from litellm's offline cost map,
    ``calls`` = HTTP attempts made (retries included)."""
    model: str = ""
    response_id: str = ""
    """The provider's id of the completion (``chatcmpl-…``), when it sent one."""
    retries: int = Field(0, ge=0)
    """Transient failures retried before this reply."""


class Completer(Protocol):
    """Makes one chat completion (retrying transient errors itself).

    A completer may also offer ``count_tokens(request) -> int``, the prompt's tokens by the
    model's own tokenizer (:meth:`LiteLLMCompleter.count_tokens`); :func:`count_prompt_tokens`
    uses it when present.
    """

    def __call__(self, request: LLMRequest) -> LLMReply: ...


# --- token allowances (the repair budget) ------------------------------------------------------

MESSAGE_OVERHEAD_TOKENS = 4
"""Tokens a chat format adds per message (role, separators), as OpenAI's counting rule says."""
REPLY_PRIMING_TOKENS = 3
"""Tokens a chat format adds once per request (the reply's priming)."""


def estimate_prompt_tokens(request: LLMRequest) -> int:
    """The prompt's tokens at one per four characters (rounded up) per message, plus the chat
    format's overhead: never less than what the fake server (or a provider billing ⌊chars/4⌋)
    reports."""
    return (
        sum(
            -(-len(m.content) // CHARS_PER_TOKEN) + MESSAGE_OVERHEAD_TOKENS
            for m in request.messages
        )
        + REPLY_PRIMING_TOKENS
    )


def count_prompt_tokens(request: LLMRequest, complete: object = None) -> int:
    """The prompt's tokens as reserved and checked: the larger of :func:`estimate_prompt_tokens`
    and the completer's own count (``complete.count_tokens``, the model's tokenizer) when it
    has one and it answers."""
    estimate = estimate_prompt_tokens(request)
    counter = getattr(complete, "count_tokens", None)
    if counter is None:
        return estimate
    try:
        counted = int(counter(request))
    except Exception:  # a tokenizer that cannot load or answer: the estimate stands
        return estimate
    return max(estimate, counted)


@dataclass
class Allowance:
    """Tokens a scope (one repair call, or one re-critique) may still spend."""

    tokens: int
    spent: int = 0

    @property
    def left(self) -> int:
        return max(0, self.tokens - self.spent)


_allowance: contextvars.ContextVar[Allowance | None] = contextvars.ContextVar(
    "critique_token_allowance", default=None
)


@contextlib.contextmanager
def token_allowance(tokens: int | None) -> Iterator[Allowance | None]:
    """Run the block with ``tokens`` to spend on LLM calls (None: no limit). Per thread and
    per task (a context variable), so concurrent stages never share one."""
    allowance = None if tokens is None else Allowance(max(0, int(tokens)))
    reset = _allowance.set(allowance)
    try:
        yield allowance
    finally:
        _allowance.reset(reset)


class AllowanceSpent(LLMTransientError):
    """A call was not made: its prompt does not fit in what the repair's budget reservation has
    left. Callers treat it like an unavailable LLM and answer token-free, saying so."""


def complete_within(complete: Completer, request: LLMRequest) -> LLMReply:
    """``complete(request)`` inside the current :func:`token_allowance`, if any.

    The call's ``max_tokens`` becomes ``min(request.max_tokens, left − counted prompt)``; when
    that leaves no room for a reply, :class:`AllowanceSpent` is raised and nothing is sent.
    What the provider reports is taken off the allowance; a reply that reports no usage at all
    is taken as having spent its whole bound (prompt + ``max_tokens``): never under-counted.
    """
    allowance = _allowance.get()
    if allowance is None:
        return complete(request)
    prompt = count_prompt_tokens(request, complete)
    room = allowance.left - prompt
    if room < 1:
        raise AllowanceSpent(
            f"LLM {request.purpose} call not made: the repair's budget reservation has "
            f"{allowance.left} token(s) left and the prompt alone counts {prompt}",
            hint="raise budget.total_tokens or repair_budget_fraction, or lower llm.max_tokens",
        )
    wanted = request.max_tokens if request.max_tokens is not None else room
    fitted = request.model_copy(update={"max_tokens": max(1, min(wanted, room))})
    reply = complete(fitted)
    if reply.usage.tokens == 0:
        bound = prompt + (fitted.max_tokens or 0)
        reply = reply.model_copy(
            update={"usage": reply.usage.model_copy(update={"tokens_in": bound})}
        )
    allowance.spent += reply.usage.tokens
    return reply


# The operator's API key (settings.LLM_API_KEY) goes only with calls to the providers of the
# configured models (LiteLLMCompleter.key_models); other calls, and calls without it, get the
# provider's own variable from litellm (OPENAI_API_KEY, ANTHROPIC_API_KEY …).

TRANSIENT_HINT = (
    "the provider timed out, rate-limited or failed; try later, or raise llm.max_retries / "
    "llm.timeout_s"
)
PERMANENT_HINT = (
    "check the API key (CRITIQUE_LLM_API_KEY or the provider's variable, e.g. OPENAI_API_KEY), "
    "the model name and llm.api_base"
)

Kind = Literal["transient", "permanent"]

_TRANSIENT_NAMES = (
    "Timeout",
    "RateLimitError",
    "InternalServerError",
    "ServiceUnavailableError",
    "BadGatewayError",
    "APIConnectionError",
)
_PERMANENT_NAMES = (
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "BadRequestError",
    "ContextWindowExceededError",
    "UnprocessableEntityError",
)


def _classes(module_name: str, names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    """Exception classes of an already-imported module (never imports it: a test's fake
    completion must not pay for litellm)."""
    module = sys.modules.get(module_name)
    if module is None:
        return ()
    found = (getattr(module, name, None) for name in names)
    return tuple(c for c in found if isinstance(c, type) and issubclass(c, BaseException))


def _status_kind(status: object) -> Kind:
    if isinstance(status, int) and (status >= 500 or status in (408, 429)):
        return "transient"
    return "permanent"


def classify(exc: BaseException) -> Kind | None:
    """Whether retrying ``exc`` may help; None when it is not an LLM/provider failure at all."""
    if isinstance(exc, LLMTransientError):
        return "transient"
    if isinstance(exc, LLMPermanentError):
        return "permanent"
    for module in ("litellm", "openai"):
        if isinstance(exc, _classes(module, _TRANSIENT_NAMES)):
            return "transient"
        if isinstance(exc, _classes(module, _PERMANENT_NAMES)):
            return "permanent"
    if isinstance(exc, _classes("openai", ("APIError",)) + _classes("litellm", ("APIError",))):
        return _status_kind(getattr(exc, "status_code", None))
    if isinstance(exc, TimeoutError | ConnectionError):
        return "transient"
    return None


def retry_after_s(exc: BaseException, *, now: float | None = None) -> float | None:
    """The wait a 429/503 asked for (``retry-after-ms`` or ``Retry-After`` seconds or HTTP
    date), from the exception's headers or its HTTP response; None when it asked for none."""
    sources: list[Any] = [getattr(exc, "headers", None)]
    response = getattr(exc, "response", None)
    sources.append(getattr(response, "headers", None))
    for headers in sources:
        if not headers or not hasattr(headers, "get"):
            continue
        ms = headers.get("retry-after-ms")
        if ms is not None:
            try:
                return max(0.0, float(ms) / 1000.0)
            except ValueError:
                pass
        raw = headers.get("retry-after")
        if raw is None:
            continue
        try:
            return max(0.0, float(raw))
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(str(raw)).timestamp()
            except (TypeError, ValueError):
                continue
            return max(0.0, when - (time.time() if now is None else now))
    return None


def _describe(exc: BaseException, key: str | None = None) -> str:
    """The provider's error as a manager may read it (a failure reason, a fallback note): its
    type, HTTP status and a short message with the call's ``key`` and anything key-like hidden
    (:func:`pipeline.security.redaction.provider_error`): an error body can echo the request. The
    errors built from it are raised ``from None``: Celery stores a failed stage's traceback,
    chained causes included, where managers can read it (the result backend)."""
    return provider_error(exc, (key,))


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _reply_text(response: Any) -> str:
    choices = _field(response, "choices") or []
    if not choices:
        return ""
    message = _field(choices[0], "message")
    content = _field(message, "content") if message is not None else None
    return content if isinstance(content, str) else ""


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0


class LiteLLMCompleter:
    """The production :class:`Completer`: ``litellm.completion`` with our own retry loop.

    litellm's and the OpenAI SDK's retries are switched off (``num_retries=0``,
    ``max_retries=0``) so that ``config.max_retries`` is the only bound. Transient failures
    wait ``min(backoff_max_s, backoff_s * 2**k) * rng()`` before retry ``k`` (full jitter), or
    what a 429's ``Retry-After`` asked for, capped at ``backoff_max_s``.

    ``completion``, ``sleep`` and ``rng`` are injectable (tests). ``api_key``, when given, is
    sent with every call (the caller's own choice). Otherwise ``$CRITIQUE_LLM_API_KEY`` is sent
    only with a call whose provider is the provider of one of ``key_models`` (the operator's
    configured models: :func:`pipeline.llm.providers.configured_models`); without ``key_models``,
    only when ``llm.api_base`` is set (every call then goes to the operator's endpoint). A call
    that does not carry it gets the provider's own variable from litellm, so a model a
    submission names can never take the operator's key to another provider or address.
    ``wait_for_slot`` (a worker passes the Redis limiter's) waits for the rate limit's slot
    before each attempt, reserving the prompt's tokens + ``max_tokens``.
    """

    def __init__(
        self,
        config: LLMConfig,
        *,
        completion: Callable[..., Any] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: Callable[[], float] = random.random,
        api_key: str | None = None,
        key_models: Collection[str] | None = None,
        wait_for_slot: Callable[[str, int], float] | None = None,
    ) -> None:
        self.config = config
        self.key_models: tuple[str, ...] | None = None if key_models is None else tuple(key_models)
        """The models whose providers ``$CRITIQUE_LLM_API_KEY`` belongs to (None: see above)."""
        self._scope = None if key_models is None else key_scope(key_models)
        self._wait_for_slot = wait_for_slot
        """``(model, reserved tokens) -> seconds waited``: the cluster-wide rate limit
        (:mod:`pipeline.store.ratelimit`), called before every attempt; None: no limit."""
        self._completion = completion
        self._checks_keys = completion is None
        """litellm's own completion: check the provider key before each call (a missing key is a
        configuration error, never a heuristic fallback)."""
        self._cost: Callable[[Any], float] | None = None
        self._sleep = sleep
        self._rng = rng
        self._explicit_key = api_key
        self._product_key = settings.raw(settings.LLM_API_KEY) or None

    def key_for(self, model: str) -> str | None:
        """The key a call to ``model`` carries: the explicit ``api_key``; else
        ``$CRITIQUE_LLM_API_KEY`` when ``model``'s provider is in the key's scope; else None
        (litellm reads the provider's own variable)."""
        if self._explicit_key is not None:
            return self._explicit_key
        if self._product_key is None:
            return None
        if self._scope is None:
            return self._product_key if self.config.api_base else None
        return self._product_key if in_key_scope(model, self._scope) else None

    def warm(self) -> None:
        """Load litellm now, so that the first call's latency is the call's own."""
        self._backend()

    def count_tokens(self, request: LLMRequest) -> int:
        """The prompt's tokens by the model's tokenizer (``litellm.token_counter``: tiktoken,
        or the provider's own where litellm bundles it; never a download)."""
        litellm = sys.modules.get("litellm")
        if litellm is None:
            if self._completion is not None:  # a test's completion: never pay for litellm
                raise LookupError("litellm is not loaded")
            litellm = load_litellm()
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        return int(litellm.token_counter(model=request.model, messages=messages))

    def _backend(self) -> Callable[..., Any]:
        if self._completion is None:
            litellm = load_litellm()
            self._completion = litellm.completion
            self._cost = _cost_with(litellm)
        return self._completion

    def _cost_of(self, response: Any) -> float:
        if self._cost is None:
            litellm = sys.modules.get("litellm")
            if litellm is None:
                return 0.0
            self._cost = _cost_with(litellm)
        return self._cost(response)

    def kwargs_for(self, request: LLMRequest) -> dict[str, Any]:
        """The keyword arguments ``litellm.completion`` gets for ``request``."""
        cfg = self.config
        kwargs: dict[str, Any] = {
            "model": request.model,
            "messages": [{"role": m.role, "content": m.content} for m in request.messages],
            "timeout": cfg.timeout_s,
            "temperature": cfg.temperature,
            "max_tokens": request.max_tokens or cfg.max_tokens,
            "num_retries": 0,
            "max_retries": 0,
        }
        if cfg.api_base:
            kwargs["api_base"] = cfg.api_base
        key = self.key_for(request.model)
        if key:
            kwargs["api_key"] = key
        if request.json_mode:
            kwargs["response_format"] = {"type": "json_object"}
        litellm = sys.modules.get("litellm")
        if litellm is not None and UNPRICED.known(litellm, request.model):
            kwargs.update(UNPRICED_KWARGS)
        return kwargs

    def reserved_tokens(self, request: LLMRequest, max_tokens: int) -> int:
        """What a call reserves of a ``tpm`` limit: the prompt's tokens (the tokenizer's count,
        else the 4-chars estimate) + ``max_tokens``. 0 when no limit is waited for."""
        if self._wait_for_slot is None:
            return 0
        try:
            prompt = self.count_tokens(request)
        except Exception:  # no tokenizer for the model, litellm not loaded: estimate
            prompt = estimate_tokens("".join(m.content for m in request.messages))
        return prompt + max_tokens

    def delay(self, retry: int, exc: BaseException | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (0-based) after ``exc``."""
        cap = self.config.backoff_max_s
        asked = retry_after_s(exc) if exc is not None else None
        if asked is not None:
            return min(cap, asked)
        return min(cap, self.config.backoff_s * (2.0**retry)) * self._rng()

    def __call__(self, request: LLMRequest) -> LLMReply:
        completion = self._backend()
        if self._checks_keys:
            # A missing provider key is a configuration error (ConfigError, permanent), never
            # a transient failure that ends in the heuristic fallback (pipeline.llm.providers).
            check_keys(
                (request.model,),
                api_base=self.config.api_base,
                api_key=self.key_for(request.model),
                key_models=(),  # the product key counts only where key_for sends it
                where="this worker's environment",
            )
        kwargs = self.kwargs_for(request)
        reserve = self.reserved_tokens(request, int(kwargs["max_tokens"]))
        attempts = self.config.max_retries + 1
        for attempt in range(1, attempts + 1):
            if self._wait_for_slot is not None:
                self._wait_for_slot(request.model, reserve)
            try:
                with call_scope(sys.modules.get("litellm")):
                    response = completion(**kwargs)
            except Exception as exc:
                kind = classify(exc)
                if kind is None:
                    raise
                if kind == "permanent":
                    raise LLMPermanentError(
                        f"LLM call to {request.model!r} ({request.purpose}) was refused: "
                        f"{_describe(exc, kwargs.get('api_key'))}",
                        hint=PERMANENT_HINT,
                    ) from None  # the provider's own text stays out of stored tracebacks
                if attempt == attempts:
                    raise LLMTransientError(
                        f"LLM call to {request.model!r} ({request.purpose}) failed after "
                        f"{attempts} attempt{'s' if attempts != 1 else ''}; last error: "
                        f"{_describe(exc, kwargs.get('api_key'))}",
                        hint=TRANSIENT_HINT,
                    ) from None
                self._sleep(self.delay(attempt - 1, exc))
                continue
            usage = _field(response, "usage")
            tokens_in = _count(_field(usage, "prompt_tokens"))
            tokens_out = _count(_field(usage, "completion_tokens"))
            if "input_cost_per_token" not in kwargs:
                UNPRICED.learn(request.model, response, tokens_in + tokens_out)
            return LLMReply(
                text=_reply_text(response),
                usage=Usage(
                    tokens_in=tokens_in,
                    tokens_out=tokens_out,
                    cost=self._cost_of(response),
                    calls=attempt,
                ),
                model=str(_field(response, "model") or request.model),
                response_id=str(_field(response, "id") or ""),
                retries=attempt - 1,
            )
        raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover


def _cost_with(litellm: Any) -> Callable[[Any], float]:
    """``litellm.completion_cost`` from the offline cost map; unknown models cost 0.0.

    ``litellm.completion`` already priced its response (``_hidden_params["response_cost"]``:
    the same calculation, None for a model the map does not know): that figure is used, so a
    call is not priced twice; a response without it (a test's completion) is priced here."""

    def cost(response: Any) -> float:
        hidden = getattr(response, "_hidden_params", None)
        if isinstance(hidden, Mapping) and "response_cost" in hidden:
            value = hidden["response_cost"]
        else:
            try:
                value = litellm.completion_cost(completion_response=response)
            except Exception:  # unknown model, missing usage: the cost is unknown, not an error
                return 0.0
        return float(value) if isinstance(value, int | float) and value > 0 else 0.0

    return cost


UNPRICED_KWARGS: dict[str, float] = {"input_cost_per_token": 0.0, "output_cost_per_token": 0.0}
"""Sent with a call to a model litellm's cost map does not price (:data:`UNPRICED`): litellm
prices the reply at these rates instead of looking the model up in its map again."""


class CostMapMisses:
    """Model names litellm's cost map does not price, learnt from litellm's own answer.

    litellm prices every reply while it returns it; for a model its map does not know (a
    self-hosted or custom model name) that means several failed look-ups per call (~1 ms of
    CPU) and no figure (``_hidden_params["response_cost"]`` None: the reply costs 0.0 here).
    After one such reply with tokens, calls to that name carry :data:`UNPRICED_KWARGS`, so the
    same 0.0 comes without the look-ups. A name is forgotten when the map changes size (an
    operator's ``litellm.register_model``): the next call asks the map again. Names the map
    knows are never listed: litellm prices them from the map as before.
    """

    def __init__(self) -> None:
        self._missed: dict[str, int] = {}
        """model name -> ``len(litellm.model_cost)`` when litellm last failed to price it."""

    def known(self, litellm: Any, model: str) -> bool:
        """Whether ``model`` is a known miss of the current cost map."""
        stamp = self._missed.get(model)
        if stamp is None:
            return False
        if stamp == _map_size(litellm):
            return True
        self._missed.pop(model, None)
        return False

    def learn(self, model: str, response: Any, tokens: int) -> None:
        """Note ``model`` when litellm returned ``response`` (with ``tokens`` of usage) but no
        price for it; a reply without usage says nothing about the map."""
        hidden = getattr(response, "_hidden_params", None)
        if tokens <= 0 or not isinstance(hidden, Mapping) or "response_cost" not in hidden:
            return
        if hidden["response_cost"] is not None:
            return
        litellm = sys.modules.get("litellm")
        if litellm is not None:
            self._missed[model] = _map_size(litellm)

    def clear(self) -> None:
        self._missed.clear()


def _map_size(litellm: Any) -> int:
    cost_map = getattr(litellm, "model_cost", None)
    return len(cost_map) if isinstance(cost_map, Mapping) else -1


UNPRICED = CostMapMisses()
"""This process's known misses, shared by all its completers."""
