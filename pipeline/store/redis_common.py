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
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

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

from pipeline.errors import ConfigError, StoreUnavailableError
from pipeline.store import keys

# --- Sentinel URLs and settings --------------------------------------------------------------

SENTINEL_SCHEME = "sentinel"
MASTER_ENV = "CRITIQUE_REDIS_MASTER"
"""The master name the Sentinels monitor (required with a ``sentinel://`` URL)."""
SENTINEL_PASSWORD_ENV = "CRITIQUE_SENTINEL_PASSWORD"
"""The Sentinels' own password (``requirepass`` in their configuration), if they have one."""
DEFAULT_SENTINEL_PORT = 26379
URL_ENVS = ("REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
"""The settings that name a Redis (any of them may be a ``sentinel://`` URL)."""
STORE_URL_ENV = "CRITIQUE_STORE_URL"
"""The store's URL, when it is not ``REDIS_URL`` (a Redis Cluster, another Redis or Sentinel)."""
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
"""The URL schemes of a Redis Cluster store (plain and TLS)."""
DEFAULT_CLUSTER_PORT = 6379

StoreClient = redis.Redis | redis.cluster.RedisCluster
"""A client of the store: one Redis (or Sentinel's current master), or a Redis Cluster."""


def store_url(env: Mapping[str, str] | None = None) -> str:
    """The store's URL: ``CRITIQUE_STORE_URL``, else ``REDIS_URL``, else the local default."""
    env = os.environ if env is None else env
    return (
        (env.get(STORE_URL_ENV) or "").strip()
        or (env.get("REDIS_URL") or "").strip()
        or DEFAULT_REDIS_URL
    )


def store_setting(env: Mapping[str, str] | None = None) -> str:
    """The setting the store's URL comes from (for messages): ``CRITIQUE_STORE_URL`` when it is
    set, else ``REDIS_URL``."""
    env = os.environ if env is None else env
    return STORE_URL_ENV if (env.get(STORE_URL_ENV) or "").strip() else "REDIS_URL"


def is_cluster_url(url: str | None) -> bool:
    """Whether ``url`` is a Redis Cluster URL (``redis+cluster://`` or ``rediss+cluster://``)."""
    scheme = (url or "").strip().partition("://")[0].lower()
    return scheme in CLUSTER_SCHEMES and "://" in (url or "")


@dataclass(frozen=True)
class ClusterURL:
    """A parsed ``redis+cluster://`` URL: startup nodes, credentials, TLS."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    ssl: bool = False

    def redacted(self) -> str:
        """The URL without its credentials (for messages)."""
        scheme = CLUSTER_SCHEMES[1] if self.ssl else CLUSTER_SCHEMES[0]
        return f"{scheme}://" + ",".join(f"{_host(h)}:{p}" for h, p in self.nodes)


def parse_cluster_url(url: str, *, setting: str = STORE_URL_ENV) -> ClusterURL:
    """Parse ``redis+cluster://[user:password@]host[:port],host[:port],…[/0]`` (or
    ``rediss+cluster://`` for TLS). A cluster has database 0 only. Raises ``ConfigError``, one
    line naming ``setting``, for anything else."""
    example = "redis+cluster://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379"
    raw = url.strip()
    scheme, sep, rest = raw.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ConfigError(
            f"{setting}: a Redis Cluster URL starts with redis+cluster:// or rediss+cluster:// "
            f"(e.g. {example})",
            key=setting,
        )
    auth, at, hosts = rest.rpartition("@")
    if not at:
        auth, hosts = "", rest
    hosts, slash, path = hosts.partition("/")
    if "?" in hosts or "#" in hosts or "?" in path or "#" in path:
        raise ConfigError(
            f"{setting}: query parameters are not read from a Redis Cluster URL (e.g. {example})",
            key=setting,
        )
    if slash and path.strip("/") not in ("", "0"):
        raise ConfigError(
            f"{setting}: a Redis Cluster has database 0 only, got /{path.strip('/')} "
            f"(e.g. {example})",
            key=setting,
        )
    nodes: list[tuple[str, int]] = []
    for part in (p.strip() for p in hosts.split(",")):
        if not part:
            continue
        try:
            u = urlsplit(f"redis://{part}")
            port = u.port
        except ValueError as exc:
            raise ConfigError(
                f"{setting}: {part!r} is not a valid cluster node address: {exc} (e.g. {example})",
                key=setting,
            ) from None
        if not u.hostname or u.path:
            raise ConfigError(
                f"{setting}: {part!r} is not a cluster node address host:port (e.g. {example})",
                key=setting,
            )
        nodes.append((u.hostname, port or DEFAULT_CLUSTER_PORT))
    if not nodes:
        raise ConfigError(f"{setting} names no Redis Cluster node (e.g. {example})", key=setting)
    user, colon, password = auth.partition(":")
    return ClusterURL(
        tuple(dict.fromkeys(nodes)),
        unquote(user) or None,
        unquote(password) if colon else None,
        scheme.lower() == CLUSTER_SCHEMES[1],
    )


SENTINEL_SOCKET_TIMEOUT_S = 5.0
"""Connect and reply timeout on a connection to a Sentinel: a Sentinel that is down or cut off
is skipped for the next one within this, never waited on forever."""


def is_sentinel_url(url: str | None) -> bool:
    """Whether ``url`` is a ``sentinel://`` URL (kombu's and Celery's Sentinel form)."""
    return (url or "").strip().lower().startswith(SENTINEL_SCHEME + "://")


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``sentinel://`` URL: the Sentinels' addresses, and the master's database and
    credentials."""

    sentinels: tuple[tuple[str, int], ...]
    db: int
    username: str | None = None
    password: str | None = None

    def url(self) -> str:
        """The URL with the database and credentials on every part, the one form that kombu (it
        reads them from the first part) and Celery's Sentinel backend (each part, then the
        first) both read the same way."""
        auth = ""
        if self.username or self.password:
            user = quote(self.username or "", safe="")
            auth = f"{user}:{quote(self.password, safe='')}@" if self.password else f"{user}@"
        return ";".join(
            f"{SENTINEL_SCHEME}://{auth}{_host(h)}:{p}/{self.db}" for h, p in self.sentinels
        )

    def redacted(self) -> str:
        """The URL without its password (for messages)."""
        return ";".join(f"{SENTINEL_SCHEME}://{_host(h)}:{p}/{self.db}" for h, p in self.sentinels)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_sentinel_url(url: str, *, setting: str = "REDIS_URL") -> SentinelURL:
    """Parse ``sentinel://[user:password@]host[:port][/db];sentinel://host[:port];…``.

    The database and credentials may be on any part (on the last, ``…;sentinel://host:port/2``,
    or on the first); parts that give them must agree. Raises ``ConfigError`` naming ``setting``
    for anything else."""
    sentinels: list[tuple[str, int]] = []
    dbs: set[int] = set()
    users: set[str] = set()
    passwords: set[str] = set()
    parts = [p.strip() for p in url.strip().split(";") if p.strip()]
    if not parts:
        raise ConfigError(f"{setting} is empty", key=setting)
    for part in parts:
        where = f"{setting}: {part.split('@')[-1]!r}"
        try:
            u = urlsplit(part)
            port = u.port
        except ValueError as exc:
            raise ConfigError(
                f"{where} is not a valid Sentinel address: {exc}", key=setting
            ) from None
        if u.scheme.lower() != SENTINEL_SCHEME:
            raise ConfigError(
                f"{where}: every part of a Sentinel URL starts with sentinel:// "
                "(sentinel://host:port;sentinel://host:port/db)",
                key=setting,
            )
        if not u.hostname:
            raise ConfigError(f"{where} names no Sentinel host", key=setting)
        if u.query or u.fragment:
            raise ConfigError(
                f"{where}: query parameters are not read from a Sentinel URL; "
                f"the master name goes in {MASTER_ENV}",
                key=setting,
            )
        path = u.path.strip("/")
        if path:
            if not path.isdigit():
                raise ConfigError(
                    f"{where}: the path must be a database number, got {path!r}", key=setting
                )
            dbs.add(int(path))
        if u.username:
            users.add(unquote(u.username))
        if u.password is not None:
            passwords.add(unquote(u.password))
        sentinels.append((u.hostname, port or DEFAULT_SENTINEL_PORT))
    if len(dbs) > 1 or len(users) > 1 or len(passwords) > 1:
        what = "databases" if len(dbs) > 1 else "credentials"
        raise ConfigError(
            f"{setting}: its parts name different {what}; give the database (and the "
            "master's password) once, e.g. sentinel://:pw@h1:26379/0;sentinel://h2:26379",
            key=setting,
        )
    return SentinelURL(
        tuple(dict.fromkeys(sentinels)),
        dbs.pop() if dbs else 0,
        users.pop() if users else None,
        passwords.pop() if passwords else None,
    )


def sentinel_master(env: Mapping[str, str] | None = None, *, setting: str = "REDIS_URL") -> str:
    """The master name (``CRITIQUE_REDIS_MASTER``); ``ConfigError`` naming it when unset."""
    env = os.environ if env is None else env
    name = (env.get(MASTER_ENV) or "").strip()
    if not name:
        raise ConfigError(
            f"{setting} is a sentinel:// URL but {MASTER_ENV} is not set: set it to the name "
            "the Sentinels monitor (their 'sentinel monitor <name> <ip> <port> <quorum>' line)",
            key=MASTER_ENV,
        )
    return name


def sentinel_kwargs(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Connection options for the Sentinels themselves: short timeouts (a dead Sentinel is
    skipped for the next), TCP keepalive, and ``CRITIQUE_SENTINEL_PASSWORD`` when set (the
    master's password stays in the URL)."""
    env = os.environ if env is None else env
    out: dict[str, Any] = {
        "socket_timeout": SENTINEL_SOCKET_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_SOCKET_TIMEOUT_S,
        "socket_keepalive": True,
    }
    password = env.get(SENTINEL_PASSWORD_ENV)
    if password:
        out["password"] = password
    return out


def check_redis_urls(env: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigError`` (one line, naming the setting) unless every ``sentinel://`` URL in
    ``REDIS_URL`` / ``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND`` / ``CRITIQUE_STORE_URL``
    parses and ``CRITIQUE_REDIS_MASTER`` is set, and every ``redis+cluster://`` URL parses and
    names the store only (never the broker nor the result backend). Other URLs are left to
    their clients."""
    env = os.environ if env is None else env
    for setting in (*URL_ENVS, STORE_URL_ENV):
        url = env.get(setting)
        if is_sentinel_url(url):
            parse_sentinel_url(str(url), setting=setting)
            sentinel_master(env, setting=setting)
        elif is_cluster_url(url):
            parse_cluster_url(str(url), setting=setting)
            _store_only(setting, env)
        elif setting == STORE_URL_ENV and (url or "").strip():
            _plain_url(str(url), setting)


def _store_only(setting: str, env: Mapping[str, str]) -> None:
    """A Redis Cluster URL in ``setting`` must not become the broker or the result backend."""
    hint = (
        "a Redis Cluster can hold only the store: set CRITIQUE_STORE_URL to it and point "
        "REDIS_URL (or CELERY_BROKER_URL and CELERY_RESULT_BACKEND) at a plain Redis or Sentinel"
    )
    if setting in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        raise ConfigError(f"{setting} is a Redis Cluster URL: {hint}", key=setting)
    if setting == "REDIS_URL":
        lacking = [s for s in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND") if not env.get(s)]
        if lacking:
            raise ConfigError(
                f"REDIS_URL is a Redis Cluster URL and {' and '.join(lacking)} "
                f"{'is' if len(lacking) == 1 else 'are'} not set: {hint}",
                key=setting,
            )


def _plain_url(url: str, setting: str) -> None:
    """``ConfigError`` unless ``url`` is a ``redis://``, ``rediss://`` or ``unix://`` URL that
    redis-py reads."""
    scheme = url.strip().partition("://")[0].lower()
    if scheme not in ("redis", "rediss", "unix") or "://" not in url:
        raise ConfigError(
            f"{setting}: {url.split('@')[-1]!r} is not a store URL: use redis://, rediss://, "
            "unix://, sentinel://host:port;…/db or redis+cluster://host:port,host:port,…",
            key=setting,
        )
    try:
        redis.connection.parse_url(url.strip())  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ConfigError(f"{setting}: {exc}", key=setting) from None


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
    name = (env.get(MASTER_ENV) or "").strip()
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


def _note_master(pool: Any, address: tuple[str, int] | None, recheck_in: float) -> None:
    pool._critique_master = (time.monotonic() + recheck_in, address)


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
        if seen is None or began >= seen[0]:
            try:
                host, port = pool.sentinel_manager.discover_master(pool.service_name)
                address: tuple[str, int] | None = (str(host), int(port))
            except (RedisConnectionError, RedisTimeoutError):  # none known (yet): can't tell
                address = None
            took = time.monotonic() - began
            _note_master(pool, address, max(MASTER_CHECK_S, 10 * took))
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
    the store may be one, :func:`store_client_from_url`."""
    if is_cluster_url(url):
        raise ConfigError(
            f"{setting} is a Redis Cluster URL, which only the store may use (CRITIQUE_STORE_URL)",
            key=setting,
        )
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **kwargs)
    env = os.environ if env is None else env
    parsed = parse_sentinel_url(url, setting=setting)
    master = sentinel_master(env, setting=setting)
    ssl = bool(kwargs.pop("ssl", False))
    sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs(env)
    )
    creds: dict[str, Any] = {"db": parsed.db}
    if parsed.username:
        creds["username"] = parsed.username
    if parsed.password is not None:
        creds["password"] = parsed.password
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        master,
        redis_class=redis.Redis,
        connection_class=FailoverSSLConnection if ssl else FailoverConnection,
        **creds,
        **kwargs,
    )
    return client


def store_client_from_url(
    url: str,
    *,
    setting: str = STORE_URL_ENV,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> StoreClient:
    """A client of the store at ``url``: :func:`client_from_url`, or for a ``redis+cluster://``
    URL a ``redis.cluster.RedisCluster`` over its startup nodes with the same ``kwargs`` (it
    discovers the other nodes, follows ``MOVED``/``ASK`` and a replica's promotion). A cluster
    client asks a node for the slot map as it is built: a cluster that cannot be reached is a
    ``StoreUnavailableError`` (transient; the next call tries again)."""
    if not is_cluster_url(url):
        return client_from_url(url, setting=setting, env=env, **kwargs)
    parsed = parse_cluster_url(url, setting=setting)
    if parsed.username:
        kwargs.setdefault("username", parsed.username)
    if parsed.password is not None:
        kwargs.setdefault("password", parsed.password)
    if parsed.ssl:
        kwargs.setdefault("ssl", True)
    nodes = [redis.cluster.ClusterNode(h, p) for h, p in parsed.nodes]  # type: ignore[no-untyped-call]
    try:
        return redis.cluster.RedisCluster(startup_nodes=nodes, **kwargs)
    except _MAYBE_AWAY as exc:
        if not is_unavailable(exc):
            raise ConfigError(f"{setting}: {exc}", key=setting) from None
        raise StoreUnavailableError(
            f"the Redis Cluster store at {parsed.redacted()} is unavailable: {exc}",
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
        return f"{scheme}://" + ",".join(f"{_host(n.host)}:{n.port}" for n in nodes)
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
            f"do the Sentinels at {url} know a master? check {setting} and {MASTER_ENV} "
            "(a failover takes the Sentinels' down-after-milliseconds plus a few seconds)"
        )
    else:
        hint = f"is Redis running at {url}? set {setting}"
    return StoreUnavailableError(f"the Redis store at {url} is unavailable: {exc}", hint=hint)


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
