"""Translates vLLM's KV-cache events (its own block hashes) into Ferry's chained block hashes.

vLLM publishes each newly cached block with its vLLM hash (sha256-based, `bytes` by default or a
64-bit `int` with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), the parent block's vLLM hash and the block's
token ids. The router only knows token ids, so the bridge recomputes Ferry's hash of every stored
block from its parent's Ferry hash and its tokens, remembers vLLM hash -> Ferry hash, and uses that
map to translate removals. Pure logic: no I/O and no vLLM import, so it is tested without vLLM.

Events of the host-memory offload tier (vLLM's OffloadingConnector, medium "CPU") are kept and passed on
with their medium, tracked apart from the device pool's (a block may be in both), so the router can weigh
host blocks below device ones. Other media (vLLM's "STORAGE") are not indexed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvstore.hashing import block_hashes, chain_seed
from schemas.kv_events import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

logger = logging.getLogger(__name__)

VllmBlockHash = int | bytes

# vLLM tags the device-resident pool "GPU" even on the CPU backend; "CPU" is the host offload tier.
_TRACKED_MEDIA = (None, MEDIUM_DEVICE, MEDIUM_HOST)


class VllmEventBatch(Protocol):
    """What the bridge reads from `vllm.distributed.kv_events.KVEventBatch`."""

    @property
    def ts(self) -> float:
        """Wall-clock time of the engine step."""
        ...

    @property
    def events(self) -> Sequence[Any]:
        """vLLM's BlockStored, BlockRemoved and AllBlocksCleared events of that step."""
        ...


@dataclass(slots=True)
class _Known:
    ferry_hash: int
    # vLLM may cache the same content twice (two requests computed the block in the same step) and
    # then reports one BlockStored and one BlockRemoved per copy; the block is gone after the last.
    copies: int = 1


class KVBridge:
    """Stateful translator of one engine's vLLM KV events into Ferry KV events."""

    def __init__(self, model: str, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self._known: dict[VllmBlockHash, _Known] = {}
        # The same for the host tier's copies.
        self._host: dict[VllmBlockHash, _Known] = {}
        self._warned_unknown = False
        # Counters for metrics and tests: blocks that could not be translated.
        self.skipped_blocks = 0

    def __len__(self) -> int:
        return len(self._known) + len(self._host)

    def ferry_hash(self, vllm_hash: VllmBlockHash) -> int | None:
        """The Ferry hash of a cached vLLM block (on either tier), or None if the bridge does not know it."""
        known = self._known.get(vllm_hash) or self._host.get(vllm_hash)
        return None if known is None else known.ferry_hash

    def translate(self, batch: VllmEventBatch) -> KVEventBatch | None:
        """Ferry events for one vLLM batch; None when nothing in it concerns the index."""
        out: list[KVEvent] = []
        for event in batch.events:
            # Dispatch on the msgspec tag vLLM encodes (the class name), so no vLLM import is needed.
            match type(event).__name__:
                case "BlockStored":
                    stored = self._stored(event)
                    if stored is not None:
                        out.append(stored)
                case "BlockRemoved":
                    removed = self._removed(event)
                    if removed is not None:
                        out.append(removed)
                case "AllBlocksCleared":
                    self._known.clear()
                    self._host.clear()
                    out.append(AllBlocksCleared())
                case other:
                    logger.debug("ignoring vLLM KV event of kind %s", other)
        return KVEventBatch(ts=batch.ts, events=out) if out else None

    def reset(self) -> KVEventBatch:
        """Forget every block (events were lost) and tell the index to drop this engine's blocks."""
        self._known.clear()
        self._host.clear()
        self._warned_unknown = False
        return KVEventBatch(ts=time.time(), events=[AllBlocksCleared()])

    def snapshot(self) -> KVEventBatch:
        """The whole known cache as one batch, for a reader that fell behind."""
        events: list[KVEvent] = [AllBlocksCleared()]
        if self._known:
            events.append(BlockStored(block_hashes=[k.ferry_hash for k in self._known.values()]))
        if self._host:
            host = [k.ferry_hash for k in self._host.values()]
            events.append(BlockStored(block_hashes=host, medium=MEDIUM_HOST))
        return KVEventBatch(ts=time.time(), events=events)

    def _tracked(self, event: Any) -> bool:
        medium = getattr(event, "medium", None)
        # Ferry indexes one chain per model; further groups (sliding window, Mamba state) of hybrid
        # models describe the same tokens again.
        group = getattr(event, "group_idx", None)
        return medium in _TRACKED_MEDIA and group in (None, 0)

    def _table(self, event: Any) -> tuple[dict[VllmBlockHash, _Known], str | None]:
        if getattr(event, "medium", None) == MEDIUM_HOST:
            return self._host, MEDIUM_HOST
        return self._known, None

    def _stored(self, event: Any) -> BlockStored | None:
        hashes: list[VllmBlockHash] = list(event.block_hashes)
        if not hashes or not self._tracked(event):
            return None
        table, medium = self._table(event)
        lora_name: str | None = getattr(event, "lora_name", None)
        # An offloaded copy of blocks the device pool reported: its Ferry hashes are known already (vLLM
        # may also send such a copy as a placeholder, without tokens).
        copied = [f for h in hashes if (f := self.ferry_hash(h)) is not None] if medium is not None else []
        if copied and len(copied) == len(hashes):
            self._remember(table, hashes, copied)
            return BlockStored(block_hashes=copied, lora_name=lora_name, medium=medium)
        tokens: Sequence[int] = event.token_ids
        if event.block_size != self.block_size or len(tokens) != len(hashes) * self.block_size:
            logger.warning(
                "skipping %d vLLM block(s) of %d tokens in blocks of %d; Ferry hashes blocks of %d",
                len(hashes),
                len(tokens),
                event.block_size,
                self.block_size,
            )
            self.skipped_blocks += len(hashes)
            return None
        parent_vllm = event.parent_block_hash
        parent: int | None = None
        if parent_vllm is not None:
            parent = self.ferry_hash(parent_vllm)
            if parent is None:
                # Without the parent's Ferry hash the chain cannot be continued; a guessed hash
                # would make the router trust blocks this engine does not hold.
                self._warn_unknown(len(hashes))
                return None
        ferry = block_hashes(tokens, self.block_size, chain_seed(self.model, lora_name), parent=parent)
        self._remember(table, hashes, ferry)
        return BlockStored(block_hashes=ferry, parent_hash=parent, lora_name=lora_name, medium=medium)

    @staticmethod
    def _remember(table: dict[VllmBlockHash, _Known], hashes: list[VllmBlockHash], ferry: list[int]) -> None:
        for vllm_hash, ferry_hash in zip(hashes, ferry, strict=True):
            known = table.get(vllm_hash)
            if known is None:
                table[vllm_hash] = _Known(ferry_hash)
            else:
                known.copies += 1

    def _removed(self, event: Any) -> BlockRemoved | None:
        if not self._tracked(event):
            return None
        table, medium = self._table(event)
        gone = list(self._forget(table, event.block_hashes))
        return BlockRemoved(block_hashes=gone, medium=medium) if gone else None

    @staticmethod
    def _forget(table: dict[VllmBlockHash, _Known], hashes: Iterable[VllmBlockHash]) -> Iterable[int]:
        for vllm_hash in hashes:
            known = table.get(vllm_hash)
            if known is None:
                # Blocks stored before a reset, or skipped above: the index never had them.
                continue
            known.copies -= 1
            if known.copies == 0:
                del table[vllm_hash]
                yield known.ferry_hash

    def _warn_unknown(self, n: int) -> None:
        self.skipped_blocks += n
        if not self._warned_unknown:
            self._warned_unknown = True
            logger.warning("skipping vLLM blocks whose parent block is unknown (events were lost)")
        else:
            logger.debug("skipping %d vLLM block(s) with an unknown parent", n)
