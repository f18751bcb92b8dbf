"""Helpers shared by the Redis stores: error mapping, reply decoding, prefix and TTL defaults,
and the one way every process builds a Redis client from a URL (``redis://``, ``rediss://``,
``unix://``, Sentinel's ``sentinel://host:port;sentinel://host:port;…/db``, or, for the store
only, a Redis Cluster's ``redis+cluster://host:port,host:port,…``).

**Where the store lives.** ``CRITIQUE_STORE_URL`` (default: ``REDIS_URL``) is the store: pattern
memory, budget, blobs, trace, the pending index, steps, results, the rate limiter, the critique
cache, the sweeper's probes and locks, the archive index. The broker and Celery's result backend
stay where ``REDIS_URL`` / ``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND`` say.

**Redis Cluster** (the store only: kombu and Celery's backend cannot use one). A
``redis+cluster://[user:password@]host:port,host:port,…[/0]`` URL (``rediss+cluster://`` for TLS)
lists startup nodes (port 6379 when omitted); the client discovers the rest and follows slot
moves and failovers (``redis.cluster.RedisCluster``). Every multi-key script and transaction of
the stores touches keys of one hash tag (a run's ``{run_id}``, see :mod:`pipeline.store.keys`).

**Sentinel.** A ``sentinel://`` URL lists the Sentinels (``;``-separated, port 26379 when
omitted); the database and the master's own password (``sentinel://:pw@host:port/db``) go in the
URL as usual, on any of its parts. Two settings go with it: ``CRITIQUE_REDIS_MASTER`` (required:
the name the Sentinels monitor, their ``sentinel monitor <name> …`` line) and
``CRITIQUE_SENTINEL_PASSWORD`` (optional: the Sentinels' own password). A client built here
asks the Sentinels for the current master on every (re)connect, so a failover is a reconnect.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import redis
import redis.cluster
import redis.sentinel
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline import settings
from pipeline.errors import ConfigError, StoreUnavailableError
from pipeline.store import keys
from pipeline.store.urls import (  # every URL's parser and check live in one module
    CLUSTER_SCHEMES,
    DEFAULT_SENTINEL_PORT,
    SETTINGS,
    cannot_reach,
    check_url,
    check_urls,
    host_part,
    is_cluster_url,
    is_sentinel_url,
    parse_cluster_url,
    parse_sentinel_url,
    sentinel_master,
    store_setting,
)

# --- URLs and settings: parsed and checked in pipeline.store.urls ----------------------------

URL_ENVS = ("REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
"""The settings that name the broker's and the backend's Redis (any may be ``sentinel://``)."""

StoreClient = redis.Redis | redis.cluster.RedisCluster
"""A client of the store: one Redis (or Sentinel's current master), or a Redis Cluster."""

SENTINEL_CONNECT_TIMEOUT_S = 1.0
"""Connect timeout to a Sentinel: one that is down, or cut off by a partition that drops its
packets, is skipped for the next within this."""
SENTINEL_SOCKET_TIMEOUT_S = 2.0
"""Reply timeout on a connection to a Sentinel (its answers take microseconds)."""


DEAD_PEER_S = 10
"""A store connection whose peer went silent (a host gone, a partition that drops packets) is
dropped after this long: a command unacknowledged at the TCP level for 10 s
(``TCP_USER_TIMEOUT``), or an idle connection after 10 s + 3 keepalive probes 5 s apart. A slow
reply from a live server is not cut short (its kernel acknowledged the command)."""


STORE_TIMEOUTS: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 30}
"""Every store client's timeouts (seconds): a connect within 5, a reply within 30 (the longest
blocking read a store call makes is shorter)."""


def store_socket_options() -> dict[str, Any]:
    """A store client's socket options: :data:`STORE_TIMEOUTS`, and keepalive probes that find
    a silent peer dead within :data:`DEAD_PEER_S` (sync and asyncio clients alike)."""
    return {
        **STORE_TIMEOUTS,
        "socket_keepalive": True,
        "socket_keepalive_options": dead_peer_options(),
    }


def dead_peer_options() -> dict[int, int]:
    """The TCP options of :data:`DEAD_PEER_S` (``socket_keepalive_options``), those this platform
    has: Linux all of them."""
    wanted = {
        "TCP_KEEPIDLE": DEAD_PEER_S,
        "TCP_KEEPINTVL": 5,
        "TCP_KEEPCNT": 3,
        "TCP_USER_TIMEOUT": DEAD_PEER_S * 1000,
    }
    return {getattr(socket, k): v for k, v in wanted.items() if hasattr(socket, k)}


def sentinel_kwargs(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Connection options for the Sentinels themselves: short timeouts and no retry on the same
    Sentinel (``retry: None``; redis-py asks the next one, so a Sentinel cut off by a partition
    costs one connect timeout, :data:`SENTINEL_CONNECT_TIMEOUT_S`, not four with backoff), TCP
    keepalive, and ``CRITIQUE_SENTINEL_PASSWORD`` when set (the master's password stays in the
    URL). Plain JSON values: kombu and Celery show them in ``celery inspect stats``."""
    env = os.environ if env is None else env
    out: dict[str, Any] = {
        "socket_timeout": SENTINEL_SOCKET_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
        "retry": None,
    }
    password = settings.raw(settings.SENTINEL_PASSWORD, env)
    if password:
        out["password"] = password
    return out


def check_redis_urls(env: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigError`` (one line, naming the setting) unless every URL setting parses:
    :func:`pipeline.store.urls.check_urls` (schemes, hosts, database numbers; a ``sentinel://``
    URL's parts and ``CRITIQUE_REDIS_MASTER``; a ``redis+cluster://`` URL's nodes, and that it
    names the store only)."""
    check_urls(env)


def celery_url(url: str, *, setting: str) -> str:
    """``url`` as Celery and kombu should get it: a ``sentinel://`` URL with its database and
    credentials on every part (:meth:`SentinelURL.url`); any other URL, or one that does not
    parse (the start-up checks report it), unchanged."""
    if not is_sentinel_url(url):
        return url
    try:
        return parse_sentinel_url(url, setting=setting).url()
    except ConfigError:
        return url


def sentinel_transport_options(url: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The transport options a ``sentinel://`` broker or result backend needs
    (``master_name``, ``sentinel_kwargs``); ``{}`` for any other URL. Without
    ``CRITIQUE_REDIS_MASTER`` ``master_name`` is left out: the start-up checks say what to set."""
    if not is_sentinel_url(url):
        return {}
    env = os.environ if env is None else env
    opts: dict[str, Any] = {"sentinel_kwargs": sentinel_kwargs(env)}
    name = (settings.raw(settings.REDIS_MASTER, env) or "").strip()
    if name:
        opts["master_name"] = name
    return opts


# --- failover-aware connections ------------------------------------------------------------------


def is_demoted_reply(exc: BaseException) -> bool:
    """Whether ``exc`` is a reply that says "not this server, not now" during a failover:
    ``UNBLOCKED … (master -> replica?)``, sent to a client blocked in BRPOP/XREAD when its
    server turns into a replica, or ``NOREPLICAS`` from a master with ``min-replicas-to-write``
    that has lost its replicas (cut off from them, or already replaced). redis-py has no class
    for either (a plain ``ResponseError``), unlike ``READONLY``."""
    if not isinstance(exc, ResponseError):
        return False
    msg = str(exc)
    return msg.startswith(("UNBLOCKED", "NOREPLICAS")) or "master -> replica" in msg


MASTER_CHECK_S = 1.0
"""How often (at most, per connection pool) a Sentinel-managed connection asks the Sentinels
whether the server it talks to is still the master."""


class _Switches:
    """How many master switches this process's connections have seen (any pool: the store's,
    the broker's), and the write journal of each thread inside :func:`fenced_writes`."""

    def __init__(self) -> None:
        self.seen = 0
        self.local = threading.local()


_SWITCHES = _Switches()


def master_switches() -> int:
    """Master switches this process has seen so far (a Sentinel failover, each time one of its
    connection pools learns that the master moved)."""
    return _SWITCHES.seen


def _note_master(pool: Any, address: tuple[str, int] | None, recheck_in: float) -> None:
    known = getattr(pool, "_critique_known", None)
    if address is not None:
        if known is not None and known != address:
            _SWITCHES.seen += 1  # a plain int: under the GIL a lost increment is still > before
        pool._critique_known = address
    pool._critique_master = (time.monotonic() + recheck_in, address, _SWITCHES.seen)


@contextmanager
def fenced_writes() -> Iterator[None]:
    """Run a task's body with its acknowledged writes (each :func:`replicated` call) journaled;
    if a master switch happened meanwhile (:func:`master_switches`), apply them all again, in
    order, on the master that holds the data now, before the task ends.

    Why: a switch the process learns of part-way through a task (a ``SENTINEL FAILOVER``, a
    partition healing) can leave the task's first writes on the old master, acknowledged by a
    replica that was not the one promoted and that then resyncs, while its later writes and
    its next message reach the new master: the chain goes on without those counts or charges.
    Every journaled write is an idempotent script (a pattern record per critique, a charge per
    lease, a result per pass), so applying one again where it landed already changes nothing.
    A task that raises journals nothing further: its retry writes everything again."""
    local = _SWITCHES.local
    outer = getattr(local, "journal", None)
    if outer is not None:  # nested: the outermost fence replays
        yield
        return
    began = _SWITCHES.seen
    journal: list[tuple[Any, Any, list[str], list[Any]]] = []
    local.journal = journal
    try:
        yield
    finally:
        local.journal = None
    if _SWITCHES.seen != began and journal:
        for client, script, script_keys, args in journal:
            replicated(client, script, script_keys, args)


class FailoverConnection(redis.sentinel.SentinelManagedConnection):
    """redis-py's Sentinel-managed connection, made to follow a failover by itself:

    - a demoted master's ``UNBLOCKED`` reply (and ``NOREPLICAS``, :func:`is_demoted_reply`) is a
      connection loss, like ``READONLY`` (redis-py maps only ``READONLY`` so): the connection is
      dropped, the next one asks the Sentinels for the current master, and the error is a
      ``ConnectionError`` (retried by redis-py, kombu and Celery; ``StoreUnavailableError`` in
      the stores);
    - before it sends a command, at most every :data:`MASTER_CHECK_S` per pool, it asks the
      Sentinels for the master's address, and a connection to any other server is dropped with
      a ``ConnectionError`` (nothing of the command was sent). After a ``SENTINEL FAILOVER``,
      or a partition, the old master keeps accepting writes until Sentinel reconfigures it
      (about 10 s later: its periodic INFO), and a connection opened before the switch would
      write there, to be discarded when it resyncs; this narrows that window to about a
      second. A slow answer (Sentinels unreachable) spaces the checks out (10x its time).
    """

    def connect_to(self, address: Any) -> None:
        # The address the Sentinels just gave: the handshake that follows must not be refused.
        _note_master(self.connection_pool, (str(address[0]), int(address[1])), MASTER_CHECK_S)
        super().connect_to(address)  # type: ignore[no-untyped-call]

    def _superseded(self) -> bool:
        """Whether the Sentinels name another server as the master than this connection's."""
        pool = self.connection_pool
        if not getattr(pool, "is_master", False):
            return False
        seen = getattr(pool, "_critique_master", None)
        began = time.monotonic()
        # Due, or another pool of this process has seen a switch since this one last asked.
        if seen is None or began >= seen[0] or seen[2] != _SWITCHES.seen:
            try:
                host, port = pool.sentinel_manager.discover_master(pool.service_name)
                address: tuple[str, int] | None = (str(host), int(port))
            except (RedisConnectionError, RedisTimeoutError):  # none known (yet): can't tell
                address = None
            took = time.monotonic() - began
            # No Sentinel answered: space the checks out (10x their cost). One answered: the
            # next check asks it first (redis-py moves it to the front), whatever the dead ones
            # before it cost this time.
            _note_master(
                pool, address, MASTER_CHECK_S if address else max(MASTER_CHECK_S, 10 * took)
            )
            seen = pool._critique_master
        address = seen[1]
        return address is not None and (str(self.host), int(self.port)) != address

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._sock is not None and self._superseded():
            where = f"{self.host}:{self.port}"
            self.disconnect()
            raise RedisConnectionError(
                f"{where} is no longer the master (a Sentinel failover): reconnecting"
            )
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not is_demoted_reply(exc) or not self.connection_pool.is_master:
                raise
            self.disconnect()  # type: ignore[no-untyped-call]
            raise RedisConnectionError(
                f"{self.host}:{self.port} can no longer take writes as the master: {exc}"
            ) from exc


class FailoverSSLConnection(FailoverConnection, redis.SSLConnection):
    """:class:`FailoverConnection` over TLS."""


def client_from_url(
    url: str,
    *,
    setting: str = "REDIS_URL",
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> redis.Redis:
    """A Redis client for ``url`` with ``kwargs`` (timeouts, health checks, retry…).

    ``redis://``, ``rediss://``, ``unix://``: ``redis.Redis.from_url``. ``sentinel://``: a client
    of the master named by ``CRITIQUE_REDIS_MASTER`` (``ConfigError`` naming it when unset),
    found through the Sentinels on every (re)connect, with the same ``kwargs``; a demoted
    master's ``READONLY`` or ``UNBLOCKED`` reply drops the connection
    (:class:`FailoverConnection`). A Redis Cluster URL is refused here (``ConfigError``): only
    the store may be one, :func:`store_client_from_url`. A URL of a known setting
    (:data:`pipeline.store.urls.SETTINGS`) that is wrong (no scheme, no host…) is a one-line
    ``ConfigError`` naming the setting."""
    if is_cluster_url(url):
        raise ConfigError(
            f"{setting} is a Redis Cluster URL, which only the store may use (CRITIQUE_STORE_URL)",
            key=setting,
        )
    env = os.environ if env is None else env
    if setting in SETTINGS:
        check_url(setting, url, env)
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **kwargs)
    parsed = parse_sentinel_url(url, setting=setting)
    master = sentinel_master(env, setting=setting)
    ssl = bool(kwargs.pop("ssl", False))
    sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs(env)
    )
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        master,
        redis_class=redis.Redis,
        connection_class=FailoverSSLConnection if ssl else FailoverConnection,
        db=parsed.db,
        **parsed.auth(),
        **kwargs,
    )
    return client


def store_client_from_url(
    url: str,
    *,
    setting: str = settings.STORE_URL.name,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> StoreClient:
    """A client of the store at ``url``: :func:`client_from_url`, or for a ``redis+cluster://``
    URL a ``redis.cluster.RedisCluster`` over its startup nodes with the same ``kwargs`` (it
    discovers the other nodes, follows ``MOVED``/``ASK`` and a replica's promotion). A cluster
    client asks a node for the slot map as it is built: a cluster that cannot be reached is a
    ``StoreUnavailableError`` (transient; the next call tries again). Its connections find a
    silent peer dead within :data:`DEAD_PEER_S` unless ``kwargs`` set their own keepalive."""
    kwargs.setdefault("socket_keepalive", True)
    kwargs.setdefault("socket_keepalive_options", dead_peer_options())
    if not is_cluster_url(url):
        return client_from_url(url, setting=setting, env=env, **kwargs)
    parsed = parse_cluster_url(url, setting=setting)
    kwargs = {**parsed.auth(), **({"ssl": True} if parsed.ssl else {}), **kwargs}
    nodes = [redis.cluster.ClusterNode(h, p) for h, p in parsed.nodes]  # type: ignore[no-untyped-call]
    try:
        return redis.cluster.RedisCluster(startup_nodes=nodes, **kwargs)
    except _MAYBE_AWAY as exc:
        if not is_unavailable(exc):
            raise ConfigError(f"{setting}: {exc}", key=setting) from None
        raise StoreUnavailableError(
            cannot_reach("the Redis Cluster", parsed.redacted(), exc),
            hint=f"is the cluster up (cluster_state:ok)? check {setting}",
        ) from exc


def connection_kwargs(client: Any) -> dict[str, Any]:
    """The connection options ``client`` (a Redis, Sentinel or cluster client) opens its
    connections with; ``{}`` when it has none to tell."""
    if isinstance(client, redis.cluster.RedisCluster):
        return dict(client.get_connection_kwargs() or {})  # type: ignore[no-untyped-call]
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    return dict(kwargs or {})


def redis_url_of(client: StoreClient) -> str:
    """A password-free URL naming the server ``client`` talks to (for error hints)."""
    if isinstance(client, redis.cluster.RedisCluster):
        nodes = client.get_primaries() or client.get_nodes()  # type: ignore[no-untyped-call]
        ssl = bool(connection_kwargs(client).get("ssl"))
        scheme = CLUSTER_SCHEMES[1] if ssl else CLUSTER_SCHEMES[0]
        return f"{scheme}://" + ",".join(f"{host_part(n.host)}:{n.port}" for n in nodes)
    pool = client.connection_pool
    kw = pool.connection_kwargs
    db = kw.get("db", 0)
    if isinstance(pool, redis.sentinel.SentinelConnectionPool):
        sentinels = getattr(pool.sentinel_manager, "sentinels", None) or []
        where = ";".join(
            f"sentinel://{s.connection_pool.connection_kwargs.get('host', '?')}:"
            f"{s.connection_pool.connection_kwargs.get('port', DEFAULT_SENTINEL_PORT)}"
            for s in sentinels
        )
        return f"{where}/{db} (master {pool.service_name})"
    if kw.get("path"):
        return f"unix://{kw['path']}?db={db}"
    return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{db}"


UNAVAILABLE: tuple[type[Exception], ...] = (
    RedisConnectionError,  # refused, reset, closed; also LOADING (a restart reading its AOF)
    RedisTimeoutError,
    ReadOnlyError,  # writing to a replica: a failover is under way
    TryAgainError,  # a cluster slot migrating
    ClusterDownError,  # a cluster, or a master, is down (MASTERDOWN)
    ClusterError,  # a cluster's redirections or errors outlasted the client's retries
    SlotNotCoveredError,  # a cluster slot without a master (a node down, not yet replaced)
)
"""Redis errors that say "not now" rather than "never": ``StoreUnavailableError`` (transient).
(So is a demoted master's ``UNBLOCKED`` reply, a plain ``ResponseError``: :func:`is_demoted_reply`.
A Sentinel that knows no master raises ``MasterNotFoundError``, a ``ConnectionError``.)"""

_MAYBE_AWAY: tuple[type[Exception], ...] = (*UNAVAILABLE, ResponseError, RedisClusterException)
"""The errors :func:`is_unavailable` sorts into "not now" and the rest."""
_CLUSTER_AWAY = ("cannot be connected", "are not covered", "could not agree")
"""What redis-py's cluster client says, in a plain ``RedisClusterException``, when it cannot
rebuild its slot map (every node it knows is away, or mid-failover): "not now" too. Any other
``RedisClusterException`` (keys of two slots in one script or transaction) is a bug: raised."""


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store is away for now (:data:`UNAVAILABLE`, a demoted master's
    reply, a cluster client that cannot rebuild its slot map) rather than "never"."""
    if isinstance(exc, UNAVAILABLE):
        return True
    if isinstance(exc, RedisClusterException):
        return any(s in str(exc) for s in _CLUSTER_AWAY)
    return isinstance(exc, ResponseError) and is_demoted_reply(exc)


def _unavailable(client: StoreClient, exc: BaseException) -> StoreUnavailableError:
    url = redis_url_of(client)
    setting = store_setting()
    if isinstance(client, redis.cluster.RedisCluster):
        hint = (
            f"is the Redis Cluster at {url} up (cluster_state:ok)? check {setting} (a node's "
            "failover takes the cluster's cluster-node-timeout plus a second or two)"
        )
    elif isinstance(client.connection_pool, redis.sentinel.SentinelConnectionPool):
        hint = (
            f"do the Sentinels at {url} know a master? check {setting} and "
            f"{settings.REDIS_MASTER.name} "
            "(a failover takes the Sentinels' down-after-milliseconds plus a few seconds)"
        )
    else:
        hint = f"start Redis there, or point {setting} at a running one"
    what = "the Redis Cluster" if isinstance(client, redis.cluster.RedisCluster) else "Redis"
    return StoreUnavailableError(cannot_reach(what, url, exc), hint=hint)


@contextmanager
def store_errors(client: StoreClient) -> Iterator[None]:
    """Map Redis connection failures, timeouts and failover replies (:data:`UNAVAILABLE`, and a
    demoted master's ``UNBLOCKED``) to ``StoreUnavailableError`` (transient: retried with
    backoff) with a hint."""
    try:
        yield
    except _MAYBE_AWAY as exc:
        if not is_unavailable(exc):
            raise
        raise _unavailable(client, exc) from exc


def decodes_responses(client: Any) -> bool:
    """Whether ``client`` (a Redis, Sentinel or cluster client) decodes replies to ``str``
    (``decode_responses=True``); a client with no options to tell is taken as bytes-mode."""
    return bool(connection_kwargs(client).get("decode_responses", False))


def text(value: bytes | str) -> str:
    """A reply as ``str`` whether the client decodes responses or not."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def resolve_ttl_ms(ttl_s: float | None) -> int:
    """A run TTL in milliseconds: ``ttl_s`` if given, else ``$CRITIQUE_RUN_TTL_S`` (7 days)."""
    seconds = keys.run_ttl_s() if ttl_s is None else ttl_s
    if seconds <= 0:
        raise ValueError(f"run TTL must be positive, got {seconds!r}")
    return max(1, int(seconds * 1000))


def resolve_prefix(prefix: str | None) -> str:
    """A checked key prefix: ``prefix`` if given, else ``$CRITIQUE_KEY_PREFIX`` or ``critique``."""
    return keys.key_prefix() if prefix is None else keys.check_prefix(prefix)


# -- acknowledged writes on a replica ------------------------------------------------------------
DEFAULT_REPLICA_WAIT_MS = settings.integer(settings.STORE_REPLICA_WAIT_MS, {})  # 2 s


def replicas_required(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(replicas, wait_ms)`` from :data:`~pipeline.settings.STORE_REPLICAS` and
    :data:`~pipeline.settings.STORE_REPLICA_WAIT_MS`; a value
    that is not a whole number ≥ 0 (≥ 1 for the wait) is a ``ConfigError`` naming it."""
    env = os.environ if env is None else env
    out = []
    for name, default, least in (
        (settings.STORE_REPLICAS.name, 0, 0),
        (settings.STORE_REPLICA_WAIT_MS.name, DEFAULT_REPLICA_WAIT_MS, 1),
    ):
        raw = (env.get(name) or "").strip()
        try:
            value = int(raw) if raw else default
        except ValueError:
            value = -1
        if value < least:
            raise ConfigError(f"{name}={raw!r}: give a whole number ≥ {least}", key=name)
        out.append(value)
    return out[0], out[1]


def replicated(client: StoreClient, script: Any, keys: list[str], args: list[Any]) -> Any:
    """Run a registered store script and, when :data:`~pipeline.settings.STORE_REPLICAS` asks
    for replicas, ``WAIT`` for them on the same connection (one pipeline, not a transaction)
    before answering: a write a failover could drop (the master crashed, or was demoted, before
    its replicas had it) is a
    ``StoreUnavailableError`` instead of an acknowledged write, so the task retries it (every
    such script is idempotent) on whichever master holds the data then. A Redis Cluster store
    relies on its own replicas (``WAIT`` has no key to route by): the script runs alone."""
    journal = getattr(_SWITCHES.local, "journal", None)
    if journal is not None:
        journal.append((client, script, keys, args))
    wanted, wait_ms = replicas_required()
    if wanted <= 0 or isinstance(client, redis.cluster.RedisCluster):
        return script(keys=keys, args=args)
    pipe = client.pipeline(transaction=False)
    script(keys=keys, args=args, client=pipe)
    pipe.execute_command("WAIT", wanted, wait_ms)  # type: ignore[no-untyped-call]
    got, acked = pipe.execute()
    if int(acked) < wanted:
        raise StoreUnavailableError(
            f"a write reached {int(acked)} of the {wanted} replica(s) "
            f"{settings.STORE_REPLICAS.name} asks for "
            f"within {wait_ms} ms (a failover under way, or a replica down)",
            hint=f"the task retries it; check the replicas (INFO replication), or lower "
            f"{settings.STORE_REPLICAS.name}",
        )
    return got
