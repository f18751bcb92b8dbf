"""The verdict → framework mapping, written once for every adapter.

A framework hook needs the same few things from a :class:`~pipeline.models.CritiqueResult`:
whether the output may pass, the defects as plain records, the feedback to send a worker back
with, the score to report (never a made-up one), and which of the outputs a repair chain saw is
the one the service kept. The adapters also share how a framework's output becomes a
submission's and back (:func:`as_payload`, :func:`as_output`), how a name becomes an id the
fleet accepts (:func:`identifier`), how a mode sets the configuration (:func:`door_config`) and
one asyncio client per event loop (:class:`LoopClients`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pydantic

from pipeline.models import CritiqueResult, Defect, defect_line
from workers.aclient import AsyncCritiqueClient

Mode = Literal["verdict", "repair"]
"""*verdict*: the framework re-runs its worker with the defects (``repairer: worker``);
*repair*: the fleet's own repairer repairs and the framework gets the repaired output."""
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")

PASSING = frozenset({"accepted", "accepted_with_warnings", "repaired"})
"""Statuses whose output a manager may use as it is."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the fleet said about one output a framework hook saw: its result, or ``unchecked``
    (passed on without a verdict, ``fail_open``; or rejected without one) and why."""

    status: str
    reason: str
    result: CritiqueResult | None = None

    @property
    def checked(self) -> bool:
        """False for an output nobody checked: never treat it as reviewed."""
        return self.result is not None and self.result.checked


class KeptVerdicts(OrderedDict[str, Verdict]):
    """The latest verdicts by key (an agent run's id, a task execution's), at most ``limit``:
    the oldest go first."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def keep(self, key: str, verdict: Verdict) -> None:
        self[key] = verdict
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


def passes(result: CritiqueResult) -> bool:
    """True when the manager may use the result's output (accepted, with warnings, repaired)."""
    return result.status in PASSING


def severity(defect: Defect) -> str:
    """A defect's severity as a framework reads it: a false positive grounding found is
    ``info`` (nothing to fix), whatever the critic said."""
    return "info" if defect.false_positive else defect.severity


def defect_records(result: CritiqueResult) -> list[dict[str, str]]:
    """Every defect of the verdict's envelope: category, location, description, severity."""
    return [
        {
            "category": d.category,
            "location": d.location or "",
            "description": d.description,
            "severity": severity(d),
        }
        for d in result.envelope.defects
    ]


def feedback(result: CritiqueResult) -> str:
    """What to tell the worker sent back: the verdict line's reasons (the deciding defects;
    not its ``next:`` step, which is the manager's), then the critic's prescriptions; "" for a
    passing output."""
    if passes(result):
        return ""
    lines = [line for line in result.why() if not line.startswith("next: ")]
    lines = lines or [defect_line(d) for d in result.envelope.actionable]
    lines += [f"fix: {p}" for p in result.envelope.prescriptions]
    return "\n".join(lines)


def comparable(output: Any) -> str:
    """An output as the service compares it: JSON with sorted keys (text as it is)."""
    if isinstance(output, str):
        return output
    return json.dumps(output, sort_keys=True, ensure_ascii=False, default=str)


def kept_index(result: CritiqueResult, candidates: Sequence[Any]) -> int:
    """Which of ``candidates`` (the outputs a repair chain submitted, oldest first) is the one
    the service kept (``result.output``, keep-best); the newest when none matches exactly."""
    kept = comparable(result.output)
    for i in range(len(candidates) - 1, -1, -1):
        if comparable(candidates[i]) == kept:
            return i
    return len(candidates) - 1


def door_config(mode: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The submissions' configuration for an adapter in ``mode``: verdict mode adds
    ``repairer: worker``; a ``ValueError`` for an unknown mode or repair mode with it."""
    if mode not in ("verdict", "repair"):
        raise ValueError(f"mode {mode!r}: use 'verdict' (the worker re-runs) or 'repair'")
    cfg = dict(config or {})
    if mode == "verdict":
        cfg["repairer"] = "worker"
    elif cfg.get("repairer") == "worker":
        raise ValueError("repairer: worker is verdict mode: use mode='verdict'")
    return cfg


def identifier(value: str, fallback: str) -> str:
    """``value`` as a run or worker id the fleet accepts (letters, digits, ``._-``, at most
    128, no ``..``); ``fallback`` when nothing is left."""
    cleaned = _UNSAFE.sub("-", value).strip(".-_")[:128].strip(".-_")
    return re.sub(r"\.{2,}", ".", cleaned) or fallback


def first_line(exc: BaseException) -> str:
    """An error's first line (its class name when it has no text)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def as_payload(output: Any) -> str | dict[str, Any]:
    """A framework's output as a submission's ``output``: text as it is, a structured output
    (a Pydantic model, dataclass, TypedDict, dict) as its JSON object, anything else as JSON."""
    if isinstance(output, str):
        return output
    dumped = pydantic.TypeAdapter(type(output)).dump_python(output, mode="json")
    if isinstance(dumped, dict):
        return {str(k): v for k, v in dumped.items()}
    return dumped if isinstance(dumped, str) else json.dumps(dumped, ensure_ascii=False)


def as_output(value: Any, like: Any) -> Any:
    """The fleet's output ``value`` in the type of the worker's output ``like`` (text stays
    text; a structured output is parsed back into its class)."""
    if isinstance(like, str):
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(type(like))
    if isinstance(value, str):
        return adapter.validate_json(value)
    return adapter.validate_python(value)


def as_text(output: Any) -> str:
    """An output as the text a model reads."""
    payload = as_payload(output)
    return payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)


def kept_candidate(result: CritiqueResult, candidates: Sequence[Any]) -> Any | None:
    """The candidate (the worker's own object) the service kept, or None when the kept output
    is none of them (the fleet's repairer changed it)."""
    if not candidates:
        return None
    kept = candidates[kept_index(result, [as_payload(c) for c in candidates])]
    return kept if comparable(as_payload(kept)) == comparable(result.output) else None


class LoopClients:
    """One :class:`AsyncCritiqueClient` per event loop (a client's connections belong to the
    loop that made them), or the one given. The first is made at once, so a bad configuration
    fails where the adapter is built, not at its first output."""

    def __init__(self, config: Mapping[str, Any], given: AsyncCritiqueClient | None) -> None:
        self._config = dict(config)
        self._given = given
        self._spare = None if given is not None else AsyncCritiqueClient(self._config)
        self._by_loop: dict[asyncio.AbstractEventLoop, AsyncCritiqueClient] = {}

    def get(self) -> AsyncCritiqueClient:
        """The running loop's client."""
        if self._given is not None:
            return self._given
        loop = asyncio.get_running_loop()
        client = self._by_loop.get(loop)
        if client is None:
            client = self._spare or AsyncCritiqueClient(self._config)
            self._spare = None
            self._by_loop = {lp: c for lp, c in self._by_loop.items() if not lp.is_closed()}
            self._by_loop[loop] = client
        return client

    async def aclose(self) -> None:
        """Close the running loop's client when it was made here."""
        client = self._by_loop.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()
