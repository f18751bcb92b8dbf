"""The fake OpenAI-compatible server the LLM benches share, in a process of its own (so its
threads never share a GIL with the pipeline or the peer): ``serve`` runs it in the child (the
bench's hidden ``--serve``), :class:`ServerProcess` starts that child and talks to it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def serve(answer: Callable[[dict[str, Any]], Any], backlog: int | None = None) -> int:
    """Run the fake server in this process: ``answer(body)`` is each request's reply (a
    ``tests.fakes.openai_server.reply``); prints its URL, answers until SIGTERM or SIGINT.
    ``backlog``: the listen backlog it binds with (http.server's default is 5, which bursts of
    connections overflow, each drop a 1 s SYN retry)."""
    from http.server import ThreadingHTTPServer

    from tests.fakes.openai_server import FakeOpenAIServer

    if backlog is not None:
        ThreadingHTTPServer.request_queue_size = backlog  # this process only
    server = FakeOpenAIServer()
    server.set_default(answer)
    server.serve_until_signalled(lambda s: s.url)
    return 0


class ServerProcess:
    """``script --serve …`` (a bench whose ``--serve`` calls :func:`serve`) in a child process."""

    def __init__(self, script: str, args: Sequence[str]) -> None:
        argv = [sys.executable, str(Path(script).resolve()), "--serve", *args]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        if not self.url:
            raise RuntimeError("the fake LLM server did not start")
        from tests.fakes.openai_server import FakeLLMAdmin

        self.admin = FakeLLMAdmin(self.url)

    @property
    def api_base(self) -> str:
        return self.url + "/v1"

    def completions(self) -> list[dict[str, Any]]:
        """The chat-completion requests the server has answered so far."""
        return [r for r in self.admin.requests() if r.get("path") == "/chat/completions"]

    def calls(self) -> int:
        return len(self.completions())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
