"""Server-Sent Events: framing, and an ASGI response that aborts upstream when the client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping

from starlette.types import Receive, Scope, Send

log = logging.getLogger("ferry.sse")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


def event(data: bytes, event_id: int | None = None) -> bytes:
    """One SSE event carrying a single-line JSON payload."""
    if event_id is None:
        return b"data: " + data + b"\n\n"
    return b"id: %d\ndata: %s\n\n" % (event_id, data)


class SSEResponse:
    """Streams pre-framed events; on disconnect the event iterator is closed so upstream aborts.

    Starlette's StreamingResponse cancels the producing task on disconnect but does not close the
    iterator, which would leave the worker generating for nobody; this class always runs `aclose()`.
    """

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: Mapping[str, str] | None = None,
        send_timeout_s: float = 30.0,
    ) -> None:
        self._events = events
        self._headers = dict(headers or {})
        self._send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ] + [(k.lower().encode(), v.encode()) for k, v in self._headers.items()]
        self._gone = False
        self._send_started: float | None = None
        pump = asyncio.create_task(self._pump(send, raw_headers))
        watch = asyncio.create_task(self._watch_disconnect(receive))
        stall = asyncio.create_task(self._watch_stall())
        try:
            done, _ = await asyncio.wait([pump, watch, stall], return_when=asyncio.FIRST_COMPLETED)
            if pump in done:
                pump.result()
            else:
                # The flag backs up the cancel below: a cancellation can be lost in a race with a
                # completing await, and uvicorn accepts sends to a closed connection silently.
                self._gone = True
                if stall in done:
                    log.warning("client read nothing for %.0fs; closing its stream", self._send_timeout_s)
                else:
                    log.debug("client disconnected mid-stream")
        finally:
            for t in (pump, watch, stall):
                t.cancel()
            await asyncio.gather(pump, watch, stall, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._events.aclose()  # type: ignore[attr-defined]

    async def _pump(self, send: Send, raw_headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        loop = asyncio.get_running_loop()
        async for chunk in self._events:
            if self._gone:
                return
            # A timestamp, not a timeout per send: this runs once per event, and _watch_stall reads it.
            self._send_started = loop.time()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self._send_started = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch_stall(self) -> None:
        """Return once one send has been blocked for the send timeout: a client that stops reading must not
        hold a stream (and its engine slot) forever."""
        loop = asyncio.get_running_loop()
        period = self._send_timeout_s / 4
        while True:
            await asyncio.sleep(period)
            started = self._send_started
            if started is not None and loop.time() - started >= self._send_timeout_s:
                return

    @staticmethod
    async def _watch_disconnect(receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
