"""The network interface gloo uses between hosts: by default the one on this host's route to node 0.

gloo, left alone, binds the address this host's name resolves to and advertises it to its peers.
On many hosts that is a loopback address (Debian's ``127.0.1.1 <hostname>`` line, or a container's
``127.0.0.1 <hostname>``): the other hosts are then told to connect to their own loopback, and the
world never forms. So a deployment that spans hosts picks the interface whose address is the
source address of the route to ``master_addr`` (what the kernel would use to reach node 0), unless
``$GLOO_SOCKET_IFNAME`` names one; an interface whose address is loopback while node 0 is not is
refused at once, naming the address, the interface and the fix.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

from moeflow import settings
from moeflow.comm.kv_link import route_source
from moeflow.config import ConfigError

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's primary IPv4 address


class InterfaceError(ConfigError):
    """No interface this host can advertise to the other hosts (a setup error: the CLI exits 2 with it)."""


@dataclass(frozen=True)
class Interface:
    name: str  # e.g. "eth0": what gloo binds ($GLOO_SOCKET_IFNAME)
    addr: str  # its address, the one the other hosts are told to connect to
    chosen_by: str  # "GLOO_SOCKET_IFNAME" or "the route to <master_addr>"


def address_of(name: str) -> str | None:
    """The primary IPv4 address of interface ``name``, else its first IPv6 one (None: it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            return socket.inet_ntoa(packed[20:24])
        except OSError:
            pass
    return next((a for n, a in _ipv6_addresses() if n == name), None)


def interface_with(addr: str) -> str | None:
    """The interface that holds ``addr`` (None: no interface of this host does)."""
    for _, name in socket.if_nameindex():
        if address_of(name) == addr:
            return name
    return next((n for n, a in _ipv6_addresses() if a == addr), None)


def _ipv6_addresses() -> list[tuple[str, str]]:
    """(interface, address) of every IPv6 address, from /proc/net/if_inet6 (Linux)."""
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    return [(r[5], str(ipaddress.IPv6Address(bytes.fromhex(r[0])))) for r in rows if len(r) >= 6]


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:  # a host name
        return any(ipaddress.ip_address(i[4][0]).is_loopback for i in socket.getaddrinfo(addr, None))


def choose(master_addr: str) -> Interface:
    """The interface this host's workers use for gloo in a deployment that spans hosts."""
    name = settings.gloo_socket_ifname()
    if name is not None:
        addr, how = address_of(name), "GLOO_SOCKET_IFNAME"
        if addr is None:
            raise InterfaceError(f"GLOO_SOCKET_IFNAME={name} names no interface with an address on this host "
                                 f"(interfaces: {', '.join(n for _, n in socket.if_nameindex())})")
    else:
        try:
            addr = route_source(master_addr)
        except OSError as e:
            raise InterfaceError(f"no route from this host to node 0 at {master_addr}: {e}") from None
        name, how = interface_with(addr), f"the route to {master_addr}"
        if name is None:
            raise InterfaceError(f"the route to node 0 at {master_addr} leaves from {addr}, which no interface "
                                 f"of this host holds; set GLOO_SOCKET_IFNAME to the interface the hosts share")
    if is_loopback(addr) and not is_loopback(master_addr):
        raise InterfaceError(
            f"gloo would tell the other hosts to connect to {addr} (interface {name}, chosen by {how}), a loopback "
            f"address they cannot reach: set GLOO_SOCKET_IFNAME to the interface the hosts share, or give "
            f"--master-addr as node 0's address on it")
    return Interface(name, addr, how)


def use_between_hosts(master_addr: str) -> Interface:
    """Choose the interface and make this process's gloo groups bind it."""
    iface = choose(master_addr)
    settings.set_gloo_socket_ifname(iface.name)
    return iface
