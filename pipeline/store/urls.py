"""The one check of every URL setting, run by every command before it starts anything.

:func:`check_urls` reads the settings in :data:`URL_SETTINGS` (``REDIS_URL``,
``CELERY_BROKER_URL``, ``CELERY_RESULT_BACKEND``, ``CRITIQUE_STORE_URL``) and raises
:class:`~pipeline.errors.ConfigError` for the first bad one, in one line that names the
setting, says what is wrong with the value and shows a right one::

    REDIS_URL='localhost:6394' has no scheme; set e.g. REDIS_URL=redis://localhost:6394/0
    (accepted: redis://, rediss://, unix://, sentinel://)

Table-driven: :data:`SCHEMES` says how each scheme is checked, :data:`URL_SETTINGS` which
schemes each setting accepts; a new scheme is one line in each (a checker may be shared).
A password in a URL is never echoed: every message that names a URL shows it through
:func:`redact_url` (``***``). The Sentinel and Redis Cluster URL parsers live here too
(:func:`parse_sentinel_url`, :func:`parse_cluster_url`); a cluster URL names the store only
(``CRITIQUE_STORE_URL``, or ``REDIS_URL`` with the broker and the backend set apart).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, quote, unquote, urlsplit

from pipeline import settings
from pipeline.errors import ConfigError, did_you_mean

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redact_url(value: str) -> str:
    """``value`` with the password of every ``user:password@`` part shown as ``***``: for every
    message and log line that names a URL.

    Errs on the side of hiding: the user information of each part (the text after the start or
    after a ``scheme://``, up to that part's last ``@``) loses everything after its first ``:``,
    so a scheme-less ``user:secret@host:6379/0``, a password holding ``/``, ``;`` or an unescaped
    ``@``, and each part of a ``sentinel://…;sentinel://…`` list are all covered; text that only
    looks like one (``host:6379/0?x=a@b``) is hidden too, which costs a message some detail,
    never a secret."""
    parts = value.split("://")
    for i, part in enumerate(parts):
        userinfo, at, rest = part.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        if at and colon:
            parts[i] = f"{user}:***@{rest}"
    return "://".join(parts)


def cannot_reach(what: str, url: str, reason: object) -> str:
    """``cannot reach <what> at <url>: <reason>``, on one line: the one wording of every
    unreachable-service message (a command's, the stores', the client's), the URL's password
    shown as ``***``. What to do follows as the error's hint, `` (hint: …)``."""
    return f"cannot reach {what} at {redact_url(url)}: {' '.join(str(reason).split())}"


def _server(u: SplitResult) -> str | None:
    """What is wrong with a ``scheme://host:port/db`` URL (a Redis server), or None (no host is
    redis-py's localhost)."""
    try:
        u.port  # noqa: B018 - parses the port, raises ValueError when it is not a number
    except ValueError:
        return "has a port that is not a number"
    path = u.path.strip("/")
    if path and not path.isdigit():
        return f"has a path {path!r} where the database number goes (/0 … /15)"
    return None


def _unix(u: SplitResult) -> str | None:
    """What is wrong with a ``unix:///path/to/redis.sock`` URL, or None."""
    return None if u.path else "names no socket path (unix:///path/to/redis.sock)"


def _sentinel(value: str, setting: str, env: Mapping[str, str]) -> None:
    """A ``sentinel://`` URL: every part parses, and ``CRITIQUE_REDIS_MASTER`` is set (the
    parser's own one-line errors, naming ``setting``)."""
    parse_sentinel_url(value, setting=setting)
    sentinel_master(env, setting=setting)


def _amqp(u: SplitResult) -> str | None:
    """What is wrong with an ``amqp://user:pass@host:5672/vhost`` URL, or None (an empty host
    is kombu's localhost)."""
    try:
        u.port  # noqa: B018
    except ValueError:
        return "has a port that is not a number"
    return None


# --- Sentinel URLs (also re-exported by pipeline.store.redis_common) ----------------------------

SENTINEL_SCHEME = "sentinel"
# The master's name and the Sentinels' own password: settings.REDIS_MASTER, SENTINEL_PASSWORD.
DEFAULT_SENTINEL_PORT = 26379


def is_sentinel_url(url: str | None) -> bool:
    """Whether ``url`` is a ``sentinel://`` URL (kombu's and Celery's Sentinel form)."""
    return (url or "").strip().lower().startswith(SENTINEL_SCHEME + "://")


def _auth(username: str | None, password: str | None) -> dict[str, Any]:
    """``username`` and ``password`` as client options, each only when the URL sets it (an
    empty password, ``user:@``, is a password)."""
    auth: dict[str, Any] = {"username": username} if username else {}
    if password is not None:
        auth["password"] = password
    return auth


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``sentinel://`` URL: the Sentinels' addresses, and the master's database and
    credentials."""

    sentinels: tuple[tuple[str, int], ...]
    db: int
    username: str | None = None
    password: str | None = None

    def auth(self) -> dict[str, Any]:
        """The master's credentials the URL sets, as ``username``/``password`` options."""
        return _auth(self.username, self.password)

    def url(self) -> str:
        """The URL with the database and credentials on every part, the one form that kombu (it
        reads them from the first part) and Celery's Sentinel backend (each part, then the
        first) both read the same way."""
        auth = ""
        if self.username or self.password:
            user = quote(self.username or "", safe="")
            auth = f"{user}:{quote(self.password, safe='')}@" if self.password else f"{user}@"
        return ";".join(
            f"{SENTINEL_SCHEME}://{auth}{host_part(h)}:{p}/{self.db}" for h, p in self.sentinels
        )

    def redacted(self) -> str:
        """The URL without its password (for messages)."""
        return ";".join(
            f"{SENTINEL_SCHEME}://{host_part(h)}:{p}/{self.db}" for h, p in self.sentinels
        )


def host_part(host: str) -> str:
    """``host`` as it goes before ``:port`` in a URL (an IPv6 address in brackets)."""
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
                f"the master name goes in {settings.REDIS_MASTER.name}",
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
    name = (settings.raw(settings.REDIS_MASTER, env) or "").strip()
    if not name:
        raise ConfigError(
            f"{setting} is a sentinel:// URL but {settings.REDIS_MASTER.name} is not set: "
            "set it to the name "
            "the Sentinels monitor (their 'sentinel monitor <name> <ip> <port> <quorum>' line)",
            key=settings.REDIS_MASTER.name,
        )
    return name


# --- Redis Cluster URLs (the store only; re-exported by pipeline.store.redis_common) -----------

# The store's URL, when it is not REDIS_URL: settings.STORE_URL.
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
"""The URL schemes of a Redis Cluster store (plain and TLS)."""
DEFAULT_CLUSTER_PORT = 6379


def store_url(env: Mapping[str, str] | None = None) -> str:
    """The store's URL: ``CRITIQUE_STORE_URL``, else ``REDIS_URL``, else the local default."""
    env = os.environ if env is None else env
    return (
        (settings.raw(settings.STORE_URL, env) or "").strip()
        or (env.get("REDIS_URL") or "").strip()
        or DEFAULT_REDIS_URL
    )


def store_setting(env: Mapping[str, str] | None = None) -> str:
    """The setting the store's URL comes from (for messages): ``CRITIQUE_STORE_URL`` when it is
    set, else ``REDIS_URL``."""
    env = os.environ if env is None else env
    return (
        settings.STORE_URL.name
        if (settings.raw(settings.STORE_URL, env) or "").strip()
        else "REDIS_URL"
    )


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

    def auth(self) -> dict[str, Any]:
        """The credentials the URL sets, as a client's ``username``/``password`` options."""
        return _auth(self.username, self.password)

    def redacted(self) -> str:
        """The URL without its credentials (for messages)."""
        scheme = CLUSTER_SCHEMES[1] if self.ssl else CLUSTER_SCHEMES[0]
        return f"{scheme}://" + ",".join(f"{host_part(h)}:{p}" for h, p in self.nodes)


def parse_cluster_url(url: str, *, setting: str = settings.STORE_URL.name) -> ClusterURL:
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


Checker = Callable[[SplitResult], "str | None"]

SCHEMES: dict[str, Checker | None] = {
    "redis": _server,
    "rediss": _server,
    "unix": _unix,
    "sentinel": None,  # checked whole by _sentinel: ';'-separated parts
    "redis+cluster": None,  # checked whole by _cluster: ','-separated nodes
    "rediss+cluster": None,
    "amqp": _amqp,
    "amqps": _amqp,
    "pyamqp": _amqp,
}
"""How each scheme is checked: a function of the split URL returning what is wrong (or None)."""

REDIS_SCHEMES = ("redis", "rediss", "unix", "sentinel")
BROKER_SCHEMES = (*REDIS_SCHEMES, "amqp", "amqps", "pyamqp")
STORE_SCHEMES = (*REDIS_SCHEMES, *CLUSTER_SCHEMES)
"""A store may be a Redis Cluster; REDIS_URL too, when the broker and the backend are set apart
(:func:`_store_only`)."""


@dataclass(frozen=True)
class URLSetting:
    """An environment variable holding a URL: the schemes it accepts and a right example."""

    env: str
    schemes: tuple[str, ...]
    example: str


URL_SETTINGS: tuple[URLSetting, ...] = (
    URLSetting("REDIS_URL", STORE_SCHEMES, DEFAULT_REDIS_URL),
    URLSetting("CELERY_BROKER_URL", BROKER_SCHEMES, DEFAULT_REDIS_URL),
    URLSetting("CELERY_RESULT_BACKEND", REDIS_SCHEMES, DEFAULT_REDIS_URL),
    URLSetting(settings.STORE_URL.name, STORE_SCHEMES, DEFAULT_REDIS_URL),
)
"""Every URL setting a command reads, in the order they are checked."""

SETTINGS: dict[str, URLSetting] = {s.env: s for s in URL_SETTINGS}


def _accepted(schemes: tuple[str, ...]) -> str:
    return ", ".join(f"{s}://" for s in schemes)


def _example(setting: URLSetting, value: str) -> str:
    """A right URL close to ``value``: ``localhost:6394`` → ``redis://localhost:6394/0``."""
    bare = value.strip()
    if bare and "://" not in bare and re.fullmatch(r"[A-Za-z0-9._\-\[\]:]+(/\d+)?", bare):
        return f"redis://{bare}" + ("" if "/" in bare else "/0")
    return setting.example


def url_problem(setting: URLSetting, value: str, env: Mapping[str, str]) -> str | None:
    """The one-line message for a bad ``value`` of ``setting``, or None when it is right.
    A ``sentinel://`` URL's own errors are raised by its parser (``ConfigError``)."""
    shown = redact_url(value)
    accepted = f"(accepted: {_accepted(setting.schemes)})"
    if not value.strip():
        return (
            f"{setting.env} is set but empty; unset it or set e.g. {setting.env}={setting.example}"
        )
    if "://" not in value:
        return (
            f"{setting.env}={shown!r} has no scheme; set e.g. "
            f"{setting.env}={_example(setting, value)} {accepted}"
        )
    scheme = value.strip().split("://", 1)[0].lower()
    if scheme in CLUSTER_SCHEMES:
        _store_only(setting.env, env)  # the broker and the backend cannot be a cluster
    if scheme not in setting.schemes or scheme not in SCHEMES:
        return (
            f"{setting.env}={shown!r}: scheme {scheme + '://'!r} is not one this setting "
            f"takes {accepted}; e.g. {setting.env}={setting.example}"
        )
    check = SCHEMES[scheme]
    if check is None:
        if scheme in CLUSTER_SCHEMES:
            parse_cluster_url(value, setting=setting.env)
        else:
            _sentinel(value, setting.env, env)
        return None
    problem = check(urlsplit(value.strip()))
    if problem:
        return f"{setting.env}={shown!r} {problem}; e.g. {setting.env}={setting.example}"
    return None


def check_url(env_name: str, value: str, env: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigError`` (one line, ``key`` = the setting) unless ``value`` is a right URL
    for the setting ``env_name`` (one of :data:`URL_SETTINGS`)."""
    setting = SETTINGS[env_name]
    problem = url_problem(setting, value, os.environ if env is None else env)
    if problem:
        raise ConfigError(problem, key=env_name)


def check_urls(env: Mapping[str, str] | None = None) -> None:
    """Check every URL setting present in ``env`` (default ``os.environ``); ``ConfigError`` for
    the first bad one. Unset settings are not checked (their default is right)."""
    env = os.environ if env is None else env
    for setting in URL_SETTINGS:
        value = env.get(setting.env)
        if value is not None:
            check_url(setting.env, value, env)


# --- look-alikes of the URL settings --------------------------------------------------------------

LOOKALIKE_PREFIXES = ("REDIS", "CELERY")
"""Variables with these prefixes are compared with the URL settings: a typo of one (``REDIS_ULR``)
would otherwise leave the default, ``redis://127.0.0.1:6379/0``, in force without a word."""
LOOKALIKE_CUTOFF = 0.75
"""How alike (difflib's ratio) a name must be to a URL setting to be taken for its misspelling:
``REDIS_ULR``, ``REDIS_URI``, ``CELERY_BROKER`` are; ``REDIS_HOST``, ``REDIS_PASSWORD`` or KEDA's
``REDIS_ADDRESS`` (other tools' settings, which may share the environment) are not."""
CELERY_OWN_SETTINGS = frozenset(
    {
        "CELERY_BROKER_READ_URL", "CELERY_BROKER_WRITE_URL", "CELERY_CONFIG_MODULE",
        "CELERY_LOADER", "CELERY_CUSTOM_WORKER_POOL", "CELERY_LOG_FILE", "CELERY_LOG_LEVEL",
        "CELERY_LOG_REDIRECT", "CELERY_LOG_REDIRECT_LEVEL", "CELERY_RDB_HOST", "CELERY_RDB_PORT",
        "CELERY_SKIP_CHECKS", "CELERY_TRACE_APP", "CELERY_BENCH", "CELERY_BENCH_EVERY",
    }
)  # fmt: skip
"""Variables Celery itself reads: never taken for a misspelling."""
_said: set[str] = set()


def unread_lookalikes(env: Mapping[str, str] | None = None) -> list[str]:
    """One warning per variable in ``env`` (default ``os.environ``) that nothing reads but that
    looks like a misspelling of a URL setting: ``REDIS_ULR is set but not read; did you mean
    REDIS_URL?``. A warning, never an error: the variable may be another tool's. ``CRITIQUE_*``
    names are the configuration check's (an unknown one is an error there)."""
    env = os.environ if env is None else env
    settings = [s.env for s in URL_SETTINGS]
    known = {*settings, *CELERY_OWN_SETTINGS}
    out = []
    for name in sorted(env):
        if name in known or not name.upper().startswith(LOOKALIKE_PREFIXES):
            continue

        guess = did_you_mean(name, settings, cutoff=LOOKALIKE_CUTOFF)
        if guess:
            out.append(f"{name} is set but not read; {guess.strip()}")
    return out


def new_lookalike_warnings(env: Mapping[str, str] | None = None) -> list[str]:
    """:func:`unread_lookalikes` less those this process already returned: said once per
    process, whichever of the CLI and the client comes first."""
    fresh = [w for w in unread_lookalikes(env) if w not in _said]
    _said.update(fresh)
    return fresh
