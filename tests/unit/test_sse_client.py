"""The benchmarks' HTTP client reuses a keep-alive connection only while the server still keeps it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest_asyncio

from bench.sse_client import Connection

BODY = b'{"ok":true}'


class _Server:
    """Answers every request with a small JSON body on a keep-alive connection; counts connections."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(BODY)}\r\n\r\n".encode()
                    + BODY
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest_asyncio.fixture
async def server() -> AsyncIterator[tuple[_Server, int]]:
    s = _Server()
    s.server = await asyncio.start_server(s._serve, "127.0.0.1", 0)
    port = s.server.sockets[0].getsockname()[1]
    yield s, port
    s.server.close()
    await s.server.wait_closed()


async def test_a_connection_is_reused_within_its_expiry(server: tuple[_Server, int]) -> None:
    s, port = server
    conn = Connection("127.0.0.1", port, keepalive_expiry_s=30.0)
    for _ in range(3):
        r = await conn.post_json("/x", b"{}")
        assert r.status == 200 and r.body == BODY
    conn.close()
    assert s.connections == 1


async def test_a_connection_idle_past_its_expiry_is_replaced(server: tuple[_Server, int]) -> None:
    s, port = server
    conn = Connection("127.0.0.1", port, keepalive_expiry_s=0.05)
    assert (await conn.post_json("/x", b"{}")).status == 200
    await asyncio.sleep(0.1)  # the idle time under test, not a wait for an event
    assert (await conn.post_json("/x", b"{}")).status == 200
    conn.close()
    assert s.connections == 2
