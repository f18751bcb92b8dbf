"""Every ``CRITIQUE_*`` environment variable that is not a configuration field, declared once.

Configuration fields (``CRITIQUE_<FIELD>``, mapped onto :class:`pipeline.config.CritiqueConfig`)
are the workflow's settings; the variables here are the deployment's: where Redis keys live
and how long, signing keys, Celery's limits, the sweeper's timing, the CLI's defaults, the test
suite's switches. Each is one :class:`Setting`: its name, its default, how its value parses,
who reads it and what it does. docs/configuration.md ("Deployment settings") lists the same
names and defaults in one table, and a unit test keeps the two in step; the configuration
check (:func:`pipeline.config.read_env`) takes every name here as known, not a typo.

The accessors read the environment when they are called, never at import: a value a module
reads at import (``celeryconfig``, :data:`workers.runtime.INLINE_LIMIT`) is read then because
that module calls the accessor then. Pure: the standard library only; a reader that turns a bad
value into a ``ConfigError`` with its own hint does so itself, from :func:`given`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Kind = Literal["int", "float", "str", "flag", "list", "secret", "path", "url", "choice"]
"""How a value parses: a whole number, a number, free text, 1/0 (anything but 0, false, no, off
is on), a comma-separated list, a secret (comma-separated keys), a path, a URL, or one of a few
words."""
Readers = Literal["worker", "client", "both", "CLI", "tests"]
"""Who reads it: workers, clients (the Python client, the CLI's client side), both, the
``critique`` CLI only, or the test suite only."""


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``default`` is what an unset (or blank) one means, as the
    documentation's table gives it (None: none, or computed, see ``doc``); ``floor``, where
    set, is the least value :func:`integer` and :func:`number` raise a smaller one to (a
    reader that refuses a value out of range says so in ``doc`` and checks it itself)."""

    name: str
    default: str | None
    kind: Kind
    readers: Readers
    doc: str
    floor: float | None = None


def _s(
    name: str,
    default: str | None,
    kind: Kind,
    readers: Readers,
    doc: str,
    floor: float | None = None,
) -> Setting:
    return Setting(f"CRITIQUE_{name}", default, kind, readers, doc, floor)


# --- files and the CLI ----------------------------------------------------------------------
CONFIG = _s("CONFIG", None, "path", "both", "the workflow.awp.yaml to read (unset: none)")
WORKSPACE = _s("WORKSPACE", "workspace", "path", "both", "root folder for artifacts")
ARCHIVE_DIR = _s(
    "ARCHIVE_DIR",
    None,
    "path",
    "both",
    "where runs' durable records go (unset: the workspace's archive)",
)
ARCHIVE_AFTER_S = _s(
    "ARCHIVE_AFTER_S", "600", "float", "worker",
    "quiet seconds before a worker archives a settled run (0: this worker never does)",
)  # fmt: skip
QUEUES = _s(
    "QUEUES", "critique.cpu,critique.llm,critique.llm.critic", "list", "CLI",
    "queues a `critique worker` consumes",
)  # fmt: skip
CONCURRENCY = _s(
    "CONCURRENCY", None, "int", "CLI",
    "threads or processes per `critique worker` process (unset: 16 threads, 32 calls in flight "
    "per CPU)",
)  # fmt: skip
PROCESSES = _s(
    "PROCESSES", "auto", "int", "CLI",
    "`critique worker` processes (auto: two per usable CPU, one per CPU on a host of one or two)",
)  # fmt: skip
LOG_LEVEL = _s("LOG_LEVEL", "INFO", "choice", "CLI", "`critique worker`'s log level")

# --- Redis keys -----------------------------------------------------------------------------
KEY_PREFIX = _s("KEY_PREFIX", "critique", "str", "both", "prefix of every Redis key")
RUN_TTL_S = _s(
    "RUN_TTL_S", "604800", "int", "both", "seconds a run's keys live after its last write (> 0)"
)
LIVE_TTL_S = _s(
    "LIVE_TTL_S", "86400", "int", "both",
    "seconds a live pass's step records, first message and blobs live after their last write "
    "(> 0)",
)  # fmt: skip
STEPS_GRACE_S = _s(
    "STEPS_GRACE_S", "0", "int", "worker",
    "seconds a finished pass's step records stay, for inspection (≥ 0)",
)  # fmt: skip
LESSONS_TTL_S = _s(
    "LESSONS_TTL_S", "2592000", "int", "worker",
    "seconds the shared lessons live after the last run that taught one (> 0)",
)  # fmt: skip
LESSONS_SCOPE = _s(
    "LESSONS_SCOPE", "run", "choice", "both",
    "`run`: each run's lessons are its own; `fleet`: shared by every run",
)  # fmt: skip

# --- the store's Redis --------------------------------------------------------------------------
STORE_URL = _s(
    "STORE_URL", None, "url", "both",
    "the store's Redis when not REDIS_URL (may be a Redis Cluster)",
)  # fmt: skip
REDIS_MASTER = _s(
    "REDIS_MASTER", None, "str", "both", "the Sentinel master's name (required with sentinel://)"
)
SENTINEL_PASSWORD = _s(
    "SENTINEL_PASSWORD", None, "secret", "both", "the Sentinels' own password, if any"
)
STORE_REPLICAS = _s(
    "STORE_REPLICAS", "0", "int", "worker",
    "replicas a result, pattern count or budget charge must reach (WAIT; ≥ 0)",
)  # fmt: skip
STORE_REPLICA_WAIT_MS = _s(
    "STORE_REPLICA_WAIT_MS", "2000", "int", "worker",
    "milliseconds one such write waits for them (≥ 1)",
)  # fmt: skip

# --- budget leases --------------------------------------------------------------------------
LEASE_TTL_S = _s(
    "LEASE_TTL_S", "900", "float", "worker", "the most seconds a repair's budget lease is held"
)
LEASE_DEAD_S = _s(
    "LEASE_DEAD_S", "20", "float", "both",
    "seconds without a beat before a lease's holder counts as dead (≥ 0; 0: only the TTL ends it)",
)  # fmt: skip
LEASE_BEAT_S = _s(
    "LEASE_BEAT_S", "5", "float", "both",
    "seconds between the beats of a process's leases (at most a third of LEASE_DEAD_S)",
)  # fmt: skip

# --- Celery and the runtime --------------------------------------------------------------------
INLINE_LIMIT = _s(
    "INLINE_LIMIT", "16384", "int", "both",
    "largest stage state (bytes) carried inline in a broker message; larger goes to a blob",
)  # fmt: skip
TASK_TIME_LIMIT_S = _s(
    "TASK_TIME_LIMIT_S", "600", "int", "both", "hard time limit of every task (seconds)"
)
VISIBILITY_TIMEOUT_S = _s(
    "VISIBILITY_TIMEOUT_S", None, "int", "both",
    "seconds before Redis redelivers an unacked message (unset: max(3600, 2 × time limit))",
)  # fmt: skip
RESTORE_INTERVAL_S = _s(
    "RESTORE_INTERVAL_S", "10", "float", "worker", "seconds between sweeps for unacked messages"
)
RESTORE_MUTEX_S = _s(
    "RESTORE_MUTEX_S", "60", "int", "worker", "seconds a dead sweeper's mutex blocks the others"
)
RESULT_EXPIRES_S = _s(
    "RESULT_EXPIRES_S", None, "int", "both",
    "seconds Celery's own results live (unset: CRITIQUE_RUN_TTL_S, else 7 days)",
)  # fmt: skip
PREFETCH_MULTIPLIER = _s(
    "PREFETCH_MULTIPLIER", "1", "int", "worker", "messages a worker process reserves"
)
TASK_EVENTS = _s(
    "TASK_EVENTS", "1", "flag", "worker",
    "task events (Flower); `critique worker` sets 0 unless set, Flower turns them on",
)  # fmt: skip
AMQP_QUEUE_TYPE = _s(
    "AMQP_QUEUE_TYPE", "quorum", "choice", "both",
    "the pipeline's queues on RabbitMQ: quorum or classic",
)  # fmt: skip
OUTAGE_S = _s(
    "OUTAGE_S", "120", "float", "both",
    "seconds publishes, result writes and reads without a deadline ride out a Redis outage", 1,
)  # fmt: skip

# --- recovery -------------------------------------------------------------------------------------
STALL_S = _s(
    "STALL_S", None, "float", "worker",
    "seconds without progress before a pass is re-driven (unset: task time limit + 30)", 0.1,
)  # fmt: skip
SWEEP_S = _s(
    "SWEEP_S", "5", "float", "worker",
    "seconds between sweeps, probes and holder reports (0: no sweeping)", 0,
)  # fmt: skip
STALL_MAX_RESUMES = _s(
    "STALL_MAX_RESUMES", "5", "int", "worker", "re-drives of one stalled pass before giving up", 1
)

# --- secrets ------------------------------------------------------------------------------------
LLM_API_KEY = _s(
    "LLM_API_KEY", None, "secret", "both",
    "the operator's API key, sent only to the configured models' providers",
)  # fmt: skip
SECRET = _s(
    "SECRET", None, "secret", "both",
    "HMAC key(s) signing stage messages, gate requests and records, the signing one first",
)  # fmt: skip
ENTRY_SECRET = _s(
    "ENTRY_SECRET", None, "secret", "both",
    "HMAC key(s) of the managers' entry messages (critique.submit), `name=key` or bare",
)  # fmt: skip

# --- the test suite -------------------------------------------------------------------------------
TEST_REDIS_URL = _s("TEST_REDIS_URL", None, "url", "tests", "the test suite's Redis")
TEST_REQUIRE_FASTSCAN = _s(
    "TEST_REQUIRE_FASTSCAN", None, "flag", "tests", "fail, not skip, without the C scanner"
)
TEST_SENTINEL_DEMOTE = _s(
    "TEST_SENTINEL_DEMOTE", None, "flag", "tests", "run the Sentinel demotion variant"
)

ALL: tuple[Setting, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Setting))
"""Every setting, in the order declared."""
NAMES: frozenset[str] = frozenset(s.name for s in ALL)


def raw(setting: Setting, env: Mapping[str, str] | None = None) -> str | None:
    """The variable's value exactly as set in ``env`` (default ``os.environ``), None if unset."""
    return (os.environ if env is None else env).get(setting.name)


def given(setting: Setting, env: Mapping[str, str] | None = None) -> str:
    """The value without surrounding whitespace; ``""`` when unset or blank (the default)."""
    return (raw(setting, env) or "").strip()


def value(setting: Setting, env: Mapping[str, str] | None = None) -> str:
    """The value exactly as set (blank included), else the default (``LookupError`` if none)."""
    got = raw(setting, env)
    return _default(setting) if got is None else got


def _default(setting: Setting) -> str:
    if setting.default is None:
        raise LookupError(f"{setting.name} has no fixed default")
    return setting.default


def integer(setting: Setting, env: Mapping[str, str] | None = None) -> int:
    """A whole number: the value, else the default (unset or blank), at least ``floor``.
    ``ValueError`` when it does not parse."""
    value = int(given(setting, env) or _default(setting))
    return value if setting.floor is None else max(int(setting.floor), value)


def number(setting: Setting, env: Mapping[str, str] | None = None) -> float:
    """A number: the value, else the default (unset or blank), at least ``floor``.
    ``ValueError`` when it does not parse."""
    value = float(given(setting, env) or _default(setting))
    return value if setting.floor is None else max(setting.floor, value)


def flag(setting: Setting, env: Mapping[str, str] | None = None) -> bool:
    """On unless the value is 0, false, no or off; the default when unset or blank."""
    text = given(setting, env).lower() or _default(setting)
    return text not in ("0", "false", "no", "off")
