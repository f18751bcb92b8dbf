"""A real OTLP/HTTP trace receiver on loopback (what a collector's ``otlp`` receiver does on
port 4318), decoding each ``ExportTraceServiceRequest`` with ``opentelemetry-proto``, and the
client process the tracing tests submit through.

    with OTLPReceiver() as receiver:            # receiver.endpoint: OTEL_EXPORTER_OTLP_ENDPOINT
        ...
        spans = receiver.wait_for(lambda spans: ...)

``python -m tests.support.otlp submit`` is the client: it reads ``{"config", "submissions"}``
as JSON on stdin, submits them with ``CritiqueClient`` (tracing as its environment says),
waits, and prints ``{"results": [...], "tracing": telemetry.status()}`` as one JSON line.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support import wait_until

KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclasses.dataclass(frozen=True)
class Span:
    """One exported span, decoded: ids in lower-case hex (``parent_id`` "" for a root)."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str
    service: str
    attributes: dict[str, Any]
    events: tuple[tuple[str, dict[str, Any]], ...]
    status: int
    """``Status.code``: 0 unset, 1 ok, 2 error."""

    def values(self) -> list[Any]:
        """Every attribute value of the span and of its events."""
        return [*self.attributes.values(), *(v for _, a in self.events for v in a.values())]


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in any_value.kvlist_value.values}
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def decode(body: bytes) -> list[Span]:
    """The spans of one protobuf ``ExportTraceServiceRequest``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest.FromString(body)
    out = []
    for resource_spans in request.resource_spans:
        service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(
                    Span(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=KINDS.get(s.kind, "UNSPECIFIED"),
                        service=service,
                        attributes=_attributes(s.attributes),
                        events=tuple((e.name, _attributes(e.attributes)) for e in s.events),
                        status=s.status.code,
                    )
                )
    return out


class OTLPReceiver:
    """``POST /v1/traces`` (protobuf, gzip or not) on 127.0.0.1, answered 200 with an empty
    ``ExportTraceServiceResponse``; every span kept (:attr:`spans`), requests counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self.requests = 0
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """What ``OTEL_EXPORTER_OTLP_ENDPOINT`` names (the exporter adds ``/v1/traces``)."""
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _add(self, spans: list[Span]) -> None:
        with self._lock:
            self.requests += 1
            self._spans.extend(spans)

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[Span]:
        """The spans received of one trace."""
        return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, ready: Callable[[list[Span]], bool], timeout: float = 30.0) -> list[Span]:
        """The spans once ``ready(spans)`` holds (the exporters send in batches)."""
        return wait_until(
            lambda: (lambda spans: spans if ready(spans) else None)(self.spans),
            timeout,
            what="the spans",
        )


def _handler(receiver: OTLPReceiver) -> type[BaseHTTPRequestHandler]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceResponse,
    )

    answer = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            receiver._add(decode(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    return Handler


def submit_main() -> int:
    """The client process (see the module's docstring)."""
    from workers import telemetry
    from workers.client import CritiqueClient

    job = json.load(sys.stdin)
    client = CritiqueClient(job["config"])
    results = client.wait_many(client.submit_many(job["submissions"]), timeout=120)
    out = {"results": [r.model_dump(mode="json") for r in results], "tracing": telemetry.status()}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["submit"]:
    sys.exit(submit_main())
