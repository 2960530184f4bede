"""Server addresses: the default, and whether an address points at this machine only (loopback)."""

from __future__ import annotations

import ipaddress
import socket

DEFAULT_ADDRESS = "localhost:50051"


def split_host(address: str) -> str:
    """The host part of a gRPC target: ``host:port``, ``[v6]:port``, ``ipv4:...``/``dns:///...`` forms."""
    target = address
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    target = target.split(",")[0]  # a list of ipv4:/ipv6: addresses: judge each via is_loopback
    if target.startswith("["):
        return target[1:].split("]", 1)[0]
    if target.count(":") == 1:
        return target.split(":", 1)[0]
    return target  # a bare host or a bare IPv6 literal


def is_loopback(address: str) -> bool:
    """True when every address the target resolves to is a loopback address (or it is a unix socket).

    Resolution failures count as not loopback: a load generator must not guess.
    """
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("ipv4:", "ipv6:"):
        if address.startswith(scheme):
            return all(is_loopback(part) for part in address[len(scheme):].split(","))
    host = split_host(address)
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
