"""A worker that consumes an LLM queue imports litellm while it starts (not on its first call,
where every thread would wait on the import lock), with its tokenizer and its first call's
imports; nothing else imports it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys, types
import workers.app as app
print("after import:", "litellm" in sys.modules)
queues = types.SimpleNamespace(consume_from={q: None for q in sys.argv[1].split(",")})
sender = types.SimpleNamespace(app=types.SimpleNamespace(amqp=types.SimpleNamespace(queues=queues)))
app._load_litellm_on_llm_workers(sender=sender)
print("after worker_init:", "litellm" in sys.modules)
print("tokenizer:", "tiktoken_ext.openai_public" in sys.modules)
print("completion path:", "litellm.proxy._types" in sys.modules)
"""


@pytest.mark.parametrize(
    ("queues", "loaded"),
    [
        ("critique.cpu", False),
        ("critique.cpu,critique.llm", True),
        ("critique.llm.critic", True),
    ],
)
def test_litellm_is_imported_at_worker_start_only_for_llm_queues(queues: str, loaded: bool) -> None:
    """Importing the Celery app never loads litellm; the worker_init hook loads it, a tokenizer
    and the modules of litellm's first completion when the worker consumes critique.llm or
    critique.llm.critic, and none of them for critique.cpu alone."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, queues],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        check=True,
    ).stdout.splitlines()
    assert out[:2] == ["after import: False", f"after worker_init: {loaded}"]
    assert out[2:] == [f"tokenizer: {loaded}", f"completion path: {loaded}"]
