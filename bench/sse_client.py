"""A lean asyncio HTTP/1.1 client for streaming benchmarks: POST JSON, timestamp every SSE event on arrival.

General-purpose clients (httpx, aiohttp) spend tens of microseconds of Python per streamed event; on a
2-core machine that CPU is taken from the server being measured. This client is an `asyncio.Protocol`:
bytes are parsed in `data_received` (chunked transfer encoding, then SSE framing) and each `data:` payload is
stored with the `time.perf_counter()` of the read that delivered it. JSON is decoded only after the
response has ended, so the per-event cost while streaming is a few `bytes.find` calls.

One `Connection` carries one request at a time and is reused (keep-alive), like one user of a chat app.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from time import perf_counter
from typing import cast

import msgspec

_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _BODY = range(6)


@dataclass(slots=True)
class Response:
    """One finished HTTP exchange, with the arrival time of every SSE `data:` payload."""

    status: int
    started: float  # perf_counter() just before the request was written
    headers_at: float  # when the status line and headers had arrived
    finished: float  # when the last byte of the body had arrived
    headers: dict[str, str]
    events: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival, data payload)
    body: bytes = b""  # the body of a response that is not an event stream (e.g. a JSON error)


class _Protocol(asyncio.Protocol):
    """Incremental HTTP/1.1 response parser; one response at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self._buf = bytearray()
        self._waiter: asyncio.Future[Response] | None = None
        self._started = 0.0
        self._reset()

    def _reset(self) -> None:
        self._state = _HEAD
        self._status = 0
        self._headers: dict[str, str] = {}
        self._headers_at = 0.0
        self._sse = False
        self._remaining = 0
        self._pending = bytearray()  # SSE bytes not yet ending in a blank line
        self._body = bytearray()
        self._events: list[tuple[float, bytes]] = []
        self._keep_alive = True

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        """Fail the request in flight, if any."""
        self.lost = exc or ConnectionResetError("connection closed by the server")
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(self.lost)

    def data_received(self, data: bytes) -> None:
        """Parse what arrived; every event completed by this read gets this read's timestamp."""
        now = perf_counter()
        self._buf += data
        try:
            self._parse(now)
        except Exception as exc:  # a malformed response: fail the request, drop the connection
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(exc)
            if self.transport is not None:
                self.transport.abort()

    # -- requests ----------------------------------------------------------------------------------

    def begin(self, request: bytes) -> asyncio.Future[Response]:
        """Write one request; the future resolves when its whole response has arrived."""
        assert self.transport is not None and self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        self._started = perf_counter()
        self.transport.write(request)
        return self._waiter

    # -- parsing -----------------------------------------------------------------------------------

    def _parse(self, now: float) -> None:
        buf = self._buf
        while True:
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                self._head(bytes(buf[:end]), now)
                del buf[: end + 4]
            elif state == _CHUNK_SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
                del buf[: end + 2]
                if size == 0:
                    self._state = _TRAILER
                else:
                    self._remaining = size
                    self._state = _CHUNK_DATA
            elif state in (_CHUNK_DATA, _BODY):
                if not buf:
                    return
                n = min(self._remaining, len(buf))
                self._payload(bytes(buf[:n]), now)
                del buf[:n]
                self._remaining -= n
                if self._remaining:
                    return
                if state == _BODY:
                    self._finish(now)
                else:
                    self._state = _CHUNK_END
            elif state == _CHUNK_END:
                if len(buf) < 2:
                    return
                del buf[:2]
                self._state = _CHUNK_SIZE
            else:  # _TRAILER: optional trailer lines, then a blank line
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:
                    self._finish(now)

    def _head(self, head: bytes, now: float) -> None:
        lines = head.decode("latin-1").split("\r\n")
        self._status = int(lines[0].split(" ", 2)[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self._headers[name.strip().lower()] = value.strip()
        self._headers_at = now
        self._sse = self._headers.get("content-type", "").startswith("text/event-stream")
        self._keep_alive = self._headers.get("connection", "").lower() != "close"
        if "chunked" in self._headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        else:
            self._remaining = int(self._headers.get("content-length", "0"))
            self._state = _BODY
            if self._remaining == 0:
                self._finish(now)

    def _payload(self, data: bytes, now: float) -> None:
        if not self._sse:
            self._body += data
            return
        pending = self._pending
        pending += data
        start = 0
        while True:
            end = pending.find(b"\n\n", start)
            if end < 0:
                break
            for line in bytes(pending[start:end]).split(b"\n"):
                if line.startswith(b"data:"):
                    self._events.append((now, line[5:].lstrip()))
            start = end + 2
        if start:
            del pending[:start]

    def snapshot(self) -> Response | None:
        """What the response in flight has delivered so far (None if no request is in flight)."""
        if self._waiter is None:
            return None
        return Response(
            status=self._status,
            started=self._started,
            headers_at=self._headers_at,
            finished=perf_counter(),
            headers=dict(self._headers),
            events=list(self._events),
        )

    def _finish(self, now: float) -> None:
        response = Response(
            status=self._status,
            started=self._started,
            headers_at=self._headers_at,
            finished=now,
            headers=self._headers,
            events=self._events,
            body=bytes(self._body),
        )
        keep_alive = self._keep_alive
        waiter, self._waiter = self._waiter, None
        self._reset()
        if waiter is not None and not waiter.done():
            waiter.set_result(response)
        if not keep_alive and self.transport is not None:
            self.transport.close()


# A connection idle this long is not reused: uvicorn closes one idle for 5 s (its default keep-alive), and
# a request written just as the server's close is on its way is reset (httpx's keepalive_expiry is 5 s too).
KEEPALIVE_EXPIRY_S = 4.0


class Connection:
    """One keep-alive HTTP/1.1 connection to `host:port` that sends one request at a time."""

    def __init__(self, host: str, port: int, keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S) -> None:
        self.host = host
        self.port = port
        self.keepalive_expiry_s = keepalive_expiry_s
        self._proto: _Protocol | None = None
        self._idle_since = 0.0  # perf_counter() when the last response ended
        # What a request that failed or was cancelled midway had received (its TTFT may be known).
        self.partial: Response | None = None

    async def _ensure(self) -> _Protocol:
        proto = self._proto
        if proto is not None and perf_counter() - self._idle_since > self.keepalive_expiry_s:
            self.close()
            proto = None
        if proto is None or proto.lost is not None or proto.transport is None or proto.transport.is_closing():
            loop = asyncio.get_running_loop()
            _transport, proto = await loop.create_connection(_Protocol, self.host, self.port)
            self._proto = proto
        return proto

    async def post_json(self, path: str, body: bytes, timeout_s: float = 60.0) -> Response:
        """POST `body` (already JSON) and wait for the whole response; the connection is kept for reuse."""
        return await self.request("POST", path, body, timeout_s)

    async def request(self, method: str, path: str, body: bytes = b"", timeout_s: float = 60.0) -> Response:
        """Send one request and wait for the whole response; the connection is kept for reuse."""
        proto = await self._ensure()
        request = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1") + body
        self.partial = None
        try:
            response = await asyncio.wait_for(proto.begin(request), timeout_s)
        except BaseException:
            self.partial = proto.snapshot()
            self.close()  # the connection is in an unknown state; start afresh next time
            raise
        self._idle_since = perf_counter()
        return response

    def close(self) -> None:
        """Drop the connection."""
        if self._proto is not None and self._proto.transport is not None:
            with contextlib.suppress(Exception):
                self._proto.transport.abort()
        self._proto = None


# ---- OpenAI stream chunks, decoded after the fact ----------------------------------------------------


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None  # chat.completion.chunk
    text: str | None = None  # text_completion
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _StreamChunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: dict[str, object] | None = None


_chunk_decoder = msgspec.json.Decoder(_StreamChunk)


@dataclass(slots=True)
class StreamStats:
    """What one streamed OpenAI response measured, all times in seconds."""

    status: int
    ok: bool
    ttfb: float  # request written -> first SSE event (the role chunk, before any token)
    ttft: float  # request written -> first event carrying generated text
    itls: list[float]  # gaps between consecutive events carrying text
    duration: float
    content_events: int
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


def stream_stats(resp: Response) -> StreamStats:
    """Decode the events of a streamed chat or text completion and time them."""
    nan = float("nan")
    if resp.status != 200:
        detail = resp.body[:200].decode(errors="replace")
        return StreamStats(resp.status, False, nan, nan, [], resp.finished - resp.started, 0, 0, 0, detail)
    content_times: list[float] = []
    usage: _Usage | None = None
    error: str | None = None
    done = False
    for arrived, data in resp.events:
        if data == b"[DONE]":
            done = True
            continue
        chunk = _chunk_decoder.decode(data)
        if chunk.error is not None:
            error = str(chunk.error.get("message", chunk.error))
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if (c.delta is not None and c.delta.content) or c.text:
                content_times.append(arrived)
                break
    first = resp.events[0][0] - resp.started if resp.events else nan
    ttft = content_times[0] - resp.started if content_times else nan
    itls = [b - a for a, b in itertools.pairwise(content_times)]
    if error is None and not done:
        error = "stream ended without [DONE]"
    if error is None and usage is None:
        error = "no usage chunk"
    return StreamStats(
        status=resp.status,
        ok=error is None,
        ttfb=first,
        ttft=ttft,
        itls=itls,
        duration=resp.finished - resp.started,
        content_events=len(content_times),
        prompt_tokens=usage.prompt_tokens if usage else 0,
        completion_tokens=usage.completion_tokens if usage else 0,
        error=error,
    )
