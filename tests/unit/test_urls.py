"""Every URL setting is checked in one place (pipeline.store.urls) before any command starts
anything: a bad one is one line naming the variable, the value's problem and a right example,
exit 2 — `critique worker` before it spawns a node, and the client at construction."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.store.urls import SCHEMES, URL_SETTINGS, check_url, check_urls, redact_url
from workers.cli import main

URL_ENVS = [s.env for s in URL_SETTINGS]

BAD = [
    ("REDIS_URL", "localhost:6394", "has no scheme", "REDIS_URL=redis://localhost:6394/0"),
    ("REDIS_URL", "", "set but empty", "REDIS_URL=redis://"),
    ("REDIS_URL", "http://h:6379/0", "scheme 'http://' is not one", "REDIS_URL=redis://"),
    ("REDIS_URL", "redis://h:port/0", "port that is not a number", "REDIS_URL=redis://"),
    ("REDIS_URL", "redis://h:6379/abc", "database number", "REDIS_URL=redis://"),
    ("REDIS_URL", "unix://", "names no socket path", "unix:///path"),
    ("REDIS_URL", "amqp://h//", "scheme 'amqp://' is not one", "REDIS_URL=redis://"),
    ("CELERY_BROKER_URL", "h:5672", "has no scheme", "CELERY_BROKER_URL=redis://h:5672/0"),
    ("CELERY_BROKER_URL", "amqp://h:x//", "port that is not a number", "CELERY_BROKER_URL="),
    ("CELERY_RESULT_BACKEND", "rpc://", "scheme 'rpc://' is not one", "CELERY_RESULT_BACKEND="),
    ("CRITIQUE_STORE_URL", "127.0.0.1", "has no scheme", "CRITIQUE_STORE_URL=redis://127.0.0.1/0"),
    ("REDIS_URL", "sentinel://h1:1/0;redis://h2:2/0", "starts with sentinel://", "sentinel://"),
    ("REDIS_URL", "sentinel://h1:1/0", "CRITIQUE_REDIS_MASTER is not set", "sentinel monitor"),
]


@pytest.mark.parametrize(("env", "value", "problem", "example"), BAD)
def test_a_bad_url_is_one_line_naming_the_setting_problem_and_example(
    env: str, value: str, problem: str, example: str
) -> None:
    with pytest.raises(ConfigError) as err:
        check_urls({env: value})
    msg = str(err.value)
    assert msg.startswith(env) and problem in msg and example in msg, msg
    assert "\n" not in msg and err.value.key in (env, "CRITIQUE_REDIS_MASTER")


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("REDIS_URL", "redis://127.0.0.1:6379/0"),
        ("REDIS_URL", "redis://"),  # redis-py's localhost:6379/0
        ("REDIS_URL", "rediss://:pw@host:6380/2"),
        ("REDIS_URL", "unix:///run/redis.sock?db=1"),
        ("CELERY_BROKER_URL", "amqp://user:pass@host:5672//"),
        ("CELERY_BROKER_URL", "amqps://host//"),
        ("CELERY_BROKER_URL", "pyamqp://host"),
        ("CELERY_BROKER_URL", "sentinel://h1:26379;sentinel://h2:26379/0"),
        ("CELERY_RESULT_BACKEND", "rediss://h:6379/1"),
    ],
)
def test_right_urls_pass(env: str, value: str) -> None:
    check_urls({env: value, "CRITIQUE_REDIS_MASTER": "mymaster"})


def test_the_broker_alone_takes_amqp_and_every_scheme_has_a_checker_entry() -> None:
    """A scheme a setting accepts is one the table knows how to check (one line to add)."""
    for setting in URL_SETTINGS:
        assert set(setting.schemes) <= set(SCHEMES), setting.env
    check_url("CELERY_BROKER_URL", "amqp://h//", {})
    with pytest.raises(ConfigError):
        check_url("CELERY_RESULT_BACKEND", "amqp://h//", {})


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("REDIS_URL", "redis://app:s3cret@h:1/db"),
        ("REDIS_URL", "app:s3cret@h:6379/0"),  # no scheme (issue 33)
        ("CELERY_BROKER_URL", ":s3cret@h:6379"),
        ("REDIS_URL", "http://app:s3cret@h:6379/0"),  # a scheme the setting does not take
        ("REDIS_URL", "redis://app:s3c/ret@h:1/db"),  # a '/' in the password
        ("REDIS_URL", "redis://app:s3c@ret@h:x/0"),  # an unescaped '@' in the password
        ("CELERY_BROKER_URL", "amqp://app:s3cret@h:x//"),
    ],
)
def test_a_password_in_a_bad_url_is_never_echoed(env: str, value: str) -> None:
    """Whatever is wrong with the URL, the message shows its password as ***."""
    with pytest.raises(ConfigError) as err:
        check_urls({env: value})
    assert "s3c" not in str(err.value) and "***" in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("user:secret@host:6379/0", "user:***@host:6379/0"),
        ("redis://:secret@h/0", "redis://:***@h/0"),
        ("redis://u:se@cr/et@h:1/0", "redis://u:***@h:1/0"),
        (
            "sentinel://:a1@h1:1/0;sentinel://:b2@h2:2",
            "sentinel://:***@h1:1/0;sentinel://:***@h2:2",
        ),
        ("redis+cluster://u:secret@a:1,b:2", "redis+cluster://u:***@a:1,b:2"),
        ("redis://critique-manager@h:6379/0", "redis://critique-manager@h:6379/0"),
        ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),
    ],
)
def test_redact_url_hides_every_password_and_keeps_the_rest(url: str, shown: str) -> None:
    """Every user:password@ part loses its password, scheme or not; a URL without one is
    unchanged (the user name stays: it says which ACL user failed)."""
    assert redact_url(url) == shown


def test_an_unreachable_redis_message_hides_the_password() -> None:
    """`cannot reach Redis at …` (critique submit, the demo's external workers) names the
    server, never its password."""
    from workers.commands._common import unreachable_redis

    err = unreachable_redis("redis://app:s3cret@h:1/0", ConnectionError("refused"), "the broker")
    assert "s3cret" not in str(err) and "redis://app:***@h:1/0" in str(err)


@pytest.fixture
def clean_urls(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for env in URL_ENVS:
        monkeypatch.delenv(env, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "argv",
    [
        ["submit", "-"],
        ["status", "r1"],
        ["watch", "r1"],
        ["report", "r1"],
        ["resume", "r1"],
        ["archive", "r1"],
        ["worker", "--dry-run"],
        ["demo"],
    ],
)
@pytest.mark.parametrize(
    ("env", "value"), [("REDIS_URL", "localhost:6394"), ("CELERY_BROKER_URL", "ftp://x")]
)
def test_every_command_refuses_a_bad_url_before_it_starts(
    clean_urls: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: str,
    value: str,
) -> None:
    """Exit 2 with one line on stderr and nothing on stdout, whatever the command."""
    clean_urls.setenv(env, value)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"critique {argv[0]}: {env}=") and err.count("\n") == 1, err


def test_offline_commands_do_not_read_the_urls(
    clean_urls: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`critique l0` lints files: a bad REDIS_URL is not its business."""
    clean_urls.setenv("REDIS_URL", "localhost:6394")
    path = tmp_path / "ok.md"
    path.write_text("# Title\n\nSome real text.\n", encoding="utf-8")
    assert main(["l0", str(path)]) == 0


def test_the_client_refuses_a_bad_url_at_construction(clean_urls: pytest.MonkeyPatch) -> None:
    from workers.client import CritiqueClient

    clean_urls.setenv("REDIS_URL", "localhost:6394")
    with pytest.raises(ConfigError, match=r"^REDIS_URL='localhost:6394' has no scheme"):
        CritiqueClient()


def test_a_store_client_for_a_bad_url_is_a_config_error_not_a_traceback() -> None:
    from pipeline.store.redis_common import client_from_url

    with pytest.raises(ConfigError, match="REDIS_URL='localhost:6394' has no scheme"):
        client_from_url("localhost:6394", env={})
