"""A variable that looks like a misspelt URL setting (``REDIS_ULR``) is named in one warning line,
once per process, by every command that reaches Redis and by ``CritiqueClient()`` (issue 34):
without it the default, ``redis://127.0.0.1:6379/0``, would be used without a word. Other
tools' variables (``REDIS_HOST``, KEDA's ``REDIS_ADDRESS``) and Celery's own are left alone."""

from __future__ import annotations

import logging

import pytest

from pipeline.store import urls
from workers.cli import main
from workers.exit_codes import EXIT_UNAVAILABLE

DEAD = "redis://127.0.0.1:1/0"  # nothing listens on port 1


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Nothing said yet in this process."""
    monkeypatch.setattr(urls, "_said", set())
    return monkeypatch


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("REDIS_ULR", "REDIS_URL"),
        ("REDIS_URI", "REDIS_URL"),
        ("redis_url", "REDIS_URL"),
        ("CELERY_BROKER", "CELERY_BROKER_URL"),
        ("CELERY_RESULTS_BACKEND", "CELERY_RESULT_BACKEND"),
    ],
)
def test_a_lookalike_of_a_url_setting_is_named_with_the_setting_meant(
    name: str, meant: str
) -> None:
    """One line naming the variable that is not read and the setting it looks like."""
    assert urls.unread_lookalikes({name: "redis://h:6380/0"}) == [
        f"{name} is set but not read; did you mean {meant}?"
    ]


@pytest.mark.parametrize(
    "name",
    [
        "REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "REDIS_HOST", "REDIS_PORT",
        "REDIS_PASSWORD", "REDIS_ADDRESS", "CELERY_POOL", "CELERY_BROKER_READ_URL",
        "CELERY_CONFIG_MODULE", "CRITIQUE_STORE_ULR", "MY_REDIS_ULR",
    ],
)  # fmt: skip
def test_read_settings_and_other_tools_variables_are_not_warned_about(name: str) -> None:
    """Settings that are read (ours, Celery's own), other tools' REDIS_* names, CRITIQUE_*
    names (the configuration check's) and names with another prefix give no warning."""
    assert urls.unread_lookalikes({name: "x"}) == []


def test_a_command_warns_once_on_stderr_and_goes_on(
    fresh: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`critique status` with REDIS_ULR set: one `critique status: warning: …` line, then the
    command runs as before (here against an unreachable REDIS_URL: exit 3, after riding out
    the outage for CRITIQUE_OUTAGE_S, 1 s here rather than the default 120)."""
    for setting in urls.URL_SETTINGS:
        fresh.delenv(setting.env, raising=False)
    fresh.setenv("REDIS_URL", DEAD)
    fresh.setenv("CRITIQUE_OUTAGE_S", "1")
    fresh.setenv("REDIS_ULR", "redis://127.0.0.1:6390/0")
    from workers import runtime

    runtime.forget_store()  # an earlier test's store client would answer instead of DEAD's
    try:
        assert main(["status", "some-run"]) == EXIT_UNAVAILABLE
    finally:
        runtime.forget_store()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (
        "critique status: warning: REDIS_ULR is set but not read; did you mean REDIS_URL?"
    )
    assert not any("REDIS_ULR" in line for line in lines[1:])


def test_the_client_logs_the_warning_once_per_process(
    fresh: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """CritiqueClient() logs the same line as a warning; a second client says nothing more."""
    from workers.client import CritiqueClient

    fresh.setenv("CELERY_BROKER", "redis://127.0.0.1:6390/0")
    with caplog.at_level(logging.WARNING, logger="workers.client"):
        CritiqueClient()
        CritiqueClient()
    said = [r.getMessage() for r in caplog.records if "CELERY_BROKER" in r.getMessage()]
    assert said == ["CELERY_BROKER is set but not read; did you mean CELERY_BROKER_URL?"]
