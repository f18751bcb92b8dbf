"""Redis Cluster store settings: ``CRITIQUE_STORE_URL`` (default ``REDIS_URL``), the
``redis+cluster://`` URL and its one-line refusals, where a cluster URL may not go (the broker,
the result backend), how a cluster's "not now" errors are told from bugs, and the hash-tag rule
of the key layout (every key one script touches in one slot). Only the unreachable-cluster
checks open a socket (to a port nothing listens on); the cluster itself is
``tests/faults/test_cluster_store.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from redis.cluster import key_slot
from redis.exceptions import RedisClusterException, SlotNotCoveredError

from pipeline.errors import ConfigError, StoreUnavailableError
from pipeline.store import keys
from pipeline.store.pending import RedisPendingIndex
from pipeline.store.redis_common import (
    check_redis_urls,
    client_from_url,
    is_unavailable,
    store_client_from_url,
    store_errors,
)
from pipeline.store.urls import (
    ClusterURL,
    is_cluster_url,
    parse_cluster_url,
    store_setting,
    store_url,
)
from workers.embedded import free_port


@pytest.mark.parametrize(
    ("url", "want"),
    [
        (
            "redis+cluster://10.0.0.1:7000,10.0.0.2:7001,10.0.0.3",
            ClusterURL((("10.0.0.1", 7000), ("10.0.0.2", 7001), ("10.0.0.3", 6379))),
        ),
        ("redis+cluster://:p%40w@h1:1,h2:2/0", ClusterURL((("h1", 1), ("h2", 2)), None, "p@w")),
        ("rediss+cluster://app:pw@h1:1/", ClusterURL((("h1", 1),), "app", "pw", True)),
        ("REDIS+CLUSTER://[::1]:7000,h1:1,", ClusterURL((("::1", 7000), ("h1", 1)))),
    ],
)
def test_cluster_urls_parse(url: str, want: ClusterURL) -> None:
    assert is_cluster_url(url)
    assert parse_cluster_url(url) == want
    assert "pw" not in want.redacted() and "@" not in want.redacted()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://", "names no Redis Cluster node"),
        ("redis+cluster://h1:1,h2:2/1", "database 0 only"),
        ("redis+cluster://h1:1?ssl=true", "query parameters are not read"),
        ("redis+cluster://h1:port,h2:2", "not a valid cluster node address"),
        ("redis+cluster://h1:1,:2", "not a cluster node address"),
        ("cluster://h1:1", "starts with redis+cluster://"),
    ],
)
def test_malformed_cluster_urls_are_refused_in_one_line_naming_the_setting(
    url: str, says: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cluster_url(url)
    msg = str(err.value)
    assert says in msg and msg.startswith("CRITIQUE_STORE_URL") and "\n" not in msg
    assert err.value.key == "CRITIQUE_STORE_URL"


def test_the_store_url_defaults_to_redis_url() -> None:
    assert store_url({}) == "redis://127.0.0.1:6379/0"
    assert (store_url({"REDIS_URL": "redis://b:1/0"}), store_setting({})) == (
        "redis://b:1/0",
        "REDIS_URL",
    )
    env = {"REDIS_URL": "redis://b:1/0", "CRITIQUE_STORE_URL": "redis+cluster://c:2"}
    assert (store_url(env), store_setting(env)) == ("redis+cluster://c:2", "CRITIQUE_STORE_URL")


def test_a_cluster_url_names_the_store_only() -> None:
    """kombu and Celery's backend cannot use a cluster: a cluster URL as the broker or the
    result backend (directly, or through REDIS_URL they default to) is one clear line."""
    cluster = "redis+cluster://h1:1,h2:2"
    check_redis_urls({"REDIS_URL": "redis://b:1/0", "CRITIQUE_STORE_URL": cluster})
    for setting in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        with pytest.raises(ConfigError, match=rf"^{setting} is a Redis Cluster URL: ") as err:
            check_redis_urls({setting: cluster})
        assert "\n" not in str(err.value) and err.value.key == setting
    with pytest.raises(ConfigError, match=r"^REDIS_URL is a Redis Cluster URL and CELERY_RESULT"):
        check_redis_urls({"REDIS_URL": cluster, "CELERY_BROKER_URL": "redis://b:1/0"})
    check_redis_urls(
        {
            "REDIS_URL": cluster,
            "CELERY_BROKER_URL": "redis://b:1/0",
            "CELERY_RESULT_BACKEND": "redis://b:1/1",
        }
    )
    with pytest.raises(
        ConfigError, match=r"^CRITIQUE_STORE_URL='http://u:\*\*\*@h1:1/0': sch"
    ) as e:
        check_redis_urls({"CRITIQUE_STORE_URL": "http://u:secret@h1:1/0"})
    assert "secret" not in str(e.value) and "redis+cluster://" in str(e.value)
    with pytest.raises(ConfigError, match=r"^CRITIQUE_STORE_URL.*database 0 only"):
        check_redis_urls({"CRITIQUE_STORE_URL": "redis+cluster://h1:1/2"})
    with pytest.raises(ConfigError, match=r"^CRITIQUE_STORE_URL is a sentinel.*REDIS_MASTER"):
        check_redis_urls({"CRITIQUE_STORE_URL": "sentinel://h1:1/0"})
    with pytest.raises(ConfigError, match="only the store may use"):
        client_from_url(cluster, setting="CELERY_BROKER_URL")


def test_an_unreachable_cluster_is_unavailable_not_a_crash() -> None:
    """Building a cluster client asks a node for the slot map: with none answering it is the
    transient StoreUnavailableError naming the setting, so a worker retries later."""
    url = f"redis+cluster://127.0.0.1:{free_port()}"
    with pytest.raises(StoreUnavailableError) as err:
        store_client_from_url(url, socket_connect_timeout=1, socket_timeout=1)
    assert "CRITIQUE_STORE_URL" in (err.value.hint or "")
    plain = store_client_from_url("redis://127.0.0.1:1/0")
    assert isinstance(plain, redis.Redis)


def test_cluster_errors_are_told_apart_from_bugs() -> None:
    """A slot without a master or a slot map that cannot be rebuilt is "not now"; keys of two
    slots in one command (a layout bug) is raised as it is, never retried."""
    assert is_unavailable(SlotNotCoveredError('Slot "12" is not covered by the cluster.'))
    assert is_unavailable(
        RedisClusterException("Redis Cluster cannot be connected. Please provide at least one")
    )
    assert is_unavailable(redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"))
    bug = RedisClusterException("EVALSHA - all keys must map to the same key slot")
    assert not is_unavailable(bug)
    client = redis.Redis(host="127.0.0.1", port=1)
    with pytest.raises(StoreUnavailableError), store_errors(client):
        raise SlotNotCoveredError("Slot 1 is not covered")
    with pytest.raises(RedisClusterException), store_errors(client):
        raise bug


def _slots(*names: str) -> set[int]:
    return {key_slot(n.encode()) for n in names}


def test_every_key_one_script_touches_shares_one_slot() -> None:
    """The hash-tag rule: a run's keys (and its archive marker and pass step hashes) are in
    the run's slot, a queue's two probe keys in one, the four lessons keys in one; the shared
    keys used alone are not pinned to the runs' slots."""
    run = "r-1"
    run_keys = [keys.run_key(run, s) for s in keys.RUN_KEY_SUFFIXES]
    run_keys += [keys.pass_steps_key(run, "1:w:sid"), keys.shared_key(f"archive:done:{{{run}}}")]
    assert _slots(*run_keys) == {key_slot(run.encode())}
    assert len(_slots(*(keys.shared_key(k) for k in keys.LESSONS_KEYS))) == 1
    probe = RedisPendingIndex.__new__(RedisPendingIndex)
    probe._prefix = keys.key_prefix()
    for queue in keys.QUEUES:
        assert len(_slots(*probe._probe_keys(queue))) == 1
    assert len(_slots(*run_keys, keys.shared_key(keys.PENDING_RUNS))) == 2


def test_commands_refuse_a_malformed_store_url_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``critique worker``, ``submit`` and ``status``: exit 2, one line naming
    CRITIQUE_STORE_URL, before anything is started, sent or read."""
    from workers import runtime
    from workers.cli import main

    monkeypatch.setenv("CRITIQUE_STORE_URL", "redis+cluster://h1:1,h2:2/3")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "CRITIQUE_REDIS_MASTER"):
        monkeypatch.delenv(name, raising=False)
    runtime.client.cache_clear()
    runtime.stores.cache_clear()
    sub = tmp_path / "subs.jsonl"
    sub.write_text(json.dumps({"run_id": "r", "worker_id": "w", "output": "x"}) + "\n")
    try:
        for argv in (["worker", "--dry-run"], ["submit", str(sub)], ["status", "r"]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "CRITIQUE_STORE_URL" in err[0], (argv, err)
            assert "database 0 only" in err[0], (argv, err)
    finally:
        runtime.client.cache_clear()
        runtime.stores.cache_clear()
