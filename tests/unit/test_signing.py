"""Signed broker messages (pipeline.security.signing) and the codec around them
(workers.runtime)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
from pathlib import Path

import pytest

from pipeline.errors import ConfigError, ForgedMessageError, PermanentError, SubmissionError
from pipeline.loop.stages import start
from pipeline.models import Submission
from pipeline.security import signing

KEY = b"k" * 32
OTHER = b"o" * 32
MSG = {
    "v": 1,
    "sid": "abc123",
    "config": {"enabled": True, "min_score_to_complete": 0.6, "rubric": {"dimensions": ["a"]}},
    "state": '{"next": "gate"}',
}


def test_round_trip_signed_message_verifies() -> None:
    """A message signed with a key verifies with that key, and signing leaves the input alone."""
    signed = signing.sign(MSG, [KEY])
    assert signed["sig"].startswith("hmac-sha256:") and len(signed["sig"]) == 12 + 64
    assert "sig" not in MSG
    signing.verify(signed, [KEY])


def test_signature_is_hmac_sha256_over_canonical_json() -> None:
    """The signature is HMAC-SHA256 of sorted-key, no-whitespace, UTF-8 JSON (interoperable)."""
    body = json.dumps(MSG, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    expected = hmac.new(KEY, body.encode("utf-8"), hashlib.sha256).hexdigest()
    assert signing.sign(MSG, [KEY])["sig"] == "hmac-sha256:" + expected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("v", 2),
        ("sid", "abc124"),
        ("config", {**MSG["config"], "min_score_to_complete": 0.0}),
        ("state", '{"next": "done"}'),
        ("state_ref", "sha256:" + "0" * 64),
    ],
)
def test_tampering_with_any_field_breaks_the_signature(field: str, value: object) -> None:
    """Changing, adding or replacing any field after signing is refused."""
    signed = signing.sign(MSG, [KEY])
    with pytest.raises(ForgedMessageError, match="bad signature"):
        signing.verify({**signed, field: value}, [KEY])


def test_removing_a_field_breaks_the_signature() -> None:
    """Dropping a signed field (e.g. the config overrides) is refused too."""
    signed = signing.sign(MSG, [KEY])
    del signed["config"]
    with pytest.raises(ForgedMessageError, match="bad signature"):
        signing.verify(signed, [KEY])


def test_tampering_inside_a_nested_value_breaks_the_signature() -> None:
    """A change deep inside the config is covered as well."""
    signed = signing.sign(MSG, [KEY])
    signed["config"] = {**signed["config"], "rubric": {"dimensions": ["b"]}}
    with pytest.raises(ForgedMessageError):
        signing.verify(signed, [KEY])


def test_missing_signature_is_refused() -> None:
    """An unsigned message is refused, saying it is unsigned."""
    with pytest.raises(ForgedMessageError, match="unsigned"):
        signing.verify(MSG, [KEY])


@pytest.mark.parametrize("sig", [123, None, "", "sha1:abcd", "hmac-sha256:", "hmac-sha256:zz"])
def test_malformed_signature_is_refused(sig: object) -> None:
    """A signature of the wrong type or scheme, empty or not hex, never verifies."""
    with pytest.raises(ForgedMessageError):
        signing.verify({**MSG, "sig": sig}, [KEY])


def test_wrong_key_is_refused() -> None:
    """A message signed with another key is refused."""
    with pytest.raises(ForgedMessageError, match="another key"):
        signing.verify(signing.sign(MSG, [OTHER]), [KEY])


def test_rotation_first_key_signs_any_key_verifies() -> None:
    """With several secrets the first signs and any verifies, so keys rotate without downtime."""
    old = signing.sign(MSG, [OTHER])
    new = signing.sign(MSG, [KEY, OTHER])
    assert new["sig"] == signing.sign(MSG, [KEY])["sig"]
    signing.verify(old, [KEY, OTHER])
    signing.verify(new, [KEY, OTHER])
    with pytest.raises(ForgedMessageError):
        signing.verify(old, [KEY])


def test_canonical_encoding_ignores_key_order() -> None:
    """The same fields in another order (as JSON round trips may produce) sign the same."""
    reordered = {k: MSG[k] for k in reversed(list(MSG))}
    reordered["config"] = {k: MSG["config"][k] for k in reversed(list(MSG["config"]))}
    assert signing.canonical(reordered) == signing.canonical(MSG)
    signing.verify(signing.sign(MSG, [KEY]), [KEY])
    signing.verify({**signing.sign(MSG, [KEY]), **reordered}, [KEY])


def test_survives_a_json_round_trip() -> None:
    """What the broker delivers (JSON dumped and loaded, tuples as lists) still verifies."""
    msg = {**MSG, "files": ({"path": "a.txt", "size": 1},), "score": 0.1 + 0.2}
    signed = signing.sign(msg, [KEY])
    signing.verify(json.loads(json.dumps(signed)), [KEY])


def test_non_ascii_is_signed_as_utf8() -> None:
    """Non-ASCII text is signed as raw UTF-8 and survives an ASCII-escaped JSON transport."""
    msg = {**MSG, "state": '{"output": "Umsatz stieg um 4 % — 売上 🚀"}'}
    signed = signing.sign(msg, [KEY])
    assert "売上".encode() in signing.canonical(msg)
    signing.verify(json.loads(json.dumps(signed, ensure_ascii=True)), [KEY])
    with pytest.raises(ForgedMessageError):
        signing.verify({**signed, "state": msg["state"].replace("売", "壳")}, [KEY])


@pytest.mark.parametrize(
    "value", [float("nan"), "\ud800", object()], ids=["nan", "lone-surrogate", "object"]
)
def test_values_json_cannot_carry_are_refused_not_crashed(value: object) -> None:
    """NaN, a lone surrogate or a non-JSON value make the message unverifiable: refused."""
    with pytest.raises(ForgedMessageError, match="canonically encoded"):
        signing.verify({**MSG, "x": value, "sig": "hmac-sha256:" + "0" * 64}, [KEY])


def test_deep_nesting_is_refused_not_crashed() -> None:
    """A message nested too deeply for the encoder is refused, not a RecursionError."""
    deep: dict[str, object] = {}
    node = deep
    for _ in range(100_000):
        node["a"] = {}
        node = node["a"]  # type: ignore[assignment]
    with pytest.raises(ForgedMessageError):
        signing.verify({**MSG, "config": deep, "sig": "hmac-sha256:" + "0" * 64}, [KEY])


# -- messages name the task they are addressed to -------------------------------------------------
def test_an_addressed_message_is_accepted_only_as_its_task_and_id() -> None:
    """A signed message names its task and task id; it passes as them, and is refused as
    another id, another task, or when it names none."""
    signed = signing.sign(signing.address(MSG, "critique.gate", "id-1"), [KEY])
    signing.verify(signed, [KEY])
    signing.check_addressed(signed, "critique.gate", "id-1")
    for task, task_id in (("critique.gate", "id-2"), ("critique.l0", "id-1")):
        with pytest.raises(ForgedMessageError, match="replayed under another task or id"):
            signing.check_addressed(signed, task, task_id)
    with pytest.raises(ForgedMessageError, match="covers no task id"):
        signing.check_addressed(signing.sign(MSG, [KEY]), "critique.gate", "id-1")


def test_the_address_is_covered_by_the_signature() -> None:
    """Re-addressing a signed message without the key breaks its signature."""
    signed = signing.sign(signing.address(MSG, "critique.gate", "id-1"), [KEY])
    assert signing.addressee(signed) == ("critique.gate", "id-1")
    for field, value in (("task_id", "victim-id"), ("task_name", "critique.l0")):
        with pytest.raises(ForgedMessageError, match="bad signature"):
            signing.verify({**signed, field: value}, [KEY])


# -- stored records are signed per kind ------------------------------------------------------------
RECORD = {"run_id": "r1", "member": "1:w1:s1", "status": "accepted", "best_score": 0.9}


def test_a_record_verifies_only_as_its_kind() -> None:
    """A record signed as a result verifies as a result, not as a failure or as a message; a
    message's signature does not make it a record either."""
    signed = signing.sign_record("result", RECORD, [KEY])
    signing.verify_record("result", json.loads(json.dumps(signed)), [KEY])
    with pytest.raises(ForgedMessageError, match="bad signature"):
        signing.verify_record("failure", signed, [KEY])
    with pytest.raises(ForgedMessageError, match="bad signature"):
        signing.verify(signed, [KEY])
    with pytest.raises(ForgedMessageError, match="bad signature"):
        signing.verify_record("result", signing.sign(RECORD, [KEY]), [KEY])


def test_a_record_unsigned_altered_or_under_another_key_is_refused() -> None:
    """What a store writer without the secret can write never verifies as a record."""
    signed = signing.sign_record("result", RECORD, [KEY])
    with pytest.raises(ForgedMessageError, match="unsigned result record"):
        signing.verify_record("result", RECORD, [KEY])
    with pytest.raises(ForgedMessageError, match="bad signature"):
        signing.verify_record("result", {**signed, "best_score": 1.0}, [KEY])
    with pytest.raises(ForgedMessageError, match="bad signature"):
        signing.verify_record("result", signing.sign_record("result", RECORD, [OTHER]), [KEY])
    assert signing.sign_record("result", RECORD, []) == RECORD  # no secret: stored unsigned


def test_no_secrets_means_unsigned_and_verify_refuses() -> None:
    """Signing without secrets leaves the message unsigned; verifying without any refuses."""
    assert signing.sign(MSG, []) == MSG
    with pytest.raises(ForgedMessageError):
        signing.verify(signing.sign(MSG, [KEY]), [])


def test_parse_secrets_comma_separated_first_signs() -> None:
    """CRITIQUE_SECRET holds comma-separated secrets (spaces and empty items ignored)."""
    a, b = "a" * 16, "b" * 20
    assert signing.parse_secrets(None) == ()
    assert signing.parse_secrets("  ") == ()
    assert signing.parse_secrets(f" {a} , ,{b},") == (a.encode(), b.encode())


def test_parse_secrets_refuses_a_short_secret_without_quoting_it() -> None:
    """A guessable secret is a configuration error naming the variable, not the value."""
    with pytest.raises(ConfigError) as info:
        signing.parse_secrets("a" * 16 + ",hunter2")
    assert info.value.key == "CRITIQUE_SECRET"
    assert "hunter2" not in str(info.value)


def test_forged_message_error_is_a_permanent_submission_error() -> None:
    """ForgedMessageError sits in the permanent branch: Celery never retries it."""
    exc = ForgedMessageError("bad signature")
    assert isinstance(exc, SubmissionError) and isinstance(exc, PermanentError)
    assert "CRITIQUE_SECRET" in str(exc)
    assert str(ForgedMessageError(*exc.args)) == str(exc)  # as Celery rebuilds it from args


# -- the codec in workers.runtime (no broker: inline states only) --------------------------------
def _state_msg(monkeypatch: pytest.MonkeyPatch, secret: str | None) -> dict[str, object]:
    from workers import runtime

    if secret is None:
        monkeypatch.delenv("CRITIQUE_SECRET", raising=False)
    else:
        monkeypatch.setenv("CRITIQUE_SECRET", secret)
    sub = Submission(run_id="r1", worker_id="w1", task="t", output="fine output")
    return runtime.encode(start(sub), {"enabled": True}, pass_id="s1")


def test_encode_signs_when_the_secret_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime.encode signs with CRITIQUE_SECRET and runtime.decode accepts its own messages."""
    from workers import runtime

    msg = _state_msg(monkeypatch, "s" * 32)
    assert str(msg["sig"]).startswith("hmac-sha256:")
    state, overrides = runtime.decode(msg)
    assert state.submission.run_id == "r1" and overrides == {"enabled": True}


def test_without_a_secret_messages_are_unsigned_and_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Development mode: no secret, no signature, and decode accepts as before."""
    from workers import runtime

    msg = _state_msg(monkeypatch, None)
    assert "sig" not in msg
    assert runtime.decode(msg)[0].submission.worker_id == "w1"


def test_decode_refuses_unsigned_and_altered_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the secret set, decode refuses an unsigned message and one altered after signing."""
    from workers import runtime

    unsigned = _state_msg(monkeypatch, None)
    monkeypatch.setenv("CRITIQUE_SECRET", "s" * 32)
    with pytest.raises(ForgedMessageError, match="unsigned"):
        runtime.decode(unsigned)
    signed = runtime.sign(unsigned)
    runtime.decode(signed)
    with pytest.raises(ForgedMessageError, match="bad signature"):
        runtime.decode({**signed, "sid": "s2"})


def test_decode_refuses_garbage_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a dict, a wrong version, missing or ill-typed fields: SubmissionError, no crash."""
    from workers import runtime

    monkeypatch.delenv("CRITIQUE_SECRET", raising=False)
    good = _state_msg(monkeypatch, None)
    for bad in (
        "junk",
        [1, 2],
        None,
        {**good, "v": 2},
        {"v": 1, "sid": "x", "config": {}},
        {**good, "state": 42},
        {**good, "config": [1]},
        {**good, "state": '{"next": "gate"}'},
        {**good, "state": "x" * 100_000},
    ):
        with pytest.raises(SubmissionError) as info:
            runtime.decode(bad)
        assert "x" * 300 not in str(info.value)


def test_gate_request_is_signed_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A complete_gate request: signed by runtime.sign, refused unsigned or altered."""
    from workers import runtime

    monkeypatch.setenv("CRITIQUE_SECRET", "g" * 32)
    req = {"v": 1, "request_id": "q1", "run_id": "r1", "final_result": "done"}
    signed = runtime.sign(req)
    assert runtime.decode_gate_request(signed).run_id == "r1"
    with pytest.raises(ForgedMessageError):
        runtime.decode_gate_request(req)
    with pytest.raises(ForgedMessageError):
        runtime.decode_gate_request({**signed, "run_id": "r2"})
    with pytest.raises(SubmissionError, match="expected a dict"):
        runtime.decode_gate_request("junk")


def test_decode_checks_the_address_only_with_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's decode (given the task and id it runs as) refuses a message addressed to
    another; without the secret (development) nothing is checked."""
    from workers import runtime

    monkeypatch.setenv("CRITIQUE_SECRET", "a" * 32)
    sub = Submission(run_id="r1", worker_id="w1", task="t", output="fine output")
    msg = runtime.encode(start(sub), {}, pass_id="s1", task="critique.l0", task_id="t-1")
    assert runtime.decode(msg, task="critique.l0", task_id="t-1")[0].submission.run_id == "r1"
    with pytest.raises(ForgedMessageError, match="replayed under another task or id"):
        runtime.decode(msg, task="critique.l0", task_id="t-2")
    monkeypatch.delenv("CRITIQUE_SECRET")
    runtime.decode(msg, task="critique.gate", task_id="t-2")


def test_address_re_signs_only_what_verifies(monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime.address re-addresses a signed message (for the next task, a continuation) but
    refuses to re-sign an unsigned or altered one: a store record is never laundered."""
    from workers import runtime

    monkeypatch.setenv("CRITIQUE_SECRET", "b" * 32)
    sub = Submission(run_id="r1", worker_id="w1", task="t", output="fine output")
    msg = runtime.encode(start(sub), {}, pass_id="s1", task="critique.l0", task_id="t-1")
    assert runtime.address(msg, "critique.l0", "t-1") is msg
    moved = runtime.address(msg, "critique.critic", "t-9")
    runtime.decode(moved, task="critique.critic", task_id="t-9")
    unsigned = {k: v for k, v in msg.items() if k != "sig"}
    for bad in (unsigned, {**msg, "sid": "s2"}):
        with pytest.raises(ForgedMessageError):
            runtime.address(bad, "critique.gate", "t-3")


def test_gate_request_is_addressed_to_its_task_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """A complete_gate request carries its address next to its fields (not as request
    fields) and is refused under another task id."""
    from workers import runtime

    monkeypatch.setenv("CRITIQUE_SECRET", "g" * 32)
    req = {"v": 1, "request_id": "q1", "run_id": "r1", "final_result": "done", "task": "t"}
    signed = runtime.sign(signing.address(req, "critique.complete_gate", "g-1"))
    got = runtime.decode_gate_request(signed, task="critique.complete_gate", task_id="g-1")
    assert (got.run_id, got.task) == ("r1", "t")
    with pytest.raises(ForgedMessageError, match="replayed under another task or id"):
        runtime.decode_gate_request(signed, task="critique.complete_gate", task_id="g-2")


def test_a_recorded_failure_reads_like_the_error_it_records() -> None:
    """The client words a worker's failure record as it words the exception: a refusal as
    'was refused by the worker: …', anything else with its error type, in one line."""
    from pipeline.store.runs import Failure
    from workers.client import failure_text

    refused = Failure("l0", "RefusedOverrideError", "may not set\n'llm.api_base'", True)
    assert failure_text(refused) == "was refused by the worker: may not set 'llm.api_base'"
    crashed = Failure("critic", "LLMPermanentError", "401 Incorrect API key", False)
    assert failure_text(crashed) == "failed: LLMPermanentError: 401 Incorrect API key"


def test_secret_read_at_call_time_and_rotation_in_the_codec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The codec reads CRITIQUE_SECRET at each call; an old-key message verifies after rotation."""
    from workers import runtime

    old, new = "o" * 32, "n" * 32
    msg = _state_msg(monkeypatch, old)
    monkeypatch.setenv("CRITIQUE_SECRET", f"{new},{old}")
    runtime.decode(msg)
    monkeypatch.setenv("CRITIQUE_SECRET", new)
    with pytest.raises(ForgedMessageError):
        runtime.decode(msg)


# -- the commands --------------------------------------------------------------------------------
def test_worker_warns_when_the_secret_is_unset(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`critique worker` without CRITIQUE_SECRET says that verdicts can be forged."""
    from workers.cli import main

    monkeypatch.delenv("CRITIQUE_SECRET", raising=False)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    assert main(["worker"]) == 3  # stops at the Redis check, after the warning
    err = capsys.readouterr().err
    assert (
        "CRITIQUE_SECRET is unset: anyone who can write to the broker can forge verdicts; "
        "set it on every worker and client" in err
    )
    monkeypatch.setenv("CRITIQUE_SECRET", "w" * 32)
    assert main(["worker"]) == 3
    assert "CRITIQUE_SECRET is unset" not in capsys.readouterr().err


def test_worker_refuses_a_short_secret(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`critique worker` with a guessable CRITIQUE_SECRET exits 2 without echoing it."""
    from workers.cli import main

    monkeypatch.setenv("CRITIQUE_SECRET", "changeme")
    assert main(["worker", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "CRITIQUE_SECRET" in err and "changeme" not in err


def test_demo_signs_with_a_private_secret_when_none_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`critique demo` gives its process a random secret while it runs, then removes it."""
    import os

    from workers.commands._pipeline import sign_with_a_private_secret

    monkeypatch.delenv("CRITIQUE_SECRET", raising=False)
    lines: list[str] = []
    with contextlib.ExitStack() as stack:
        sign_with_a_private_secret(stack, lines.append)
        secret = os.environ["CRITIQUE_SECRET"]
        assert len(secret) >= 32 and signing.parse_secrets(secret)
    assert "CRITIQUE_SECRET" not in os.environ
    assert "random CRITIQUE_SECRET" in lines[0]
    monkeypatch.setenv("CRITIQUE_SECRET", "mine" * 8)
    with contextlib.ExitStack() as stack:
        sign_with_a_private_secret(stack, lines.append)
    assert os.environ["CRITIQUE_SECRET"] == "mine" * 8


def test_entry_messages_verify_with_the_entry_key_and_stage_messages_never_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With CRITIQUE_ENTRY_SECRET set, entry messages sign and verify with it alone, and the
    workers' CRITIQUE_SECRET stays the only key of stage messages (split keys)."""
    from workers import runtime

    monkeypatch.setenv("CRITIQUE_SECRET", "w" * 32)
    monkeypatch.setenv("CRITIQUE_ENTRY_SECRET", "m" * 32)
    assert runtime.entry_secrets() == (b"m" * 32,)
    assert runtime.secrets() == (b"w" * 32,)
    entry = runtime.sign_entry({"v": 1})
    signing.verify(entry, runtime.entry_secrets())
    with pytest.raises(ForgedMessageError, match="another key"):
        runtime.verify(entry)


def test_one_secret_setups_sign_entry_messages_with_critique_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without CRITIQUE_ENTRY_SECRET (or with it blank), entry messages use CRITIQUE_SECRET."""
    from workers import runtime

    monkeypatch.setenv("CRITIQUE_SECRET", "w" * 32)
    monkeypatch.setenv("CRITIQUE_ENTRY_SECRET", " ")
    assert runtime.entry_secrets() == (b"w" * 32,)
    runtime.verify(runtime.sign_entry({"v": 1}))


def test_a_short_entry_secret_is_refused_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A guessable managers' key fails naming CRITIQUE_ENTRY_SECRET, never its value."""
    from workers import runtime

    monkeypatch.setenv("CRITIQUE_ENTRY_SECRET", "short-key")
    with pytest.raises(ConfigError, match="CRITIQUE_ENTRY_SECRET") as info:
        runtime.entry_secrets()
    assert "short-key" not in str(info.value)


def test_a_trace_tag_is_bound_to_its_run_and_its_bytes() -> None:
    """A trace event's tag verifies only for the same run, the same bytes and a known secret;
    a missing tag never does."""
    from pipeline.security.signing import trace_mac, trace_mac_ok

    key, other = b"a" * 32, b"b" * 32
    tag = trace_mac("run-1", b'{"type":"l0"}', key)
    assert trace_mac_ok("run-1", b'{"type":"l0"}', tag, (other, key))
    assert trace_mac_ok("run-1", b'{"type":"l0"}', tag.encode(), (key,))
    assert not trace_mac_ok("run-2", b'{"type":"l0"}', tag, (key,))
    assert not trace_mac_ok("run-1", b'{"type":"result"}', tag, (key,))
    assert not trace_mac_ok("run-1", b'{"type":"l0"}', tag, (other,))
    assert not trace_mac_ok("run-1", b'{"type":"l0"}', None, (key,))


def test_state_dirs_name_the_archive_and_workspace_but_never_the_commands_own(
    tmp_path: Path,
) -> None:
    """The sandbox hides the archive directory and the workspace root; a directory holding the
    command's temp dir or its Python (here: /) is never hidden, nor a missing one."""
    import tempfile

    from pipeline.security.sandbox import state_dirs

    arch, ws = tmp_path / "arch", tmp_path / "ws"
    arch.mkdir()
    ws.mkdir()
    env = {"CRITIQUE_ARCHIVE_DIR": str(arch), "CRITIQUE_WORKSPACE": str(ws)}
    assert state_dirs(env) == tuple(sorted([str(arch.resolve()), str(ws.resolve())]))
    assert (
        state_dirs({"CRITIQUE_ARCHIVE_DIR": tempfile.gettempdir(), "CRITIQUE_WORKSPACE": "/"}) == ()
    )
    assert (
        state_dirs(
            {
                "CRITIQUE_ARCHIVE_DIR": str(tmp_path / "missing"),
                "CRITIQUE_WORKSPACE": str(tmp_path / "nope"),
            }
        )
        == ()
    )
