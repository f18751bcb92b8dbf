"""``critique demo`` and ``critique ab`` with ``CRITIQUE_STORE_URL`` set but ``REDIS_URL`` not:
one line naming what to set, exit 2, and no embedded Redis started (in-process, before anything
is reached)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.ab_models import write_inputs
from workers.cli import main

MESSAGE = (
    "CRITIQUE_STORE_URL is set but REDIS_URL is not: set REDIS_URL (and CELERY_BROKER_URL if it "
    "differs) to the broker your workers consume, or unset CRITIQUE_STORE_URL to run on an "
    "embedded Redis"
)


@pytest.mark.parametrize("command", ["demo", "ab"])
def test_a_store_url_without_a_broker_url_is_a_usage_error(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pins the choice: a store URL alone is neither an embedded run (its records would land on
    that store, next to a private broker no deployed worker consumes) nor a deployed one (no
    broker named): exit 2 with exactly one line on stderr, and nothing started (no "embedded
    Redis on …" line). Nothing listens on the store URL: it is never contacted."""
    for name in ("REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CRITIQUE_STORE_URL", "redis+cluster://127.0.0.1:1,127.0.0.1:2")
    if command == "demo":
        argv = ["demo", "--out", str(tmp_path / "ws")]
    else:
        inputs = write_inputs(tmp_path / "inputs.jsonl")
        argv = ["ab", str(inputs), "--out", str(tmp_path / "out"), "--model", "m"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2
    assert err.splitlines() == [f"critique {command}: {MESSAGE}"]
    assert "embedded Redis on" not in out + err  # its progress line when one starts
