"""LoRA adapters at runtime: the Kafka exchange behind the frontend's admin endpoints (server/routes.py).

Loads and unloads take vLLM's bodies (`{"lora_name", "lora_path"}`), send `LoadLora`/`UnloadLora` to the
workers' request topics and wait for each worker's `LoraAck` on this frontend's admin topic. Workers publish their adapters in their
heartbeats, which is what routing and `/v1/models` read; `GET /v1/admin/lora_adapters` lists them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from bus.doorbell import Doorbell
from bus.read_spec import Batch, Hooks, Options, Poll, Tail
from bus.reader import Reader
from kvstore.bells import Bells
from schemas.admin import (
    LoadLoraAdapterRequest,
    LoraAdapter,
    UnloadLoraAdapterRequest,
)
from schemas.kafka import LoadLora, LoraAck, UnloadLora, admin_reply_decoder, request_encoder
from schemas.names import request_topic
from schemas.status import WorkerStatus
from server.errors import APIError, broker_unavailable
from server.pool import WorkerPool

log = logging.getLogger("ferry.frontend")

T = TypeVar("T")

# How long a worker may take to answer a load or unload (vLLM loads a small adapter in well under 1 s).
ACK_TIMEOUT_S = 30.0

# What a worker's refusal means for the operator.
_STATUS = {"lora_invalid": 400, "lora_exists": 400, "lora_not_supported": 400, "lora_not_found": 404}


class AckInbox:
    """Reads this frontend's admin topic and hands each LoraAck to the operation waiting for it."""

    def __init__(self, bootstrap: str, topic: str, fetch_wait_ms: int = 100) -> None:
        self.topic = topic
        self._waiting: dict[str, asyncio.Queue[LoraAck]] = {}
        # Acks matter only to operations waiting for them: with none, the reader sleeps until one starts.
        self._bell = Doorbell()
        self._reader = Reader(
            "admin acks",
            bootstrap,
            admin_reply_decoder,
            Options(fetch_wait_ms=fetch_wait_ms, poll=Poll(1000, 256), watch_reset=True),
            Hooks(self._handle, failed=self._failed, may_sleep=lambda: not self._waiting),
            self._bell,
        )
        self.failed: BaseException | None = None

    async def start(self) -> None:
        """Create the topic and position at its end, so only answers to this process's operations count."""
        await self._reader.start(Tail(self.topic))

    async def stop(self) -> None:
        """Stop reading."""
        await self._reader.stop()

    def expect(self, op_id: str) -> asyncio.Queue[LoraAck]:
        """A mailbox for the acks of operation `op_id`; release it with `forget`."""
        if self.failed is not None:
            raise APIError(
                503, "The admin reply stream of this frontend is down.", code="frontend_unavailable"
            )
        # Bounded by the number of workers asked: each answers once.
        box: asyncio.Queue[LoraAck] = asyncio.Queue()
        self._waiting[op_id] = box
        self._bell.ring()
        return box

    def forget(self, op_id: str) -> None:
        """Drop the mailbox of `op_id` (late acks are then ignored)."""
        self._waiting.pop(op_id, None)

    async def _handle(self, batch: Batch[LoraAck]) -> None:
        for _record, ack in batch.messages:
            box = self._waiting.get(ack.op_id)
            if box is not None:
                box.put_nowait(ack)

    def _failed(self, exc: BaseException) -> None:
        # Waiting operations time out on their own; new ones are refused from now on.
        self.failed = exc


class LoraAdmin:
    """Loads and unloads adapters on workers and reports which workers hold which."""

    def __init__(
        self,
        inbox: AckInbox,
        producer: AIOKafkaProducer,
        pool: WorkerPool,
        base_model: str,
        timeout_s: float = ACK_TIMEOUT_S,
        send_timeout_s: float = 5.0,
        bells: Bells | None = None,
    ) -> None:
        self.inbox = inbox
        self._bells = bells
        self._producer = producer
        self._pool = pool
        self.base_model = base_model
        self.timeout_s = timeout_s
        self._send_timeout_s = send_timeout_s
        # Where adapters loaded through this frontend came from (for listings); workers know only names.
        self.paths: dict[str, str] = {}

    # ---- operations ------------------------------------------------------------------------------

    async def load(self, body: LoadLoraAdapterRequest) -> LoraAdapter:
        """Load an adapter onto one named worker or every live worker of the model that serves LoRA."""
        name, path = body.lora_name.strip(), body.lora_path.strip()
        if not name:
            raise APIError(400, "'lora_name' must not be empty.", param="lora_name", code="invalid_value")
        if name == self.base_model:
            raise APIError(
                400,
                f"'lora_name' cannot be the base model's name `{name}`.",
                param="lora_name",
                code="invalid_value",
            )
        if not path:
            raise APIError(400, "'lora_path' must not be empty.", param="lora_path", code="invalid_value")
        targets = self._targets(body.worker_id, lambda w: True)
        acks = await self._exchange(targets, lambda op, topic: LoadLora(op, name, path, topic))
        if body.worker_id is None:
            # Asking everyone: workers started without LoRA slots just say so.
            acks = {
                w: a
                for w, a in acks.items()
                if a is None or a.error is None or a.error.code != "lora_not_supported"
            }
            if not acks:
                raise APIError(
                    400,
                    f"No live worker of `{self.base_model}` serves LoRA adapters (start workers with --max-loras N).",
                    code="lora_not_supported",
                )
        done = self._outcome(acks, "load", name)
        self.paths[name] = path
        await self._pool.tick()
        log.info("LoRA adapter %s loaded from %s on %s", name, path, ", ".join(done))
        return LoraAdapter(lora_name=name, base_model=self.base_model, workers=done, lora_path=path)

    async def unload(self, body: UnloadLoraAdapterRequest) -> LoraAdapter:
        """Unload an adapter from one named worker or from every worker that holds it."""
        name = body.lora_name.strip()
        targets = self._targets(body.worker_id, lambda w: name in w.lora_adapters)
        if not targets:
            raise APIError(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="lora_not_found"
            )
        acks = await self._exchange(targets, lambda op, topic: UnloadLora(op, name, topic))
        if body.worker_id is None:
            # A worker listed it a heartbeat ago and dropped it since (another frontend unloaded it).
            acks = {
                w: a
                for w, a in acks.items()
                if a is None or a.error is None or a.error.code != "lora_not_found"
            }
        done = self._outcome(acks, "unload", name)
        if not any(name in w.lora_adapters for w in self._pool.workers.values() if w.worker_id not in done):
            self.paths.pop(name, None)
        await self._pool.tick()
        log.info("LoRA adapter %s unloaded from %s", name, ", ".join(done) or "no worker")
        return LoraAdapter(lora_name=name, base_model=self.base_model, workers=done)

    def listing(self) -> list[LoraAdapter]:
        """Adapters that live workers hold, with the workers holding each."""
        holders: dict[str, list[str]] = {}
        base: dict[str, str] = {}
        for w in sorted(self._pool.workers.values(), key=lambda w: w.worker_id):
            if w.draining:
                continue
            for name in w.lora_adapters:
                holders.setdefault(name, []).append(w.worker_id)
                base[name] = w.model
        return [
            LoraAdapter(lora_name=n, base_model=base[n], workers=ws, lora_path=self.paths.get(n))
            for n, ws in sorted(holders.items())
        ]

    # ---- helpers ---------------------------------------------------------------------------------

    def _targets(self, worker_id: str | None, wanted: Callable[[WorkerStatus], bool]) -> list[str]:
        live = [w for w in self._pool.live(self.base_model) if w.model == self.base_model]
        if worker_id is not None:
            if not any(w.worker_id == worker_id for w in live):
                raise APIError(
                    404,
                    f"No live worker `{worker_id}` serves `{self.base_model}`.",
                    param="worker_id",
                    code="worker_not_found",
                )
            return [worker_id]
        if not live:
            raise APIError(
                503,
                f"No live worker serves the model `{self.base_model}` right now.",
                code="no_workers",
                retry_after=1,
            )
        return sorted(w.worker_id for w in live if wanted(w))

    async def _exchange(
        self, targets: list[str], make: Callable[[str, str], LoadLora | UnloadLora]
    ) -> dict[str, LoraAck | None]:
        """Send one control message to each target and collect their acks; None for a worker that never answered."""
        op_id = f"lora-{secrets.token_hex(8)}"
        box = self.inbox.expect(op_id)
        acks: dict[str, LoraAck | None] = dict.fromkeys(targets)
        try:
            msg = make(op_id, self.inbox.topic)
            raw = request_encoder.encode(msg)
            try:
                async with asyncio.timeout(self._send_timeout_s):
                    await asyncio.gather(
                        *(
                            self._producer.send_and_wait(
                                request_topic(w), raw, key=op_id.encode(), partition=0
                            )
                            for w in targets
                        )
                    )
            except (KafkaError, TimeoutError) as exc:
                raise broker_unavailable() from exc
            if self._bells is not None:
                for w in targets:
                    self._bells.ring_soon(w)
            pending = set(targets)
            try:
                async with asyncio.timeout(self.timeout_s):
                    while pending:
                        ack = await box.get()
                        if ack.worker_id in pending:
                            pending.discard(ack.worker_id)
                            acks[ack.worker_id] = ack
            except TimeoutError:
                pass
        finally:
            self.inbox.forget(op_id)
        return acks

    def _outcome(self, acks: dict[str, LoraAck | None], verb: str, name: str) -> list[str]:
        """Workers that did what was asked; an APIError naming the others if any failed."""
        done = sorted(w for w, a in acks.items() if a is not None and a.error is None)
        silent = sorted(w for w, a in acks.items() if a is None)
        failed = {w: a.error for w, a in acks.items() if a is not None and a.error is not None}
        so_far = f" ({verb}ed on {', '.join(done)})" if done else ""
        if failed:
            w, err = sorted(failed.items())[0]
            status = _STATUS.get(err.code, 503 if err.retriable else 500)
            raise APIError(
                status, f"Worker {w} could not {verb} '{name}': {err.message}{so_far}", code=err.code
            )
        if silent:
            raise APIError(
                504,
                f"Worker(s) {', '.join(silent)} did not answer the {verb} of '{name}' within "
                f"{self.timeout_s:.0f}s{so_far}.",
                code="worker_timeout",
            )
        return done
