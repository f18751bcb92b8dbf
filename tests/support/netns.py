"""A network partition with real sockets: a Linux network namespace joined to this one by a
veth pair. Processes started with :attr:`Netns.exec` run inside it and are reached at
:attr:`Netns.inner`; they reach this side at :attr:`Netns.outer`. :meth:`Netns.cut` takes the
link down (every packet between the two sides is lost, connections across it fail or hang as
on a real partition) and :meth:`Netns.heal` brings it back. Needs root (``CAP_NET_ADMIN`` and
``CAP_SYS_ADMIN``) and iproute2's ``ip``; :func:`netns_unavailable` says why not, for a skip."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid

NOBODY = "02:00:00:00:00:01"
"""A locally administered hardware address no interface has: frames sent to it are dropped."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=15)


def netns_unavailable() -> str | None:
    """None when this process can make a namespace and a veth pair; else why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not on PATH"
    if os.geteuid() != 0:
        return "making a network namespace needs root"
    probe = f"cpprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed: {getattr(exc, 'stderr', '') or exc}"
    _ip("netns", "del", probe)
    return None


class Netns:
    """One namespace and its link; :meth:`create` makes them, :meth:`delete` removes both."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.name = f"cp{tag}"
        self._out, self._in = f"cpo{tag}", f"cpi{tag}"
        net = 1 + int(tag, 16) % 250  # a /24 of its own: two runs at once never share one
        self.outer, self.inner = f"10.231.{net}.1", f"10.231.{net}.2"
        self.exec = ["ip", "netns", "exec", self.name]

    def create(self) -> Netns:
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self._out, "type", "veth", "peer", "name", self._in)
            _ip("link", "set", self._in, "netns", self.name)
            # Each side's address on its loopback (it stays up when the link goes down, so a
            # side keeps reaching itself), and a route to the other side's over the link.
            _ip("addr", "add", f"{self.outer}/32", "dev", "lo")
            _ip("link", "set", self._out, "up")
            inside = ["-n", self.name]
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "addr", "add", f"{self.inner}/32", "dev", "lo")
            _ip(*inside, "link", "set", self._in, "up")
            _ip(*inside, "route", "add", f"{self.outer}/32", "dev", self._in)
            _ip("route", "add", f"{self.inner}/32", "dev", self._out)
        except BaseException:
            self.delete()
            raise
        return self

    def cut(self) -> None:
        """The partition: each side's next hop to the other is a hardware address no one has,
        so every frame across the link is dropped by the receiving side, silently (no error,
        no reset: a connection across it hangs until its timeouts, as on a real partition).
        The link stays up, so no packet finds another way (a default route)."""
        for side, address, dev in self._sides():
            _ip(
                *side, "neigh", "replace", address, "lladdr", NOBODY, "dev", dev, "nud", "permanent"
            )

    def heal(self) -> None:
        """The link carries frames again (each side learns the other's address anew)."""
        for side, address, dev in self._sides():
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip(*side, "neigh", "del", address, "dev", dev)

    def _sides(self) -> list[tuple[tuple[str, ...], str, str]]:
        """(where ``ip`` runs, the other side's address, the link's end there), per side."""
        return [((), self.inner, self._out), (("-n", self.name), self.outer, self._in)]

    def delete(self) -> None:
        """The link (its peer goes with it) and the namespace; processes inside must be gone."""
        for args in (
            ("link", "del", self._out),
            ("netns", "del", self.name),
            ("addr", "del", f"{self.outer}/32", "dev", "lo"),
        ):
            with contextlib.suppress(subprocess.CalledProcessError):  # never made, or gone
                _ip(*args)
