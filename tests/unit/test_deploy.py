"""The deploy files: every queue has a consumer in every target (compose, systemd, Kubernetes +
KEDA), every worker starts through `critique worker` (so its checks run), the LLM workers get
the providers' key variables, and every CRITIQUE_* variable they set is one the configuration
loader accepts."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import ENV_NON_FIELDS, read_env
from pipeline.store.keys import QUEUES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
LLM_QUEUES = {"critique.llm", "critique.llm.critic"}
PROVIDER_KEYS = ("CRITIQUE_LLM_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY")


def _queues(argv: list[str]) -> set[str]:
    """The -Q of a `critique worker` command line."""
    assert argv[:2] == ["critique", "worker"], f"not started through critique worker: {argv}"
    return set(argv[argv.index("-Q") + 1].split(","))


def _accepted(names: dict[str, Any], where: str) -> None:
    """read_env takes every CRITIQUE_* variable (a field or a known non-field)."""
    env = {k: str(v if v is not None else "x") for k, v in names.items()}
    critique = {k: v for k, v in env.items() if k.startswith("CRITIQUE_")}
    try:
        read_env({k: v for k, v in critique.items() if k not in ENV_NON_FIELDS})
    except Exception as exc:  # pragma: no cover - the assertion message is the point
        pytest.fail(f"{where}: {exc}")


# --- docker compose ------------------------------------------------------------------------------
def _compose() -> dict[str, Any]:
    doc = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _compose_workers() -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in _compose()["services"].items()
        if name.startswith("worker") or "worker" in (svc.get("command") or [])
    }


def test_compose_consumes_every_queue_through_critique_worker() -> None:
    """Each queue has a compose service; every worker service runs `critique worker`."""
    workers = _compose_workers()
    consumed: set[str] = set()
    for name, svc in workers.items():
        consumed |= _queues(list(svc["command"]))
        assert "celery" not in svc["command"][:1], name
    assert consumed == set(QUEUES)


def test_compose_passes_provider_keys_to_llm_workers_and_env_is_accepted() -> None:
    """The LLM workers get CRITIQUE_LLM_API_KEY and the providers' own variables as optional
    pass-through (no value: from the shell or .env, else unset); every CRITIQUE_* is known."""
    for name, svc in _compose()["services"].items():
        env = svc.get("environment") or {}
        assert isinstance(env, dict), name
        _accepted(env, f"compose service {name}")
    for name, svc in _compose_workers().items():
        if _queues(list(svc["command"])) & LLM_QUEUES:
            env = svc["environment"]
            for key in PROVIDER_KEYS:
                assert key in env and env[key] is None, (name, key)
        assert "CRITIQUE_SECRET" in svc["environment"], name


def _rabbitmq_override() -> dict[str, Any]:
    doc = yaml.safe_load((DEPLOY / "docker-compose.rabbitmq.yml").read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def test_the_rabbitmq_override_points_every_worker_and_flower_at_a_healthy_rabbitmq() -> None:
    """docker-compose.rabbitmq.yml adds a `rabbitmq` service (management image, a healthcheck,
    a data volume, a password that must be set) and gives every worker service of
    docker-compose.yml and Flower an amqp:// CELERY_BROKER_URL on it, started only once it is
    healthy; Flower also gets the management API (its Broker tab); every CRITIQUE_* set is
    accepted."""
    override = _rabbitmq_override()["services"]
    rabbit = override["rabbitmq"]
    assert "management" in rabbit["image"]
    assert rabbit["healthcheck"]["test"][:2] == ["CMD", "rabbitmq-diagnostics"]
    assert any(v.endswith(":/var/lib/rabbitmq") for v in rabbit["volumes"])
    assert ":?" in rabbit["environment"]["RABBITMQ_DEFAULT_PASS"]  # compose refuses without it
    vhost = rabbit["environment"]["RABBITMQ_DEFAULT_VHOST"]
    for name in [*_compose_workers(), "flower"]:
        svc = override.get(name)
        assert svc is not None, f"{name} keeps the Redis broker"
        env = svc["environment"]
        _accepted(env, f"rabbitmq override {name}")
        url = env["CELERY_BROKER_URL"]
        assert url.startswith("amqp://critique:") and url.endswith(f"@rabbitmq:5672/{vhost}")
        assert svc["depends_on"]["rabbitmq"] == {"condition": "service_healthy"}
        assert svc["depends_on"]["redis"] == {"condition": "service_healthy"}  # still the store
    assert override["flower"]["environment"]["FLOWER_BROKER_API"].endswith("@rabbitmq:15672/api/")
    assert set(rabbit["networks"]) >= set(_compose()["services"]["flower"]["networks"])


# --- systemd -------------------------------------------------------------------------------------
def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def test_systemd_units_cover_every_queue_through_critique_worker() -> None:
    """critique-worker@ runs `critique worker -Q ${CRITIQUE_QUEUES}`; the worker-*.env
    instances together consume every queue; every env file's CRITIQUE_* is accepted."""
    unit = (DEPLOY / "systemd" / "critique-worker@.service").read_text(encoding="utf-8")
    joined = unit.replace("\\\n", " ")  # systemd's line continuations
    exec_start = re.search(r"^ExecStart=(.*)$", joined, re.MULTILINE)
    assert exec_start is not None
    argv = exec_start.group(1).split()
    assert argv[0].endswith("/critique") and argv[1] == "worker"
    assert argv[argv.index("-Q") + 1] == "${CRITIQUE_QUEUES}"
    assert "EnvironmentFile=/etc/critique/secret.env" in unit
    consumed: set[str] = set()
    for path in sorted((DEPLOY / "systemd").glob("*.env")):
        env = _env_file(path)
        _accepted(env, str(path.name))
        if path.name.startswith("worker-"):
            consumed |= set(env["CRITIQUE_QUEUES"].split(","))
    assert consumed == set(QUEUES)
    for name in re.findall(r"EnvironmentFile=-?/etc/critique/([\w-]+\.env)", unit):
        if "%i" not in name:
            assert (DEPLOY / "systemd" / name).is_file() or name == "flower.env", name


# --- Kubernetes + KEDA ---------------------------------------------------------------------------
def _k8s_docs() -> Iterator[dict[str, Any]]:
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc:
                yield doc


def _worker_deployments() -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d
        for d in _k8s_docs()
        if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("worker")
    }


def test_kubernetes_has_a_scaled_deployment_per_queue() -> None:
    """One worker Deployment per queue, each `critique worker`, each scaled by a KEDA
    ScaledObject on its own queue's list; LLM ones get the provider key Secrets."""
    deployments = _worker_deployments()
    by_queue: dict[str, str] = {}
    for name, d in deployments.items():
        (container,) = d["spec"]["template"]["spec"]["containers"]
        for queue in _queues(list(container["command"])):
            by_queue[queue] = name
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        _accepted(env, f"Deployment {name}")
        assert "CRITIQUE_SECRET" in env, name
        if _queues(list(container["command"])) & LLM_QUEUES:
            assert "CRITIQUE_LLM_API_KEY" in env, name
            refs = [e.get("secretRef", {}).get("name") for e in container.get("envFrom", [])]
            assert "critique-llm-providers" in refs, name
    assert set(by_queue) == set(QUEUES)
    scaled = {
        d["spec"]["triggers"][0]["metadata"]["listName"]: d["spec"]["scaleTargetRef"]["name"]
        for d in _k8s_docs()
        if d["kind"] == "ScaledObject"
    }
    assert scaled == by_queue


def test_kubernetes_configmaps_set_only_accepted_variables() -> None:
    """The critique-config ConfigMap (envFrom of every pod) sets no unknown CRITIQUE_*."""
    for d in _k8s_docs():
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "critique-config":
            _accepted(d["data"], "ConfigMap critique-config")
            return
    pytest.fail("no critique-config ConfigMap")


def test_the_check_itself_refuses_a_typo() -> None:
    """The helper these tests use does catch a mistyped variable."""
    with pytest.raises(pytest.fail.Exception):
        _accepted({"CRITIQUE_MAX_REPAIRS": "3"}, "a typo")
