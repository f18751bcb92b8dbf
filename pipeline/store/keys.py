"""Every Redis key, queue and task name the product uses, in one place, each with its comment.

Run keys are ``<prefix>:{<run_id>}:<suffix>``: the ``{run_id}`` hash tag puts a whole run in one
Redis Cluster slot, so the Lua scripts may touch several of its keys atomically. Every run key
expires ``CRITIQUE_RUN_TTL_S`` seconds after its last write; the keys that only serve a live
chain (a pass's step records, its first message) expire ``CRITIQUE_LIVE_TTL_S`` after theirs,
and are deleted as soon as the pass's result lands. Blob keys are content-addressed and
shared by every run (``<prefix>:blob:<sha256 hex>``); they expire too. Lessons
(``<prefix>:lessons:{lessons}:*``, written only when ``CRITIQUE_LESSONS_SCOPE=fleet``) are shared
too and expire ``CRITIQUE_LESSONS_TTL_S`` seconds after the last run that taught one.

**Redis Cluster** (``CRITIQUE_STORE_URL=redis+cluster://…``): a key's slot is the hash of its
first ``{…}`` (its hash tag), else of the whole name. One script, transaction or multi-key
command touches keys of one tag only: a run's keys share ``{run_id}`` (the archive marker too),
a queue's two probe keys ``{queue}``, the four lessons keys ``{lessons}``. Every other shared
key (a blob, a cache entry or claim, an entry task id's claim, a rate-limit bucket,
``pending:runs``, ``archive:runs``, the sweep and archive locks) is used alone, each in a slot
of its own, so several of them are never written in one atomic step. Scripts get every key
they touch in ``KEYS``; none builds a key name from ``ARGV``.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from pipeline import settings
from pipeline.errors import ConfigError
from pipeline.models import LessonScope, check_identifier

# --- environment -----------------------------------------------------------------------------

# (the variables themselves: pipeline.settings)
# The defaults, as pipeline.settings declares them (one place: its table and docs/configuration.md).
DEFAULT_PREFIX = settings.value(settings.KEY_PREFIX, {})  # critique
DEFAULT_RUN_TTL_S = settings.integer(settings.RUN_TTL_S, {})  # 7 days after a run's last write
DEFAULT_LIVE_TTL_S = settings.integer(settings.LIVE_TTL_S, {})  # 1 day: a live pass's steps
DEFAULT_LESSONS_TTL_S = settings.integer(settings.LESSONS_TTL_S, {})  # 30 days after a lesson
LESSONS_SCOPES = ("run", "fleet")  # a run's lessons are its own, or shared by the whole fleet

# --- queues and tasks (celeryconfig and workers.routing route by these names) ----------------

QUEUE_CPU = "critique.cpu"  # queue for CPU-bound stages: L0, heuristic/rubric critics, gates
QUEUE_LLM = "critique.llm"  # queue for LLM-bound stages: LLM critic (inline mode), repair
QUEUE_CRITIC = "critique.llm.critic"  # queue for the LLM critic in mode: dedicated
QUEUES = (QUEUE_CPU, QUEUE_LLM, QUEUE_CRITIC)  # every queue a worker may consume

TASK_L0 = "critique.l0"  # task: the Layer-0 output contract
TASK_CRITIC = "critique.critic"  # task: run the configured critic
TASK_DECIDE = "critique.decide"  # task: convergence decision (continue, stop, escalate)
TASK_REPAIR = "critique.repair"  # task: one targeted repair attempt
TASK_GATE = "critique.gate"  # task: the per-submission gate at the end of the chain
TASK_COMPLETE_GATE = "critique.complete_gate"  # task: the manager's completion gate
TASK_PROBE = "critique.probe"  # task: a queue-drain probe (workers.recovery), no payload
TASK_SUBMIT = "critique.submit"  # task: the entry task, one JSON submission (docs/entry.md)
QUEUE_SUBMIT = QUEUE_CPU  # queue managers publish entry messages to (a plain Redis list)

# --- run key suffixes (under ``<prefix>:{<run_id>}:``) -----------------------------------------

PATTERNS_FREQ = "patterns:freq"  # sorted set: pattern key -> frequency + order tiebreak (ranks)
PATTERNS_DETAIL = "patterns:detail"  # hash: pattern key -> JSON details (category, rule, order…)
PATTERNS_SEEN = "patterns:seen"  # set: critique keys already recorded (exactly-once recording)
PATTERNS_COUNTED = "patterns:counted"  # set: "<pass key>|<sha1 of pattern key>" counted per pass
PATTERNS_SEQ = "patterns:seq"  # string: the last first-recorded order handed out in the run
BUDGET = "budget"  # hash: "spent" -> repair tokens charged; "overrun" -> charged past reservations;
# "rounds", "growth", "reply" -> what committed repair rounds used (pipeline.store.base.RepairUsage)
BUDGET_LEASES = "budget:leases"  # hash: lease id -> "tokens:expires_us:state:charge[:holder]"
BUDGET_LIVE = "budget:live"  # sorted set: undone lease id -> when it stops holding (µs): its TTL,
# or sooner its holder's liveness deadline (pipeline.store.leases); past ones reclaimed
BUDGET_WAITING = "budget:waiting"  # sorted set: waiting lease id -> last ask + grace (µs)
TRACE = "trace"  # stream: the run's single trace channel, one JSON "event" field per entry
TRACE_EVENT_FIELD = "event"  # the field of each trace stream entry holding its event
TRACE_SIG_FIELD = "sig"  # with CRITIQUE_SECRET: the event's tag (security.signing.trace_mac)
TRACE_MAXLEN = 100_000  # approximate cap on a run's trace stream (XADD MAXLEN ~)
TRACE_CAPPED = "trace:capped"  # hash: kind -> how many capped events (unverified refusals) came
TRACE_OPS = "trace:ops"  # sorted set: ids of the latest appends (a re-sent append adds nothing)
SUBMITTED = "submitted"  # hash: "<iteration>:<worker_id>" -> JSON {task_id, signature, sid, at}
MESSAGES = "messages"  # hash: "<iteration>:<worker>:<sid>" -> a live pass's first message (JSON)
RESULTS = "results"  # hash: "<iteration>:<worker_id>" -> a result stored without a pass
PASS_RESULTS = "results:pass"  # hash: "<iteration>:<worker>:<sid>" -> that pass's packed result
PASSES = "passes"  # hash: "<iteration>:<worker_id>" -> the latest pass id (sid), set at submit
COMPLETIONS = "completions"  # hash: "rejected" -> gate rejections; "req:<id>" -> counted
STEPS = "steps"  # hash: "complete_gate:<request id>" -> the completion decision (signed JSON)
PASS_STEPS = "steps:pass"  # hash ``…:steps:pass:<iteration>:<worker>:<sid>``: a live pass's
# step records, "<iteration>:<worker>:<sid>:<round>:<attempt>:<stage>" -> output; deleted with
# the pass's result (see pass_steps_key)
PENDING = "pending"  # sorted set: "<iteration>:<worker>:<sid>" -> last progress (unix s), unsettled
RESUMES = "resumes"  # hash: "<iteration>:<worker>:<sid>" -> times the pass was re-driven as stalled
SUSPECTS = "suspects"  # hash: "<iteration>:<worker>:<sid>" -> "<progress>@<t>": no message at t
FAILURES = "failures"  # hash: pass member or "complete_gate:<request id>" -> a worker's failure
OWNER = "owner"  # string: the identity whose key opened the run (security.signing.entry_identity)
DONE = "done"  # pub/sub channel ``…:done`` (no key): a pass member published as its result or
# failure lands; a waiting client reads then instead of at its next poll (a hint, never trusted)
PARKED = (
    "parked"  # string ``…:parked:<pass id>``: a pass's state kept for its worker's repair (TTL)
)

RUN_KEY_SUFFIXES: tuple[str, ...] = (
    PATTERNS_FREQ,
    PATTERNS_DETAIL,
    PATTERNS_SEEN,
    PATTERNS_COUNTED,
    PATTERNS_SEQ,
    BUDGET,
    BUDGET_LEASES,
    BUDGET_LIVE,
    BUDGET_WAITING,
    TRACE,
    SUBMITTED,
    MESSAGES,
    RESULTS,
    PASS_RESULTS,
    PASSES,
    COMPLETIONS,
    STEPS,
    PENDING,
    RESUMES,
    SUSPECTS,
    FAILURES,
    OWNER,
    TRACE_CAPPED,
    TRACE_OPS,
)  # every run key suffix, for scans, reports and tests

# --- shared (not per-run) keys ---------------------------------------------------------------

BLOB = "blob"  # string under ``<prefix>:blob:<sha256 hex>``: content-addressed bytes, all runs
LESSONS_TAG = "{lessons}"  # the lessons' one hash tag: one cluster slot for their one script
LESSONS_RUNS = f"lessons:{LESSONS_TAG}:runs"  # sorted set: pattern key -> runs + order tiebreak
LESSONS_DETAIL = f"lessons:{LESSONS_TAG}:detail"  # hash: pattern key -> JSON {category, rule…}
LESSONS_SEQ = f"lessons:{LESSONS_TAG}:seq"  # string: the last first-learned order handed out
LESSONS_HELD = f"lessons:{LESSONS_TAG}:held"  # hash: sha1 of a run id -> lessons it brought, kept
LESSONS_KEYS = (LESSONS_RUNS, LESSONS_DETAIL, LESSONS_SEQ, LESSONS_HELD)  # fleet scope only; all
# expire CRITIQUE_LESSONS_TTL_S
PENDING_RUNS = "pending:runs"  # sorted set: run id -> last submit; runs the stall sweeper scans
SWEEP_LOCK = "sweep:lock"  # string: token of the worker sweeping for stalls now (expires)
ARCHIVE_RUNS = "archive:runs"  # sorted set: run id -> when the archiver looks at it next (unix s)
ARCHIVE_DONE = "archive:done"  # string ``…:archive:done:{<run_id>}``: the run's last archive (JSON)
ARCHIVE_LOCK = "archive:lock"  # string: token of the worker archiving due runs now (expires)
CACHE = "cache:critique"  # string ``<prefix>:cache:critique:<sha256>``: envelope JSON (TTL)
CACHE_CLAIM = "cache:claim"  # string ``<prefix>:cache:claim:<sha256>``: who critiques it (TTL)
RATELIMIT = "ratelimit"  # hash ``<prefix>:ratelimit:<model>``: "rpm", "tpm" -> GCRA TAT (ms)
PROBE = "probe"  # hash ``<prefix>:probe:{<queue>}``: "sent", "done" -> last probe sent, run
METRICS_COUNTERS = "metrics:{counters}"  # hash: fleet counters (pipeline.store.metrics), no TTL
METRICS_DURATIONS = "metrics:{durations}"  # hash: "<stage>:b<i>" / "<stage>:sum": stage histogram
METRICS_KEYS = (METRICS_COUNTERS, METRICS_DURATIONS)  # each its own {tag}: its own cluster slot
PROBE_DRAINED = "drained"  # sorted set ``<prefix>:probe:{<queue>}:drained``: probe sent -> ran
AMQP_CENSUS = "amqp:census"  # ``<prefix>:amqp:census:{<vhost digest>}:reports`` (hash: worker ->
# JSON consumer report) and ``…:quiet`` (sorted set: census time -> quiet queues), RabbitMQ only
ENTRY_CLAIM = "entry"  # string ``<prefix>:entry:<sha256 of a task id>``: JSON {run_id, iteration,
# worker_id, pass_id} of the entry message that first ran under that id, fleet-wide (run TTL)
DEADLETTER = "deadletter"  # list: broker messages refused at a worker's door (workers.door),
# newest first, JSON {reason, detail, queue, at, task, id, excerpt}; capped, expires like a run
DEADLETTER_MAX = 1000  # entries the dead-letter list keeps (LPUSH + LTRIM)
FLEET_POSTURE = "fleet:posture"  # hash: worker node name -> JSON posture (security.posture): the
# keys it requires, as key ids, never keys; refreshed every sweeper tick, expires once none is

# --- broker keys (in the Redis broker's database, beside kombu's own) -------------------------

HOLDERS = "critique.holders"  # hash ``<unacked key>.critique.holders``: worker -> JSON held tags


def key_prefix() -> str:
    """The key prefix: ``$CRITIQUE_KEY_PREFIX`` or ``critique``."""
    return check_prefix(settings.raw(settings.KEY_PREFIX) or DEFAULT_PREFIX)


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it can head a key (non-empty; no braces, glob characters, spaces)."""
    if not prefix or any(c in prefix for c in "{}*?[]\\ \t\r\n"):
        raise ConfigError(
            f"Redis key prefix {prefix!r} must be non-empty, without braces, glob characters "
            "or whitespace",
            key=settings.KEY_PREFIX.name,
        )
    return prefix


def _seconds_env(setting: settings.Setting, default: int, hint: str) -> int:
    """``setting`` as a positive whole number of seconds, or ``default`` when unset or blank."""
    name = setting.name
    raw = settings.raw(setting)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(
            f"{name}={raw!r} is not a positive number of seconds", key=name, hint=hint
        )
    return value


def run_ttl_s() -> int:
    """The run TTL in seconds: ``$CRITIQUE_RUN_TTL_S`` (a positive integer) or 7 days."""
    return _seconds_env(settings.RUN_TTL_S, DEFAULT_RUN_TTL_S, "unset it for the 7-day default")


def live_ttl_s() -> int:
    """The live-chain TTL in seconds: ``$CRITIQUE_LIVE_TTL_S`` (a positive integer) or 1 day.

    A pass's step records and first message serve only its live chain: they are deleted when
    its result lands, and expire this long after their last write if it never does (a pass
    queued longer than this loses its replay records and its re-drive)."""
    return _seconds_env(settings.LIVE_TTL_S, DEFAULT_LIVE_TTL_S, "unset it for the 1-day default")


def steps_grace_s() -> int:
    """How long a finished pass's step records stay readable (for inspection), in seconds:
    ``$CRITIQUE_STEPS_GRACE_S`` (a whole number, 0 or more) or 0, deleted with the result. A
    late delivery of a finished pass's step never needs them: it ends at the result."""
    name = settings.STEPS_GRACE_S.name
    raw = settings.raw(settings.STEPS_GRACE_S)
    if raw is None or not raw.strip():
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(
            f"{name}={raw!r} is not a whole number of seconds (0 or more)",
            key=name,
            hint="unset it to release a pass's steps when its result lands",
        )
    return value


def lessons_ttl_s() -> int:
    """The lessons TTL in seconds: ``$CRITIQUE_LESSONS_TTL_S`` (a positive integer) or 30 days.

    Lessons are shared by every run; each write pushes their expiry back out, so they vanish
    only after this long without a run teaching one."""
    return _seconds_env(
        settings.LESSONS_TTL_S, DEFAULT_LESSONS_TTL_S, "unset it for the 30-day default"
    )


def lessons_scope() -> LessonScope:
    """Whose lessons a run sees: ``$CRITIQUE_LESSONS_SCOPE``, ``run`` (the default) or ``fleet``.

    A worker-side setting, read from the environment only (no submission's configuration can
    widen it): under ``run`` a run's lessons are the patterns it taught itself and nothing is
    written to the shared lessons keys; ``fleet`` is the operator's consent to one shared
    store, where any run that can submit puts text into every run's ``lessons.md``, bounded
    per run (:data:`~pipeline.store.base.MAX_LESSONS_PER_RUN`) and labelled with counts."""
    name = settings.LESSONS_SCOPE.name
    raw = settings.given(settings.LESSONS_SCOPE).lower()
    if raw in ("", "run"):
        return "run"
    if raw != "fleet":
        raise ConfigError(
            f"{name}={raw!r} is neither 'run' nor 'fleet'",
            key=name,
            hint="unset it to keep each run's lessons to itself",
        )
    return "fleet"


def run_key(run_id: str, suffix: str, prefix: str | None = None) -> str:
    """The key ``<prefix>:{<run_id>}:<suffix>``; ``run_id`` must be a safe identifier."""
    check_identifier(run_id, "run_id")
    return f"{prefix or key_prefix()}:{{{run_id}}}:{suffix}"


def pass_steps_key(run_id: str, pass_member: str, prefix: str | None = None) -> str:
    """The step-record hash of one pass (``pass_member``: ``<iteration>:<worker>:<sid>``), in
    its run's slot; the one key a finished pass's steps live in, so one ``DEL`` releases them."""
    return run_key(run_id, f"{PASS_STEPS}:{pass_member}", prefix)


class StepId(NamedTuple):
    """A pass's step id taken apart (:func:`parse_step_id`)."""

    pass_member: str  # "<iteration>:<worker>:<sid>": the pass the step belongs to
    round: int  # the loop's round (one more per repair round)
    attempt: int  # the repair attempt within the round
    stage: str  # "l0", "critic", "decide" or "repair"


def step_id(pass_member: str, round: int, attempt: int, stage: str) -> str:
    """The id of one stage run of a pass (``pass_member``: ``<iteration>:<worker>:<sid>``):
    ``"<pass_member>:<round>:<attempt>:<stage>"``, its field in the pass's step-record hash
    (:func:`pass_steps_key`). Parsed back by :func:`parse_step_id`."""
    return f"{pass_member}:{round}:{attempt}:{stage}"


def parse_step_id(step: str) -> StepId | None:
    """The parts of a step id made by :func:`step_id`; None for any other step id (a completion
    gate's ``complete_gate:<request id>``) or a malformed one."""
    parts = step.split(":")
    if len(parts) != 6:
        return None
    try:
        round_, attempt = int(parts[3]), int(parts[4])
    except ValueError:
        return None
    return StepId(":".join(parts[:3]), round_, attempt, parts[5])


def shared_key(suffix: str, prefix: str | None = None) -> str:
    """A key shared by every run: ``<prefix>:<suffix>`` (blobs, lessons)."""
    return f"{prefix or key_prefix()}:{suffix}"


def run_key_pattern(run_id: str, prefix: str | None = None) -> str:
    """A SCAN ``MATCH`` pattern for every key of one run."""
    check_identifier(run_id, "run_id")
    return f"{prefix or key_prefix()}:{{{run_id}}}:*"


def ratelimit_key(model: str, prefix: str | None = None) -> str:
    """The rate-limit bucket of one LLM model (shared by every worker and run)."""
    return shared_key(f"{RATELIMIT}:{model}", prefix)


def pattern_key(category: str, prevention_rule: str) -> str:
    """Identity of a pattern (a field of ``patterns:freq``/``patterns:detail``/``lessons:*``):
    its category and its whitespace/case-folded prevention rule."""
    return f"{category}|{' '.join(prevention_rule.lower().split())}"


def entry_claim_key(task_id: str, prefix: str | None = None) -> str:
    """The fleet-wide claim of an entry task id (:data:`ENTRY_CLAIM`): hashed, because a task
    id comes from the broker (any length, any characters, braces that would pick a cluster
    slot)."""
    digest = hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).hexdigest()
    return shared_key(f"{ENTRY_CLAIM}:{digest}", prefix)


def blob_key(sha256_hex: str, prefix: str | None = None) -> str:
    """The key of a content-addressed blob (no hash tag: blobs are shared across runs)."""
    return shared_key(f"{BLOB}:{sha256_hex}", prefix)
