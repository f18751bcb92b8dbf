"""A scripted AWP delegation-loop world: a workflow on disk, a fake model playing every role, and
``awp run`` driving it (issue 35 harness).

The pieces:

* :func:`write_workflow` writes a minimal delegation-loop workflow (``workflow.awp.yaml``, nothing
  else: with no ``agents/manager`` directory AWP runs its built-in *inline* manager).
* :class:`AwpScript` answers every chat request AWP makes in that flow on a
  :class:`~tests.fakes.openai_server.FakeOpenAIServer`: the manager, the workers (some defective
  by design, fixed when re-run in repair mode), AWP's own in-process critic and its LLM
  validator. It is a pure function of each request, so the fake's handler threads can call it
  concurrently, and it reads the request log back (:meth:`AwpScript.worker_requests`, ...).
* :func:`run_awp` runs ``awp run`` as a subprocess against the fake and returns the run's output
  directory (``<workflow>/workspace/runs/<run_id>/``).

This module never imports ``awp``; only :func:`run_awp` and :func:`validate_workflow` need its
``awp`` console script (next to ``sys.executable`` or on ``PATH``). Tests using it should
``pytest.importorskip("awp")`` first.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.fakes.openai_server import FakeOpenAIServer, ScriptItem, system_text, user_text

# --- what AWP's requests look like (awp-agents 1.0.56) -----------------------------------------
#
# Each kind is told apart by how its system message STARTS, so text quoted inside a prompt (a
# worker's instructions, a previous output echoed into a repair prompt) cannot confuse them.

AWP_MANAGER = "You are a Manager Agent in an AWP Delegation Loop."
"""Inline manager (``DelegationLoopRunner._build_manager_system_prompt``); streamed, wants JSON."""
AWP_WORKER = "You are a Worker Agent (ID: "
"""Ephemeral worker (``_run_ephemeral_worker_impl``); the id follows (``w3``, ``w3_repair``)."""
AWP_CRITIC = "You are a Quality Critic"
"""AWP's in-process critic (the ``critique_rubric`` artifact); wants a critique JSON object."""
AWP_VALIDATOR = "You are a Validation Agent."
"""Tier-2 LLM validation of each worker result (``_validate_llm``); wants a small JSON object."""

REPAIR_MODE = "REPAIR MODE"
"""Appears in a worker's system message both for a critique repair and for any re-entry of a
worker id seen before (``w1`` again in iteration 2 included): not enough on its own."""
CRITIQUE_REPAIR = "## REPAIR MODE — Fix specific defects"
"""Heading of ``CritiqueEngine._build_repair_prompt``: the worker is being repaired after a
critique. It replaces the envelope's instructions, so it lands in the worker's system message."""
REENTRY = "## REPAIR MODE (Continuing Prior Work)"
"""Section added to any worker whose logical id was dispatched before in this run."""
QUALITY_GUARD = "# Quality Guard"
"""Skill the runner adds to workers once the critic's pattern memory is non-empty."""
KNOWN_PITFALLS = "## Known Pitfalls"
"""Heading of ``CritiqueEngine.build_pattern_pitfalls_section`` inside that skill."""

MANAGER_ITERATION = re.compile(r"^## Current Iteration: (\d+)\s*$", re.MULTILINE)
WORKER_ID = re.compile(r"\(ID: ([^)\s]+)\)")
WORKER_RESULT = re.compile(r"## Worker Result\n```json\n(.*?)\n```", re.DOTALL)
OUTPUT_CONTRACT = re.compile(r"## Expected Output Contract\n```json\n(.*?)\n```", re.DOTALL)
LOGICAL_SUFFIX = re.compile(r"(_repair|_retry\d*|_v\d+)+$", re.IGNORECASE)

# Our own tag, put at the start of every subtask's instructions by the scripted manager. A worker
# finds its iteration and subtask in it; a repair prompt still carries it (AWP appends the
# original instructions "for context").
TAG = re.compile(r"\[awp-harness iteration=(\d+) subtask=(\d+)\]")

REQUIRED_FIELDS = ("summary", "findings", "confidence")
DEFECT_KINDS = ("placeholder", "missing_field", "bad_json", "confidence_word")
"""``placeholder``: ``TODO`` in ``summary``; ``missing_field``: no ``findings``; ``bad_json``:
``findings`` is a string that claims to be a JSON list but does not parse; ``confidence_word``:
``confidence`` is a word (AWP replaces a non-numeric confidence with a derived number before
its critic sees the result, so this one never reaches the critic as written)."""
TASK = "Survey five aspects of the fictional Larkspur bridge project and summarise what each shows."
"""The default task. AWP scans the task for deliverable words (substrings: ``report``,
``document``, ``image``, ``chart``, ``plot``, ``table``, ``csv``, ...) and then rejects the
manager's COMPLETE until a file of that kind exists under ``output/``: keep them out of it."""

PLACEHOLDER = re.compile(r"\b(TODO|TBD|FIXME|PLACEHOLDER)\b")


def logical_id(worker_id: str) -> str:
    """``w3_repair`` → ``w3`` (the suffixes AWP strips for the same purpose)."""
    return LOGICAL_SUFFIX.sub("", worker_id) or worker_id


def request_kind(request: Mapping[str, Any]) -> str:
    """``manager`` | ``worker`` | ``critic`` | ``validator`` | ``unknown``."""
    text = system_text(request).lstrip()
    for kind, marker in (
        ("manager", AWP_MANAGER),
        ("worker", AWP_WORKER),
        ("critic", AWP_CRITIC),
        ("validator", AWP_VALIDATOR),
    ):
        if text.startswith(marker):
            return kind
    return "unknown"


def default_defects(workers: int, iterations: int) -> dict[tuple[int, str], str]:
    """Iteration ``i`` makes ``w{i}`` leave a placeholder, the next one omit ``findings`` and the
    one after emit broken JSON (wrapping round); the others are clean. Fewer kinds when there are
    fewer than three workers."""
    plan: dict[tuple[int, str], str] = {}
    kinds = DEFECT_KINDS[:3][:workers]
    for i in range(1, iterations + 1):
        for offset, kind in enumerate(kinds):
            plan[(i, f"w{(i - 1 + offset) % workers + 1}")] = kind
    return plan


def _sse(text: str, request: Mapping[str, Any]) -> ScriptItem:
    """A streamed (``stream: true``) answer: one SSE chunk with the whole text, then ``[DONE]``.

    The fake server has no streaming mode; ``raw_body`` is sent as is and AWP's client only
    reads its ``data:`` lines. The chunk carries ``usage`` so AWP counts the manager's tokens.
    """
    prompt = sum(len(str(m.get("content") or "")) for m in request.get("messages") or []) // 4
    completion = len(text) // 4
    chunk = {
        "id": "chatcmpl-awp-harness",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    return {"raw_body": f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"}


class AwpScript:
    """Plays the manager, the workers, the critic and the validator of an AWP delegation loop.

    ``defects`` maps ``(iteration, worker_id)`` to one of :data:`DEFECT_KINDS` (default:
    :func:`default_defects`). Install it on a fake with :meth:`install` (it becomes the fake's
    default answer, so queued or ``on()`` items a test adds still take precedence).
    """

    def __init__(
        self,
        *,
        workers: int = 5,
        iterations: int = 3,
        defects: Mapping[tuple[int, str], str] | None = None,
        required_fields: Sequence[str] = REQUIRED_FIELDS,
    ) -> None:
        self.workers = workers
        self.iterations = iterations
        self.required_fields = list(required_fields)
        self.defects = dict(default_defects(workers, iterations) if defects is None else defects)
        unknown = sorted(set(self.defects.values()) - set(DEFECT_KINDS))
        if unknown:
            raise ValueError(f"unknown defect kind(s) {unknown}; known: {list(DEFECT_KINDS)}")
        self.fake: FakeOpenAIServer | None = None

    # --- wiring ---------------------------------------------------------------------------------

    def install(self, fake: FakeOpenAIServer) -> AwpScript:
        fake.set_default(self.respond)
        self.fake = fake
        return self

    def respond(self, request: dict[str, Any]) -> str | ScriptItem:
        kind = request_kind(request)
        if kind == "manager":
            text = json.dumps(self.manager_decision(self._manager_iteration(request)))
            return _sse(text, request) if request.get("stream") else text
        if kind == "worker":
            return json.dumps(self.worker_output(request))
        if kind == "critic":
            return json.dumps(self.critique(request))
        if kind == "validator":
            return json.dumps(self.validation(request))
        return '{"ok": true}'  # recorded; unknown_requests() lists it

    # --- the manager ----------------------------------------------------------------------------

    @staticmethod
    def _manager_iteration(request: Mapping[str, Any]) -> int:
        found = MANAGER_ITERATION.findall(user_text(request))
        return int(found[-1]) if found else 1

    def envelope(self, iteration: int, k: int) -> dict[str, Any]:
        return {
            "worker_id": f"w{k}",
            "subtask_id": f"s{iteration}_{k}",
            "instructions": (
                f"[awp-harness iteration={iteration} subtask={k}] Examine aspect {k} of the "
                f"project for round {iteration} and report what it shows."
            ),
            "tools_allowed": [],
            "output_contract": {
                "required_fields": self.required_fields,
                "description": "A short summary, a list of findings and a numeric confidence.",
            },
            "codemode": {"enabled": False, "tool_creation": False},
            "temperature": 0.0,
        }

    def manager_decision(self, iteration: int) -> dict[str, Any]:
        if iteration <= self.iterations:
            return {
                "decision": "delegate",
                "reasoning": f"round {iteration}: one subtask per aspect",
                "delegations": [self.envelope(iteration, k) for k in range(1, self.workers + 1)],
                "confidence": 0.5,
            }
        return {
            "decision": "complete",
            "reasoning": f"{self.iterations} rounds done",
            "final_result": {
                "summary": f"{self.workers} aspects surveyed over {self.iterations} rounds.",
                "confidence": 0.9,
            },
            "confidence": 0.9,
        }

    # --- the workers ----------------------------------------------------------------------------

    def clean_output(self, iteration: int, k: int, *, repaired: bool = False) -> dict[str, Any]:
        note = " after repair" if repaired else ""
        return {
            "summary": f"Aspect {k}, round {iteration}: two observations recorded{note}.",
            "findings": [f"aspect {k} observation A", f"aspect {k} observation B"],
            "confidence": 0.85,
        }

    def worker_output(self, request: Mapping[str, Any]) -> dict[str, Any]:
        sys_text = system_text(request)
        tag = TAG.search(sys_text)
        iteration, k = (int(tag.group(1)), int(tag.group(2))) if tag else (0, 0)
        if CRITIQUE_REPAIR in sys_text:
            return self.clean_output(iteration, k, repaired=True)
        out = self.clean_output(iteration, k)
        kind = self.defects.get((iteration, f"w{k}"))
        if kind == "placeholder":
            out["summary"] = f"TODO: write the summary for aspect {k}"
        elif kind == "missing_field":
            del out["findings"]
        elif kind == "bad_json":
            out["findings"] = f'["aspect {k} observation A", "aspect {k} obser'
        elif kind == "confidence_word":
            out["confidence"] = "high"
        return out

    # --- AWP's critic and validator -------------------------------------------------------------

    @staticmethod
    def _worker_result(request: Mapping[str, Any]) -> Any:
        found = WORKER_RESULT.search(user_text(request))
        if not found:
            return None
        try:
            return json.loads(found.group(1))
        except ValueError:
            return None  # the critic prompt truncates results over 6000 characters

    def critique(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """A critique in the rubric's shape; critical defects for what :meth:`worker_output`
        breaks. Descriptions avoid words that name files AWP writes (``result``, ``critique``,
        ``instructions``, ...): its false-positive filter downgrades a ``missing_data`` defect
        whose text mentions any file under ``workspace/`` to ``info``."""
        text = user_text(request)
        result = self._worker_result(request)
        contract_match = OUTPUT_CONTRACT.search(text)
        required: list[str] = list(self.required_fields)
        if contract_match:
            with contextlib.suppress(ValueError, AttributeError):
                required = list(json.loads(contract_match.group(1)).get("required_fields", []))
        if not isinstance(result, dict):
            return {
                "score": 0.5,
                "summary": "could not read the worker output",
                "defects": [],
                "prescriptions": [],
                "reusable_patterns": [],
                "effort_estimate": "trivial",
            }
        defects: list[dict[str, str]] = []
        prescriptions: list[str] = []
        patterns: list[str] = []
        for name in required:
            if name not in result:
                defects.append(
                    {
                        "category": "missing_data",
                        "location": f"root.{name}",
                        "description": f"required field '{name}' is absent",
                        "severity": "critical",
                    }
                )
                prescriptions.append(f"Add the '{name}' field.")
                patterns.append("Return every field the output contract requires.")
        for name, value in result.items():
            if isinstance(value, str) and not name.startswith("_") and PLACEHOLDER.search(value):
                defects.append(
                    {
                        "category": "incomplete",
                        "location": f"root.{name}",
                        "description": f"'{name}' holds placeholder text instead of content",
                        "severity": "critical",
                    }
                )
                prescriptions.append(f"Replace the placeholder in '{name}' with real content.")
                patterns.append("Never deliver placeholder markers such as TODO.")
        findings = result.get("findings")
        if "findings" in result and not isinstance(findings, list):
            claimed = isinstance(findings, str) and findings.lstrip()[:1] in ("[", "{")
            defects.append(
                {
                    "category": "wrong_format",
                    "location": "root.findings",
                    "description": (
                        "'findings' claims to be JSON but does not parse"
                        if claimed
                        else "'findings' is not a list"
                    ),
                    "severity": "critical",
                }
            )
            prescriptions.append("Return 'findings' as a JSON array of strings.")
            patterns.append("Emit structured fields as real JSON, not as text that looks like it.")
        confidence = result.get("confidence")
        if "confidence" in result and not isinstance(confidence, (int, float)):
            defects.append(
                {
                    "category": "wrong_format",
                    "location": "root.confidence",
                    "description": "'confidence' is not a number",
                    "severity": "critical",
                }
            )
            prescriptions.append("Give 'confidence' as a number between 0 and 1.")
        critical = sum(1 for d in defects if d["severity"] == "critical")
        score = 0.92 if not critical else max(0.1, 0.45 - 0.1 * (critical - 1))
        return {
            "score": score,
            "summary": "meets the contract" if not critical else f"{critical} critical defect(s)",
            "defects": defects,
            "prescriptions": prescriptions,
            "reusable_patterns": sorted(set(patterns)),
            "effort_estimate": "trivial" if critical <= 1 else "moderate",
        }

    def validation(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Valid, with the worker's own confidence echoed (AWP overwrites the result's
        confidence with ``adjusted_confidence``)."""
        result = self._worker_result(request)
        answer: dict[str, Any] = {"valid": True, "feedback": "ok", "suggestion": ""}
        if isinstance(result, dict) and isinstance(result.get("confidence"), (int, float)):
            answer["adjusted_confidence"] = result["confidence"]
        return answer

    # --- reading the request log ----------------------------------------------------------------

    def _log(self) -> list[dict[str, Any]]:
        if self.fake is None:
            raise RuntimeError("install() the script on a fake server first")
        return [b for b in self.fake.completions if isinstance(b, dict)]

    def requests(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Chat request bodies, oldest first, of one kind (:func:`request_kind`) or all."""
        return [b for b in self._log() if kind is None or request_kind(b) == kind]

    def unknown_requests(self) -> list[dict[str, Any]]:
        return self.requests("unknown")

    @staticmethod
    def worker_id(request: Mapping[str, Any]) -> str:
        found = WORKER_ID.search(system_text(request))
        return found.group(1) if found else ""

    @staticmethod
    def worker_iteration(request: Mapping[str, Any]) -> int:
        tag = TAG.search(system_text(request))
        return int(tag.group(1)) if tag else 0

    @staticmethod
    def is_repair(request: Mapping[str, Any]) -> bool:
        """A critique repair run (not a mere re-entry of a known worker id)."""
        return CRITIQUE_REPAIR in system_text(request)

    @staticmethod
    def saw_pitfalls(request: Mapping[str, Any]) -> bool:
        """The worker's prompt carried the critic's learned pitfalls ("# Quality Guard")."""
        text = system_text(request)
        return QUALITY_GUARD in text and KNOWN_PITFALLS in text

    def worker_requests(
        self,
        iteration: int | None = None,
        *,
        worker_id: str | None = None,
        repair: bool | None = None,
    ) -> list[dict[str, Any]]:
        """Worker requests, optionally of one iteration, one logical worker (``w3`` matches
        ``w3_repair``) and only repairs (``repair=True``) or only first runs (``False``)."""
        out = []
        for body in self.requests("worker"):
            if iteration is not None and self.worker_iteration(body) != iteration:
                continue
            if worker_id is not None and logical_id(self.worker_id(body)) != worker_id:
                continue
            if repair is not None and self.is_repair(body) != repair:
                continue
            out.append(body)
        return out

    def repair_requests(self, iteration: int | None = None) -> list[dict[str, Any]]:
        return self.worker_requests(iteration, repair=True)

    def defective(self, iteration: int) -> dict[str, str]:
        """``{worker_id: defect kind}`` planned for one iteration."""
        return {w: kind for (i, w), kind in self.defects.items() if i == iteration}


# --- the workflow -------------------------------------------------------------------------------

WORKFLOW_NAME = "critique_harness"

DEFAULT_CRITIQUE: dict[str, Any] = {
    "enabled": True,
    "max_repair_attempts": 2,
    "repair_budget_fraction": 0.15,
    "pattern_memory": True,
    # AWP's completion gate averages the FIRST (pre-repair) critique scores of the last
    # iteration, so repaired defects still count against it; the script decides when the loop
    # ends instead.
    "min_score_to_complete": 0.0,
}


def _yaml_scalar(value: Any) -> str:
    # JSON scalars are valid YAML flow scalars.
    return json.dumps(value)


def _yaml(data: Mapping[str, Any], indent: int = 0) -> list[str]:
    """Block-style YAML for nested mappings of scalars and lists of scalars (all we write)."""
    pad = "  " * indent
    lines: list[str] = []
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            lines.append(f"{pad}{key}:")
            lines.extend(_yaml(value, indent + 1))
        elif isinstance(value, list) and value:
            lines.append(f"{pad}{key}:")
            lines.extend(f"{pad}  - {_yaml_scalar(v)}" for v in value)
        else:
            lines.append(f"{pad}{key}: {_yaml_scalar(value)}")
    return lines


def workflow_manifest(
    *,
    workers: int = 5,
    iterations: int = 3,
    critique: Mapping[str, Any] | None = None,
    name: str = WORKFLOW_NAME,
) -> dict[str, Any]:
    """The ``workflow.awp.yaml`` content as a dict (see :func:`write_workflow`)."""
    return {
        "awp": "1.0.0",
        "workflow": {
            "name": name,
            "version": "1.0.0",
            "description": "Scripted delegation loop for critique tests (issue 35).",
        },
        "orchestration": {
            "engine": "delegation_loop",
            "delegation_loop": {
                # No such directory: the runner falls back to its built-in inline manager.
                "manager": "agents/manager",
                "budget": {
                    # The completing manager call is an iteration (a loop) of its own.
                    "max_loops": iterations + 2,
                    "max_total_workers": 500,
                    "max_total_tokens": 2_000_000,
                    "max_wall_time": 300,
                    "max_depth": 0,
                    "max_workers_per_iteration": max(6, workers),
                },
                # Without codemode.* here the runner forces code mode on every worker: a
                # code.execute tool, a per-worker executor and a workspace tree walk that races
                # the run logger's *.tmp files (FileNotFoundError fails the worker).
                "worker_policy": {
                    "manager_controlled": [
                        "instructions",
                        "skills",
                        "tools_allowed",
                        "output_contract",
                        "temperature",
                    ]
                },
                # Reusing w1..wN every iteration trips "delegated 3 times, likely stuck", which
                # feeds the stall detector a zero: a warning in iteration 3, and the run stops
                # (partial, stall_detected) in iteration 4.
                "termination": {"enabled": False},
                "critique": {**DEFAULT_CRITIQUE, **dict(critique or {})},
            },
        },
    }


def write_workflow(
    dir: Path,
    *,
    workers: int = 5,
    iterations: int = 3,
    critique: Mapping[str, Any] | None = None,
) -> Path:
    """Write the workflow into ``dir/critique_harness/`` (AWP wants ``workflow.name`` to match
    its directory's name) and return that directory. ``critique`` overrides keys of
    :data:`DEFAULT_CRITIQUE`. ``workers``/``iterations`` size the budget; the loop's shape
    itself comes from the :class:`AwpScript` answering the manager."""
    wf_dir = Path(dir) / WORKFLOW_NAME
    wf_dir.mkdir(parents=True, exist_ok=True)
    manifest = workflow_manifest(workers=workers, iterations=iterations, critique=critique)
    text = "\n".join(_yaml(manifest)) + "\n"
    (wf_dir / "workflow.awp.yaml").write_text(text, encoding="utf-8")
    return wf_dir


# --- running AWP --------------------------------------------------------------------------------


class AwpRunError(RuntimeError):
    pass


def awp_executable() -> str:
    """The ``awp`` console script of this interpreter's environment, else the one on PATH."""
    local = Path(sys.executable).parent / "awp"
    if local.exists():
        return str(local)
    found = shutil.which("awp")
    if not found:
        raise AwpRunError("no `awp` executable: install awp-agents into this environment")
    return found


_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


def awp_env(fake: FakeOpenAIServer, *, model: str = "fake-model") -> dict[str, str]:
    """The variables AWP's ``LLMClient`` reads, pointed at ``fake``."""
    return {"LLM_BASE_URL": fake.api_base, "LLM_API_KEY": "sk-awp-harness", "LLM_MODEL": model}


def base_env(home: Path) -> dict[str, str]:
    """This process's environment made hermetic for ``awp run``: a private ``HOME`` (AWP reads
    ``~/.awp/.env`` and its prompt-artifact DB ``~/.awp/outer_loop.db``, which can replace the
    critic's rubric), no inherited proxies, and a dead HTTPS proxy so the CLI's PyPI update check
    fails at once instead of reaching out (or waiting 3 s)."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARS}
    env.update(
        HOME=str(home),
        AWP_OUTER_LOOP_DB=str(home / ".awp" / "outer_loop.db"),
        HTTPS_PROXY="http://127.0.0.1:9",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
    )
    return env


def validate_workflow(workflow_dir: Path, *, timeout: float = 60) -> str:
    """``awp validate``; returns its output, raises :class:`AwpRunError` when it fails. (It
    prints "[FAIL] Graph must have at least one node" for any delegation-loop workflow yet
    exits 0: the graph check is advisory there.)"""
    proc = subprocess.run(
        [awp_executable(), "validate", str(workflow_dir)],
        env=base_env(Path(workflow_dir).parent / "home"),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AwpRunError(f"awp validate exited {proc.returncode}:\n{output}")
    return output


def run_awp(
    workflow_dir: Path,
    env: Mapping[str, str],
    *,
    task: str = TASK,
    timeout: float = 120,
    launcher: Sequence[str] = (),
) -> Path:
    """``awp run <workflow_dir> --task <task>`` in a subprocess (stdin not a TTY, so no wizard),
    with :func:`base_env` plus ``env`` (:func:`awp_env`). Returns the run's output directory
    ``<workflow_dir>/workspace/runs/<run_id>/``; stdout and stderr go to ``awp-run.log`` beside
    the workflow directory. ``launcher`` replaces ``awp`` (``[critique, "awp"]``: the same run with
    critique on the fleet). Raises :class:`AwpRunError` on a non-zero exit, a timeout or no new
    run directory."""
    workflow_dir = Path(workflow_dir)
    runs = workflow_dir / "workspace" / "runs"
    before = {p.name for p in runs.iterdir()} if runs.is_dir() else set()
    full_env = base_env(workflow_dir.parent / "home")
    full_env.update(env)
    log = workflow_dir.parent / "awp-run.log"
    started = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        try:
            proc = subprocess.run(
                [*(launcher or [awp_executable()]), "run", str(workflow_dir), "--task", task],
                env=full_env,
                cwd=workflow_dir.parent,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise AwpRunError(f"awp run timed out after {timeout}s; log: {log}") from exc
    elapsed = time.monotonic() - started
    tail = log.read_text(encoding="utf-8", errors="replace")[-4000:]
    if proc.returncode != 0:
        raise AwpRunError(f"awp run exited {proc.returncode} after {elapsed:.1f}s:\n{tail}")
    new = sorted(p for p in runs.iterdir() if p.is_dir() and p.name not in before)
    if len(new) != 1:
        raise AwpRunError(f"expected one new run directory in {runs}, got {new}:\n{tail}")
    return new[0]
