"""Helpers shared by the Redis stores: error mapping, reply decoding, prefix and TTL defaults,
and the one way every process builds a Redis client from a URL (``redis://``, ``rediss://``,
``unix://``, or Sentinel's ``sentinel://host:port;sentinel://host:port;…/db``).

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
import redis.sentinel
from redis.exceptions import ClusterDownError, ReadOnlyError, ResponseError, TryAgainError
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
    ``REDIS_URL`` / ``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND`` parses and
    ``CRITIQUE_REDIS_MASTER`` is set. Other URLs are left to their clients."""
    env = os.environ if env is None else env
    for setting in URL_ENVS:
        url = env.get(setting)
        if is_sentinel_url(url):
            parse_sentinel_url(str(url), setting=setting)
            sentinel_master(env, setting=setting)


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
    (:class:`FailoverConnection`)."""
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


def redis_url_of(client: redis.Redis) -> str:
    """A password-free URL naming the server ``client`` talks to (for error hints)."""
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
)
"""Redis errors that say "not now" rather than "never": ``StoreUnavailableError`` (transient).
(So is a demoted master's ``UNBLOCKED`` reply, a plain ``ResponseError``: :func:`is_demoted_reply`.
A Sentinel that knows no master raises ``MasterNotFoundError``, a ``ConnectionError``.)"""


def _unavailable(client: redis.Redis, exc: BaseException) -> StoreUnavailableError:
    url = redis_url_of(client)
    if isinstance(client.connection_pool, redis.sentinel.SentinelConnectionPool):
        hint = (
            f"do the Sentinels at {url} know a master? check REDIS_URL and {MASTER_ENV} "
            "(a failover takes the Sentinels' down-after-milliseconds plus a few seconds)"
        )
    else:
        hint = f"is Redis running at {url}? set REDIS_URL"
    return StoreUnavailableError(f"the Redis store at {url} is unavailable: {exc}", hint=hint)


@contextmanager
def store_errors(client: redis.Redis) -> Iterator[None]:
    """Map Redis connection failures, timeouts and failover replies (:data:`UNAVAILABLE`, and a
    demoted master's ``UNBLOCKED``) to ``StoreUnavailableError`` (transient: retried with
    backoff) with a hint."""
    try:
        yield
    except UNAVAILABLE as exc:
        raise _unavailable(client, exc) from exc
    except ResponseError as exc:
        if not is_demoted_reply(exc):
            raise
        raise _unavailable(client, exc) from exc


def decodes_responses(client: Any) -> bool:
    """Whether ``client`` decodes replies to ``str`` (``decode_responses=True``); a client
    without a connection pool (a cluster client) is taken as bytes-mode."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None) or {}
    return bool(kwargs.get("decode_responses", False))


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
