"""Two "hosts" for the multi-host tests: network namespaces joined by a veth pair.

Needs root and ``ip``; without them the tests that use ``two_hosts`` skip and say why. The
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
    netns: str | None  # the namespace's name; None: this machine's own (the test's)
    dev: str  # its end of the veth pair
    addr: str  # its address on the pair

    def command(self, *argv: str, env: dict[str, str] | None = None) -> list[str]:
        """``argv`` run inside this host. NOTE: without $GLOO_SOCKET_IFNAME: moeflow must find the veth
        itself (the host name resolves to a loopback address on these machines, as on many hosts)."""
        enter = ["ip", "netns", "exec", self.netns] if self.netns else []
        return [*enter, "env", *(f"{k}={v}" for k, v in (env or {}).items()), *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@contextlib.contextmanager
def two_hosts(tag: str = "", a_is_here: bool = False):
    """(host A, host B); ``a_is_here``: host A is this machine's own namespace (a server there is
    reachable from the test), only B is made. Skips the test when namespaces cannot be made here."""
    k = (os.getpid() + sum(map(ord, tag))) % 250 + 1
    a = Host(None if a_is_here else f"mf{os.getpid()}{tag}a", f"mfva{k}", f"10.213.{k}.1")
    b = Host(f"mf{os.getpid()}{tag}b", f"mfvb{k}", f"10.213.{k}.2")
    made = []
    try:
        for h in (a, b):
            if h.netns:
                _ip("netns", "add", h.netns)
                made.append(h.netns)
        _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for h in (a, b):
            where = ["-n", h.netns] if h.netns else []
            if h.netns:
                _ip("link", "set", h.dev, "netns", h.netns)
            _ip(*where, "addr", "add", f"{h.addr}/24", "dev", h.dev)
            _ip(*where, "link", "set", h.dev, "up")
            if h.netns:
                _ip("-n", h.netns, "link", "set", "lo", "up")
    except (OSError, subprocess.SubprocessError) as e:
        _remove(made, a)
        reason = f"cannot create network namespaces (needs root and iproute2): {getattr(e, 'stderr', None) or e}"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    try:
        yield a, b
    finally:
        _remove(made, a)


def _remove(namespaces: list[str], a: Host) -> None:
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if a.netns is None:  # B's end went with B's namespace, and so the pair; this is for a failed start
        subprocess.run(["ip", "link", "del", a.dev], capture_output=True)
