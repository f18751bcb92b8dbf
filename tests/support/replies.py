"""A TCP proxy in front of a real Redis that can lose one reply: the command reaches Redis and
runs, then the connection is cut before its reply reaches the client — what a network fault
does at the worst moment. redis-py then re-sends the command on a new connection (its default
retry), so a command that is not idempotent runs twice."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from workers.embedded import free_port


class ReplyLoser:
    """``127.0.0.1:<port>`` → ``upstream``; after :meth:`lose_next_reply`, the next reply from
    Redis is dropped and both sides of that connection are closed; after :meth:`hold`, nothing
    from Redis gets through (a replica linked through it lags: what the master sends it is gone)
    while the connections stay open."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.lost = 0
        self._armed = threading.Event()
        self._holding = threading.Event()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_next_reply(self) -> None:
        self._armed.set()

    def hold(self) -> None:
        self._holding.set()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._server.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:  # the upstream is down (killed by the test): refuse this one
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if replies and self._armed.is_set():
                    self._armed.clear()
                    self.lost += 1
                    break  # the reply is dropped: cut both sides
                if replies and self._holding.is_set():
                    continue  # never delivered
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@contextlib.contextmanager
def losing_replies(upstream_port: int) -> Iterator[ReplyLoser]:
    proxy = ReplyLoser(upstream_port)
    try:
        yield proxy
    finally:
        proxy.close()
