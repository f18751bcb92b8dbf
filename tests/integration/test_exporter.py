"""``critique exporter`` after a known run through a real worker: the scraped text parses with
prometheus_client's parser and its counts are the run's (statuses, stage runs, tokens,
refusals), read from the counters the worker wrote to the store."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import typing
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.models import UNCHECKED_LINE, Status, Submission
from tests.support import wait_until
from tests.support.entry import hand_built, todo_report
from tests.support.rawcelery import entry_body, push, task_meta
from tests.support.submissions import CONFIG, KINDS, make_sub
from tests.support.workers import ROOT, WorkerProcess, WorkerSpec, client_on, worker_db_url
from workers.embedded import free_port


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[dict[str, str]]:
    """This process's client and the worker on the same (flushed) store, unsigned."""
    with client_on(worker_db_url(redis_url), CRITIQUE_SECRET="") as e:
        yield e


WORKER = WorkerSpec("exp", concurrency=2)


@pytest.fixture(scope="module")
def fleet(
    env: dict[str, str], worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, str], str]]:
    """The module's worker and an exporter on its store; yields (env, metrics URL)."""
    logs: Path = tmp_path_factory.mktemp("exporter")
    port = free_port()
    with open(logs / "exporter.log", "wb") as out:
        exporter = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "exporter", "--host", "127.0.0.1",
             "--port", str(port)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_until(lambda: _scrape(url) is not None, 30, what="the exporter to serve")
        yield env, url
    finally:
        exporter.terminate()
        exporter.wait(timeout=10)


def _scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return str(resp.read().decode())
    except OSError:
        return None


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the scraped text, parsed by prometheus_client: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_a_scrape_after_a_known_run_counts_what_the_run_did(
    fleet: tuple[dict[str, str], str],
) -> None:
    """Outputs by status, stage runs, tokens by phase and refusals match the run's results."""
    from workers.client import CritiqueClient

    env, url = fleet
    run_id = f"metrics-{uuid.uuid4().hex[:8]}"
    client = CritiqueClient(CONFIG)
    subs = [make_sub(run_id, f"w{i}", 1, kind) for i, kind in enumerate(KINDS * 2)]
    results = client.wait_many(client.submit_many(subs), timeout=120)
    r = redis.Redis.from_url(env["REDIS_URL"])
    refused_id = str(uuid.uuid4())
    bad = entry_body(hand_built(f"refused-{run_id}"), refused_id, {"command": "rm -rf /"})
    push(r, "critique.submit", refused_id, bad)
    assert task_meta(r, refused_id)["status"] == "FAILURE"

    statuses = Counter(res.status for res in results)
    rounds = sum(len(res.attempts) for res in results)

    def settled() -> dict[Any, float] | None:
        text = _scrape(url)
        got = _samples(text) if text else {}
        total = sum(v for (name, _), v in got.items() if name == "critique_outputs_total")
        refused = got.get(("critique_refused_total", (("reason", "override"),)), 0)
        return got if total == len(results) and refused == 1 else None

    got = wait_until(settled, 30, what="the exporter to count the run")
    for status in typing.get_args(Status):
        key = ("critique_outputs_total", (("status", status),))
        assert got[key] == statuses.get(status, 0), status
    assert rounds > 0 and statuses["repaired"] > 0  # the run exercised a repair round
    moved = {k[1][0][1] for k in got if k[0] == "critique_deadlettered_total"}
    assert moved == {"encoding", "json", "depth", "envelope", "headers", "task", "body", "eta",
                     "raised"}  # fmt: skip
    count = {
        stage: got[("critique_stage_duration_seconds_count", (("stage", stage),))]
        for stage in ("l0", "critic", "decide", "repair", "gate")
    }
    assert count == {
        "l0": len(results) + rounds,
        "critic": len(results) + rounds,
        "decide": len(results) + rounds,
        "repair": rounds,
        "gate": len(results),
    }
    inf = got[("critique_stage_duration_seconds_bucket", (("le", "+Inf"), ("stage", "l0")))]
    assert inf == count["l0"]
    critique_tokens = sum(res.usage.tokens - res.repair_usage.tokens for res in results)
    repair_tokens = sum(res.repair_usage.tokens for res in results)
    assert got[("critique_llm_tokens_total", (("phase", "critique"),))] == critique_tokens
    assert got[("critique_llm_tokens_total", (("phase", "repair"),))] == repair_tokens
    assert got[("critique_budget_charged_tokens_total", ())] == sum(
        res.budget_charged for res in results
    )
    assert got[("critique_redrives_total", ())] == 0
    assert ("critique_cache_hits_total", ()) in got
    assert ("critique_budget_cap_tokens", ()) in got
    labels = {dict(k[1]).get("status") for k in got if k[0] == "critique_outputs_total"}
    assert labels == set(typing.get_args(Status))  # unchecked and cancelled too, at 0


def test_the_dashboard_queries_only_metrics_the_exporter_serves(
    fleet: tuple[dict[str, str], str],
) -> None:
    """Every critique_* name in deploy/grafana-dashboard.json is in a scrape."""
    _, url = fleet
    served = {name for name, _ in _samples(_scrape(url) or "")}
    dashboard = (ROOT / "deploy" / "grafana-dashboard.json").read_text()
    used = set(re.findall(r"critique_[a-z_]+", dashboard)) - {"critique_pipeline"}
    assert used and used <= served, used - served


def test_an_explicitly_disabled_submission_reads_unchecked_everywhere(
    fleet: tuple[dict[str, str], str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``enabled: false`` ends ``unchecked`` with no score in the client's result, the entry
    task's result JSON, ``critique status RUN`` (text and --json) and the exporter's
    ``status="unchecked"`` count; never ``accepted``, never 1.00."""
    from workers.cli import main
    from workers.client import CritiqueClient

    env, url = fleet
    unchecked = ("critique_outputs_total", (("status", "unchecked"),))
    before = _samples(_scrape(url) or "").get(unchecked, 0)
    run_id = f"off-{uuid.uuid4().hex[:8]}"
    off = {"enabled": False}
    client = CritiqueClient(off)
    result = client.wait(client.submit(Submission.model_validate(todo_report(run_id))), 60)
    assert (result.status, result.stop_reason) == ("unchecked", "disabled")
    assert (result.original_score, result.best_score, result.checked) == (None, None, False)

    r = redis.Redis.from_url(env["REDIS_URL"])
    task_id = str(uuid.uuid4())
    push(r, "critique.submit", task_id, entry_body(todo_report(run_id, "w2"), task_id, off))
    meta = task_meta(r, task_id)
    assert meta["status"] == "SUCCESS", meta
    summary = meta["result"]
    assert (summary["status"], summary["stop_reason"]) == ("unchecked", "disabled")
    assert (summary["best_score"], summary["checked"]) == (None, False)

    capsys.readouterr()
    assert main(["status", run_id, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["counts"] == {"unchecked": 2} and doc["mean_best_score"] is None
    for row in doc["submissions"]:
        assert (row["status"], row["best_score"], row["checked"]) == ("unchecked", None, False)
        assert row["note"] == UNCHECKED_LINE
    assert main(["status", run_id]) == 0
    text = capsys.readouterr().out
    assert text.count(UNCHECKED_LINE) == 2 and "no score" in text
    assert "accepted" not in text and "1.00" not in text

    def counted() -> bool:
        return _samples(_scrape(url) or "").get(unchecked) == before + 2

    wait_until(counted, 30, what="the exporter to count the unchecked outputs")


class _LostInTheBroker:
    """A chain whose message the broker lost: registered by the client, never delivered."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id

    def freeze(self) -> _LostInTheBroker:
        return self  # its id is the one the client records before the send

    def apply_async(self) -> _LostInTheBroker:
        return self


def test_a_redrive_is_counted_once(fleet: tuple[dict[str, str], str]) -> None:
    """A pass whose first message was lost, resumed from the store: one re-drive counted, and
    its verdict counted as an output."""
    from pipeline.loop.stages import start
    from pipeline.store import keys
    from workers import runtime
    from workers.client import CritiqueClient

    _, url = fleet
    before = _samples(_scrape(url) or "")
    client = CritiqueClient(CONFIG)
    sub = make_sub(f"lost-{uuid.uuid4().hex[:8]}", "w1", 1, "clean")
    task_id = uuid.uuid4().hex
    msg = runtime.encode(
        start(sub, runtime.new_pass_id()), CONFIG, task=keys.TASK_L0, task_id=task_id
    )
    handle = client._enqueue(sub, msg, _LostInTheBroker(task_id))
    assert client.resume(handle) == "l0"
    assert client.wait(handle, timeout=60).status == "accepted"
    accepted = ("critique_outputs_total", (("status", "accepted"),))

    def counted() -> dict[Any, float] | None:
        got = _samples(_scrape(url) or "")
        return got if got.get(accepted) == before[accepted] + 1 else None

    got = wait_until(counted, 30, what="the exporter to count the re-driven pass")
    assert got[("critique_redrives_total", ())] == before[("critique_redrives_total", ())] + 1


def _threads(pid: int) -> int:
    """The process's thread count, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no thread count for {pid}")


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the exporter closed ``sock`` (a read returns end-of-file, or a reset)."""
    sock.settimeout(0.2)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_half_open_connections_hold_no_more_threads_than_the_cap_and_a_scrape_answers(
    fleet: tuple[dict[str, str], str],
) -> None:
    """An exporter with --max-connections 8 --timeout 2 (and its default host, loopback) under
    200 connections that never finish their request: its thread count stays within the cap
    (plus its idle threads and one ending; an evicted connection's thread ends before a new one
    starts, on a loaded machine too), a real scrape answers while they are open, and
    the exporter closes every one of them (the older ones for newer connections, the rest at
    the timeout)."""
    env, _ = fleet
    port = free_port()
    cap = 8
    argv = [sys.executable, "-m", "workers.cli", "exporter", "--port", str(port),
            "--max-connections", str(cap), "--timeout", "2"]  # fmt: skip
    exporter = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    held: list[socket.socket] = []
    try:
        wait_until(lambda: _scrape(url) is not None, 30, what="the exporter on loopback")
        idle = _threads(exporter.pid)
        most = idle
        for i in range(200):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line: never ends
            held.append(sock)
            if i % 10 == 0:
                most = max(most, _threads(exporter.pid))
        text = wait_until(lambda: _scrape(url), 30, what="a scrape past 200 half-open requests")
        assert "critique_outputs_total" in text
        most = max(most, _threads(exporter.pid))
        assert most <= idle + cap + 1, (idle, most)  # one thread may be ending as it is counted
        open_ones = list(held)

        def all_closed() -> bool:
            open_ones[:] = [s for s in open_ones if not _closed_by_peer(s)]
            return not open_ones

        wait_until(all_closed, 30, what="the exporter to close every half-open connection")
        assert exporter.poll() is None, "the exporter died"
    finally:
        for sock in held:
            sock.close()
        exporter.terminate()
        exporter.wait(timeout=10)
