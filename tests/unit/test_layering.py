"""The domain imports on its own: no broker, store or LLM client library is needed to load it.

Every module of ``pipeline`` imports in a fresh interpreter whose import system refuses redis,
celery, kombu, litellm (and what they pull in: hiredis, billiard, httpx, openai), except the
Redis implementations of the store, which are the adapters that exist to talk to Redis. So the
broker-free runner, the contract, the critics and pattern memory run where those libraries are
not installed, and an ``import redis`` slipped into a domain module fails here, not in a deploy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.layout import REDIS_STORE_MODULES

ROOT = Path(__file__).resolve().parents[2]

BLOCKED = ("redis", "celery", "kombu", "litellm", "hiredis", "billiard", "httpx", "openai")
"""Top-level packages the probe's import system refuses."""

REDIS_ADAPTERS = REDIS_STORE_MODULES
"""The only pipeline modules allowed to need redis: the Redis halves of the store. The store's
protocols, keys, in-process implementations and blob references import without it."""

_PROBE = """
import importlib, json, pkgutil, sys

BLOCKED = set(sys.argv[1].split(","))
SKIP = set(sys.argv[2].split(","))


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked by the layering test")
        return None


sys.meta_path.insert(0, Refuse())
try:
    import redis  # noqa: F401
except ImportError:
    blocker_works = True
else:
    blocker_works = False

import pipeline

imported, failed = [], {}
for info in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
    if info.name in SKIP:
        continue
    try:
        importlib.import_module(info.name)
    except Exception as exc:
        failed[info.name] = f"{type(exc).__name__}: {exc}"
    else:
        imported.append(info.name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps({"blocker_works": blocker_works, "imported": imported, "failed": failed,
                  "loaded": loaded}))
"""


def _probe() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(BLOCKED), ",".join(sorted(REDIS_ADAPTERS))],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_every_domain_module_imports_without_redis_celery_or_litellm() -> None:
    """Each pipeline module but the Redis store adapters imports with redis, celery, kombu,
    litellm, httpx and openai refused (a module that needs one is named with its error)."""
    result = _probe()
    assert result["blocker_works"], "the probe's import blocker let `import redis` through"
    assert result["failed"] == {}
    assert result["loaded"] == []
    imported = set(result["imported"])
    # Not vacuous: the domain and the redis-free half of the store were really imported.
    assert {
        "pipeline.loop.stages",
        "pipeline.loop.pitfalls",
        "pipeline.critics",
        "pipeline.critics.llm",
        "pipeline.contract",
        "pipeline.store",
        "pipeline.store.keys",
        "pipeline.store.memory",
        "pipeline.store.blobs",
    } <= imported


def test_only_store_modules_may_need_redis() -> None:
    """The exemption list names store adapters only: no domain module can be exempted."""
    assert all(m.startswith("pipeline.store.") for m in REDIS_ADAPTERS)
    for name in REDIS_ADAPTERS:
        path = ROOT / (name.replace(".", "/") + ".py")
        assert path.is_file(), f"{name} is exempted but does not exist"
