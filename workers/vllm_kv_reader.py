"""vLLM's KV events over ZMQ: a SUB socket on loopback that vLLM's publisher connects to, read in order.

The socket is bound here (an endpoint with a concrete host is a connect address to vLLM), so the port is
picked without a race and never exposed beyond the host. vLLM numbers its batches: a gap or an
undecodable batch means lost events, and the worker's blocks are then cleared rather than left wrong;
workers/kv_bridge.py turns the rest into Ferry's hashes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import KVEventBatch as VllmKVEventBatch

from schemas.kv_events import KVEventBatch
from workers.kv_bridge import KVBridge

logger = logging.getLogger(__name__)

TOPIC = "ferry-kv"
# As deep as vLLM's publisher queue, so a busy loop does not make ZMQ drop events.
RECEIVE_QUEUE = 100_000


class VLLMKVReader:
    """Reads vLLM's KV-event batches and publishes them in Ferry hashes; `on_fail` if the reader dies."""

    def __init__(
        self,
        bridge: KVBridge,
        publish: Callable[[KVEventBatch], None],
        on_fail: Callable[[str], None],
        name: str,
    ) -> None:
        self._bridge = bridge
        self._publish = publish
        self._on_fail = on_fail
        self._name = name
        self._zmq: zmq.asyncio.Context | None = None
        self._task: asyncio.Task[None] | None = None
        self.endpoint = ""
        self.gaps = 0

    def start(self, port: int) -> str:
        """Bind on loopback (`port`, 0 = any free one) and start reading; returns the endpoint for vLLM."""
        ctx = self._zmq = zmq.asyncio.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        host = "tcp://127.0.0.1"
        if port:
            sock.bind(f"{host}:{port}")
        else:
            port = sock.bind_to_random_port(host)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.endpoint = f"{host}:{port}"
        self._task = asyncio.create_task(self._run(sock), name=f"vllm-kv-events:{self._name}")
        return self.endpoint

    async def stop(self) -> None:
        """Stop reading and close the socket."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # the caller itself is being cancelled
        ctx, self._zmq = self._zmq, None
        if ctx is not None:
            ctx.destroy(linger=0)

    async def _run(self, sock: zmq.asyncio.Socket) -> None:
        try:
            await self._read(sock)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("vLLM KV-event reader crashed")
            self._on_fail(f"KV-event reader crashed: {e!r}")

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(VllmKVEventBatch)
        expected = 0
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                logger.warning("ignoring a KV-event message of %d frames", len(frames))
                continue
            _topic, seq_raw, payload = frames
            seq = int.from_bytes(seq_raw, "big")
            if seq != expected:
                # The map is no longer trustworthy. Dropping this worker's blocks only costs cache hits,
                # never correctness.
                logger.warning("KV events %d..%d were lost; clearing this worker's blocks", expected, seq - 1)
                self.gaps += 1
                self._publish(self._bridge.reset())
            expected = seq + 1
            try:
                batch = decoder.decode(payload)
            except msgspec.DecodeError as e:
                logger.warning("undecodable KV-event batch %d (%s); clearing this worker's blocks", seq, e)
                self.gaps += 1
                self._publish(self._bridge.reset())
                continue
            translated = self._bridge.translate(batch)
            if translated is not None:
                self._publish(translated)
