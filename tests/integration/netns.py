"""Two "hosts" for the multi-host tests: network namespaces joined by a veth pair.

Needs root and ``ip``; without them the tests that use ``two_hosts`` skip and say why. Both
namespaces are removed afterwards (deleting a namespace deletes its end of the pair, and so the pair).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Host:
    netns: str  # the namespace's name
    dev: str  # its end of the veth pair (gloo's interface: $GLOO_SOCKET_IFNAME)
    addr: str  # its address on the pair

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this host, with gloo on its veth."""
        return ["ip", "netns", "exec", self.netns, "env", f"GLOO_SOCKET_IFNAME={self.dev}", *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@contextlib.contextmanager
def two_hosts(tag: str = ""):
    """(host A, host B); skips the test when namespaces cannot be made here."""
    k = (os.getpid() + len(tag)) % 250 + 1
    a = Host(f"mf{os.getpid()}{tag}a", f"mfva{k}", f"10.213.{k}.1")
    b = Host(f"mf{os.getpid()}{tag}b", f"mfvb{k}", f"10.213.{k}.2")
    made = []
    try:
        for h in (a, b):
            _ip("netns", "add", h.netns)
            made.append(h.netns)
        _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for h in (a, b):
            _ip("link", "set", h.dev, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.dev)
            _ip("-n", h.netns, "link", "set", h.dev, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
    except (OSError, subprocess.SubprocessError) as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        reason = f"cannot create network namespaces (needs root and iproute2): {getattr(e, 'stderr', None) or e}"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    try:
        yield a, b
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
