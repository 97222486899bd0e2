"""Resumable streams' records in Redis: where a request's chunks are, and whether a resumed reader is attached."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from schemas.names import RedisKeys
from schemas.streams import StreamRecord, stream_record_decoder, stream_record_encoder

log = logging.getLogger("ferry.frontend")


class ResumeStore:
    """StreamRecords in Redis, and the marks of attached resumed readers."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, ttl_s: float, grace_s: float) -> None:
        self._redis = redis
        self._keys = keys
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._grace_ms = max(1, int(grace_s * 1000))

    async def save(self, request_id: str, record: StreamRecord) -> None:
        """Remember where a request's chunks are, for `ttl_s`."""
        await self._redis.set(
            self._keys.stream(request_id), stream_record_encoder.encode(record), px=self._ttl_ms
        )

    async def load(self, request_id: str) -> StreamRecord | None:
        """The record of a resumable request, or None if unknown or expired."""
        raw = await self._redis.get(self._keys.stream(request_id))
        if raw is None:
            return None
        return stream_record_decoder.decode(raw.encode() if isinstance(raw, str) else raw)

    async def attach(self, request_id: str) -> None:
        """Mark a reader attached for one grace period (refresh it more often than that)."""
        await self._redis.set(self._keys.stream_reader(request_id), b"1", px=self._grace_ms)

    async def attached(self, request_id: str) -> bool:
        """True while some frontend has a resumed reader on the request."""
        try:
            return bool(await self._redis.exists(self._keys.stream_reader(request_id)))
        except Exception as exc:
            # Without Redis nobody can tell: keep the request running rather than cut off a reader.
            log.warning("cannot tell whether %s has a reader (%r); assuming it does", request_id, exc)
            return True
