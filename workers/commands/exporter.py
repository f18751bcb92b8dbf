"""``critique exporter [--port 9808] [--host 0.0.0.0]``: Prometheus metrics of the whole fleet.

Serves ``/metrics`` (Prometheus text format) from the counters every worker adds to the store
(:mod:`pipeline.store.metrics`), read on each scrape: one exporter per fleet, however many
workers. What each metric means: docs/operations.md#fleet-metrics-critique-exporter. Redis is
``$REDIS_URL``; a scrape while Redis is unreachable answers 500 (Prometheus marks it down).

Exit codes (the table of ``critique --help``): runs until interrupted (130); 2 bad usage or
the port cannot be bound; 3 Redis unreachable at start.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from typing import Any

from workers.cli import EXIT_OK
from workers.commands._common import CommandError, between, service_guard

HELP = "serve the fleet's product metrics (verdicts, tokens, budget, latency) for Prometheus"
DEFAULT_PORT = 9808


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port",
        type=between(1, 65535),
        default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT})",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")


class FleetCollector:
    """Reads the fleet's metrics from the store on every scrape."""

    def __init__(self, fleet: Any) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        from pipeline.store import metrics as m

        counts, durations = self._fleet.read()
        outputs = CounterMetricFamily(
            "critique_outputs", "Outputs whose pass ended, by result status.", labels=["status"]
        )
        for status in m.STATUSES:
            outputs.add_metric([status], counts.get(f"outputs:{status}", 0))
        yield outputs
        stages = HistogramMetricFamily(
            "critique_stage_duration_seconds",
            "Time one stage took on a worker (replayed stages not counted).",
            labels=["stage"],
        )
        for stage in m.STAGES:
            buckets, total = self._fleet.histogram(durations, stage)
            stages.add_metric([stage], buckets, sum_value=total)
        yield stages
        tokens = CounterMetricFamily(
            "critique_llm_tokens",
            "LLM tokens (in + out) of finished passes, by phase.",
            labels=["phase"],
        )
        for phase in m.PHASES:
            tokens.add_metric([phase], counts.get(f"tokens:{phase}", 0))
        yield tokens
        yield CounterMetricFamily(
            "critique_budget_charged_tokens",
            "Repair tokens charged to run budgets by finished passes.",
            value=counts.get("budget_charged", 0),
        )
        runs, spent, cap = self._fleet.active_budgets()
        yield GaugeMetricFamily(
            "critique_budget_spent_tokens",
            "Repair tokens spent, summed over the runs with passes in flight.",
            value=spent,
        )
        yield GaugeMetricFamily(
            "critique_budget_cap_tokens",
            "Repair-budget caps, summed over the runs with passes in flight (0 for a run that "
            "reserved nothing yet).",
            value=cap,
        )
        yield GaugeMetricFamily(
            "critique_budget_active_runs", "Runs with passes in flight.", value=runs
        )
        yield CounterMetricFamily(
            "critique_cache_hits", "Critiques answered from the critique cache.",
            value=counts.get("cache_hits", 0),
        )  # fmt: skip
        yield CounterMetricFamily(
            "critique_redrives", "Stalled or lost passes re-driven from the store.",
            value=counts.get("redrives", 0),
        )  # fmt: skip
        refused = CounterMetricFamily(
            "critique_refused",
            "Messages refused by a worker, by reason (forged, override, malformed, config).",
            labels=["reason"],
        )
        for reason in m.REFUSALS:
            refused.add_metric([reason], counts.get(f"refused:{reason}", 0))
        yield refused


def registry() -> Any:
    """A registry with only the fleet's metrics (no exporter-process metrics)."""
    from prometheus_client import CollectorRegistry

    from workers import runtime

    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(runtime.metrics()))
    return reg


def run(args: argparse.Namespace) -> int:
    def body() -> int:
        from prometheus_client import start_http_server

        from workers import runtime

        runtime.client().ping()  # exit 3 now rather than a 500 on every scrape
        reg = registry()
        try:
            start_http_server(args.port, addr=args.host, registry=reg)
        except OSError as exc:
            raise CommandError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
        print(f"critique exporter: serving http://{args.host}:{args.port}/metrics", flush=True)
        threading.Event().wait()
        return EXIT_OK

    return service_guard("exporter", body)
