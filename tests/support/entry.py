"""Builders for the language-neutral entry: a hand-built submission (as a manager in another
language writes it), the two keys, and the Node example of docs/entry.md run as a file."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import redis

from pipeline.store import keys
from tests.support.submissions import CONFIG, REQUIRED
from tests.support.workers import ROOT


def hand_built(run_id: str, worker_id: str = "w1") -> dict[str, Any]:
    """A clean submission written out as a manager in another language would write it."""
    return {
        "run_id": run_id,
        "iteration": 1,
        "worker_id": worker_id,
        "subtask_signature": f"sig-{worker_id}",
        "task": "Summarise the quarterly sales report with findings.",
        "output": {"summary": "Sales rose 4%.", "findings": "Two regions grew.", "confidence": 0.9},
        "required_fields": list(REQUIRED),
    }


NODE = shutil.which("node")


def docs_js(tmp_path: Path) -> Path:
    """The JavaScript example of docs/entry.md, as a file."""
    text = (ROOT / "docs" / "entry.md").read_text(encoding="utf-8")
    [code] = re.findall(r"```js\n(.*?)```", text, flags=re.S)
    path = tmp_path / "submit.js"
    path.write_text(code, encoding="utf-8")
    return path


def run_docs_js(
    tmp_path: Path, run_id: str, client: redis.Redis, **redis_env: str
) -> subprocess.CompletedProcess[str]:
    """Run docs/entry.md's Node example on a hand-built submission of ``run_id`` (with the
    run's CONFIG), against the Redis ``client`` talks to, signing with the managers' key;
    ``redis_env`` adds the example's other variables (REDIS_DB, REDIS_USER, …)."""
    js = docs_js(tmp_path)
    (tmp_path / "sub.json").write_text(json.dumps(hand_built(run_id)))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    conn = client.connection_pool.connection_kwargs
    env = {
        **os.environ,
        "REDIS_HOST": str(conn["host"]),
        "REDIS_PORT": str(conn["port"]),
        **redis_env,
        "CRITIQUE_ENTRY_SECRET": MANAGER_KEY,
    }
    return subprocess.run(
        [str(NODE), str(js), str(tmp_path / "sub.json"), str(tmp_path / "config.json")],
        capture_output=True, text=True, env=env, timeout=90,
    )  # fmt: skip


WORKER_KEY = "workers-only-key-" + "w" * 16


MANAGER_KEY = "managers-entry-key-" + "m" * 16


def refusal(meta: dict[str, Any]) -> tuple[str, str]:
    """``(exc_type, reason)`` of a FAILURE record, checking it is one line and no traceback."""
    assert meta["status"] == "FAILURE", meta
    assert meta["traceback"] is None
    result = meta["result"]
    assert isinstance(result["exc_message"], list) and len(result["exc_message"]) == 1
    reason = result["exc_message"][0]
    assert isinstance(reason, str) and "\n" not in reason and reason
    return str(result["exc_type"]), reason


def pass_results(r: redis.Redis, run_id: str) -> dict[bytes, bytes]:
    return r.hgetall(keys.run_key(run_id, keys.PASS_RESULTS))
