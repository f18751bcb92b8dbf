"""OpenTelemetry tracing: one trace per submission, from its submit to its verdict
(docs/operations.md, "Tracing: OpenTelemetry").

Off by default. On in a process whose environment says where spans go, in OpenTelemetry's own
variables: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``: OTLP over
HTTP/protobuf) or ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``), unless ``OTEL_SDK_DISABLED``
is ``true``; it needs the ``otel`` extra (without it: one warning, and off). The SDK reads its
other variables itself (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_PROPAGATORS``…).
A process whose host already set an SDK tracer provider (``opentelemetry-instrument``, a manager
that traces) traces into that one, even without these variables.

Off, every hook here returns at once and this module imports nothing of OpenTelemetry. On, it is
set up once per process (:func:`setup`): in a worker's pool process (``worker_process_init``
under prefork, ``worker_init`` for the other pools: never before a fork), and by the client.
The spans: ``critique submit`` (the client's submit, or the entry task's); Celery's
``apply_async/<task>`` (PRODUCER) and ``run/<task>`` (CONSUMER), from
``opentelemetry-instrumentation-celery``, the context carried in the message headers
(``traceparent``); ``critique <stage>`` per stage run, with the numbers of its trace-stream
events; ``chat <model>`` per model call (the GenAI conventions); ``critique redrive``. The
verdict is the event ``gen_ai.evaluation.result`` on the ``critique gate`` span.

No prompt, output or submission text goes into a span unless
``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`` (docs/security.md): identifiers,
names, numbers, statuses and stop reasons only.

The GenAI metrics ``gen_ai.client.token.usage`` and ``gen_ai.client.operation.duration`` are
counted by :class:`ObservedCompleter` whether tracing is on or not: fleet counters in the store
(:mod:`pipeline.store.metrics`) that ``critique exporter`` serves, not OpenTelemetry metrics.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from celery.exceptions import Ignore, TaskPredicate

from pipeline import __version__
from pipeline.errors import CritiqueError, error_line
from pipeline.llm.completion import Completer, LLMReply, LLMRequest
from pipeline.loop.stages import BudgetWait, LoopState, PassCancelled
from pipeline.models import CritiqueResult, defect_line
from pipeline.security.model_policy import provider_of
from pipeline.store import keys

log = logging.getLogger(__name__)

CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
"""``true``: prompts, replies and defect descriptions go into spans too (docs/security.md)."""
TRACING_MODULES = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.http",
    "opentelemetry.instrumentation.celery",
)
"""What tracing loads (``celery inspect stats`` lists those a worker has loaded)."""
TEXT_CHARS = 300
"""Longest text attribute a span gets (a name, a reason) when it is not content."""

PROVIDERS = {
    "openai": "openai", "anthropic": "anthropic", "azure": "azure.ai.openai",
    "azure_ai": "azure.ai.inference", "bedrock": "aws.bedrock", "vertex_ai": "gcp.vertex_ai",
    "gemini": "gcp.gemini", "mistral": "mistral_ai", "groq": "groq", "deepseek": "deepseek",
    "perplexity": "perplexity", "xai": "x_ai", "cohere": "cohere", "watsonx": "ibm.watsonx.ai",
}  # fmt: skip
"""litellm's provider prefixes → ``gen_ai.provider.name`` (the GenAI conventions' names)."""
OTHER = "_OTHER"
ERRORS = (
    "pipeline.errors.LLMTransientError",
    "pipeline.errors.LLMPermanentError",
    "pipeline.errors.ConfigError",
)
"""The ``error.type`` values a metric label may take (any other error counts as ``_OTHER``)."""
TOKEN_BUCKETS: tuple[float, ...] = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
"""``gen_ai.client.token.usage``'s bucket bounds, as the GenAI conventions advise."""
DURATION_BUCKETS: tuple[float, ...] = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
"""``gen_ai.client.operation.duration``'s bucket bounds (seconds), as the conventions advise."""


# --- what the environment asks for ----------------------------------------------------------------


def _true(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() == "true"


def exporters(env: Mapping[str, str]) -> tuple[str, ...]:
    """The span exporters ``env`` asks for; ``()`` means tracing is off: ``OTEL_SDK_DISABLED``
    is ``true``, or neither ``OTEL_TRACES_EXPORTER`` (``none`` alone: off) nor an OTLP endpoint
    is set. An endpoint alone means ``otlp``."""
    if _true(env, "OTEL_SDK_DISABLED"):
        return ()
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        names = (n.strip() for n in named.split(","))
        return tuple(n for n in dict.fromkeys(names) if n and n != "none")
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return ("otlp",) if endpoint and endpoint.strip() else ()


def capture_content(env: Mapping[str, str]) -> bool:
    """Whether the operator opted in to content in spans (:data:`CONTENT_ENV`)."""
    return _true(env, CONTENT_ENV)


# --- setting up -----------------------------------------------------------------------------------


class _State:
    pid: int | None = None
    """The process :func:`setup` last ran in (a forked child sets up again)."""
    tracer: Any = None
    """This process's tracer while tracing is on."""
    provider: Any = None
    """The tracer provider set up here (flushed by :func:`shutdown`); None: the host's, or off."""
    content: bool = False
    client_kind: Any = None


_state = _State()


def setup(service: str = "critique-worker") -> bool:
    """Start tracing in this process if its environment asks for it (or its host traces); once
    per process, returns whether tracing is on. ``service``: the ``service.name`` when neither
    ``OTEL_SERVICE_NAME`` nor ``OTEL_RESOURCE_ATTRIBUTES`` names one."""
    if _state.pid == os.getpid():
        return _state.tracer is not None
    _state.pid, _state.tracer, _state.provider = os.getpid(), None, None
    if _true(os.environ, "OTEL_SDK_DISABLED"):
        return False
    names = exporters(os.environ)
    host = _host_provider()
    if not names and host is None:
        return False
    try:
        from opentelemetry.trace import SpanKind

        provider = host if host is not None else _own_provider(names, service)
    except ImportError as exc:
        log.warning(
            "tracing: the environment asks for it (OTEL_*), but the otel extra is not installed "
            "(pip install 'critique-pipeline[otel]'): %s; tracing stays off",
            exc,
        )
        return False
    _instrument_celery(provider)
    _state.content = capture_content(os.environ)
    _state.client_kind = SpanKind.CLIENT
    _state.tracer = provider.get_tracer("critique-pipeline", __version__)
    return True


def _host_provider() -> Any:
    """The SDK tracer provider already set in this process (by its host application, or
    inherited through a fork), else None; imports nothing."""
    trace, sdk = sys.modules.get("opentelemetry.trace"), sys.modules.get("opentelemetry.sdk.trace")
    if trace is None or sdk is None:
        return None
    provider = trace.get_tracer_provider()
    return provider if isinstance(provider, sdk.TracerProvider) else None


def _own_provider(names: tuple[str, ...], service: str) -> Any:
    """A tracer provider with a batch processor per exporter named, set as the global one."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    env = os.environ
    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    provider = TracerProvider(
        resource=Resource.create({} if named else {"service.name": service}),
        sampler=_without_probes(),
    )
    for name in names:
        if name == "otlp":
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            if protocol != "http/protobuf":
                log.warning("tracing: OTLP protocol %r asked for; sending http/protobuf", protocol)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter: Any = OTLPSpanExporter()
        elif name == "console":
            exporter = ConsoleSpanExporter()
        else:
            log.warning(
                "tracing: OTEL_TRACES_EXPORTER %r is not one of otlp, console: skipped", name
            )
            continue
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _state.provider = provider
    return provider


def _without_probes() -> Any:
    """The sampler ``OTEL_TRACES_SAMPLER`` names (the SDK's default: parent-based, always on),
    dropping the stall sweeper's queue probes (``critique.probe``, every few seconds per queue:
    plumbing, not work), and so their message's run too."""
    from opentelemetry.sdk.trace.sampling import (
        Decision,
        Sampler,
        SamplingResult,
        _get_from_env_or_default,
    )

    class WithoutProbes(Sampler):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def should_sample(
            self,
            parent_context: Any,
            trace_id: int,
            name: str,
            kind: Any = None,
            attributes: Any = None,
            links: Any = None,
            trace_state: Any = None,
        ) -> Any:
            if name.endswith(f"/{keys.TASK_PROBE}"):
                return SamplingResult(Decision.DROP)
            return self.inner.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )

        def get_description(self) -> str:
            return f"WithoutProbes{{{self.inner.get_description()}}}"

    return WithoutProbes(_get_from_env_or_default())


def _instrument_celery(provider: Any) -> None:
    """Celery's spans and the context in its message headers (once per process)."""
    try:
        celery_otel: Any = importlib.import_module("opentelemetry.instrumentation.celery")
    except ImportError:
        log.warning(
            "tracing: opentelemetry-instrumentation-celery is not installed: no Celery spans, "
            "and a trace ends at the broker"
        )
        return
    instrumentor = celery_otel.CeleryInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(tracer_provider=provider)


def shutdown() -> None:
    """Export what is buffered and stop (a prefork pool process as it exits); the SDK does it
    at exit in other processes."""
    if _state.provider is not None and _state.pid == os.getpid():
        _state.provider.shutdown()


def status() -> dict[str, Any]:
    """Whether this process traces, and which of :data:`TRACING_MODULES` it has loaded."""
    on = _state.tracer is not None and _state.pid == os.getpid()
    return {"on": on, "loaded": [m for m in TRACING_MODULES if m in sys.modules]}


# --- spans ----------------------------------------------------------------------------------------


def _critique(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {f"critique.{k}": v for k, v in attributes.items() if v is not None}


def _safe_message(exc: BaseException) -> str:
    """What a span says of an error: the product's own one-line message (or, with content
    captured, any error's), else only its type (a library's message may quote its input)."""
    if isinstance(exc, CritiqueError) or _state.content:
        return error_line(exc, TEXT_CHARS)
    return type(exc).__name__


def error_type(exc: BaseException) -> str:
    """``error.type``: the exception's fully qualified class name."""
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


class Traced:
    """The span a hook opened, or none (tracing off: every method does nothing)."""

    __slots__ = ("span",)

    def __init__(self, span: Any = None) -> None:
        self.span = span

    def set(self, **attributes: Any) -> None:
        """``critique.<key>`` attributes."""
        if self.span is not None:
            self.span.set_attributes(_critique(attributes))

    def ran(self, stage: str, state: LoopState, events: Callable[[], list[dict[str, Any]]]) -> None:
        """The stage ran: its ``stage`` trace event's figures become the span's attributes, its
        other events (rounds, gates, notes) span events ``critique.<type>``."""
        if self.span is None:
            return
        self.span.set_attribute("critique.next", state.next)
        for event in events():
            attributes = event_attributes(event, _state.content)
            kind = str(event.get("type") or "event")[:40]
            if kind == "stage" and event.get("stage") == stage:
                self.span.set_attributes(attributes)
            else:
                self.span.add_event(f"critique.{kind}", attributes)

    def verdict(self, result: CritiqueResult) -> None:
        """The pass's verdict: the event ``gen_ai.evaluation.result``."""
        if self.span is None:
            return
        self.set(status=result.status, stop_reason=result.stop_reason, repairs=len(result.attempts))
        self.span.add_event(
            "gen_ai.evaluation.result", evaluation_attributes(result, _state.content)
        )

    def failed(self, exc: BaseException) -> None:
        """A budget wait or a cancel is an event; any other error the span's status."""
        if self.span is None:
            return
        if isinstance(exc, BudgetWait):
            wait = {"retry_s": round(exc.retry_s, 3), "reason": exc.reason[:TEXT_CHARS]}
            self.span.add_event("critique.budget_wait", _critique(wait))
            return
        if isinstance(exc, PassCancelled):
            self.span.add_event("critique.cancelled")
            return
        if isinstance(exc, TaskPredicate):  # Celery's flow (a replacement's Ignore, a Retry)
            if not isinstance(exc, Ignore):
                self.span.add_event(f"celery.{type(exc).__name__.lower()}")
            return
        _error(self.span, exc)


OFF = Traced()


def _error(span: Any, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    message = _safe_message(exc)
    span.set_attribute("error.type", error_type(exc))
    span.add_event("exception", {"exception.type": error_type(exc), "exception.message": message})
    span.set_status(Status(StatusCode.ERROR, message))


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Traced]:
    """A span ``name`` around the block (with ``critique.<key>`` attributes), current while it
    runs; an error leaving the block is recorded (:meth:`Traced.failed`). Off: :data:`OFF`."""
    tracer = _state.tracer
    if tracer is None:
        yield OFF
        return
    with tracer.start_as_current_span(
        name,
        attributes=_critique(attributes),
        record_exception=False,
        set_status_on_exception=False,
    ) as opened:
        traced = Traced(opened)
        try:
            yield traced
        except BaseException as exc:
            traced.failed(exc)
            raise


def stage_span(
    stage: str, state: LoopState, pass_id: str = ""
) -> contextlib.AbstractContextManager[Traced]:
    """The span ``critique <stage>`` of one stage run of ``state``'s pass."""
    sub = state.submission
    return span(
        f"critique {stage}",
        stage=stage,
        run_id=sub.run_id,
        iteration=sub.iteration,
        worker_id=sub.worker_id,
        pass_id=pass_id or state.pass_id or None,
        round=state.round,
        attempt=state.attempt,
    )


def event(name: str, **attributes: Any) -> None:
    """An event ``name`` (``critique.<key>`` attributes) on the current span, if tracing."""
    if _state.tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().add_event(name, _critique(attributes))


# --- what spans say (pure) ------------------------------------------------------------------------

_ON_THE_SPAN = frozenset({"type", "stage", "worker_id", "iteration", "pass_id"})
"""Event fields the stage span carries already."""
_NAMES = frozenset(
    {"critic", "reviser", "cache", "verdict", "stop_reason", "status", "lease", "gate", "by",
     "after_step", "error", "check", "note"}
)  # fmt: skip
"""Text fields of trace events that are the product's own words (names, ids, verdicts), never
the output's: kept without :data:`CONTENT_ENV`."""


def event_attributes(event: Mapping[str, Any], content: bool = False) -> dict[str, Any]:
    """A trace-stream event as span attributes ``critique.<field>``: numbers and flags as they
    are, a mapping's numbers as ``<field>.<key>``, a list as its ``<field>.count``, text only for
    :data:`_NAMES` (any text with ``content``), clipped."""
    out: dict[str, Any] = {}
    for key, value in event.items():
        name = f"critique.{key}"
        if key in _ON_THE_SPAN or value is None:
            continue
        if isinstance(value, bool | int | float):
            out[name] = value
        elif isinstance(value, str):
            if key in _NAMES or content:
                out[name] = value[: TEXT_CHARS if not content else None]
        elif isinstance(value, Mapping):
            for k, v in value.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    out[f"{name}.{str(k)[:40]}"] = v
        elif isinstance(value, list | tuple):
            out[f"{name}.count"] = len(value)
    return out


def explanation(result: CritiqueResult, content: bool = False) -> str:
    """The verdict's deciding defect in one line (an escalated or failed output's first deciding
    defect, else the best output's first actionable one), else its stop reason: severity and
    category only, the location and description too with ``content``."""
    deciding = result.deciding_defects or result.envelope.actionable
    if not deciding:
        return f"{result.stop_reason}: no actionable defect"
    d = deciding[0]
    line = f"[{d.severity}] " + (defect_line(d) if content else d.category[:80])
    return line if content else line + (f" ({d.check})" if d.check else "")


def evaluation_attributes(result: CritiqueResult, content: bool = False) -> dict[str, Any]:
    """The ``gen_ai.evaluation.result`` event of a pass's result: the best score, the status
    as its label, the deciding defect as its explanation (:func:`explanation`)."""
    attributes: dict[str, Any] = {
        "gen_ai.evaluation.name": "critique",
        "gen_ai.evaluation.score.label": result.status,
        "gen_ai.evaluation.explanation": explanation(result, content),
        "critique.stop_reason": result.stop_reason,
        "critique.critic": result.envelope.critic[:TEXT_CHARS],
    }
    if result.best_score is not None:
        attributes["gen_ai.evaluation.score.value"] = result.best_score
    return attributes


def provider_name(model: str) -> str:
    """``gen_ai.provider.name`` of a litellm model name (its prefix, as the conventions name it;
    an unknown prefix as it is; :data:`OTHER` without one)."""
    prefix = provider_of(model)
    return PROVIDERS.get(prefix, prefix) or OTHER


def request_model(model: str) -> str:
    """``gen_ai.request.model``: the model as the provider is asked for it (no litellm prefix)."""
    return model.partition("/")[2] if provider_of(model) else model


@functools.lru_cache(maxsize=16)
def _server(api_base: str) -> dict[str, Any]:
    """``server.address`` and ``server.port`` of an API base URL (never its credentials)."""
    parts = urlsplit(api_base)
    return {"server.address": parts.hostname or ""} | (
        {"server.port": parts.port} if parts.port else {}
    )


def _messages(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "parts": [{"type": "text", "content": text}]}


def chat_attributes(
    request: LLMRequest, api_base: str | None = None, content: bool = False
) -> dict[str, Any]:
    """A ``chat`` span's attributes known before the call."""
    out: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider_name(request.model),
        "gen_ai.request.model": request_model(request.model),
        "critique.purpose": request.purpose,
    }
    if request.max_tokens:
        out["gen_ai.request.max_tokens"] = request.max_tokens
    if api_base:
        out.update(_server(api_base))
    if content:
        system = [m for m in request.messages if m.role == "system"]
        chat = [_messages(m.role, m.content) for m in request.messages if m.role != "system"]
        out["gen_ai.system_instructions"] = json.dumps(
            [{"type": "text", "content": m.content} for m in system], ensure_ascii=False
        )
        out["gen_ai.input.messages"] = json.dumps(chat, ensure_ascii=False)
    return out


def reply_attributes(reply: LLMReply, content: bool = False) -> dict[str, Any]:
    """A ``chat`` span's attributes from its reply: the usage as the provider reported it."""
    out: dict[str, Any] = {
        "gen_ai.response.model": reply.model,
        "gen_ai.usage.input_tokens": reply.usage.tokens_in,
        "gen_ai.usage.output_tokens": reply.usage.tokens_out,
        "critique.attempts": reply.usage.calls,
    }
    if reply.response_id:
        out["gen_ai.response.id"] = reply.response_id
    if content:
        out["gen_ai.output.messages"] = json.dumps(
            [_messages("assistant", reply.text)], ensure_ascii=False
        )
    return out


# --- the GenAI metrics (fleet counters; critique exporter serves them) ----------------------------


def metric_fields(
    model: str, seconds: float, reply: LLMReply | None, exc: BaseException | None
) -> list[tuple[str, int]]:
    """The fleet-counter increments of one model call: ``genai:duration:<provider>:<error
    type>:b<i>`` and ``:us`` (microseconds), and with reported usage ``genai:tokens:<provider>:
    <input|output>:b<i>`` and ``:sum`` (bucket ``i`` of :data:`DURATION_BUCKETS` /
    :data:`TOKEN_BUCKETS`, the last one ``+Inf``). Labels come from fixed lists."""
    provider = PROVIDERS.get(provider_of(model), OTHER)
    error = "" if exc is None else error_type(exc) if error_type(exc) in ERRORS else OTHER
    base = f"genai:duration:{provider}:{error}"
    out = [(f"{base}:b{bisect.bisect_left(DURATION_BUCKETS, seconds)}", 1)]
    out.append((f"{base}:us", max(0, round(seconds * 1e6))))
    if reply is not None and reply.usage.tokens > 0:
        for kind, n in (("input", reply.usage.tokens_in), ("output", reply.usage.tokens_out)):
            tokens = f"genai:tokens:{provider}:{kind}"
            out += [(f"{tokens}:b{bisect.bisect_left(TOKEN_BUCKETS, n)}", 1), (f"{tokens}:sum", n)]
    return out


Histograms = dict[tuple[str, str], tuple[list[tuple[str, int]], float]]


def metric_histograms(counts: Mapping[str, int]) -> tuple[Histograms, Histograms]:
    """``(tokens, durations)`` from the fleet counters :func:`metric_fields` wrote: per
    ``(provider, token type)`` and ``(provider, error type)``, the cumulative buckets
    ``[(le, count)…, ("+Inf", count)]`` and the sum (tokens, seconds). Fields that do not parse
    or carry a label off the fixed lists are skipped."""
    raw: dict[tuple[str, str, str], tuple[dict[int, int], list[float]]] = {}
    labels = {"tokens": ("input", "output"), "duration": ("", OTHER, *ERRORS)}
    providers = {*PROVIDERS.values(), OTHER}
    for field, n in counts.items():
        parts = field.split(":")
        if len(parts) != 5 or parts[0] != "genai" or parts[1] not in labels:
            continue
        _, metric, provider, label, slot = parts
        if provider not in providers or label not in labels[metric]:
            continue
        buckets, total = raw.setdefault((metric, provider, label), ({}, [0.0]))
        bounds = TOKEN_BUCKETS if metric == "tokens" else DURATION_BUCKETS
        if slot.startswith("b") and slot[1:].isdigit() and int(slot[1:]) <= len(bounds):
            buckets[int(slot[1:])] = buckets.get(int(slot[1:]), 0) + int(n)
        elif slot in ("sum", "us"):
            total[0] += n / 1e6 if slot == "us" else n
    tokens: Histograms = {}
    durations: Histograms = {}
    for (metric, provider, label), (buckets, total) in sorted(raw.items()):
        bounds = TOKEN_BUCKETS if metric == "tokens" else DURATION_BUCKETS
        cumulative, seen = [], 0
        for i, bound in enumerate((*bounds, float("inf"))):
            seen += buckets.get(i, 0)
            cumulative.append(("+Inf" if i == len(bounds) else repr(float(bound)), seen))
        (tokens if metric == "tokens" else durations)[(provider, label)] = (cumulative, total[0])
    return tokens, durations


# --- the model calls ------------------------------------------------------------------------------


class ObservedCompleter:
    """A :class:`~pipeline.llm.completion.Completer` whose calls are counted in the fleet's GenAI
    metrics (``count(field, n)``: :func:`metric_fields`) and, while tracing, each a GenAI span
    ``chat <model>`` (CLIENT) with the usage as the provider reported it. Anything else
    (``count_tokens``, ``warm``…) is the inner completer's."""

    def __init__(self, inner: Completer, count: Callable[[str, int], None]) -> None:
        self._inner = inner
        self._count = count
        config = getattr(inner, "config", None)
        self._api_base: str | None = getattr(config, "api_base", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, request: LLMRequest) -> LLMReply:
        began = time.perf_counter()
        with self._span(request) as opened:
            try:
                reply = self._inner(request)
            except Exception as exc:
                self._measure(request, began, None, exc)
                if opened is not None:
                    _error(opened, exc)
                raise
            self._measure(request, began, reply, None)
            if opened is not None:
                opened.set_attributes(reply_attributes(reply, _state.content))
            return reply

    def _measure(
        self, request: LLMRequest, began: float, reply: LLMReply | None, exc: Exception | None
    ) -> None:
        for field, n in metric_fields(request.model, time.perf_counter() - began, reply, exc):
            self._count(field, n)

    @contextlib.contextmanager
    def _span(self, request: LLMRequest) -> Iterator[Any]:
        tracer = _state.tracer
        if tracer is None:
            yield None
            return
        with tracer.start_as_current_span(
            f"chat {request_model(request.model)}",
            kind=_state.client_kind,
            attributes=chat_attributes(request, self._api_base, _state.content),
            record_exception=False,
            set_status_on_exception=False,
        ) as opened:
            yield opened
