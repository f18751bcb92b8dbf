"""Tracing's pure helpers (workers/telemetry.py): which variables turn it on, what a span may
say (redaction), the GenAI metric fields. The processes that trace (or not) are in
tests/integration/test_otel.py."""

from __future__ import annotations

import json

import pytest

from pipeline.llm.completion import ChatMessage, LLMReply, LLMRequest
from pipeline.models import CritiqueEnvelope, CritiqueResult, Defect, Usage
from workers import telemetry as t

SECRET = "the quarterly numbers nobody may see"


def test_tracing_is_on_only_where_the_standard_variables_say_so() -> None:
    """An OTLP endpoint or OTEL_TRACES_EXPORTER turns it on; OTEL_SDK_DISABLED=true, 'none' or
    nothing at all leaves it off."""
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert t.exporters({}) == ()
    assert t.exporters(endpoint) == ("otlp",)
    assert t.exporters({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == (
        "otlp",
    )
    assert t.exporters({**endpoint, "OTEL_SDK_DISABLED": "TRUE"}) == ()
    assert t.exporters({**endpoint, "OTEL_TRACES_EXPORTER": "none"}) == ()
    assert t.exporters({"OTEL_TRACES_EXPORTER": "console, otlp,console"}) == ("console", "otlp")
    assert t.capture_content({t.CONTENT_ENV: "true"}) and not t.capture_content({})


def test_trace_events_become_numbers_and_names_never_text_unless_opted_in() -> None:
    """Numbers, flags and the product's own names are kept; a reason that may quote the output
    only with the opt-in; mappings flatten, lists count, the span's own ids are not repeated."""
    event = {
        "type": "round", "stage": "decide", "worker_id": "w1", "round": 2, "score": 0.5,
        "verdict": "continue", "reason": f"placeholder '{SECRET}' at summary",
        "scores": {"accuracy": 0.4}, "fixed": [["missing_data", "findings"]], "lease": None,
        "budget_wait": True,
    }  # fmt: skip
    plain = t.event_attributes(event)
    assert plain == {
        "critique.round": 2,
        "critique.score": 0.5,
        "critique.verdict": "continue",
        "critique.scores.accuracy": 0.4,
        "critique.fixed.count": 1,
        "critique.budget_wait": True,
    }
    assert SECRET in t.event_attributes(event, content=True)["critique.reason"]


def _result(status: str, stop: str, defect: Defect | None) -> CritiqueResult:
    envelope = CritiqueEnvelope(
        worker_id="w1", score=0.4, defects=(defect,) if defect else (), critic="llm:openai/m"
    )
    return CritiqueResult(
        run_id="r", worker_id="w1", status=status, stop_reason=stop, output={"a": SECRET},
        original_score=0.4, best_score=0.4, envelope=envelope,
    )  # fmt: skip


def test_the_evaluation_event_explains_the_deciding_defect_without_its_text_by_default() -> None:
    """score.label is the status, score.value the best score; the explanation names the deciding
    defect's severity and category in one line, its location and description only opted in."""
    defect = Defect(
        category="missing_data",
        severity="critical",
        location="findings",
        description=f"the findings omit {SECRET}",
        source="llm",
    )
    result = _result("escalated", "attempts_exhausted", defect)
    plain = t.evaluation_attributes(result)
    assert plain["gen_ai.evaluation.score.label"] == "escalated"
    assert plain["gen_ai.evaluation.score.value"] == 0.4
    assert plain["gen_ai.evaluation.explanation"] == "[critical] missing_data"
    assert SECRET not in json.dumps(plain)
    opted = t.evaluation_attributes(result, content=True)["gen_ai.evaluation.explanation"]
    assert opted == f"[critical] missing_data at findings: the findings omit {SECRET}"
    accepted = t.evaluation_attributes(_result("accepted", "accepted", None))
    assert accepted["gen_ai.evaluation.explanation"] == "accepted: no actionable defect"


def test_chat_spans_name_the_call_and_its_usage_and_carry_messages_only_opted_in() -> None:
    """GenAI attributes from the request and the provider-reported usage; the prompt and the
    reply as gen_ai.*.messages only with the opt-in."""
    request = LLMRequest(
        model="anthropic/claude-x",
        messages=(
            ChatMessage(role="system", content="sys"),
            ChatMessage(role="user", content=SECRET),
        ),
        max_tokens=200,
        purpose="repair",
    )
    reply = LLMReply(
        text=SECRET, usage=Usage(tokens_in=12, tokens_out=3, calls=1), model="claude-x-1",
        response_id="msg_1",
    )  # fmt: skip
    before = t.chat_attributes(request, "https://user:pw@llm.example:8443/v1")
    assert before == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "anthropic",
        "gen_ai.request.model": "claude-x",
        "gen_ai.request.max_tokens": 200,
        "critique.purpose": "repair",
        "server.address": "llm.example",
        "server.port": 8443,
    }
    after = t.reply_attributes(reply)
    assert (after["gen_ai.usage.input_tokens"], after["gen_ai.usage.output_tokens"]) == (12, 3)
    assert (after["gen_ai.response.id"], after["gen_ai.response.model"]) == ("msg_1", "claude-x-1")
    assert SECRET not in json.dumps([before, after])
    opted = {**t.chat_attributes(request, content=True), **t.reply_attributes(reply, content=True)}
    assert json.loads(opted["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": SECRET}]}
    ]
    assert (
        SECRET in opted["gen_ai.output.messages"] and "sys" in opted["gen_ai.system_instructions"]
    )


def test_provider_and_model_names_follow_the_genai_conventions() -> None:
    """litellm's prefix becomes the conventions' provider name; the request model loses it."""
    assert t.provider_name("bedrock/anthropic.claude") == "aws.bedrock"
    assert t.provider_name("ollama/llama3") == "ollama"
    assert t.provider_name("gpt-4o") == t.OTHER
    assert t.request_model("openai/gpt-4o-mini") == "gpt-4o-mini"
    assert t.request_model("gpt-4o") == "gpt-4o"


def test_metric_fields_add_up_to_cumulative_histograms_and_foreign_fields_are_skipped() -> None:
    """Two calls' fields, summed as the store sums them, read back as Prometheus histograms; a
    field with a label off the fixed lists (planted in Redis) is ignored."""
    counts: dict[str, int] = {}
    ok = LLMReply(text="", usage=Usage(tokens_in=300, tokens_out=3, calls=1))
    for model, seconds, reply, exc in (
        ("openai/a", 0.05, ok, None),
        ("weird/b", 2.0, None, TimeoutError("x")),
    ):
        for field, n in t.metric_fields(model, seconds, reply, exc):
            counts[field] = counts.get(field, 0) + n
    counts["genai:tokens:evil-provider:input:b0"] = 99
    counts["genai:duration:openai:oops:b0"] = 99
    tokens, durations = t.metric_histograms(counts)
    assert set(tokens) == {("openai", "input"), ("openai", "output")}
    buckets, total = tokens[("openai", "input")]
    assert total == 300 and buckets[-1] == ("+Inf", 1)
    assert dict(buckets)["256.0"] == 0 and dict(buckets)["1024.0"] == 1
    assert set(durations) == {("openai", ""), ("_OTHER", "_OTHER")}
    fast, seconds = durations[("openai", "")]
    assert dict(fast)["0.04"] == 0 and dict(fast)["0.08"] == 1
    assert seconds == pytest.approx(0.05)


def test_a_span_names_an_errors_type_unless_the_message_is_ours_or_content_is_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A span's error message: the product's own message on one line (its type's name when it
    is empty), any other error only by its type (its text may quote input) unless content
    capture is on."""
    from pipeline.errors import ConfigError

    monkeypatch.setattr(t._state, "content", False)
    assert t._safe_message(ConfigError("no key\nset X", hint="set it")) == "no key set X"
    assert t._safe_message(ConfigError("")) == "ConfigError"
    assert t._safe_message(ValueError("the secret input")) == "ValueError"
    monkeypatch.setattr(t._state, "content", True)
    assert t._safe_message(ValueError("the input\nquoted")) == "the input quoted"
    assert t._safe_message(ValueError()) == "ValueError"
