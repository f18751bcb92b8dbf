"""The worker's door (pipeline.security.message_checks): a well-formed protocol-2 message of a task
the worker runs is admitted (with its delivery tag and info rewritten), anything else is a refusal
with a bounded reason, and no input at all makes the check raise."""

from __future__ import annotations

import base64
import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.security import message_checks as env
from tests.support.rawcelery import protocol2

QUEUE = "critique.cpu"
POLICY = env.Policy(
    tasks={"critique.submit": (1, 1), "critique.probe": (2, 2)},
    queues=frozenset({"critique.cpu", "critique.llm", "critique.llm.critic"}),
    max_delay_s=600.0,
    max_expires_s=86400.0,
    max_timelimit_s=600.0,
)
NOW = time.time()


def honest() -> dict[str, Any]:
    """A hand-built entry message, as docs/entry.md shows (the manager's raw LPUSH)."""
    doc: dict[str, Any] = json.loads(protocol2("critique.submit", "t-1", [{"v": 1}]))
    return doc


def with_body(doc: dict[str, Any], body: Any) -> dict[str, Any]:
    doc["body"] = base64.b64encode(json.dumps(body).encode()).decode()
    return doc


def check(doc: Any) -> env.Admitted | env.Refusal:
    raw = doc if isinstance(doc, bytes | str) else json.dumps(doc)
    return env.check_raw(raw, QUEUE, POLICY, NOW)


def reason(doc: Any) -> str:
    got = check(doc)
    assert isinstance(got, env.Refusal), "admitted"
    assert got.reason in env.REASONS
    return got.reason


def test_an_honest_entry_message_is_admitted_with_a_fresh_tag_and_its_own_queue() -> None:
    """Admitted: the sender's delivery tag and routing are replaced (they could overwrite another
    message's unacked record, or send a restore to any key)."""
    doc = honest()
    doc["properties"]["delivery_info"] = {"exchange": "x", "routing_key": "critique:pending:runs"}
    got = check(doc)
    assert isinstance(got, env.Admitted)
    props = got.payload["properties"]
    assert props["delivery_tag"] != doc["properties"]["delivery_tag"]
    assert props["delivery_info"] == {"exchange": "", "routing_key": QUEUE}
    assert (got.task, got.task_id) == ("critique.submit", "t-1")


def test_a_message_celery_itself_builds_is_admitted() -> None:
    """What kombu publishes for a Celery client (every protocol-2 header, an eta a retry gives)."""
    doc = honest()
    soon = datetime.fromtimestamp(NOW + 60, UTC).isoformat()
    doc["headers"].update(
        eta=soon, group_index=None, replaced_task_nesting=2, stamped_headers=None, stamps={},
        timelimit=[None, None], budget_wait=1,
    )  # fmt: skip
    assert isinstance(check(doc), env.Admitted)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"x", "json"),
        (b"\xff\xfe{}", "encoding"),
        (b"42", "envelope"),
        (b"[1, 2]", "envelope"),
        (b'"text"', "envelope"),
        (b"[" * 100_000 + b"]" * 100_000, "depth"),
        (b'{"body": NaN}', "json"),
    ],
)
def test_bytes_that_are_no_envelope_are_refused(raw: bytes, why: str) -> None:
    """Non-JSON, invalid UTF-8, a JSON number, list or string, a depth json cannot parse."""
    assert reason(raw) == why


def test_each_broken_envelope_field_is_refused() -> None:
    """Wrong types where kombu or Celery index or decode: headers, properties, body."""
    cases: list[tuple[str, Any]] = [
        ("headers", "not a dict"),
        ("properties", [1]),
        ("body", None),
        ("body", "%%% not base64 %%%"),
        ("content-type", "application/x-python-serialize"),
    ]
    for field, value in cases:
        doc = honest()
        doc[field] = value
        assert reason(doc) in ("envelope", "headers"), field


def test_a_body_that_is_not_args_kwargs_embed_is_refused() -> None:
    """The body: [args, kwargs, embed] with the task's arity, no kwargs, no chord."""
    for body in (
        None, 5, "x", {"args": [1]}, [[1], {}], ["a", {}, {}], [[1], [], {}],
        [[1, 2], {}, {}], [[1], {"k": 1}, {}], [[1], {}, {"chord": {"task": "critique.submit"}}],
    ):  # fmt: skip
        assert reason(with_body(honest(), body)) == "body", body


def test_body_bytes_that_are_not_utf8_json_are_refused() -> None:
    doc = honest()
    doc["body"] = base64.b64encode(b"\xff\xff").decode()
    assert reason(doc) == "encoding"
    doc["body"] = base64.b64encode(b"[[1], {}, ").decode()
    assert reason(doc) == "json"


def test_a_body_nested_deeper_than_the_bound_is_refused() -> None:
    deep: Any = "x"
    for _ in range(env.MAX_DEPTH + 5):
        deep = [deep]
    assert reason(with_body(honest(), [[deep], {}, {}])) == "depth"


def test_kombu_typed_objects_are_refused() -> None:
    """kombu's decoder would turn {"__type__", "__value__"} into bytes, dates or UUIDs."""
    typed = {"__type__": "bytes", "__value__": "eA=="}
    assert reason(with_body(honest(), [[typed], {}, {}])) == "body"


@pytest.mark.parametrize(
    "task", ["celery.accumulate", "celery.group", "celery.chord_unlock", "nope", "critique.x"]
)
def test_tasks_the_worker_does_not_run_are_refused(task: str) -> None:
    doc = honest()
    doc["headers"]["task"] = task
    got = check(doc)
    assert isinstance(got, env.Refusal) and got.reason == "task" and got.task == task


def test_callbacks_may_name_only_the_products_tasks_on_its_queues() -> None:
    """A link to a built-in task, a group, or a queue that is a store key is refused."""
    for link in (
        {"task": "celery.group", "options": {}},
        {"task": "critique.submit", "options": {"queue": "critique:{r}:entries"}},
        {"task": "critique.submit", "options": {"routing_key": "critique:pending:runs"}},
        {"task": "critique.submit", "subtask_type": "group"},
    ):
        body = [[1], {}, {"callbacks": None, "errbacks": None, "chain": [link], "chord": None}]
        assert reason(with_body(honest(), body)) == "body", link
    fine = {"task": "critique.submit", "options": {"queue": "critique.llm"}}
    body = [[1], {}, {"callbacks": [fine], "errbacks": None, "chain": None, "chord": None}]
    assert isinstance(check(with_body(honest(), body)), env.Admitted)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("id", "a b"),
        ("id", 5),
        ("retries", -1),
        ("retries", True),
        ("timelimit", [None, 10**9]),
        ("timelimit", "x"),
        ("group", "g-1"),
        ("ignore_result", "no"),
        ("argsrepr", {"a": 1}),
        ("chain", "x"),
        ("is_eager", True),
        ("custom", {"nested": 1}),
    ],
)
def test_headers_of_the_wrong_type_or_a_reserved_name_are_refused(header: str, value: Any) -> None:
    doc = honest()
    doc["headers"][header] = value
    assert reason(doc) == "headers"


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("eta", "2099-01-01T00:00:00+00:00"),
        ("eta", "2099-01-01T00:00:00"),
        ("eta", "tomorrow"),
        ("eta", 12),
        ("expires", "2099-01-01T00:00:00Z"),
    ],
)
def test_an_eta_or_expires_beyond_the_bound_or_unreadable_is_refused(
    header: str, value: Any
) -> None:
    """Hoarding: a message held for an eta in 2099 would sit in the worker and in unacked."""
    doc = honest()
    doc["headers"][header] = value
    assert reason(doc) == "eta"


def test_a_refusal_names_the_task_and_id_escaped_and_short() -> None:
    doc = honest()
    doc["headers"]["id"] = "\x1b[31m" + "i" * 500
    got = check(doc)
    assert isinstance(got, env.Refusal) and got.task_id is not None
    assert got.task_id.isascii() and "\x1b" not in got.task_id and len(got.task_id) < 140


def test_the_consumer_check_reads_any_brokers_message() -> None:
    """check_message: headers, body bytes and content type as a kombu message holds them."""
    doc = honest()
    body = base64.b64decode(doc["body"])
    ok = env.check_message(doc["headers"], body, "application/json", "utf-8", POLICY, NOW)
    assert ok is None
    bad = env.check_message({"task": "celery.group", "id": "x"}, body, "application/json",
                            "utf-8", POLICY, NOW)  # fmt: skip
    assert bad is not None and bad.reason == "task"
    assert env.check_message(None, None, None, None, POLICY, NOW) is not None


def test_a_control_message_kombu_cannot_build_is_refused() -> None:
    good = honest()
    assert env.check_fanout(good) is None
    for bad in (5, {"properties": 1}, {"properties": {"delivery_tag": 1}}):
        assert env.check_fanout(bad) is not None


def test_the_excerpt_is_printable_ascii_and_short() -> None:
    out = env.excerpt(b"\x00\xff\x1b[2J" + b"a" * 1000)
    assert out.isascii() and out.isprintable() and len(out) < 200


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_are_refused_or_admitted_never_raised(raw: bytes) -> None:
    got = check(raw)
    assert isinstance(got, env.Refusal | env.Admitted)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=20,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(field=st.sampled_from(["headers", "properties", "body", "content-type", "x"]), value=JSON)
def test_any_json_in_any_envelope_field_never_raises(field: str, value: Any) -> None:
    """Whatever value one field holds, the door answers (and an admitted one still has the
    shape kombu indexes)."""
    doc = honest()
    doc[field] = value
    got = check(doc)
    if isinstance(got, env.Admitted):
        assert isinstance(got.payload["properties"]["delivery_tag"], str)
        assert got.task in POLICY.tasks


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(header=st.sampled_from([*sorted(env.KNOWN_HEADERS), "x", "chain"]), value=JSON)
def test_any_header_value_never_raises(header: str, value: Any) -> None:
    doc = honest()
    doc["headers"][header] = value
    assert isinstance(check(doc), env.Refusal | env.Admitted)
    body = base64.b64decode(honest()["body"])
    got = env.check_message(doc["headers"], body, "application/json", "utf-8", POLICY, NOW)
    assert got is None or got.reason in env.REASONS


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(body=JSON)
def test_any_body_never_raises(body: Any) -> None:
    got = check(with_body(honest(), body))
    assert isinstance(got, env.Refusal | env.Admitted)
