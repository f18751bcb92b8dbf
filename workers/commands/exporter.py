"""``critique exporter [--port 9808] [--host 127.0.0.1]``: Prometheus metrics of the whole fleet.

Serves ``/metrics`` (Prometheus text format) from the counters every worker adds to the store
(:mod:`pipeline.store.metrics`), read on each scrape: one exporter per fleet, however many
workers. What each metric means: docs/operations.md#fleet-metrics-critique-exporter. Redis is
``$REDIS_URL``; a scrape while Redis is unreachable answers 500 (Prometheus marks it down).

It listens on loopback unless ``--host`` says otherwise (the metrics are unauthenticated: keep
them off the network, as Flower's). Each connection gets ``--timeout`` seconds per read or write,
and at most ``--max-connections`` are open at once: past that, a new connection closes the
oldest one still sending its request (a half-open connection holds a slot only until a real
scrape needs it), or is closed itself when every slot is answering (:class:`BoundedServer`).
Half-open connections cost a file descriptor each, never a thread beyond the cap.

Exit codes (the table of ``critique --help``): runs until interrupted (130); 2 bad usage or
the port cannot be bound; 3 Redis unreachable at start.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from workers.commands._common import CommandError, above, at_least, between, service_guard
from workers.exit_codes import EXIT_OK

HELP = "serve the fleet's product metrics (verdicts, tokens, budget, latency) for Prometheus"
DEFAULT_PORT = 9808
DEFAULT_HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 10.0
"""Seconds a connection may wait on one read or write before it is closed."""
DEFAULT_MAX_CONNECTIONS = 32
"""Connections served at once (one thread each); Prometheus needs one per scrape."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port",
        type=between(1, 65535),
        default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to bind (default {DEFAULT_HOST}: this host only, since the metrics have "
        "no password; --host 0.0.0.0 opens every interface on purpose, e.g. in a container "
        "whose network is private)",
    )
    parser.add_argument(
        "--timeout",
        type=above(0),
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"per-connection read/write timeout (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=at_least(1),
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"connections served at once (default {DEFAULT_MAX_CONNECTIONS})",
    )


class _Handler(WSGIRequestHandler):
    """One request per connection, with ``timeout`` (set per server, :func:`serve`) on every
    read and write; once its request line and headers are in, the connection is no longer the
    first to be closed."""

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.answering(self.request)  # type: ignore[attr-defined]
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: one line per scrape would drown the log."""


class BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``max_connections`` of them alive at once.

    A new connection beyond the cap shuts down the oldest connection that has not finished
    sending its request (the one most likely half-open) and waits for its thread to end (at
    once: its blocked read returns) before starting its own; when every open connection is
    being answered, the new one is closed unanswered. Connections waiting in the listen
    backlog cost no thread."""

    daemon_threads = True
    request_queue_size = 128
    END_WAIT_S = 1.0
    """How long a new connection waits for an evicted connection's thread to end."""

    def __init__(
        self, address: tuple[str, int], handler: type[_Handler], *, max_connections: int
    ) -> None:
        self.max_connections = max_connections
        self._ended = threading.Condition()
        self._open: set[Any] = set()
        """Connections whose thread is alive (evicted ones until their thread ends)."""
        self._waiting: dict[Any, None] = {}
        """Open connections still sending their request, oldest first."""
        self._evicted: set[Any] = set()
        """Connections shut down for newer ones whose thread has not ended yet."""
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._ended:
            admitted = self._room()
            if admitted:
                self._open.add(request)
                self._waiting[request] = None
        if not admitted:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def _room(self) -> bool:
        """Whether a thread may start: below the cap, or brought below it by evicting the
        oldest half-open connection and waiting for its thread to end (under the lock)."""
        deadline = time.monotonic() + self.END_WAIT_S
        while len(self._open) >= self.max_connections:
            if not self._evicted and not self._evict_oldest():
                return False  # every open connection is being answered
            left = deadline - time.monotonic()
            if left <= 0 or not self._ended.wait(left):
                return False
        return True

    def _evict_oldest(self) -> bool:
        """Shut down the oldest connection still sending its request (under the lock)."""
        for oldest in self._waiting:
            del self._waiting[oldest]
            self._evicted.add(oldest)
            with contextlib.suppress(OSError):  # already gone
                oldest.shutdown(socket.SHUT_RDWR)  # its blocked read returns: the thread ends
            return True
        return False

    def answering(self, request: Any) -> None:
        """``request`` sent its whole request: it is answered, not evicted."""
        with self._ended:
            self._waiting.pop(request, None)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._ended:
                self._waiting.pop(request, None)
                self._evicted.discard(request)
                self._open.discard(request)
                self._ended.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out, hung up or was closed for a newer one is no error; anything
        else is one line on stderr, never a traceback per connection."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            print(f"critique exporter: request failed: {exc!r}", file=sys.stderr, flush=True)


def serve(
    host: str, port: int, app: Any, *, max_connections: int, timeout_s: float
) -> BoundedServer:
    """A bound :class:`BoundedServer` for ``app`` (IPv6 when ``host`` is an IPv6 address)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("Server", (BoundedServer,), {"address_family": family})
    handler = type("Handler", (_Handler,), {"timeout": timeout_s})
    server: BoundedServer = server_class((host, port), handler, max_connections=max_connections)
    server.set_app(app)
    return server


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

        # lazy: pipeline.store.metrics loads redis; `critique --help` imports this module
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
            "critique_budget_active_runs",
            "Runs with a pass in flight now (pending, or holding a repair-budget lease).",
            value=runs,
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
        # lazy: pipeline.security.message_checks is not loaded by `critique --help`, which imports
        # this module and stays fast
        from pipeline.security.message_checks import REASONS

        moved = CounterMetricFamily(
            "critique_deadlettered",
            "Broker messages moved aside unrun by a worker's door, by reason (docs/security.md, "
            "'The broker door').",
            labels=["reason"],
        )
        for reason in REASONS:
            moved.add_metric([reason], counts.get(f"deadletter:{reason}", 0))
        yield moved
        yield from _genai(counts)


def _genai(counts: dict[str, int]) -> Iterator[Any]:
    """OpenTelemetry's GenAI client metrics in Prometheus naming (``gen_ai.client.token.usage``
    → ``gen_ai_client_token_usage``, ``gen_ai.client.operation.duration`` in seconds), from the
    fleet counters every worker's model calls add (:func:`workers.telemetry.metric_fields`)."""
    from prometheus_client.core import HistogramMetricFamily

    # lazy: workers.telemetry loads celery; `critique --help` imports this module
    from workers.telemetry import metric_histograms

    tokens, durations = metric_histograms(counts)
    families = (
        (
            "gen_ai_client_token_usage",
            "Tokens per model call as the provider reported them, by token type (GenAI "
            "gen_ai.client.token.usage, unit {token}).",
            "gen_ai_token_type",
            tokens,
        ),
        (
            "gen_ai_client_operation_duration_seconds",
            "Duration of a model call, retries and rate-limit waits included (GenAI "
            "gen_ai.client.operation.duration); error_type empty on success.",
            "error_type",
            durations,
        ),
    )
    for name, text, last_label, rows in families:
        family = HistogramMetricFamily(
            name, text, labels=["gen_ai_operation_name", "gen_ai_provider_name", last_label]
        )
        for (provider, value), (buckets, total) in rows.items():
            family.add_metric(["chat", provider, value], buckets, sum_value=total)
        yield family


def registry() -> Any:
    """A registry with only the fleet's metrics (no exporter-process metrics)."""
    from prometheus_client import CollectorRegistry

    # lazy: workers.runtime loads celery; `critique --help` imports this module
    from workers import runtime

    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(runtime.metrics()))
    return reg


def run(args: argparse.Namespace) -> int:
    def body() -> int:
        from prometheus_client import make_wsgi_app

        # lazy: workers.runtime loads celery; `critique --help` imports this module
        from workers import runtime

        runtime.client().ping()  # exit 3 now rather than a 500 on every scrape
        app = make_wsgi_app(registry())
        try:
            server = serve(
                args.host,
                args.port,
                app,
                max_connections=args.max_connections,
                timeout_s=args.timeout,
            )
        except OSError as exc:
            raise CommandError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
        print(f"critique exporter: serving http://{args.host}:{args.port}/metrics", flush=True)
        try:
            server.serve_forever()
        finally:
            server.server_close()
        return EXIT_OK

    return service_guard("exporter", body)
