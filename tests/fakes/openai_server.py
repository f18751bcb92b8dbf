"""A fake OpenAI-compatible chat-completions server on loopback, scriptable per test.

litellm's real client path (the ``openai`` SDK over httpx) talks to it through ``api_base``, so
tests exercise the same HTTP, error mapping and usage parsing as production.

Endpoints (a leading ``/v1`` is optional on every path):

    POST /chat/completions   answer the next scripted item (see below), record the request
    POST /_script            replace the script with a JSON list of items
    GET  /_requests          the recorded requests, oldest first
    GET  /_usage             ``sum_usage()``: the usage of every reply actually delivered
    POST /_reset             forget the script, the routes and the recorded requests

The JSON script item is the single source of truth; the Python helpers below (:func:`reply`,
:func:`error`, :func:`timeout`, ...) only build these dicts::

    {
      "match": "You are the critic",  # only requests whose system message contains this
      "repeat": false,         # true: never consumed, answers every matching request
      "delay_s": 0.0,          # wait before answering (longer than the client's timeout → timeout)
      "status": 200,           # other than 200: an OpenAI error body (see ``error_type``)
      "reply": "text",         # the assistant message content; "" is an empty reply
      "prompt_tokens": 12,     # usage to report; default len(all message text) // 4
      "completion_tokens": 3,  # default len(reply) // 4
      "no_choices": false,     # answer ``"choices": []``
      "raw_body": "{oops",     # send this verbatim as the (broken) response body
      "error_type": "...", "message": "...", "code": "...",  # error body fields
      "retry_after": 1,        # a ``Retry-After`` header, in seconds
      "headers": {}            # extra response headers
    }

Choosing the answer to a request: the first queued item whose ``match`` fits (consumed), else
the first standing answer (a ``repeat`` item, or a Python responder added with :meth:`on`) whose
marker fits, else the default responder. A responder gets the parsed request JSON and returns
reply text or a script item.

Run standalone for processes that cannot share a Python object::

    python -m tests.fakes.openai_server --port 0     # prints the api_base, e.g. http://127.0.0.1:PORT/v1
"""

from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ScriptItem = dict[str, Any]
Responder = Callable[[dict[str, Any]], "str | ScriptItem"]

CRITIC = "You are the critic"
"""Marker at the start of the critic's system message."""
REPAIR = "You are repairing"
"""Marker at the start of the repairer's system message."""
ADJUDICATOR = "You are the adjudicator"
"""Marker at the start of the paired critic's (adjudicator's) system message."""

ITEM_KEYS = frozenset(
    {
        "match",
        "repeat",
        "delay_s",
        "status",
        "reply",
        "prompt_tokens",
        "completion_tokens",
        "no_choices",
        "raw_body",
        "error_type",
        "message",
        "code",
        "retry_after",
        "headers",
    }
)

# status → (OpenAI error type, code, message): the shapes the real API answers with.
ERROR_SHAPES: dict[int, tuple[str, str | None, str]] = {
    400: ("invalid_request_error", None, "Invalid request: the fake server was told to refuse."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided: sk-te***st."),
    403: ("permission_error", None, "You are not allowed to use this model."),
    404: ("invalid_request_error", "model_not_found", "The model does not exist."),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached for requests. Try again."),
    500: ("server_error", None, "The server had an error while processing your request."),
    502: ("server_error", None, "Bad gateway."),
    503: ("server_error", None, "The engine is currently overloaded, please try again later."),
}


# --- script item builders (they only build the JSON dicts) -----------------------------------


def _item(match: str | None, **fields: Any) -> ScriptItem:
    item = {k: v for k, v in fields.items() if v is not None}
    if match is not None:
        item["match"] = match
    return item


def reply(
    text: str,
    *,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    delay_s: float | None = None,
    match: str | None = None,
    repeat: bool | None = None,
) -> ScriptItem:
    """A 200 answer whose message content is ``text``."""
    return _item(
        match,
        reply=text,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        delay_s=delay_s,
        repeat=repeat,
    )


def error(
    status: int,
    message: str | None = None,
    *,
    retry_after: float | None = None,
    error_type: str | None = None,
    match: str | None = None,
) -> ScriptItem:
    """An HTTP error with an OpenAI error body (429 may carry ``Retry-After``)."""
    return _item(
        match, status=status, message=message, retry_after=retry_after, error_type=error_type
    )


def timeout(delay_s: float, *, match: str | None = None) -> ScriptItem:
    """An answer that arrives only after ``delay_s`` (set the client timeout below it)."""
    return _item(match, delay_s=delay_s, reply="too late")


def malformed(
    text: str = "Sure! Here is my critique: {score: high", *, match: str | None = None
) -> ScriptItem:
    """A valid HTTP answer whose content is not JSON (for callers that asked for JSON)."""
    return reply(text, match=match)


def empty(*, match: str | None = None) -> ScriptItem:
    """A valid answer with empty content."""
    return reply("", match=match)


def no_choices(*, match: str | None = None) -> ScriptItem:
    """A valid answer with ``"choices": []``."""
    return _item(match, no_choices=True)


def broken_body(
    body: str = '{"id": "chatcmpl-broken", "choices": [', *, match: str | None = None
) -> ScriptItem:
    """A 200 whose body is not valid JSON at all."""
    return _item(match, raw_body=body)


def tool_calls(
    calls: list[tuple[str, dict[str, Any]]],
    n: int,
    *,
    model: str = "manager-model",
    prompt_tokens: int = 40,
    completion_tokens: int = 10,
) -> ScriptItem:
    """A 200 whose assistant message calls tools, ``(name, arguments)`` each (the ``n``-th
    call of the script: it makes the call ids unique), as an agent framework's model would."""
    body = {
        "id": f"chatcmpl-{model}-{n}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"call_{name}_{n}_{i}",
                            "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments)},
                        }
                        for i, (name, arguments) in enumerate(calls)
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    return {"raw_body": json.dumps(body)}


def critic_verdict(score: float, *defects: str, category: str = "hallucinated") -> str:
    """A critic reply in the critic prompt's JSON shape: each defect critical, at ``summary``,
    with a prescription to remove it."""
    found = [
        {"category": category, "severity": "critical", "location": "summary", "description": d}
        for d in defects
    ]
    return json.dumps(
        {
            "score": score,
            "defects": found,
            "prescriptions": [f"Remove it: {d}" for d in defects],
            "reusable_patterns": [],
            "summary": f"score {score}",
        }
    )


def validate_item(item: Any) -> ScriptItem:
    """Check one script item; raises ValueError naming the problem."""
    if not isinstance(item, Mapping):
        raise ValueError(f"a script item must be a JSON object, got {type(item).__name__}")
    unknown = sorted(set(item) - ITEM_KEYS)
    if unknown:
        raise ValueError(f"unknown script item key(s) {unknown}; allowed: {sorted(ITEM_KEYS)}")
    status = item.get("status", 200)
    if not isinstance(status, int) or not 100 <= status <= 599:
        raise ValueError(f"status must be an HTTP status code, got {status!r}")
    if "reply" in item and not isinstance(item["reply"], str):
        raise ValueError("reply must be a string")
    return dict(item)


# --- request helpers -------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


def system_text(request: Mapping[str, Any]) -> str:
    """The text of every system message of a chat request, joined."""
    msgs = request.get("messages") or []
    return "\n".join(
        _content_text(m.get("content"))
        for m in msgs
        if isinstance(m, Mapping) and m.get("role") == "system"
    )


def user_text(request: Mapping[str, Any]) -> str:
    """The text of every user message of a chat request, joined."""
    msgs = request.get("messages") or []
    return "\n".join(
        _content_text(m.get("content"))
        for m in msgs
        if isinstance(m, Mapping) and m.get("role") == "user"
    )


def has_marker(marker: str) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate: the request's system message contains ``marker``."""
    return lambda request: marker in system_text(request)


def _prompt_chars(request: Mapping[str, Any]) -> int:
    msgs = request.get("messages") or []
    return sum(len(_content_text(m.get("content"))) for m in msgs if isinstance(m, Mapping))


def default_responder(request: dict[str, Any]) -> str:
    """Answer used when nothing is scripted: a small JSON object (valid for json_mode)."""
    return '{"ok": true}'


# --- the server ------------------------------------------------------------------------------


class FakeOpenAIServer:
    """The fake server in a background thread of this process (``with`` starts and stops it)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._queue: list[ScriptItem] = []
        self._standing: list[tuple[str | None, Responder | ScriptItem]] = []
        self._default: Responder = default_responder
        self._records: list[dict[str, Any]] = []
        self._httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False
        self._thread: threading.Thread | None = None

    # lifecycle

    @property
    def url(self) -> str:
        """Root URL, e.g. ``http://127.0.0.1:PORT``."""
        host, port = self._httpd.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def api_base(self) -> str:
        """What litellm's ``api_base`` should be: the root URL plus ``/v1``."""
        return f"{self.url}/v1"

    def start(self) -> FakeOpenAIServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def serve_until_signalled(self, announce: Callable[[FakeOpenAIServer], str]) -> None:
        """Start, print ``announce(self)`` (the address a parent process reads), answer until
        SIGTERM or SIGINT, then stop: a fake server run as a process of its own."""
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        signal.signal(signal.SIGINT, lambda *_: done.set())
        self.start()
        print(announce(self), flush=True)
        done.wait()
        self.stop()

    def stop(self) -> None:
        self._stopping.set()  # wakes delayed answers
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # scripting

    def script(self, *items: ScriptItem) -> FakeOpenAIServer:
        """Append items: queued ones are consumed in order, ``repeat`` ones keep answering."""
        checked = [validate_item(i) for i in items]
        with self._lock:
            for item in checked:
                if item.get("repeat"):
                    self._standing.append((item.get("match"), item))
                else:
                    self._queue.append(item)
        return self

    def set_script(self, items: list[Any]) -> None:
        """Replace the script (queue and standing items) — what ``POST /_script`` does."""
        checked = [validate_item(i) for i in items]
        with self._lock:
            self._queue.clear()
            self._standing = [(m, r) for m, r in self._standing if callable(r)]
        self.script(*checked)

    def on(self, marker: str, responder: Responder | str) -> FakeOpenAIServer:
        """Answer every request whose system message contains ``marker`` with ``responder``
        (a callable of the request JSON, or fixed reply text) when no queued item fits."""
        answer: Responder | ScriptItem = (
            reply(responder) if isinstance(responder, str) else responder
        )
        with self._lock:
            self._standing.append((marker, answer))
        return self

    def set_default(self, responder: Responder | str) -> FakeOpenAIServer:
        """The answer when neither a queued item nor a standing one fits."""
        self._default = (lambda _r: responder) if isinstance(responder, str) else responder
        return self

    def reset(self) -> None:
        """Forget the script, the routes, the default and every recorded request."""
        with self._lock:
            self._queue.clear()
            self._standing.clear()
            self._records.clear()
            self._default = default_responder

    @property
    def pending(self) -> int:
        """Queued items not yet consumed."""
        with self._lock:
            return len(self._queue)

    # what was asked

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every request received: ``path``, ``headers`` (lower-case names), ``body`` (parsed
        JSON), ``status`` answered, ``usage`` reported (None on errors), ``delivered``, ``at``
        (arrival, ``time.monotonic()``)."""
        with self._lock:
            return [dict(r) for r in self._records]

    @property
    def completions(self) -> list[dict[str, Any]]:
        """The request bodies of the chat-completion calls, oldest first."""
        return [r["body"] for r in self.requests if r["path"] == "/chat/completions"]

    def requests_with(self, marker: str) -> list[dict[str, Any]]:
        """Chat-completion bodies whose system message contains ``marker``."""
        return [b for b in self.completions if isinstance(b, dict) and marker in system_text(b)]

    def sum_usage(self) -> dict[str, int]:
        """Token usage of every reply delivered to a client (timed-out ones excluded)."""
        total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "replies": 0}
        # A client can read a reply before the handler thread has marked it delivered: give
        # replies still being written a moment to finish, so the sum never races the client.
        deadline = time.monotonic() + 2.0
        records = self.requests
        while any(r.get("sending") for r in records) and time.monotonic() < deadline:
            time.sleep(0.005)
            records = self.requests
        for r in records:
            usage = r.get("usage")
            if usage and r.get("delivered"):
                for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
                    total[k] += int(usage[k])
                total["replies"] += 1
        return total

    # answering (called from handler threads)

    def _pick(self, body: dict[str, Any]) -> ScriptItem:
        sys_text = system_text(body)
        with self._lock:
            for i, item in enumerate(self._queue):
                if item.get("match") is None or item["match"] in sys_text:
                    return self._queue.pop(i)
            standing = list(self._standing)
            default = self._default
        for marker, answer in standing:
            if marker is None or marker in sys_text:
                return _resolve(answer, body)
        return _resolve(default, body)

    def _record(self, record: dict[str, Any]) -> int:
        with self._lock:
            self._records.append(record)
            return len(self._records)

    def _wait(self, seconds: float) -> None:
        self._stopping.wait(seconds)


def _resolve(answer: Responder | ScriptItem, body: dict[str, Any]) -> ScriptItem:
    if callable(answer):
        out = answer(body)
        return reply(out) if isinstance(out, str) else validate_item(out)
    return answer


def completion_body(item: ScriptItem, request: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The OpenAI chat.completion JSON for a 200 script item."""
    text = item.get("reply", "")
    prompt = item.get("prompt_tokens", _prompt_chars(request) // 4)
    completion = item.get("completion_tokens", len(text) // 4)
    choices = (
        []
        if item.get("no_choices")
        else [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ]
    )
    return {
        "id": f"chatcmpl-fake-{n}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(request.get("model") or "fake-model"),
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
        "system_fingerprint": "fp_fake",
    }


def error_body(item: ScriptItem) -> dict[str, Any]:
    """The OpenAI error JSON for an error script item."""
    status = int(item["status"])
    etype, code, message = ERROR_SHAPES.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None, "error")
    )
    return {
        "error": {
            "message": item.get("message") or message,
            "type": item.get("error_type") or etype,
            "param": None,
            "code": item.get("code", code),
        }
    }


def _peer_closed(sock: socket.socket) -> bool:
    """True when the client has hung up (it gave up waiting)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _handler_for(server: FakeOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

        def _path(self) -> str:
            path = self.path.split("?", 1)[0].rstrip("/")
            return path[3:] if path.startswith("/v1/") else path

        def _read_json(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            return json.loads(raw) if raw else None

        def _send(self, status: int, body: bytes, headers: Mapping[str, str] = {}) -> bool:
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                return True
            except OSError:
                return False

        def _send_json(self, status: int, obj: Any) -> bool:
            return self._send(status, json.dumps(obj).encode())

        def do_GET(self) -> None:
            path = self._path()
            if path == "/_requests":
                self._send_json(200, server.requests)
            elif path == "/_usage":
                self._send_json(200, server.sum_usage())
            elif path in ("/_health", "/models"):
                self._send_json(200, {"object": "list", "data": []})
            else:
                self._send_json(404, {"error": {"message": f"no route {path}", "type": "x"}})

        def do_POST(self) -> None:
            path = self._path()
            try:
                body = self._read_json()
            except ValueError:
                self._send_json(400, {"error": {"message": "request body is not JSON"}})
                return
            if path == "/_script":
                try:
                    if not isinstance(body, list):
                        raise ValueError("POST /_script wants a JSON list of script items")
                    server.set_script(body)
                except ValueError as exc:
                    self._send_json(400, {"error": {"message": str(exc)}})
                    return
                self._send_json(200, {"queued": server.pending})
            elif path == "/_reset":
                server.reset()
                self._send_json(200, {"reset": True})
            elif path == "/chat/completions":
                self._complete(path, body)
            else:
                self._send_json(404, {"error": {"message": f"no route {path}", "type": "x"}})

        def _complete(self, path: str, body: Any) -> None:
            record: dict[str, Any] = {
                "path": path,
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "body": body,
                "status": None,
                "usage": None,
                "delivered": False,
                "at": time.monotonic(),
            }
            n = server._record(record)
            if not isinstance(body, dict):
                record["status"] = 400
                record["delivered"] = self._send_json(
                    400, error_body({"status": 400, "message": "body must be a JSON object"})
                )
                return
            item = server._pick(body)
            delay = float(item.get("delay_s") or 0)
            if delay > 0:
                server._wait(delay)
                if _peer_closed(self.connection):
                    record["status"] = "client_gone"
                    return
            status = int(item.get("status", 200))
            headers = {str(k): str(v) for k, v in (item.get("headers") or {}).items()}
            if "retry_after" in item:
                headers["Retry-After"] = str(item["retry_after"])
            if "raw_body" in item:
                payload = str(item["raw_body"]).encode()
            elif status == 200:
                out = completion_body(item, body, n)
                record["usage"] = out["usage"]
                payload = json.dumps(out).encode()
            else:
                payload = json.dumps(error_body(item)).encode()
            record["status"] = status
            record["sending"] = True
            try:
                record["delivered"] = self._send(status, payload, headers)
            finally:
                record["sending"] = False

    return Handler


# --- admin client (for a server in another process) ------------------------------------------


class FakeLLMAdmin:
    """Scripts a fake server over HTTP (``/_script``, ``/_requests``, ``/_reset``)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")

    def _call(self, method: str, path: str, payload: Any = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def script(self, items: list[ScriptItem]) -> int:
        """Replace the server's script; returns how many items are queued."""
        return int(self._call("POST", "/_script", items)["queued"])

    def requests(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/_requests"))

    def usage(self) -> dict[str, int]:
        return dict(self._call("GET", "/_usage"))

    def reset(self) -> None:
        self._call("POST", "/_reset", {})


@contextmanager
def running(*items: ScriptItem) -> Iterator[FakeOpenAIServer]:
    """``with running(reply("hi")) as fake:`` — a started server with a script."""
    with FakeOpenAIServer() as fake:
        fake.script(*items)
        yield fake


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--script", help="a JSON file holding a list of script items")
    args = parser.parse_args(argv)
    server = FakeOpenAIServer(args.host, args.port)
    if args.script:
        with open(args.script, encoding="utf-8") as fh:
            server.set_script(json.load(fh))
    server.serve_until_signalled(lambda s: s.api_base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
