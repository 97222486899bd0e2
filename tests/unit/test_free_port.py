"""free_port: a port below the kernel's ephemeral range, never one somebody listens on."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from workers import ports
from workers.ports import LOWEST_PORT, ephemeral_ports, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low, _ = ephemeral_ports()
    for _ in range(20):
        port = free_port()
        assert LOWEST_PORT <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # The only candidate below the range is the port in use: the kernel's choice comes instead.
        monkeypatch.setattr(ports, "LOWEST_PORT", taken)
        monkeypatch.setattr(ports, "ephemeral_ports", lambda: (taken + 1, taken + 2))
        assert free_port(attempts=8) != taken


def test_the_range_defaults_to_linuxs_when_it_cannot_be_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ephemeral_ports() == (32768, 60999)
    (tmp_path / "range").write_text("40000\t50000\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "range")
    assert ephemeral_ports() == (40000, 50000)
