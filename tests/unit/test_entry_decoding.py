"""Entry messages as a worker reads them (issue 33): named managers' keys and the identity that
signed a message, over-deep nesting, booleans and unbounded numbers refused, and the bound on a
process's configuration caches."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.errors import ConfigError, ForgedMessageError, SubmissionError
from pipeline.models import MAX_ITERATION
from pipeline.security import signing

ALICE, ALICE_OLD, BOB = "a" * 32, "o" * 32, "b" * 32
SUB = {
    "run_id": "run-1",
    "worker_id": "w1",
    "task": "Summarise the report.",
    "output": {"summary": "Sales rose 4%."},
}


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """workers.runtime with no CRITIQUE_ environment and empty configuration caches."""
    from workers import runtime

    for name in list(os.environ):
        if name.startswith("CRITIQUE_") and name != "CRITIQUE_TEST_REDIS_URL":
            monkeypatch.delenv(name)
    runtime._configs.clear()
    runtime._contexts.clear()
    yield runtime
    runtime._configs.clear()
    runtime._contexts.clear()


def _entry(key: str | None, **change: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"v": 1, "submission": {**SUB}, "config": {}}
    body.update(change)
    body = signing.address(body, "critique.submit", "t-1")
    return body if key is None else signing.sign(body, [key.encode()])


def _decode(msg: Any) -> Any:
    from workers.entry import decode_entry

    return decode_entry(msg, task_name="critique.submit", task_id="t-1")


# --- named keys -------------------------------------------------------------------------------


def test_managers_keys_may_be_named_and_a_name_may_repeat_for_rotation() -> None:
    """`name=key` items are named, bare ones unnamed; a base64 key's `=` padding keeps it bare."""
    padded = "QUJDREVGR0hJSktMTU5PUFFSU1RVVldY="
    got = signing.parse_named_secrets(f"alice={ALICE}, bob={BOB},alice={ALICE_OLD},{padded}")
    assert got == (
        ("alice", ALICE.encode()),
        ("bob", BOB.encode()),
        ("alice", ALICE_OLD.encode()),
        ("", padded.encode()),
    )
    assert signing.parse_named_secrets(None) == () == signing.parse_named_secrets(" , ")


def test_a_short_named_key_is_refused_naming_the_variable_never_the_key() -> None:
    with pytest.raises(ConfigError, match="CRITIQUE_ENTRY_SECRET: secret #2") as info:
        signing.parse_named_secrets(f"alice={ALICE},bob=tooshort")
    assert "tooshort" not in str(info.value)


def test_verify_signer_names_the_key_that_signed() -> None:
    """Which of the keys signed (every one tried): alice's retired key is index 2; a key not
    among them is still a forgery."""
    keys_ = [ALICE.encode(), BOB.encode(), ALICE_OLD.encode()]
    assert signing.verify_signer(_entry(ALICE_OLD), keys_) == 2
    assert signing.verify_signer(_entry(BOB), keys_) == 1
    with pytest.raises(ForgedMessageError, match="another key"):
        signing.verify_signer(_entry("x" * 32), keys_)


def test_the_signer_of_an_entry_is_its_keys_identity(
    runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Named keys are `entry:<name>` (both of alice's keys the same identity), a bare key the
    unnamed `entry`, CRITIQUE_SECRET alone `fleet`, and no key at all no signer (unsigned
    fleets enforce no owner)."""
    assert _decode(_entry(None)).signer is None
    monkeypatch.setenv("CRITIQUE_SECRET", "w" * 32)
    assert _decode(_entry("w" * 32)).signer == signing.FLEET_IDENTITY == "fleet"
    monkeypatch.setenv(
        "CRITIQUE_ENTRY_SECRET", f"alice={ALICE},bob={BOB},alice={ALICE_OLD},{'u' * 32}"
    )
    assert [_decode(_entry(k)).signer for k in (ALICE, ALICE_OLD, BOB, "u" * 32)] == [
        "entry:alice",
        "entry:alice",
        "entry:bob",
        "entry",
    ]
    assert runtime.entry_secrets()[0] == ALICE.encode()
    with pytest.raises(ForgedMessageError):
        _decode(_entry("w" * 32))  # the workers' key verifies no entry once managers have theirs


# --- decoding ---------------------------------------------------------------------------------


def test_an_over_deep_entry_is_refused_before_anything_recurses(runtime: Any) -> None:
    """Deeper than MAX_ENTRY_DEPTH: one line, no RecursionError however deep (checked before
    the signature, whose canonical JSON would recurse); an output at the output's own bound
    still decodes."""
    from workers.entry import MAX_ENTRY_DEPTH

    deep: Any = "x"
    for _ in range(20_000):
        deep = [deep]
    with pytest.raises(SubmissionError, match=f"nested more than {MAX_ENTRY_DEPTH} levels"):
        _decode({"v": 1, "submission": {**SUB, "output": {"x": deep}}, "sig": "x"})
    ok: Any = "x"
    for _ in range(98):
        ok = [ok]
    assert _decode(_entry(None, submission={**SUB, "output": {"x": ok}})).submission


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"v": True}, "'v' must be the integer 1"),
        ({"v": 1.0}, "'v' must be the integer 1"),
        ({"submission": {**SUB, "iteration": True}}, "field 'iteration'"),
        ({"submission": {**SUB, "iteration": 10**300}}, "field 'iteration'"),
        ({"submission": {**SUB, "iteration": MAX_ITERATION + 1}}, "field 'iteration'"),
        ({"submission": {**SUB, "iteration": "2"}}, "field 'iteration'"),
        ({"submission": {**SUB, "files": [{"path": "a.md", "size": True}]}}, "files.0.size"),
    ],
    ids=["v-true", "v-float", "iteration-true", "iteration-10e300", "over-max", "string", "size"],
)
def test_booleans_and_unbounded_integers_are_refused(
    runtime: Any, change: dict[str, Any], says: str
) -> None:
    """`true` is not 1, and an iteration past MAX_ITERATION is refused, in one line that does
    not echo the value."""
    with pytest.raises(SubmissionError) as info:
        _decode(_entry(None, **change))
    assert says in info.value.message and "\n" not in info.value.message
    assert "0000000000" not in info.value.message


def test_the_highest_iteration_still_decodes(runtime: Any) -> None:
    got = _decode(_entry(None, submission={**SUB, "iteration": MAX_ITERATION}))
    assert got.submission.iteration == MAX_ITERATION


# --- item 5: configuration caches ---------------------------------------------------------------


def test_distinct_configurations_leave_the_configuration_cache_bounded(runtime: Any) -> None:
    """More distinct overrides than the cache holds: it keeps its bound plus the pinned own
    configuration, and reports the evictions."""
    cap = runtime.CONFIG_CACHE_MAX
    own = runtime.own_config()
    for i in range(cap + 50):
        runtime.config_for({"min_score_to_complete": round(0.1 + i / (4 * cap), 6)})
    sizes = runtime.cache_sizes()
    assert sizes["configs"] == cap + 1 and sizes["configs_evicted"] >= 50, sizes
    assert runtime.own_config() is own and "{}" in runtime._configs


# --- the CLI --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "line"),
    [
        (str(10**300), "critique status: --iteration must be ≤ 1000000"),
        ("0", "critique status: --iteration must be ≥ 1"),
    ],
)
def test_the_cli_bounds_iteration(
    capsys: pytest.CaptureFixture[str], value: str, line: str
) -> None:
    """`--iteration 10**300` is a one-line usage error (exit 2), as `0` is."""
    from workers.cli import main
    from workers.exit_codes import EXIT_USAGE

    assert main(["status", "r", "--iteration", value]) == EXIT_USAGE
    assert capsys.readouterr().err.strip() == line
