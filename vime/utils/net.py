"""This node's network: listening sockets bound to one address (never all interfaces), and the interface that
carries an address (gloo picks its interface by name)."""

from __future__ import annotations

import ipaddress
import socket

import psutil


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (port 0: a free one; read it with ``getsockname()``). Hand it
    to a server that accepts one (e.g. ``torch.distributed.TCPStore(master_listen_fd=sock.detach())``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (``lo`` for 127.0.0.1), or None."""
    try:
        wanted = ipaddress.ip_address(socket.gethostbyname(address))
    except (OSError, ValueError):
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            try:
                if ipaddress.ip_address(entry.address.split("%")[0]) == wanted:
                    return name
            except ValueError:  # a MAC address
                continue
    return None
