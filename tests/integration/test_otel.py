"""Tracing end to end (issue 38): a client process, two Celery worker processes (a prefork one
on the dedicated critic queue, a threads one on the others) and litellm's real client against
the fake LLM server, exporting to a real OTLP/HTTP receiver on loopback (tests/support/otlp.py);
then single processes in fresh interpreters: tracing off imports nothing, a missing extra leaves
it off, spans carry content only opted in, waits and errors are events and statuses."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pipeline.models import Submission
from tests.fakes.openai_server import CRITIC, REPAIR, FakeOpenAIServer, critic_verdict, reply
from tests.support.entry import hand_built
from tests.support.otlp import OTLPReceiver, Span
from tests.support.rawcelery import entry_body, push, task_meta
from tests.support.workers import (
    ROOT,
    WorkerProcess,
    WorkerStarter,
    client_on,
    llm_env,
)
from workers import telemetry as t

pytestmark = pytest.mark.integration

CRITIC_MODEL = "openai/critic-model"
WORKER_MODEL = "openai/worker-model"
TASK = "Summarise the quarterly sales report: give a summary and the key findings."
DRAFT = {"summary": "Sales rose TODO in Q3.", "confidence": 0.8}
"""A placeholder and a missing field: Layer-0 fails it, so the critic's first call is skipped and
its one repair and the re-critique are the pass's two model calls."""
FIXED = {
    "summary": "Sales rose 4% in Q3.",
    "findings": "The north grew fastest.",
    "confidence": 0.9,
}
CONFIG = {
    "enabled": True,
    "critic": "llm",
    "model": CRITIC_MODEL,
    "mode": "dedicated",
    "budget": {"total_tokens": 1_000_000},
}
REPAIR_USAGE = (321, 45)
CRITIC_USAGE = (210, 30)
CONTENT = ("TODO in Q3", "The north grew fastest", TASK, "You are repairing", "You are the critic")
"""Submission, output and prompt text: in no span without the operator's opt-in."""
LLM = {
    "CRITIQUE_ALLOWED_MODELS": f"{CRITIC_MODEL},{WORKER_MODEL}",
    "CRITIQUE_LLM__MAX_RETRIES": "1",
    "CRITIQUE_LLM__BACKOFF_S": "0.01",
    "CRITIQUE_SECRET": "",
}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def env(redis_url: str, fake: FakeOpenAIServer) -> Iterator[dict[str, str]]:
    """This process (untraced) and the traced workers share the workers' database."""
    with llm_env(redis_url, fake.api_base, **LLM) as e:
        yield e


def otel(receiver: OTLPReceiver, **more: str) -> dict[str, str]:
    """Tracing on, to the receiver, each batch sent within 100 ms."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        **more,
    }


def start_pair(
    starter: WorkerStarter, prefix: str, env: dict[str, str], critic_env: dict[str, str]
) -> tuple[WorkerProcess, WorkerProcess]:
    """The critic's worker (dedicated queue) and one for critique.cpu and critique.llm."""
    critic = starter(
        f"{prefix}-critic", critic_env, pool="prefork", concurrency=1, queues="critique.llm.critic"
    )
    rest = starter(f"{prefix}-rest", env, concurrency=2, queues="critique.cpu,critique.llm")
    return critic, rest


@pytest.fixture(scope="module")
def traced(
    env: dict[str, str], receiver: OTLPReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """Both workers tracing to the receiver: the critic's under prefork (set up in its pool
    process), the other under threads (set up in its own); their sweepers probe the queues
    every 0.5 s (probes are never traced)."""
    starter = WorkerStarter(tmp_path_factory.mktemp("otel"))
    on = {**env, **otel(receiver), "CRITIQUE_SWEEP_S": "0.5"}
    try:
        yield start_pair(starter, "otel", on, on)
    finally:
        starter.stop_all()


def submit(env: dict[str, str], *subs: Submission) -> dict[str, Any]:
    """Submit through the client process (tests/support/otlp.py) and wait for the results."""
    job = {"config": CONFIG, "submissions": [s.model_dump(mode="json") for s in subs]}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.otlp", "submit"],
        input=json.dumps(job), capture_output=True, text=True, cwd=ROOT, env=env, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def draft(run_id: str) -> Submission:
    return Submission(
        run_id=run_id,
        worker_id="w1",
        task=TASK,
        output=DRAFT,
        required_fields=("summary", "findings"),
        model=WORKER_MODEL,
    )


def script_repair(fake: FakeOpenAIServer) -> None:
    fake.reset()
    fake.script(
        reply(json.dumps(FIXED), prompt_tokens=REPAIR_USAGE[0], completion_tokens=REPAIR_USAGE[1],
              match=REPAIR),
        reply(critic_verdict(0.95), prompt_tokens=CRITIC_USAGE[0],
              completion_tokens=CRITIC_USAGE[1], match=CRITIC),
    )  # fmt: skip


def evaluations(trace: list[Span]) -> list[dict[str, Any]]:
    return [a for s in trace for name, a in s.events if name == "gen_ai.evaluation.result"]


def connected(trace: list[Span], root: Span) -> bool:
    """Every span but ``root`` has its parent in the trace: one tree."""
    ids = {s.span_id for s in trace}
    return all(s.parent_id in ids for s in trace if s is not root)


REPAIRED_TRACE = {
    "critique submit", "apply_async/critique.l0", "run/critique.l0", "critique l0",
    "critique critic", "critique decide", "apply_async/critique.repair", "run/critique.repair",
    "critique repair", "chat worker-model", "apply_async/critique.critic", "run/critique.critic",
    "chat critic-model", "critique gate",
}  # fmt: skip


def test_a_repaired_output_is_one_trace_across_the_client_and_both_workers(
    env: dict[str, str],
    traced: tuple[WorkerProcess, WorkerProcess],
    fake: FakeOpenAIServer,
    receiver: OTLPReceiver,
) -> None:
    """One output repaired across two workers: one trace rooted at the client's submit, every
    stage a span, two GenAI chat spans with the fake's usage, one evaluation event labelled with
    the result's status, no content in any span, and the fleet's GenAI metrics counted."""
    script_repair(fake)
    run_id = f"otel-{uuid.uuid4().hex[:8]}"
    out = submit({**env, **otel(receiver, OTEL_SERVICE_NAME="the-manager")}, draft(run_id))
    [result] = out["results"]
    assert (result["status"], len(result["attempts"])) == ("repaired", 1)
    assert out["tracing"]["on"] is True

    def complete(spans: list[Span]) -> bool:
        ids = {s.trace_id for s in spans if s.attributes.get("critique.run_id") == run_id}
        return len(ids) == 1 and {s.name for s in spans if s.trace_id in ids} >= REPAIRED_TRACE

    spans = receiver.wait_for(complete)
    [trace_id] = {s.trace_id for s in spans if s.attributes.get("critique.run_id") == run_id}
    trace = receiver.trace(trace_id)
    [root] = [s for s in trace if not s.parent_id]
    assert (root.name, root.service) == ("critique submit", "the-manager")
    assert connected(trace, root)
    by_id = {s.span_id: s for s in trace}
    runs = [s for s in trace if s.name.startswith("run/")]
    assert all(s.kind == "CONSUMER" and by_id[s.parent_id].kind == "PRODUCER" for s in runs)
    # Each queue has one consumer (the critic's worker, the other), and each run was sent by
    # another process: the client, then each worker in turn.
    queues = {s.name: s.attributes["messaging.destination"] for s in runs}
    assert queues == {"run/critique.l0": "critique.llm.critic",
                      "run/critique.repair": "critique.llm",
                      "run/critique.critic": "critique.llm.critic"}  # fmt: skip
    assert len({s.attributes["celery.hostname"] for s in runs}) == 3  # the senders' origins
    assert {s.service for s in trace} == {"the-manager", "critique-worker"}
    stages = Counter(s.name for s in trace if s.name.startswith("critique ") and s is not root)
    assert stages == {"critique l0": 2, "critique critic": 2, "critique decide": 2,
                      "critique repair": 1, "critique gate": 1}  # fmt: skip

    chats = {s.name: s.attributes for s in trace if s.name.startswith("chat ")}
    assert chats.keys() == {"chat worker-model", "chat critic-model"}
    for name, (tokens_in, tokens_out) in (
        ("chat worker-model", REPAIR_USAGE),
        ("chat critic-model", CRITIC_USAGE),
    ):
        a = chats[name]
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
            tokens_in,
            tokens_out,
        )
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "openai"
        assert a["gen_ai.request.model"] == name.removeprefix("chat ")
        assert a["gen_ai.response.id"].startswith("chatcmpl-fake-")
        assert a["gen_ai.response.model"]
    assert all(s.kind == "CLIENT" for s in trace if s.name.startswith("chat "))

    [evaluation] = evaluations(trace)
    assert evaluation["gen_ai.evaluation.score.label"] == result["status"]
    assert evaluation["gen_ai.evaluation.score.value"] == pytest.approx(result["best_score"])
    [repair] = [s for s in trace if s.name == "critique repair"]
    assert repair.attributes["critique.tokens"] == sum(REPAIR_USAGE)

    values = [str(v) for s in trace for v in s.values()]
    assert not [v for v in values if any(text in v for text in CONTENT)]
    assert not [s.name for s in receiver.spans if s.name.endswith("/critique.probe")]
    assert_genai_metrics()


def assert_genai_metrics() -> None:
    """``critique exporter``'s GenAI histograms hold the two calls' usage (after the workers'
    counters reached the store: they are sent after each task)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support import wait_until
    from workers.commands.exporter import registry

    def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        text = generate_latest(registry()).decode()
        got = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        labels = (("error_type", ""), ("gen_ai_operation_name", "chat"),
                  ("gen_ai_provider_name", "openai"))  # fmt: skip
        done = got.get(("gen_ai_client_operation_duration_seconds_count", labels)) == 2
        return got if done else None

    got = wait_until(samples, 30, what="the GenAI metrics")

    def usage(kind: str, what: str) -> float:
        labels = (("gen_ai_operation_name", "chat"), ("gen_ai_provider_name", "openai"),
                  ("gen_ai_token_type", kind))  # fmt: skip
        return got[(f"gen_ai_client_token_usage_{what}", labels)]

    assert usage("input", "sum") == REPAIR_USAGE[0] + CRITIC_USAGE[0]
    assert usage("output", "sum") == REPAIR_USAGE[1] + CRITIC_USAGE[1]
    assert usage("input", "count") == usage("output", "count") == 2


def test_a_traceparent_sent_with_a_raw_entry_message_is_the_parent_of_the_pipelines_spans(
    env: dict[str, str],
    traced: tuple[WorkerProcess, WorkerProcess],
    fake: FakeOpenAIServer,
    receiver: OTLPReceiver,
) -> None:
    """A manager in any language puts its W3C ``traceparent`` in the entry message's headers:
    the entry task's span is its child, and every span of the pass is in its trace."""
    fake.reset()
    fake.on(CRITIC, critic_verdict(0.95))
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    task_id, run_id = str(uuid.uuid4()), f"otel-entry-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(env["REDIS_URL"])
    body = entry_body(hand_built(run_id), task_id, CONFIG)
    push(r, "critique.submit", task_id, body, headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    meta = task_meta(r, task_id)
    assert (meta["status"], meta["result"]["status"]) == ("SUCCESS", "accepted")

    wanted = {"run/critique.submit", "critique submit", "apply_async/critique.l0",
              "run/critique.l0", "critique critic", "chat critic-model",
              "critique gate"}  # fmt: skip
    receiver.wait_for(lambda spans: wanted <= {s.name for s in spans if s.trace_id == trace_id})
    trace = receiver.trace(trace_id)
    [entry] = [s for s in trace if s.name == "run/critique.submit"]
    assert (entry.parent_id, entry.kind) == (parent, "CONSUMER")
    assert connected(trace, entry)
    assert {s.attributes.get("critique.run_id") for s in trace if s.name == "critique gate"} == {
        run_id
    }
    [evaluation] = evaluations(trace)
    assert evaluation["gen_ai.evaluation.score.label"] == "accepted"


def test_with_tracing_off_nothing_is_exported_and_no_tracing_module_is_loaded(
    redis_url: str, fake: FakeOpenAIServer, start_worker: WorkerStarter
) -> None:
    """No endpoint on the critic's worker; OTEL_SDK_DISABLED=true beside an endpoint on the
    other worker and on the client: a repaired output sends the receiver nothing, and no process
    loads the SDK's tracing, the OTLP exporter or the Celery instrumentation."""

    script_repair(fake)
    with (
        OTLPReceiver() as receiver,
        client_on(
            redis_url,
            CRITIQUE_LLM_API_KEY="sk-test",
            CRITIQUE_LLM__API_BASE=fake.api_base,
            CRITIQUE_LLM__TIMEOUT_S="5",
            **LLM,
        ) as off,
    ):  # a database of its own: the module's traced workers consume the same queues on theirs
        disabled = otel(receiver, OTEL_SDK_DISABLED="true")
        critic = start_worker("off-critic", off, concurrency=1, queues="critique.llm.critic")
        rest = start_worker("off-rest", {**off, **disabled}, queues="critique.cpu,critique.llm")
        out = submit({**off, **disabled}, draft(f"otel-off-{uuid.uuid4().hex[:8]}"))
        assert out["results"][0]["status"] == "repaired"
        assert out["tracing"] == {"on": False, "loaded": []}
        for w in (critic, rest):
            stats = _stats(off["REDIS_URL"], w.nodename)
            assert stats["critique_tracing"] == {"on": False, "loaded": []}
            w.stop()  # a tracing process would export what it holds as it exits
        assert receiver.requests == 0


def _stats(url: str, node: str) -> dict[str, Any]:
    """``celery inspect stats`` of one worker through a Celery app of its own on ``url`` (this
    process's app may carry another test's broker or transport settings), asked again until it
    answers: on a loaded machine a broadcast's reply can miss a 5 s window."""
    from celery import Celery

    for _ in range(6):
        probe = Celery("probe", broker=url, set_as_current=False)
        try:
            got = probe.control.inspect(destination=[node], timeout=5).stats()
        finally:
            probe.close()
        if got and node in got:
            return dict(got[node])
    raise AssertionError(f"{node} did not answer `inspect stats` in 6 tries")


# --- single processes, each in a fresh interpreter (no Redis, no worker) ----------------------

SECRET = "the quarterly numbers nobody may see"


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter of this checkout, with ``env`` and no other OTEL_*."""
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**base, "PYTHONPATH": str(ROOT), **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _fresh(code: str, **env: str) -> dict[str, Any]:
    """The one JSON line ``code`` prints last (:func:`_run`), with its ``stderr``."""
    done = _run(code, **env)
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    out["stderr"] = done.stderr
    return out


EXERCISE = """
    import json, sys
    import workers.app, workers.tasks, workers.client  # what a worker and a client import
    from pipeline.llm.completion import LLMReply, LLMRequest, ChatMessage
    from pipeline.loop.stages import start
    from pipeline.models import Submission
    from workers import telemetry

    def loaded():
        return sorted(m for m in sys.modules if m.startswith("opentelemetry"))

    before = loaded()
    on = telemetry.setup()
    sub = Submission(run_id="r", worker_id="w", task="t", output="o")
    with telemetry.stage_span("l0", start(sub)) as traced:
        traced.ran("l0", start(sub), lambda: [{"type": "stage", "stage": "l0", "defects": 1}])
        telemetry.event("critique.rate_limit_wait", wait_s=0.1)
    counted = []
    complete = telemetry.ObservedCompleter(
        lambda r: LLMReply(text="ok", model="m"), lambda f, n: counted.append(f)
    )
    complete(LLMRequest(model="openai/m", messages=(ChatMessage(role="user", content="hi"),)))
    print(json.dumps({"on": on, "new": sorted(set(loaded()) - set(before)),
                      "status": telemetry.status(), "counted": len(counted)}))
"""


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SDK_DISABLED": "true"},
    ],
    ids=["no-endpoint", "sdk-disabled"],
)
def test_tracing_off_imports_no_opentelemetry_module(env: dict[str, str]) -> None:
    """Off, set up, a stage span, an event and a model call import nothing of OpenTelemetry (beyond
    what redis-py and litellm load themselves) and load no tracing module; the call is still
    counted in the fleet's GenAI metrics."""
    out = _fresh(EXERCISE, **env)
    assert out["on"] is False and out["new"] == []
    assert out["status"] == {"on": False, "loaded": []}
    assert out["counted"] == 2  # its duration: a bucket and the sum (no usage reported)


def test_without_the_extra_tracing_stays_off_with_one_warning() -> None:
    """An endpoint set where the SDK cannot be imported: one warning naming the extra, tracing
    off, the pipeline's hooks still work."""
    blocked = """
        import importlib.abc, sys
        class NoSDK(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
                    raise ImportError(f"No module named {name!r}")
        sys.meta_path.insert(0, NoSDK())
        import logging
        logging.basicConfig()
    """
    code = textwrap.dedent(blocked) + textwrap.dedent(EXERCISE)
    out = _fresh(code, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9")
    assert out["on"] is False and out["status"]["on"] is False
    assert out["stderr"].count("pip install 'critique-pipeline[otel]'") == 1


def test_the_content_opt_in_puts_the_prompt_and_reply_in_the_exported_span() -> None:
    """With OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true the exported chat span (the
    console exporter's) holds the prompt and the reply; without it, neither."""
    code = f"""
        from pipeline.llm.completion import LLMReply, LLMRequest, ChatMessage
        from pipeline.models import Usage
        from workers import telemetry
        assert telemetry.setup()
        complete = telemetry.ObservedCompleter(
            lambda r: LLMReply(text="reply", usage=Usage(tokens_in=5, tokens_out=2)),
            lambda f, n: None,
        )
        message = ChatMessage(role="user", content="{SECRET}")
        complete(LLMRequest(model="openai/m", messages=(message,)))
        telemetry.shutdown()
    """
    for opted in (True, False):
        extra = {t.CONTENT_ENV: "true"} if opted else {}
        printed = _run(code, OTEL_TRACES_EXPORTER="console", **extra).stdout
        assert '"name": "chat m"' in printed and '"gen_ai.usage.input_tokens": 5' in printed
        assert (SECRET in printed) is opted


def test_waits_cache_hits_and_errors_are_span_events_and_attributes_without_foreign_text() -> None:
    """A budget wait and a cancel are events, not errors; a critic stage's cache hit is an
    attribute; a rate-limit wait is an event on its chat span; a library's error marks the span
    with its type only (its message may quote the output), the product's own with its message."""
    code = f"""
        from pipeline.errors import SubmissionError
        from pipeline.llm.completion import LLMReply, LLMRequest, ChatMessage
        from pipeline.models import Submission
        from pipeline.loop.stages import BudgetWait, PassCancelled, start
        from workers import telemetry
        assert telemetry.setup()
        state = start(Submission(run_id="r", worker_id="w", task="t", output="o"))
        for stage, exc in (("decide", BudgetWait(0.5, "repair budget: 10 tokens wait")),
                           ("repair", PassCancelled("pass p was cancelled")),
                           ("l0", ValueError("input_value='{SECRET}'")),
                           ("gate", SubmissionError("stage message: 'sid' must be a string"))):
            try:
                with telemetry.stage_span(stage, state):
                    raise exc
            except Exception:
                pass
        with telemetry.stage_span("critic", state) as traced:
            hit = {{"type": "stage", "stage": "critic", "cache": "hit", "tokens": 0}}
            traced.ran("critic", state, lambda: [hit])

        def waits(request):
            telemetry.event("critique.rate_limit_wait", model=request.model, wait_s=1.5)
            return LLMReply(text="ok")

        complete = telemetry.ObservedCompleter(waits, lambda f, n: None)
        complete(LLMRequest(model="openai/m", messages=(ChatMessage(role="user", content="x"),)))
        telemetry.shutdown()
    """
    printed = _run(code, OTEL_TRACES_EXPORTER="console").stdout
    spans = {s["name"]: s for s in _objects(printed)}
    decide, repair = spans["critique decide"], spans["critique repair"]
    assert decide["status"]["status_code"] == repair["status"]["status_code"] == "UNSET"
    [wait] = decide["events"]
    assert (wait["name"], wait["attributes"]["critique.retry_s"]) == ("critique.budget_wait", 0.5)
    assert [e["name"] for e in repair["events"]] == ["critique.cancelled"]
    l0, gate = spans["critique l0"], spans["critique gate"]
    assert (l0["status"]["status_code"], l0["attributes"]["error.type"]) == (
        "ERROR",
        "builtins.ValueError",
    )
    assert SECRET not in printed and l0["status"]["description"] == "ValueError"
    assert gate["status"]["description"] == "stage message: 'sid' must be a string"
    assert spans["critique critic"]["attributes"]["critique.cache"] == "hit"
    [limited] = spans["chat m"]["events"]
    assert (limited["name"], limited["attributes"]["critique.wait_s"]) == (
        "critique.rate_limit_wait",
        1.5,
    )


def _objects(printed: str) -> list[dict[str, Any]]:
    """The JSON objects the console exporter printed, one after another."""
    decoder, at, out = json.JSONDecoder(), 0, []
    while (at := printed.find("{", at)) >= 0:
        obj, at = decoder.raw_decode(printed, at)
        out.append(obj)
    return out
