"""Progress on long waits: a live counter rewritten in place on a terminal, plain lines at most
every few seconds elsewhere, and printed lines never torn by the counter."""

from __future__ import annotations

import io

from workers.commands._progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_live_counter_on_a_terminal() -> None:
    """On a TTY each update rewrites one line (\\r + erase); a printed line clears it first and
    redraws it after; close() erases it."""
    err, out = _Tty(), io.StringIO()
    p = Progress("submit", stream=err, clock=_Clock())
    p.update(1, 0, 2)
    p.update(2, 1, 0)
    assert err.getvalue().count("\r\x1b[K") == 2
    assert err.getvalue().endswith("submit: 2/3 finished, 1 failed, 0 pending (0.0 s)")
    p.line("a result", stream=out)
    assert out.getvalue() == "a result\n"
    assert err.getvalue().endswith(
        "\r\x1b[K\r\x1b[Ksubmit: 2/3 finished, 1 failed, 0 pending (0.0 s)"
    )
    p.close()
    assert err.getvalue().endswith("\r\x1b[K")


def test_plain_lines_elsewhere_when_due_and_changed() -> None:
    """Off a terminal: no escape codes; a plain line only every `every` seconds and only when
    the counts changed since the last one."""
    err, clock = io.StringIO(), _Clock()
    p = Progress("watch r1", stream=err, every=10.0, clock=clock)
    p.update(0, 0, 5)
    assert err.getvalue() == ""
    clock.now = 11.0
    p.update(3, 0, 2)
    clock.now = 12.0
    p.update(4, 0, 1)  # not due yet
    clock.now = 30.0
    p.update(4, 0, 1)  # due, and changed since the last line
    clock.now = 45.0
    p.update(4, 0, 1)  # due, but nothing changed since the last line
    assert err.getvalue() == (
        "watch r1: 3/5 finished, 0 failed, 2 pending (11.0 s)\n"
        "watch r1: 4/5 finished, 0 failed, 1 pending (30.0 s)\n"
    )
    assert "\x1b" not in err.getvalue()
