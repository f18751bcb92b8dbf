"""What a Redis writer without the secret can plant and a worker later reads (issue 33, item 6
and the medium items on the cache key, trace events, refusals and lessons), through a real
signed worker: a rewritten or copied critique-cache entry is a miss (the critic runs again and
the verdict is its own), a run's Known Pitfalls are part of the cache key, and after each
attack the worker is alive and serves an honest submission.

The worker gets its LLM endpoint from its own environment (``llm_env``), pointed at a fake
OpenAI-compatible server, and runs with the critique cache on.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.models import CritiqueResult, Submission
from pipeline.store import keys
from pipeline.store.metrics import FleetMetrics
from tests.fakes.openai_server import FakeOpenAIServer
from tests.support import wait_until
from tests.support.workers import WorkerProcess, WorkerSpec

pytestmark = pytest.mark.integration

CRITIC_MODEL = "openai/critic-model"
LLM_MODELS = CRITIC_MODEL
"""The models a submission may name (the worker's allowed_models)."""
WORKER = WorkerSpec("planted", env_fixture="llm_env", more_env={"CRITIQUE_CACHE__ENABLED": "true"})
"""One worker for the module, critique cache on (tests/hostile/conftest.py's `llm_env`)."""

LOW_CRITIQUE = json.dumps(
    {"score": 0.35, "defects": [], "prescriptions": [], "reusable_patterns": [], "summary": "weak"}
)
"""What the (fake) critic answers for the attacked output: a rejection."""
FORGED_ENVELOPE = {"score": 0.97, "defects": [], "summary": "planted"}
"""What the attacker writes into the cache entry."""
CONFIG = {"enabled": True, "critic": "llm", "model": CRITIC_MODEL, "max_repair_attempts": 0}


def submission(run_id: str) -> Submission:
    return Submission(
        run_id=run_id,
        worker_id="w1",
        task="Summarise the Q3 report for the board.",
        output={"summary": "Revenue was flat; the reasons are unclear.", "confidence": 0.5},
        required_fields=("summary",),
    )


def run_one(sub: Submission) -> CritiqueResult:
    from workers.client import CritiqueClient

    client = CritiqueClient(CONFIG)
    return client.wait(client.submit(sub), timeout=60)


def cache_keys(url: str) -> list[str]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return sorted(r.scan_iter(match=f"*:{keys.CACHE}:*"))


@pytest.fixture()
def critic(module_llm: FakeOpenAIServer, hostile_url: str) -> FakeOpenAIServer:
    module_llm.reset()
    module_llm.set_default(LOW_CRITIQUE)
    r = redis.Redis.from_url(hostile_url)
    for key in cache_keys(hostile_url):
        r.delete(key)
    return module_llm


def refused_count(url: str) -> int:
    return FleetMetrics(redis.Redis.from_url(url)).read()[0].get("cache_refused", 0)


@pytest.mark.parametrize("how", ["rewritten", "unsigned"])
def test_a_planted_cache_entry_never_becomes_a_verdict(
    worker: WorkerProcess, critic: FakeOpenAIServer, hostile_url: str, how: str
) -> None:
    """Rewriting a cached envelope to 0.97 (inside its signed wrapper, or as a bare unsigned
    entry) makes a miss: the next run's identical output is critiqued again and rejected, and
    the refusal is counted."""
    first = run_one(submission(f"cache-a-{uuid.uuid4().hex[:8]}"))
    assert first.status != "accepted" and first.envelope.score == 0.35
    (entry_key,) = cache_keys(hostile_url)
    r = redis.Redis.from_url(hostile_url, decode_responses=True)
    stored: dict[str, Any] = json.loads(r.get(entry_key) or "{}")
    assert "sig" in stored, "a worker with the secret stores cache entries signed"
    forged_envelope = {**json.loads(stored["envelope"]), **FORGED_ENVELOPE}
    if how == "rewritten":
        planted = json.dumps({**stored, "envelope": json.dumps(forged_envelope)})
    else:
        planted = json.dumps(forged_envelope)
    r.set(entry_key, planted, px=600_000)
    before = refused_count(hostile_url)
    calls = len(critic.completions)

    second = run_one(submission(f"cache-b-{uuid.uuid4().hex[:8]}"))

    assert second.status == first.status and second.envelope.score == 0.35
    assert not any("critique cache hit" in n for n in second.notes)
    assert len(critic.completions) == calls + 1
    wait_until(lambda: refused_count(hostile_url) > before, 10, what="cache_refused counted")


def test_a_valid_entry_copied_onto_another_key_is_a_miss(
    worker: WorkerProcess, critic: FakeOpenAIServer, hostile_url: str
) -> None:
    """A signed accepting entry copied onto the key of a rejected output does not verify there
    (each entry is signed with the key it is filed under)."""
    from tests.support.workers import ACCEPTING_CRITIQUE

    critic.set_default(ACCEPTING_CRITIQUE)
    good = submission(f"cache-g-{uuid.uuid4().hex[:8]}").model_copy(
        update={"output": {"summary": "Revenue rose 4% on new contracts.", "confidence": 0.9}}
    )
    assert run_one(good).status == "accepted"
    (good_key,) = cache_keys(hostile_url)
    critic.set_default(LOW_CRITIQUE)
    assert run_one(submission(f"cache-c-{uuid.uuid4().hex[:8]}")).envelope.score == 0.35
    r = redis.Redis.from_url(hostile_url)
    bad_key = next(k for k in cache_keys(hostile_url) if k != good_key)
    r.set(bad_key, r.get(good_key) or b"", px=600_000)

    again = run_one(submission(f"cache-d-{uuid.uuid4().hex[:8]}"))

    assert again.status != "accepted" and again.envelope.score == 0.35


def test_unsigned_refusals_claiming_a_run_are_capped_in_its_trace(
    worker: WorkerProcess, critic: FakeOpenAIServer
) -> None:
    """40 unsigned gate requests naming a victim run add at most 20 `refused` events and one
    `capped` note to its trace; every one is still counted."""
    from tests.support.hostile import send_raw
    from workers import runtime
    from workers.steps import UNVERIFIED_REFUSALS_TRACED

    run_id = f"victim-{uuid.uuid4().hex[:8]}"
    for _ in range(40):
        send_raw(keys.TASK_COMPLETE_GATE, {"run_id": run_id, "request_id": "x"})
    sink = runtime.stores().trace
    wait_until(
        lambda: sink.capped_counts(run_id).get("refused_unverified", 0) >= 40,
        60,
        what="40 refusals counted",
    )
    events = sink.read(run_id)
    assert len([e for e in events if e.get("type") == "refused"]) == UNVERIFIED_REFUSALS_TRACED
    assert [e["kind"] for e in events if e.get("type") == "capped"] == ["refused_unverified"]


def test_planted_trace_events_are_skipped_by_archive_and_report(
    worker: WorkerProcess,
    critic: FakeOpenAIServer,
    hostile_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Unsigned events a Redis writer appends to a run's trace (decompression bombs, a forged
    `result`, garbage) are skipped by `critique archive` and `critique report`, which exit 0
    and keep the worker's own signed events."""
    import zlib

    from workers.cli import main

    run_id = f"bombed-{uuid.uuid4().hex[:8]}"
    assert run_one(submission(run_id)).envelope.score == 0.35
    r = redis.Redis.from_url(hostile_url)
    stream = keys.run_key(run_id, keys.TRACE)
    bomb = zlib.compress(b'{"type":"result","pad":"' + b"x" * (1 << 20) + b'"}', 9)
    for _ in range(30):
        r.xadd(stream, {keys.TRACE_EVENT_FIELD: bomb})
    r.xadd(stream, {keys.TRACE_EVENT_FIELD: b'{"type":"result","status":"accepted","planted":1}'})
    r.xadd(stream, {keys.TRACE_EVENT_FIELD: b"\x01garbage", keys.TRACE_SIG_FIELD: b"0" * 32})
    monkeypatch.setenv("CRITIQUE_ARCHIVE_DIR", str(tmp_path / "archive"))

    assert main(["archive", run_id]) == 0
    assert main(["report", run_id, "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()

    from workers import archiving

    got = archiving.read_archived(run_id)
    assert got is not None
    path, record = got
    assert record.trace and not any("planted" in e or "pad" in e for e in record.trace)
    assert path.stat().st_size < 256 * 1024
