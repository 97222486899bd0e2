"""Ports for the servers Ferry's processes open: below the kernel's ephemeral range, where neither another
bind(0) nor an outgoing connection can take one between the check and the bind that uses it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Where free_port looks first: below the kernel's ephemeral range (read from EPHEMERAL_RANGE_FILE).
LOWEST_PORT = 10_000
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for bind(0) and outgoing connections (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A TCP port nobody listens on right now, below the ephemeral range where there is room: a port the kernel
    hands out can go to another bind(0) or an outgoing connection between this check and the bind that uses
    it (a worker's metrics server once took the port `ferry up` had found for its frontend)."""
    low, _ = ephemeral_ports()
    rng = random.SystemRandom()
    for _ in range(attempts if low > LOWEST_PORT else 0):
        port = rng.randrange(LOWEST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
