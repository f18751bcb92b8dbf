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


# --- the Sentinel variants -----------------------------------------------------------------------
def _sentinel_url_hosts(url: str, master_env: str | None) -> set[tuple[str, int]]:
    """The Sentinels a ``sentinel://`` URL lists, after the check every command makes (it parses
    and the master name is set)."""
    from pipeline.store.redis_common import check_redis_urls
    from pipeline.store.urls import parse_sentinel_url

    check_redis_urls(
        {"REDIS_URL": url, **({"CRITIQUE_REDIS_MASTER": master_env} if master_env else {})}
    )
    return set(parse_sentinel_url(url).sentinels)


def _monitor(conf: str) -> tuple[str, str, int, int]:
    """The ``sentinel monitor <name> <host> <port> <quorum>`` line of a Sentinel configuration."""
    m = re.search(r"^\s*sentinel monitor (\S+) (\S+) (\d+) (\d+)\s*$", conf, re.MULTILINE)
    assert m is not None, conf
    return m.group(1), m.group(2), int(m.group(3)), int(m.group(4))


def test_compose_sentinel_variant_points_every_service_at_its_sentinels() -> None:
    """compose.sentinel.yml, layered over docker-compose.yml: a master with AOF, a replica of it,
    three Sentinels whose quorum a majority can reach, monitoring the name every worker and
    Flower is given; each of those services gets a sentinel:// REDIS_URL listing exactly those
    Sentinels (and waits for them), and every CRITIQUE_* it sets is accepted."""
    overlay = yaml.safe_load((DEPLOY / "compose.sentinel.yml").read_text(encoding="utf-8"))
    base = _compose()["services"]
    services = overlay["services"]
    sentinels = {
        n: s for n, s in services.items() if "--sentinel" in "\n".join(s.get("command") or [])
    }
    assert len(sentinels) == 3
    monitors = {_monitor("\n".join(s["command"])) for s in sentinels.values()}
    ((name, host, port, quorum),) = monitors
    assert (host, port) == ("redis", 6379) and quorum == 2 <= len(sentinels) // 2 + 1
    master, replica = services["redis"]["command"], services["redis-replica"]["command"]
    assert "--appendonly" in master and "--replicaof" not in master
    assert replica[replica.index("--replicaof") + 1 :][:2] == ["redis", "6379"]
    assert "--appendonly" in replica
    clients = [n for n, svc in base.items() if "REDIS_URL" in (svc.get("environment") or {})]
    assert {"worker-cpu", "worker-llm", "worker-critic", "flower"} <= set(clients)
    for svc_name in clients:
        env = {**base[svc_name]["environment"], **services[svc_name]["environment"]}
        assert env["CRITIQUE_REDIS_MASTER"] == name, svc_name
        hosts = _sentinel_url_hosts(env["REDIS_URL"], env["CRITIQUE_REDIS_MASTER"])
        assert hosts == {(s, 26379) for s in sentinels}, svc_name
        assert set(services[svc_name]["depends_on"]) == set(sentinels), svc_name
        _accepted(env, f"compose.sentinel.yml service {svc_name}")
    for svc_name, svc in services.items():  # a misspelt service would start half-configured
        assert svc_name in base or "image" in svc, svc_name


def _sentinel_k8s() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes" / "sentinel").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    return docs


def test_kubernetes_sentinel_variant_matches_the_url_the_workers_get() -> None:
    """kubernetes/sentinel/: the Sentinel StatefulSet runs the pods the documented
    critique-redis URL lists (via its headless Service), monitoring the master name of the
    critique-sentinel ConfigMap with a reachable quorum; Redis runs as two pods with AOF; every
    worker Deployment and Flower read that ConfigMap (optionally), and KEDA's ScaledObjects
    there scale each worker on its own queue through the Sentinels."""
    docs = _sentinel_k8s()
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    scripts = by[("ConfigMap", "redis-sentinel-scripts")]["data"]
    settings = by[("ConfigMap", "critique-sentinel")]["data"]
    _accepted(settings, "ConfigMap critique-sentinel")
    sentinel_set = by[("StatefulSet", "sentinel")]["spec"]
    assert sentinel_set["serviceName"] == "sentinel" and ("Service", "sentinel") in by
    name, _, port, quorum = _monitor(scripts["sentinel.sh"].replace("$master", "m"))
    assert name == settings["CRITIQUE_REDIS_MASTER"] and port == 6379
    assert quorum == sentinel_set["replicas"] // 2 + 1
    pods = {(f"sentinel-{i}.sentinel", 26379) for i in range(sentinel_set["replicas"])}
    url = re.search(
        r"url='(sentinel://[^']+)'", (DEPLOY / "kubernetes/sentinel/config.yaml").read_text()
    )
    assert url is not None
    assert _sentinel_url_hosts(url.group(1), name) == pods
    assert set(settings["REDIS_SENTINEL_ADDRESSES"].split(",")) == {f"{h}:{p}" for h, p in pods}
    redis_set = by[("StatefulSet", "redis")]["spec"]
    assert redis_set["replicas"] == 2 and "--appendonly yes" in scripts["redis.sh"]
    assert "get-master-addr-by-name critique" in scripts["redis.sh"]  # rejoin as a replica
    flower = [
        d for d in _k8s_docs() if (d["kind"], d["metadata"]["name"]) == ("Deployment", "flower")
    ]
    for d in [*_worker_deployments().values(), *flower]:
        (container,) = d["spec"]["template"]["spec"]["containers"]
        refs = [e["configMapRef"] for e in container.get("envFrom", []) if "configMapRef" in e]
        assert {"name": "critique-sentinel", "optional": True} in refs, d["metadata"]["name"]
    scaled = {
        d["spec"]["triggers"][0]["metadata"]["listName"]: d["spec"]["scaleTargetRef"]["name"]
        for d in docs
        if d["kind"] == "ScaledObject"
    }
    assert scaled == {
        q: n
        for n, dep in _worker_deployments().items()
        for q in _queues(list(dep["spec"]["template"]["spec"]["containers"][0]["command"]))
    }
    for d in docs:
        if d["kind"] == "ScaledObject":
            meta = d["spec"]["triggers"][0]
            assert meta["type"] == "redis-sentinel"
            assert meta["metadata"]["addressesFromEnv"] in settings
            assert meta["metadata"]["sentinelMasterFromEnv"] == "CRITIQUE_REDIS_MASTER"
