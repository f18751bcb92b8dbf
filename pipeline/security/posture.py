"""The fleet's posture: which keys the workers require, so a sender is refused at the door.

A fleet whose workers hold ``CRITIQUE_SECRET`` refuses every unsigned or wrong-key message, and
a client learns that only at its timeout. So every worker publishes what it requires (its
:class:`WorkerPosture`) in the store, and a client reads the live workers' postures before it
sends anything: :func:`refusal` says why its messages would not run (one line naming the
variable to set), before a pass begins, so a finished run is never turned back into pending.

Nothing secret is published: a key appears as its :func:`pipeline.security.signing.key_id` (8 hex
characters of an HMAC of the key), an entry key by its identity's name too (``fleet``,
``entry``, ``entry:<name>``). The record is advisory and unsigned (a client without the key is
exactly the reader it serves): a forged posture can only refuse a client or leave it as it was
before postures existed. Pure: the store is :mod:`pipeline.store.fleet`, the clock is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from pipeline import settings
from pipeline.errors import ConfigError
from pipeline.security import signing

POSTURE_VERSION = 1
"""A posture record's ``v``."""
MIN_FRESH_S = 60.0
"""Shortest time a posture record counts as current after it was written."""


def fresh_for(interval_s: float) -> float:
    """How long a posture refreshed every ``interval_s`` seconds counts as current: four
    intervals, and at least :data:`MIN_FRESH_S` (hosts' clocks differ by a little)."""
    return max(MIN_FRESH_S, 4.0 * interval_s)


class _Record(BaseModel):
    """A record read back from the store: immutable; fields a newer worker adds are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class EntryKey(_Record):
    """One key entry messages (``critique.submit``) verify with: its identity and key id."""

    name: str
    """The identity it signs as: ``fleet`` (``CRITIQUE_SECRET``, one-secret setups), ``entry``
    (a bare managers' key) or ``entry:<name>`` (``CRITIQUE_ENTRY_SECRET``'s ``name=key``)."""
    key_id: str


class WorkerPosture(_Record):
    """What one worker requires of the messages it runs, as it last said so."""

    v: int = POSTURE_VERSION
    worker: str
    signed: bool
    """The worker holds ``CRITIQUE_SECRET``: it runs only stage messages and gate requests
    signed with one of ``key_ids``, and signs every record it writes with the first."""
    key_ids: tuple[str, ...] = ()
    """Key ids of its ``CRITIQUE_SECRET`` items, the signing one first."""
    entry_signed: bool
    """It runs only entry messages signed with one of ``entry_keys``."""
    entry_keys: tuple[EntryKey, ...] = ()
    seen: float
    """When it wrote this (unix seconds, its own clock)."""
    fresh_s: float = Field(MIN_FRESH_S, gt=0)
    """How long after ``seen`` this counts as current (:func:`fresh_for`)."""

    def live(self, now: float) -> bool:
        """Whether this is still current at ``now``."""
        return now - self.seen <= self.fresh_s


def posture_of(
    worker: str,
    secrets: Sequence[bytes],
    entry_keys: Sequence[tuple[str, bytes]],
    *,
    now: float,
    fresh_s: float,
) -> WorkerPosture:
    """The posture of a worker holding ``secrets`` (``CRITIQUE_SECRET``) and verifying entry
    messages with ``entry_keys`` (``(identity, key)`` pairs), at ``now``."""
    return WorkerPosture(
        worker=worker,
        signed=bool(secrets),
        key_ids=tuple(signing.key_id(s) for s in secrets),
        entry_signed=bool(entry_keys),
        entry_keys=tuple(EntryKey(name=n, key_id=signing.key_id(k)) for n, k in entry_keys),
        seen=now,
        fresh_s=fresh_s,
    )


NOTHING_SENT = "nothing was sent"


def _workers(some: Sequence[WorkerPosture], live: Sequence[WorkerPosture]) -> str:
    return f"{len(some)} of the {len(live)} live worker(s)"


def _ids(ids: Iterable[str]) -> str:
    return ", ".join(sorted(set(ids))) or "none"


def refusal(
    postures: Sequence[WorkerPosture], have: Sequence[bytes], now: float
) -> ConfigError | None:
    """Why the live workers among ``postures`` would not run what this process sends (stage
    messages and gate requests signed with ``have``, its ``CRITIQUE_SECRET``), or would write
    results it cannot trust; None when they would, or when no worker said (an older fleet).

    Refused: the workers sign and this process has no secret; some workers hold no secret
    while this process has one (their unsigned results would never verify here); or this
    process's signing key is not one the workers accept, or it cannot verify the key they sign
    with."""
    live = [p for p in postures if p.live(now)]
    signers = [p for p in live if p.signed]
    plain = [p for p in live if not p.signed]
    env = settings.SECRET.name
    if signers and not have:
        return ConfigError(
            f"the workers require signed messages ({_workers(signers, live)} hold a {env}) "
            f"and this process has no {env}: they would refuse everything it sends; "
            f"{NOTHING_SENT}",
            key=env,
            hint=f"set {env} in this process to the workers' value and run it again",
        )
    if have and plain:
        return ConfigError(
            f"{_workers(plain, live)} hold no {env}: they sign no result, and this process "
            f"(which holds a {env}) trusts only signed ones, so it would never see their "
            f"verdicts; {NOTHING_SENT}",
            key=env,
            hint=f"unset {env} here, or give every worker the same {env}",
        )
    if not signers:
        return None
    mine = {signing.key_id(s) for s in have}
    signs_with = signing.key_id(have[0])
    wrong = [p for p in signers if signs_with not in p.key_ids or p.key_ids[0] not in mine]
    if not wrong:
        return None
    return ConfigError(
        f"this process's {env} is another secret than the workers' (it signs as key id "
        f"{signs_with}; {_workers(wrong, live)} accept {_ids(i for p in wrong for i in p.key_ids)}"
        f"): they would refuse everything it sends; {NOTHING_SENT}",
        key=env,
        hint=f"compare the manager's {env} with the workers': they must be the same; during a "
        "rotation, list both, new first",
    )


def entry_refusal(
    postures: Sequence[WorkerPosture], have: Sequence[bytes], now: float
) -> ConfigError | None:
    """Why the live workers among ``postures`` would refuse an entry message signed with the
    first of ``have`` (the managers' key, ``CRITIQUE_ENTRY_SECRET``; unsigned when empty), or
    None: the rule docs/entry.md gives managers in other languages. Workers without entry keys
    run any entry message, signed or not."""
    live = [p for p in postures if p.live(now)]
    signers = [p for p in live if p.entry_signed]
    env = settings.ENTRY_SECRET.name
    names = _ids(k.name for p in signers for k in p.entry_keys)
    if signers and not have:
        return ConfigError(
            f"the workers require signed entry messages ({_workers(signers, live)}; keys "
            f"named {names}) and this process has no {env}: they would refuse every entry "
            f"message; {NOTHING_SENT}",
            key=env,
            hint=f"set {env} to your managers' key; in a one-secret fleet, whose entry key is "
            f"named 'fleet', that is the workers' {settings.SECRET.name}",
        )
    if not signers:
        return None
    signs_with = signing.key_id(have[0])
    wrong = [p for p in signers if signs_with not in {k.key_id for k in p.entry_keys}]
    if not wrong:
        return None
    return ConfigError(
        f"this process's {env} is not a key the workers accept for entry messages (it signs "
        f"as key id {signs_with}; {_workers(wrong, live)} accept "
        f"{_ids(k.key_id for p in wrong for k in p.entry_keys)}, named {names}): they would "
        f"refuse every entry message; {NOTHING_SENT}",
        key=env,
        hint=f"ask the operator for your key: it must be one of the workers' {env} items",
    )
