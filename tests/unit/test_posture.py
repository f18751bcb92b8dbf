"""The fleet's posture (pipeline.security.posture): key ids, the published record, and the refusals
a client gets at the door instead of at its timeout."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from pipeline.errors import ConfigError
from pipeline.security import signing
from pipeline.security.posture import (
    MIN_FRESH_S,
    WorkerPosture,
    entry_refusal,
    fresh_for,
    posture_of,
    refusal,
)

OLD = b"o" * 32
NEW = b"n" * 32
MANAGER = b"m" * 32
NOW = 1_000_000.0


def _worker(
    secrets: tuple[bytes, ...] = (OLD,),
    entry: tuple[tuple[str, bytes], ...] = (),
    *,
    name: str = "w1@host",
    seen: float = NOW,
) -> WorkerPosture:
    return posture_of(name, secrets, entry, now=seen, fresh_s=MIN_FRESH_S)


def _one_line(err: ConfigError | None) -> str:
    assert err is not None
    text = str(err)
    assert "\n" not in text
    return text


def test_a_key_id_is_stable_short_and_not_the_secret() -> None:
    """key_id is the first 8 hex of HMAC-SHA256(secret, b"critique-key-id"): the same for the
    same secret (in any language), different for another, and never the secret or a part."""
    got = signing.key_id(OLD)
    assert (
        got
        == signing.key_id(OLD)
        == hmac.new(OLD, b"critique-key-id", hashlib.sha256).hexdigest()[:8]
    )
    assert len(got) == 8 and all(c in "0123456789abcdef" for c in got)
    assert got != signing.key_id(NEW)
    assert got not in OLD.hex() and got.encode() not in OLD


def test_the_published_record_names_key_ids_and_identities_never_keys() -> None:
    """A worker's posture carries its keys' ids, the signing one first, and its entry keys'
    identities with their ids: no key's bytes appear in the JSON."""
    posture = _worker((NEW, OLD), (("entry:alice", MANAGER), ("fleet", NEW)))
    doc = json.loads(posture.model_dump_json())
    assert doc["signed"] is True and doc["entry_signed"] is True
    assert doc["key_ids"] == [signing.key_id(NEW), signing.key_id(OLD)]
    assert doc["entry_keys"] == [
        {"name": "entry:alice", "key_id": signing.key_id(MANAGER)},
        {"name": "fleet", "key_id": signing.key_id(NEW)},
    ]
    raw = posture.model_dump_json()
    for key in (OLD, NEW, MANAGER):
        assert key.decode() not in raw


def test_a_record_with_fields_a_newer_worker_adds_still_reads() -> None:
    """A reader ignores fields it does not know, so a newer worker's record still counts."""
    doc = json.loads(_worker().model_dump_json()) | {"queues": ["critique.cpu"]}
    assert WorkerPosture.model_validate(doc).signed is True


def test_freshness_is_four_ticks_and_at_least_a_minute() -> None:
    """A record counts as current for four of its worker's ticks, never under a minute."""
    assert fresh_for(5) == MIN_FRESH_S and fresh_for(60) == 240
    assert _worker(seen=NOW - MIN_FRESH_S).live(NOW)
    assert not _worker(seen=NOW - MIN_FRESH_S - 1).live(NOW)


def test_no_posture_or_only_stale_ones_lets_the_client_proceed_as_before() -> None:
    """An older fleet (no record) or workers gone quiet: nothing is refused."""
    assert refusal([], (), NOW) is None
    assert refusal([_worker(seen=NOW - 3600)], (), NOW) is None
    assert entry_refusal([_worker(entry=(("fleet", OLD),), seen=NOW - 3600)], (), NOW) is None


def test_a_signed_fleet_refuses_a_client_without_a_secret_naming_it() -> None:
    """Workers that sign and a process with no CRITIQUE_SECRET: one line naming it, a hint,
    nothing sent."""
    err = refusal([_worker(), _worker(name="w2@host")], (), NOW)
    text = _one_line(err)
    assert err is not None and err.key == "CRITIQUE_SECRET"
    assert "the workers require signed messages (2 of the 2 live worker(s)" in text
    assert "this process has no CRITIQUE_SECRET" in text and "nothing was sent" in text
    assert "hint: set CRITIQUE_SECRET in this process to the workers' value" in text


def test_a_signed_fleet_refuses_another_secret_by_key_id() -> None:
    """A process whose secret is not one the workers accept: "another secret", with both sides'
    key ids (never the keys) and the hint to compare them."""
    text = _one_line(refusal([_worker((OLD,))], (NEW,), NOW))
    assert "this process's CRITIQUE_SECRET is another secret than the workers'" in text
    assert signing.key_id(NEW) in text and signing.key_id(OLD) in text
    assert "compare the manager's CRITIQUE_SECRET with the workers'" in text
    assert OLD.decode() not in text and NEW.decode() not in text


def test_an_unsigned_fleet_refuses_a_signing_client_whose_results_would_never_verify() -> None:
    """Workers without a secret run signed messages but sign no result, which a process
    holding a secret never trusts: refused rather than left waiting for its timeout."""
    text = _one_line(refusal([_worker(())], (OLD,), NOW))
    assert "1 of the 1 live worker(s) hold no CRITIQUE_SECRET" in text
    assert "unset CRITIQUE_SECRET here, or give every worker the same CRITIQUE_SECRET" in text


def test_matching_secrets_and_a_rotation_in_progress_pass() -> None:
    """The same secret, an unsigned fleet with an unsigned client, and each step of a
    rotation (new second everywhere, then first) are all fine."""
    assert refusal([_worker((OLD,))], (OLD,), NOW) is None
    assert refusal([_worker(())], (), NOW) is None
    assert refusal([_worker((OLD, NEW))], (OLD, NEW), NOW) is None
    assert refusal([_worker((NEW, OLD))], (OLD, NEW), NOW) is None
    assert refusal([_worker((OLD, NEW))], (NEW, OLD), NOW) is None


def test_a_client_that_dropped_the_key_the_workers_still_sign_with_is_refused() -> None:
    """The workers sign results with their first key: a client that no longer holds it could
    not verify them, so it is refused too."""
    assert refusal([_worker((OLD, NEW))], (NEW,), NOW) is not None


def test_a_mixed_fleet_refuses_either_kind_of_client() -> None:
    """Mid-rollout (some workers sign, some do not): neither a client with a secret nor one
    without would get every verdict."""
    mixed = [_worker((OLD,)), _worker((), name="w2@host")]
    assert "1 of the 2 live worker(s) hold a CRITIQUE_SECRET" in _one_line(refusal(mixed, (), NOW))
    assert "1 of the 2 live worker(s) hold no" in _one_line(refusal(mixed, (OLD,), NOW))


@pytest.mark.parametrize(
    ("have", "says"),
    [
        ((), "this process has no CRITIQUE_ENTRY_SECRET"),
        ((b"x" * 32,), "is not a key the workers accept for entry messages"),
    ],
    ids=["no-key", "another-key"],
)
def test_entry_messages_are_refused_without_a_managers_key_the_workers_accept(
    have: tuple[bytes, ...], says: str
) -> None:
    """Workers that verify entry messages: a sender without a key, or with another key, is
    told so naming CRITIQUE_ENTRY_SECRET and the keys' names (never the keys)."""
    err = entry_refusal([_worker(entry=(("entry:alice", MANAGER),))], have, NOW)
    text = _one_line(err)
    assert err is not None and err.key == "CRITIQUE_ENTRY_SECRET"
    assert says in text and "entry:alice" in text and MANAGER.decode() not in text


def test_entry_messages_pass_with_an_accepted_key_or_into_an_unsigned_fleet() -> None:
    """A managers' key the workers list passes; workers without entry keys take any entry."""
    alice = (("entry:alice", MANAGER), ("entry:bob", NEW))
    assert entry_refusal([_worker(entry=alice)], (NEW,), NOW) is None
    assert entry_refusal([_worker((), ())], (), NOW) is None
    assert entry_refusal([_worker((), ())], (MANAGER,), NOW) is None
