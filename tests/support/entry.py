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
from urllib.parse import quote

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


TODO_REPORT = "# Q3 report\n\nTODO: fill in the numbers."
"""The unfinished output that issue 34 saw accepted at 1.00 when nobody said ``enabled: true``."""


def todo_report(run_id: str, worker_id: str = "w1") -> dict[str, Any]:
    """:func:`hand_built` with :data:`TODO_REPORT` as its output and no required fields: only
    a check that runs can tell it is unfinished."""
    doc = hand_built(run_id, worker_id)
    doc.update(task="Write the Q3 sales report.", output=TODO_REPORT, required_fields=[])
    return doc


NODE = shutil.which("node")


NODE_EXAMPLE = ROOT / "docs" / "examples" / "node"
"""docs/entry.md's Node manager: ``submit.js`` and its sample ``submission.json``."""
SUBMIT_JS = NODE_EXAMPLE / "submit.js"


def docs_node_block(lang: str) -> str:
    """The one fenced ``lang`` block of docs/entry.md's Node section (``js``: the script,
    ``json``: the sample submission, ``text``: the output it shows)."""
    text = (ROOT / "docs" / "entry.md").read_text(encoding="utf-8")
    section = text[text.index("## JavaScript (Node), end to end") :]
    [body] = re.findall(rf"^```{lang}\n(.*?)^```", section, flags=re.S | re.M)
    return body


def node_redis_url(client: redis.Redis) -> str:
    """The ``REDIS_URL`` of the Redis (user, password and database) ``client`` talks to."""
    conn = client.connection_pool.connection_kwargs
    user, password = conn.get("username") or "", conn.get("password")
    auth = f"{quote(user, safe='')}:{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{conn['host']}:{conn['port']}/{conn.get('db', 0)}"


def node_env(client: redis.Redis, **extra: str) -> dict[str, str]:
    """This environment for the Node example, on ``client``'s Redis: ``REDIS_URL`` set, no
    ``REDIS_HOST``/``REDIS_PORT`` and no secret unless ``extra`` gives one."""
    env = {k: v for k, v in os.environ.items() if "SECRET" not in k and k[:6] != "REDIS_"}
    return {**env, "REDIS_URL": node_redis_url(client), **extra}


def run_node(
    args: list[str], env: dict[str, str], cwd: Path = NODE_EXAMPLE
) -> subprocess.CompletedProcess[str]:
    """``node submit.js ARGS`` in ``cwd`` (the example's folder) with ``env``."""
    return subprocess.run(
        [str(NODE), str(SUBMIT_JS), *args],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=90,
    )  # fmt: skip


def run_docs_js(
    tmp_path: Path, run_id: str, client: redis.Redis
) -> subprocess.CompletedProcess[str]:
    """Run docs/entry.md's Node example on a hand-built submission of ``run_id`` (with the
    run's CONFIG), against the Redis (and user) ``client`` talks to, signing with the
    managers' key."""
    (tmp_path / "sub.json").write_text(json.dumps(hand_built(run_id)))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    env = node_env(client, CRITIQUE_ENTRY_SECRET=MANAGER_KEY)
    return run_node([str(tmp_path / "sub.json"), str(tmp_path / "config.json")], env)


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
