"""The configuration trust boundary (issue 10, items 1 and 2; who may set what),
attacked through the client, the CLI and raw broker messages against a real worker and Redis.

A submission may set policy only. One that sets a worker-only field (the LLM transport, a
command, code to import) or passes the worker's limits is refused at submit by the client and,
when the client is bypassed (a message built with the deploy secret but not by the client), by
the worker before it imports or calls anything: the attacker's LLM server gets no request, the
import marker never appears, the refusal is in the run's trace, and the worker keeps serving.

The worker here runs with ``allowed_models`` and ``max_repair_attempts: 1`` set by its operator
(environment), and with ``$HOSTILE_SIDEEFFECT_MARKER`` naming the file that importing
:mod:`tests.hostile.sideeffect` would create.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import RefusedOverrideError, SubmissionError
from pipeline.loop.stages import LoopState, start
from pipeline.models import Submission
from pipeline.store import keys
from tests.fakes.openai_server import FakeOpenAIServer
from tests.support.hostile import (
    HOSTILE_WORKER,
    honest_submission,
    send_signed,
)
from tests.support.workers import ROOT, WorkerProcess

pytestmark = pytest.mark.integration

ALLOWED = ("openai/gpt-4o-mini", "openai/gpt-4o")
WORKER_MAX_REPAIRS = 1
SIDE_EFFECT = "tests.hostile.sideeffect"
MARKER_ENV = "HOSTILE_SIDEEFFECT_MARKER"
"""The variable naming the file that importing SIDE_EFFECT creates (never imported here)."""
EXTRA = [{"name": "planted", "implementation": f"{SIDE_EFFECT}:check"}]
REPAIRER = f"{SIDE_EFFECT}:repair"


def _forget_configs() -> None:
    """Drop this process's cached configurations (the environment they came from changed)."""
    from workers import runtime

    runtime._configs.clear()
    runtime._contexts.clear()


@pytest.fixture(scope="module", autouse=True)
def operator_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The operator's settings for this module's worker (and, by default, this process):
    allowed_models, max_repair_attempts 1, and the side-effect marker's path. Autouse, so it is
    in the environment before ``hostile_env`` hands that environment to the worker."""
    marker = tmp_path_factory.mktemp("sideeffect") / "imported"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CRITIQUE_ALLOWED_MODELS", ",".join(ALLOWED))
        mp.setenv("CRITIQUE_MAX_REPAIR_ATTEMPTS", str(WORKER_MAX_REPAIRS))
        mp.setenv(MARKER_ENV, str(marker))
        _forget_configs()
        yield marker
    _forget_configs()


WORKER = HOSTILE_WORKER


@pytest.fixture(autouse=True)
def never_imported(request: pytest.FixtureRequest, operator_env: Path) -> Iterator[None]:
    """After every attack on the worker the planted module was never imported, by the worker
    or by the client (that it still serves is checked by tests/hostile/conftest.py)."""
    attacked = "worker" in request.fixturenames
    sys.modules.pop(SIDE_EFFECT, None)
    yield
    if attacked:
        assert not operator_env.exists(), "a submission made a process import its module"
        assert SIDE_EFFECT not in sys.modules, "a submission made the client import its module"


@contextlib.contextmanager
def client_sees(**env: str | None) -> Iterator[None]:
    """This process (the client) with a different own configuration than the worker's."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            if value is None:
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
        _forget_configs()
        try:
            yield
        finally:
            _forget_configs()
    _forget_configs()


class Attacker:
    """The attacker's LLM server: a FakeOpenAIServer that also counts every connection."""

    def __init__(self, fake: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fake = fake
        self.connections = 0
        self._lock = threading.Lock()
        original = fake._httpd.verify_request

        def counting(request: Any, address: Any) -> bool:
            with self._lock:
                self.connections += 1
            return bool(original(request, address))

        monkeypatch.setattr(fake._httpd, "verify_request", counting)

    @property
    def api_base(self) -> str:
        return self.fake.api_base

    def assert_untouched(self) -> None:
        """No connection and no request: so no Authorization header (the worker's API key)
        ever reached it."""
        assert self.connections == 0
        assert self.fake.requests == []


@pytest.fixture
def attacker(fake_llm: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch) -> Attacker:
    """The attacker's server, counting connections, fresh for one test."""
    return Attacker(fake_llm, monkeypatch)


def new_run(prefix: str = "boundary") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def llm_submission(run_id: str, model: str = ALLOWED[0], worker_id: str = "w1") -> Submission:
    """An output the LLM critic would critique with ``model`` (the worker's model)."""
    return Submission(
        run_id=run_id,
        worker_id=worker_id,
        task="Summarise the Q3 sales report.",
        output={"summary": "Sales rose 4% in Q3."},
        required_fields=("summary",),
        model=model,
    )


def exfiltration(api_base: str) -> dict[str, Any]:
    """The issue's key-exfiltration config: the LLM critic, pointed at the attacker."""
    return {"enabled": True, "critic": "llm", "model": ALLOWED[0], "llm": {"api_base": api_base}}


def raw_stage(task: str, state: LoopState, overrides: dict[str, Any]) -> Any:
    """A stage message built without the client (so without its check), signed with the deploy
    secret (addressed to the task id it is sent under), published straight to the broker;
    returns the AsyncResult."""
    from workers import runtime

    queue = keys.QUEUE_LLM if task == keys.TASK_REPAIR else keys.QUEUE_CPU
    if task == keys.TASK_CRITIC and overrides.get("critic") == "llm":
        queue = keys.QUEUE_LLM
    return send_signed(task, runtime.encode(state, overrides), queue=queue)


def at(state: LoopState, stage: str) -> LoopState:
    return state.model_copy(update={"next": stage})


def worker_refusal(result: Any, field: str) -> RefusedOverrideError:
    """The worker's refusal of a raw message: the task failed with RefusedOverrideError
    naming ``field``, in one line."""
    with pytest.raises(RefusedOverrideError) as info:
        result.get(timeout=30)
    exc = info.value
    assert f"{field!r}" in str(exc)
    assert "\n" not in str(exc)
    return exc


def refused_events(run_id: str) -> list[dict[str, Any]]:
    from workers.client import CritiqueClient

    return [e for e in CritiqueClient().trace(run_id) if e.get("type") == "refused"]


def assert_refusal_traced(run_id: str, stage: str, field: str, worker_id: str | None) -> None:
    """The run's trace holds the refusal: stage, worker, iteration and the reason."""
    events = refused_events(run_id)
    assert events, "no refused event in the run's trace"
    event = events[-1]
    assert event["stage"] == stage
    assert event["worker_id"] == worker_id
    assert event["iteration"] == 1
    assert f"submission may not set {field!r}" in event["reason"]


def critique_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``critique ARGS`` as a process, with this process's environment (the worker's Redis)."""
    import os

    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=dict(os.environ),
        cwd=ROOT,
        timeout=60,
    )


def assert_cli_refused(proc: subprocess.CompletedProcess[str], field: str) -> None:
    """Exit 2, one line on stderr naming the field, nothing printed as submitted, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"critique submit: submission may not set {field!r}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "submitted" not in proc.stdout


# -- key exfiltration (item 1) ----------------------------------------------------------------


def test_client_refuses_llm_api_base_and_the_attacker_gets_no_request(
    worker: WorkerProcess, attacker: Attacker
) -> None:
    """CritiqueClient({"llm": {"api_base": attacker}}) is refused at construction; nothing is
    enqueued and the attacker's server never sees a request or the worker's API key."""
    from workers.client import CritiqueClient

    with pytest.raises(RefusedOverrideError) as info:
        CritiqueClient(exfiltration(attacker.api_base))
    assert info.value.key == "llm.api_base"
    assert "submission may not set 'llm.api_base': worker-only" in str(info.value)
    attacker.assert_untouched()


def test_raw_l0_message_with_llm_api_base_is_refused_by_the_worker(
    worker: WorkerProcess, attacker: Attacker
) -> None:
    """The client bypassed: a signed critique.l0 message carrying llm.api_base is refused by the
    worker; the refusal is traced and the attacker's server gets nothing."""
    run_id = new_run()
    ar = raw_stage(keys.TASK_L0, start(llm_submission(run_id)), exfiltration(attacker.api_base))
    worker_refusal(ar, "llm.api_base")
    assert_refusal_traced(run_id, "l0", "llm.api_base", "w1")
    attacker.assert_untouched()


def test_raw_critic_message_with_llm_api_base_never_calls_the_attacker(
    worker: WorkerProcess, attacker: Attacker
) -> None:
    """The stage that would call the LLM (critique.critic, LLM critic) refuses too: no
    Authorization: Bearer <the worker's key> is ever sent to the attacker's server."""
    run_id = new_run()
    state = at(start(llm_submission(run_id)), "critic")
    ar = raw_stage(keys.TASK_CRITIC, state, exfiltration(attacker.api_base))
    worker_refusal(ar, "llm.api_base")
    assert_refusal_traced(run_id, "critic", "llm.api_base", "w1")
    attacker.assert_untouched()


def test_raw_repair_message_with_llm_api_base_never_calls_the_attacker(
    worker: WorkerProcess, attacker: Attacker
) -> None:
    """critique.repair with the LLM repairer pointed at the attacker is refused the same way."""
    from pipeline.models import CritiqueEnvelope

    run_id = new_run()
    envelope = CritiqueEnvelope(worker_id="w1", score=0.2, summary="needs work")
    state = at(start(llm_submission(run_id)), "repair").model_copy(update={"envelope": envelope})
    overrides = {**exfiltration(attacker.api_base), "repairer": "llm"}
    ar = raw_stage(keys.TASK_REPAIR, state, overrides)
    worker_refusal(ar, "llm.api_base")
    attacker.assert_untouched()


@pytest.mark.parametrize(
    ("field", "llm"),
    [
        ("llm.timeout_s", {"timeout_s": 600}),
        ("llm.max_retries", {"max_retries": 1000}),
        ("llm.max_tokens", {"max_tokens": 1_000_000}),
    ],
)
def test_raw_message_with_any_llm_setting_is_refused(
    worker: WorkerProcess, field: str, llm: dict[str, Any]
) -> None:
    """Every llm.* setting is worker-only, not just api_base (they spend the operator's
    money and time)."""
    run_id = new_run()
    ar = raw_stage(keys.TASK_L0, start(honest_submission(run_id)), {"enabled": True, "llm": llm})
    worker_refusal(ar, field)
    assert_refusal_traced(run_id, "l0", field, "honest")


def test_raw_complete_gate_request_with_llm_api_base_is_refused(
    worker: WorkerProcess, attacker: Attacker
) -> None:
    """A signed critique.complete_gate request whose config sets llm.api_base is refused."""
    from workers import runtime

    run_id = new_run()
    msg = {
        "v": runtime.MESSAGE_VERSION,
        "request_id": uuid.uuid4().hex,
        "run_id": run_id,
        "iteration": 1,
        "final_result": "done",
        "task": "",
        "files": [],
        "deliverable_expected": None,
        "config": exfiltration(attacker.api_base),
    }
    ar = send_signed(keys.TASK_COMPLETE_GATE, msg)
    worker_refusal(ar, "llm.api_base")
    assert_refusal_traced(run_id, "complete_gate", "llm.api_base", None)
    attacker.assert_untouched()


# -- code import by request (item 2) ----------------------------------------------------------


def test_client_refuses_an_extension_check(worker: WorkerProcess) -> None:
    """output_contract.extra in the client's config is refused at construction."""
    from workers.client import CritiqueClient

    with pytest.raises(RefusedOverrideError, match=r"'output_contract\.extra': worker-only"):
        CritiqueClient({"enabled": True, "output_contract": {"extra": EXTRA}})


def test_client_refuses_a_callable_repairer(worker: WorkerProcess) -> None:
    """repairer 'module:function' in the client's config is refused at construction."""
    from workers.client import CritiqueClient

    with pytest.raises(RefusedOverrideError, match="'repairer': worker-only"):
        CritiqueClient({"enabled": True, "repairer": REPAIRER})


def test_raw_message_with_an_extension_check_never_imports_it(
    worker: WorkerProcess, operator_env: Path
) -> None:
    """A signed l0 message naming a module as an extension check is refused before the
    worker imports it: the module's import marker never appears."""
    run_id = new_run()
    overrides = {"enabled": True, "output_contract": {"checks": ["default"], "extra": EXTRA}}
    ar = raw_stage(keys.TASK_L0, start(honest_submission(run_id)), overrides)
    worker_refusal(ar, "output_contract.extra")
    assert_refusal_traced(run_id, "l0", "output_contract.extra", "honest")
    assert not operator_env.exists()


def test_raw_message_with_a_callable_repairer_never_imports_it(
    worker: WorkerProcess, operator_env: Path
) -> None:
    """A signed message naming a module:function repairer is refused before the worker imports
    it (the reviser is built for every stage, so l0 is enough to trigger the import)."""
    run_id = new_run()
    overrides = {"enabled": True, "repairer": REPAIRER}
    ar = raw_stage(keys.TASK_L0, start(honest_submission(run_id)), overrides)
    worker_refusal(ar, "repairer")
    assert_refusal_traced(run_id, "l0", "repairer", "honest")
    assert not operator_env.exists()


def test_raw_message_with_command_is_refused(worker: WorkerProcess) -> None:
    """command (argv the worker would execute) and its timeout are worker-only."""
    run_id = new_run()
    ar = raw_stage(keys.TASK_L0, start(honest_submission(run_id)), {"command": ["id"]})
    worker_refusal(ar, "command")
    ar = raw_stage(keys.TASK_L0, start(honest_submission(run_id)), {"command_timeout_s": 1e6})
    worker_refusal(ar, "command_timeout_s")


def test_raw_message_with_a_non_builtin_check_name_is_refused(worker: WorkerProcess) -> None:
    """output_contract.checks may only name built-in checks."""
    run_id = new_run()
    overrides = {"output_contract": {"checks": [f"{SIDE_EFFECT}:check"]}}
    ar = raw_stage(keys.TASK_L0, start(honest_submission(run_id)), overrides)
    exc = worker_refusal(ar, "output_contract.checks")
    assert "not a built-in check" in str(exc)


def test_raw_message_widening_allowed_models_is_refused(worker: WorkerProcess) -> None:
    """A submission cannot widen the worker's allowed_models."""
    run_id = new_run()
    overrides = {"allowed_models": ["evil/model"], "model": "evil/model"}
    ar = raw_stage(keys.TASK_L0, start(honest_submission(run_id)), overrides)
    worker_refusal(ar, "allowed_models")


# -- the CLI -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ("llm.api_base=http://127.0.0.1:9/v1", "llm.api_base"),
        (f"repairer={REPAIRER}", "repairer"),
        (f"output_contract.extra={json.dumps(EXTRA)}", "output_contract.extra"),
    ],
)
def test_critique_submit_set_worker_only_exits_2_naming_it(
    worker: WorkerProcess, setting: str, field: str
) -> None:
    """`critique submit --set <worker-only>=…` exits 2 with one line naming the field and
    enqueues nothing."""
    stdin = json.dumps(
        {"run_id": new_run("cli"), "worker_id": "w1", "task": "t", "output": "the output"}
    )
    assert_cli_refused(critique_cli("submit", "-", "--set", setting, stdin=stdin), field)


def test_critique_submit_set_above_the_workers_limit_exits_2(worker: WorkerProcess) -> None:
    """`critique submit --set max_repair_attempts=5` over the operator's 1 exits 2."""
    stdin = json.dumps({"run_id": new_run("cli"), "worker_id": "w1", "task": "t", "output": "o"})
    proc = critique_cli("submit", "-", "--set", "max_repair_attempts=5", stdin=stdin)
    assert_cli_refused(proc, "max_repair_attempts")
    assert "max_repair_attempts 5 exceeds the worker's 1" in proc.stderr


# -- limits and models -------------------------------------------------------------------------


def test_client_refuses_limits_above_its_own(worker: WorkerProcess) -> None:
    """max_repair_attempts and max_output_bytes above the configured ones are refused."""
    from workers.client import CritiqueClient

    with pytest.raises(RefusedOverrideError, match="max_repair_attempts 9 exceeds the worker's 1"):
        CritiqueClient({"enabled": True, "max_repair_attempts": 9})
    with pytest.raises(RefusedOverrideError, match="max_output_bytes may only be lowered"):
        CritiqueClient({"enabled": True, "max_output_bytes": 1 << 40})


def test_raw_message_above_the_workers_limits_is_refused(worker: WorkerProcess) -> None:
    """The worker enforces its own limits on a message the client never checked."""
    run_id = new_run()
    sub = start(honest_submission(run_id))
    ar = raw_stage(keys.TASK_L0, sub, {"enabled": True, "max_repair_attempts": 50})
    assert "max_repair_attempts 50 exceeds the worker's 1" in str(
        worker_refusal(ar, "max_repair_attempts")
    )
    ar = raw_stage(keys.TASK_L0, sub, {"enabled": True, "max_output_bytes": 1 << 40})
    worker_refusal(ar, "max_output_bytes")


def test_client_refuses_a_model_outside_allowed_models(
    worker: WorkerProcess, attacker: Attacker
) -> None:
    """model and Submission.model outside allowed_models are refused at submit."""
    from workers.client import CritiqueClient

    with pytest.raises(RefusedOverrideError, match="model 'evil/model' is not in the worker's"):
        CritiqueClient({"enabled": True, "critic": "llm", "model": "evil/model"})
    client = CritiqueClient({"enabled": True, "critic": "llm"})
    with pytest.raises(RefusedOverrideError, match="'evil/model' is not in the worker's"):
        client.submit(llm_submission(new_run(), model="evil/model"))
    attacker.assert_untouched()


def test_raw_message_with_a_disallowed_model_is_refused_before_any_llm_call(
    worker: WorkerProcess,
) -> None:
    """A signed critic message whose submission names a model outside allowed_models (or whose
    config names one as the critic or adjudicator) is refused on the worker."""
    run_id = new_run()
    state = at(start(llm_submission(run_id, model="evil/model")), "critic")
    ar = raw_stage(keys.TASK_CRITIC, state, {"enabled": True, "critic": "llm"})
    with pytest.raises(RefusedOverrideError, match="'evil/model' is not in the worker's"):
        ar.get(timeout=30)
    state = at(start(llm_submission(run_id, worker_id="w2")), "critic")
    for field in ("model", "paired_model"):
        overrides = {"enabled": True, "critic": "llm", "paired_critic": True, field: "evil/m"}
        worker_refusal(raw_stage(keys.TASK_CRITIC, state, overrides), field)


# -- the client sees the worker's refusal ------------------------------------------------------


def test_wait_reports_the_workers_refusal_in_one_line(worker: WorkerProcess) -> None:
    """A client whose own limits are looser than the worker's submits; the worker refuses, and
    wait() raises SubmissionError 'submission … was refused by the worker: <reason>' (one line,
    no exception repr), and the refusal is in the run's trace."""
    from workers.client import CritiqueClient

    run_id = new_run()
    with client_sees(CRITIQUE_MAX_REPAIR_ATTEMPTS="3"):
        client = CritiqueClient({"enabled": True, "max_repair_attempts": 3})
        handle = client.submit(honest_submission(run_id, worker_id="w1"))
    with pytest.raises(SubmissionError) as info:
        client.wait(handle, timeout=30)
    msg = str(info.value)
    assert msg.startswith(
        f"submission w1 of run {run_id} was refused by the worker: "
        "submission may not set 'max_repair_attempts': max_repair_attempts 3 exceeds the "
        "worker's 1"
    ), msg
    assert "\n" not in msg and "RefusedOverrideError(" not in msg
    assert_refusal_traced(run_id, "l0", "max_repair_attempts", "w1")


def test_wait_reports_a_disallowed_submission_model(
    worker: WorkerProcess, attacker: Attacker
) -> None:
    """A client without allowed_models (and without a key, so it lets a hosted model through)
    submits a Submission.model the worker does not allow: the worker refuses before any LLM
    call and wait() says why."""
    from workers.client import CritiqueClient

    run_id = new_run()
    with client_sees(CRITIQUE_ALLOWED_MODELS=None, CRITIQUE_LLM_API_KEY=None):
        client = CritiqueClient({"enabled": True, "critic": "llm"})
        handle = client.submit(llm_submission(run_id, model="openai/o1-pro"))
    with pytest.raises(SubmissionError, match="was refused by the worker: submission's model"):
        client.wait(handle, timeout=30)
    events = refused_events(run_id)
    assert events and events[-1]["stage"] == "l0"
    assert "'openai/o1-pro' is not in the worker's allowed_models" in events[-1]["reason"]
    attacker.assert_untouched()


def test_policy_overrides_are_still_honoured(worker: WorkerProcess) -> None:
    """Within the boundary a submission still steers the critique: a lower max_repair_attempts,
    a lower max_output_bytes, a built-in check list, an allowed model, a named repairer."""
    from workers.client import CritiqueClient

    client = CritiqueClient(
        {
            "enabled": True,
            "critic": "heuristic",
            "repairer": "deterministic",
            "max_repair_attempts": 0,
            "max_output_bytes": 4096,
            "model": ALLOWED[1],
            "output_contract": {"checks": ["no_placeholder"]},
        }
    )
    result = client.wait(client.submit(honest_submission(new_run())), timeout=30)
    assert result.status == "accepted"
