"""Redis Sentinel settings: ``sentinel://`` URL parsing, ``CRITIQUE_REDIS_MASTER`` /
``CRITIQUE_SENTINEL_PASSWORD``, what Celery and kombu are handed, and how a demoted master's
replies are classified. No server is contacted: building a Sentinel client connects to nothing
until its first command (the failover itself is ``tests/faults/test_sentinel.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
import redis.sentinel

from pipeline.config import load_config
from pipeline.errors import ConfigError, StoreUnavailableError
from pipeline.store.redis_common import (
    DEAD_PEER_S,
    FailoverConnection,
    celery_url,
    check_redis_urls,
    client_from_url,
    is_demoted_reply,
    redis_url_of,
    sentinel_transport_options,
    store_client_from_url,
    store_errors,
)
from pipeline.store.urls import SentinelURL, is_sentinel_url, parse_sentinel_url

UNBLOCKED = (
    "UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)"
)


@pytest.mark.parametrize(
    ("url", "want"),
    [
        (
            "sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26380;sentinel://10.0.0.3/2",
            SentinelURL((("10.0.0.1", 26379), ("10.0.0.2", 26380), ("10.0.0.3", 26379)), 2),
        ),
        (
            "sentinel://:s3cr%40t@h1:1/3;sentinel://h2:2",
            SentinelURL((("h1", 1), ("h2", 2)), 3, None, "s3cr@t"),
        ),
        ("sentinel://app:pw@h1:26379", SentinelURL((("h1", 26379),), 0, "app", "pw")),
        ("SENTINEL://h1:5/0;", SentinelURL((("h1", 5),), 0)),
        ("sentinel://[::1]:26379/1", SentinelURL((("::1", 26379),), 1)),
    ],
)
def test_sentinel_urls_parse(url: str, want: SentinelURL) -> None:
    assert is_sentinel_url(url)
    assert parse_sentinel_url(url) == want


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (
            "sentinel://h1:1/0;redis://h2:2/0",
            "every part of a Sentinel URL starts with sentinel://",
        ),
        ("sentinel://h1:1/0;sentinel://h2:2/1", "different databases"),
        ("sentinel://:a@h1:1;sentinel://:b@h2:2", "different credentials"),
        ("sentinel://h1:1/zero", "must be a database number"),
        ("sentinel://h1:1/0?master_name=m", "CRITIQUE_REDIS_MASTER"),
        ("sentinel://:1/0", "names no Sentinel host"),
        ("sentinel://h1:port/0", "not a valid Sentinel address"),
    ],
)
def test_malformed_sentinel_urls_are_refused_in_one_line(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_sentinel_url(url, setting="CELERY_BROKER_URL")
    msg = str(err.value)
    assert says in msg and msg.startswith("CELERY_BROKER_URL") and "\n" not in msg
    assert err.value.key == "CELERY_BROKER_URL"


def test_celery_gets_the_database_and_password_on_every_part() -> None:
    """kombu reads the database and password from the first part, Celery's Sentinel backend
    from each part and then the first: the URL handed to both carries them everywhere."""
    url = "sentinel://h1:1;sentinel://:p%3Aw@h2:2/4"
    assert celery_url(url, setting="REDIS_URL") == (
        "sentinel://:p%3Aw@h1:1/4;sentinel://:p%3Aw@h2:2/4"
    )
    assert parse_sentinel_url(celery_url(url, setting="REDIS_URL")) == parse_sentinel_url(url)
    assert parse_sentinel_url(url).redacted() == "sentinel://h1:1/4;sentinel://h2:2/4"
    assert celery_url("redis://h:1/0", setting="REDIS_URL") == "redis://h:1/0"
    assert celery_url("sentinel://h1:1/x", setting="REDIS_URL") == "sentinel://h1:1/x"


def test_a_sentinel_url_needs_the_master_name() -> None:
    env = {"REDIS_URL": "sentinel://h1:1/0", "CELERY_BROKER_URL": "redis://h:1/0"}
    with pytest.raises(ConfigError) as err:
        check_redis_urls(env)
    msg = str(err.value)
    assert msg.startswith("REDIS_URL is a sentinel:// URL but CRITIQUE_REDIS_MASTER is not set")
    assert "\n" not in msg and err.value.key == "CRITIQUE_REDIS_MASTER"
    with pytest.raises(ConfigError, match=r"^CELERY_RESULT_BACKEND is a sentinel"):
        check_redis_urls({"CELERY_RESULT_BACKEND": "sentinel://h1:1/0"})
    check_redis_urls({**env, "CRITIQUE_REDIS_MASTER": "mymaster"})
    check_redis_urls({"REDIS_URL": "redis://h:1/0"})  # nothing to check


def test_transport_options_carry_the_master_and_the_sentinel_password() -> None:
    env = {"CRITIQUE_REDIS_MASTER": "mymaster", "CRITIQUE_SENTINEL_PASSWORD": "sp"}
    opts = sentinel_transport_options("sentinel://h1:1/0", env)
    assert opts["master_name"] == "mymaster"
    assert opts["sentinel_kwargs"]["password"] == "sp"
    assert opts["sentinel_kwargs"]["socket_timeout"] > 0
    assert opts["sentinel_kwargs"]["socket_connect_timeout"] > 0
    assert "password" not in sentinel_transport_options("sentinel://h1:1/0", {})["sentinel_kwargs"]
    assert "master_name" not in sentinel_transport_options("sentinel://h1:1/0", {})
    assert sentinel_transport_options("redis://h:1/0", env) == {}


def test_the_store_client_follows_the_master_with_todays_options() -> None:
    """``client_from_url`` on a Sentinel URL: a client of the named master (through the
    Sentinels), with the database and the master's password from the URL, the caller's socket
    timeouts and health checks, and failover-aware connections; the Sentinels get their own
    password and short timeouts. Nothing connects yet."""
    env = {"CRITIQUE_REDIS_MASTER": "mymaster", "CRITIQUE_SENTINEL_PASSWORD": "sp"}
    client = client_from_url(
        "sentinel://:mpw@127.0.0.1:1;sentinel://127.0.0.1:2/3",
        env=env,
        socket_connect_timeout=5,
        socket_timeout=30,
        health_check_interval=30,
    )
    pool = client.connection_pool
    assert isinstance(pool, redis.sentinel.SentinelConnectionPool)
    assert pool.service_name == "mymaster"
    assert pool.connection_class is FailoverConnection
    kw = pool.connection_kwargs
    assert (kw["db"], kw["password"]) == (3, "mpw")
    assert (kw["socket_timeout"], kw["socket_connect_timeout"], kw["health_check_interval"]) == (
        30,
        5,
        30,
    )
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [1, 2]
    assert all(s.connection_pool.connection_kwargs["password"] == "sp" for s in sentinels)
    assert redis_url_of(client) == (
        "sentinel://127.0.0.1:1;sentinel://127.0.0.1:2/3 (master mymaster)"
    )
    assert "mpw" not in redis_url_of(client)
    with pytest.raises(ConfigError, match="CRITIQUE_REDIS_MASTER"):
        client_from_url("sentinel://127.0.0.1:1/0", env={})


def test_a_demoted_masters_replies_are_transient() -> None:
    """``UNBLOCKED … master -> replica`` (a plain ResponseError in redis-py) and ``READONLY``
    are "not now" for the stores, like a lost connection; any other error reply is not."""
    client = redis.Redis(host="127.0.0.1", port=1)
    assert is_demoted_reply(redis.exceptions.ResponseError(UNBLOCKED))
    assert is_demoted_reply(redis.exceptions.ResponseError("NOREPLICAS Not enough good replicas"))
    assert not is_demoted_reply(redis.exceptions.ResponseError("WRONGTYPE Operation against"))
    assert not is_demoted_reply(redis.exceptions.ConnectionError(UNBLOCKED))
    for exc in (
        redis.exceptions.ResponseError(UNBLOCKED),
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
    ):
        with pytest.raises(StoreUnavailableError), store_errors(client):
            raise exc
    with pytest.raises(redis.exceptions.ResponseError), store_errors(client):
        raise redis.exceptions.ResponseError("WRONGTYPE Operation against a key")


def test_the_sentinel_settings_are_not_configuration_fields() -> None:
    """``CRITIQUE_REDIS_MASTER`` and ``CRITIQUE_SENTINEL_PASSWORD`` are process settings, not
    unknown ``CRITIQUE_<FIELD>`` variables (which the configuration refuses)."""
    load_config(env={"CRITIQUE_REDIS_MASTER": "m", "CRITIQUE_SENTINEL_PASSWORD": "p"})


def test_critique_worker_and_submit_refuse_a_sentinel_url_without_a_master_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Exit 2 with one line naming CRITIQUE_REDIS_MASTER, before anything is started or sent."""
    from workers.cli import main

    monkeypatch.setenv("REDIS_URL", "sentinel://127.0.0.1:1/0")
    monkeypatch.delenv("CRITIQUE_REDIS_MASTER", raising=False)
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    sub = tmp_path / "subs.jsonl"
    sub.write_text(json.dumps({"run_id": "r", "worker_id": "w", "output": "x"}) + "\n")
    for argv in (["worker", "--dry-run"], ["submit", str(sub)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "CRITIQUE_REDIS_MASTER is not set" in err[0], (argv, err)


def test_a_connection_to_a_replaced_master_is_dropped_before_it_sends() -> None:
    """After a failover the old master may still accept writes until Sentinel reconfigures it:
    a connection opened before the switch asks the Sentinels (at most every second) and, when
    they name another master, drops itself with a connection error instead of writing there."""
    import socket
    import types

    class Manager:
        address = ("127.0.0.1", 1111)

        def discover_master(self, name: str) -> tuple[str, int]:
            assert name == "m"
            return self.address

    manager = Manager()
    proxy = types.SimpleNamespace(is_master=True, service_name="m", sentinel_manager=manager)
    conn = FailoverConnection(connection_pool=proxy, host="127.0.0.1", port=1111)
    mine, peer = socket.socketpair()
    try:
        conn._sock = mine
        conn.send_packed_command([b"PING\r\n"], check_health=False)  # still the master: sent
        assert peer.recv(16) == b"PING\r\n"
        manager.address = ("127.0.0.1", 2222)  # the Sentinels promoted another server
        proxy._critique_master = (0.0, *proxy._critique_master[1:])  # its recheck is due
        with pytest.raises(redis.exceptions.ConnectionError, match="no longer the master"):
            conn.send_packed_command([b"SET k v\r\n"], check_health=False)
        assert conn._sock is None  # dropped: the next use connects to the current master
    finally:
        peer.close()


def test_sentinel_options_are_json_and_ask_each_sentinel_once() -> None:
    """The Sentinels' options survive ``celery inspect stats`` (plain JSON: a redis-py Retry
    object there broke it), a cut-off Sentinel costs one 1 s connect (no retry on the same one),
    and a Sentinel client built from them makes no retry."""
    opts = sentinel_transport_options("sentinel://h1:1/0", {"CRITIQUE_REDIS_MASTER": "m"})
    assert json.loads(json.dumps(opts)) == opts
    kw = opts["sentinel_kwargs"]
    assert (kw["socket_connect_timeout"], kw["socket_timeout"], kw["retry"]) == (1.0, 2.0, None)
    client = client_from_url("sentinel://127.0.0.1:1/0", env={"CRITIQUE_REDIS_MASTER": "m"})
    [sentinel] = client.connection_pool.sentinel_manager.sentinels
    conn = sentinel.connection_pool.make_connection()  # not connected
    assert conn.retry.get_retries() == 0
    assert conn.socket_connect_timeout == 1.0


def test_store_connections_drop_a_silent_peer_within_ten_seconds() -> None:
    """A store client's connections carry TCP keepalive and ``TCP_USER_TIMEOUT`` of
    :data:`DEAD_PEER_S`: a partition that swallows packets is a dropped connection in 10 s, not
    the kernel's 15 minutes of retransmissions; a caller's own options win."""
    import socket

    kw = store_client_from_url("redis://127.0.0.1:1/0").connection_pool.connection_kwargs
    assert kw["socket_keepalive"] is True
    opts = kw["socket_keepalive_options"]
    assert opts[socket.TCP_USER_TIMEOUT] == DEAD_PEER_S * 1000
    assert (opts[socket.TCP_KEEPIDLE], opts[socket.TCP_KEEPINTVL], opts[socket.TCP_KEEPCNT]) == (
        DEAD_PEER_S,
        5,
        3,
    )
    mine = store_client_from_url("redis://127.0.0.1:1/0", socket_keepalive_options={})
    assert mine.connection_pool.connection_kwargs["socket_keepalive_options"] == {}
