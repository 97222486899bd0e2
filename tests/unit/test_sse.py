"""SSE framing and the response's disconnect handling, with a scripted ASGI peer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.types import Message

from server.sse import DONE, SSEResponse, event


def test_event_framing() -> None:
    assert event(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert event(b'{"a":1}', 7) == b'id: 7\ndata: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"


async def test_streams_every_event_then_ends() -> None:
    sent: list[Message] = []

    async def events() -> AsyncIterator[bytes]:
        yield event(b"1", 0)
        yield DONE

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client never disconnects
        return {}

    async def send(message: Message) -> None:
        sent.append(message)

    await SSEResponse(events(), {"x-ferry-worker": "w1"})({}, receive, send)
    start = sent[0]
    assert start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"x-ferry-worker", b"w1") in start["headers"]
    assert [m["body"] for m in sent[1:]] == [b"id: 0\ndata: 1\n\n", DONE, b""]
    assert sent[-1]["more_body"] is False


async def test_disconnect_closes_the_event_iterator() -> None:
    closed = asyncio.Event()
    started = asyncio.Event()
    disconnect = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield event(b"first")
            started.set()
            await asyncio.Event().wait()  # upstream that would run forever
            yield event(b"never")
        finally:
            closed.set()

    async def receive() -> Message:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message.get("body") == event(b"first"):
            disconnect.set()

    await asyncio.wait_for(SSEResponse(events())({}, receive, send), 5)
    assert closed.is_set()


async def test_events_after_a_disconnect_are_not_sent() -> None:
    sent: list[bytes] = []
    gone = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        for i in range(1000):
            if i == 3:
                gone.set()
                await asyncio.sleep(0)  # let the disconnect be seen
            yield event(str(i).encode())

    async def receive() -> Message:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message.get("body", b""))
        await asyncio.sleep(0)

    await asyncio.wait_for(SSEResponse(events())({}, receive, send), 5)
    assert len(sent) < 10


async def test_a_client_that_stops_reading_loses_its_stream() -> None:
    closed = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            while True:
                yield event(b"token")
        finally:
            closed.set()

    async def receive() -> Message:
        await asyncio.Event().wait()  # connected, never reading
        return {}

    sends = 0

    async def send(message: Message) -> None:
        nonlocal sends
        sends += 1
        if sends > 3:
            await asyncio.Event().wait()  # the socket's buffer is full: the send never completes

    async with asyncio.timeout(5):
        await SSEResponse(events(), send_timeout_s=0.2)({}, receive, send)
    assert closed.is_set()
    assert sends == 4
