"""Progress on long waits (``submit --wait``, ``watch``): a live counter on a terminal, plain
lines otherwise.

On a terminal, one status line on stderr is rewritten in place (``\\r``) as outputs finish;
lines the command prints meanwhile (results on stdout, notes on stderr) go through
:meth:`Progress.line`, which clears the counter first and redraws it after, so the two never
mix. Elsewhere (a pipe, a CI log) there is no counter: a plain progress line on stderr at most
every ``every`` seconds, and only when the counts changed since the last one, so a quiet wait
stays readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO

_CLEAR = "\r\x1b[K"


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """A counter of ``finished / failed / pending`` over ``total`` outputs."""

    def __init__(
        self,
        label: str,
        *,
        stream: IO[str] | None = None,
        enabled: bool = True,
        every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.live = enabled and _is_tty(self.stream)
        self.every = every
        self.clock = clock
        self.began = clock()
        self._next_plain = self.began + every
        self._shown = ""
        self._last = ""

    def text(self, finished: int, failed: int, pending: int) -> str:
        total = finished + failed + pending
        return (
            f"{self.label}: {finished}/{total} finished, {failed} failed, {pending} pending "
            f"({self.clock() - self.began:.1f} s)"
        )

    def update(self, finished: int, failed: int, pending: int) -> None:
        """Show the counts: redraw the live line, or a plain line when one is due."""
        if not self.enabled:
            return
        state = f"{finished}/{failed}/{pending}"
        if self.live:
            self._draw(self.text(finished, failed, pending))
            return
        now = self.clock()
        if state != self._last and now >= self._next_plain:
            self._next_plain = now + self.every
            self._last = state
            print(self.text(finished, failed, pending), file=self.stream, flush=True)

    def line(self, text: str, stream: IO[str] | None = None) -> None:
        """Print one line (stdout by default) without tearing the live counter."""
        shown = self._shown
        self._erase()
        print(text, file=stream if stream is not None else sys.stdout, flush=True)
        if shown:
            self._draw(shown)

    def close(self) -> None:
        """Erase the live counter (the command prints its final tally itself)."""
        self._erase()

    def _draw(self, text: str) -> None:
        self.stream.write(_CLEAR + text)
        self.stream.flush()
        self._shown = text

    def _erase(self) -> None:
        if self._shown:
            self.stream.write(_CLEAR)
            self.stream.flush()
            self._shown = ""
