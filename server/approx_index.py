"""Approximate KV index for routing without KV events: the router's own decisions, forgotten after a TTL."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence


class ApproxIndex:
    """Blocks each worker was sent recently, assumed cached there until `ttl_s` passes."""

    def __init__(self, ttl_s: float, max_blocks: int = 1_000_000) -> None:
        self._ttl_s = ttl_s
        self._max = max_blocks
        # (model, hash) -> {worker: expiry}; ordered by last write so the oldest go first.
        self._blocks: OrderedDict[tuple[str, int], dict[str, float]] = OrderedDict()

    def record(
        self, model: str, worker_id: str, block_hashes: Sequence[int], now: float | None = None
    ) -> None:
        """Remember that `worker_id` will hold these blocks."""
        now = time.monotonic() if now is None else now
        expiry = now + self._ttl_s
        for h in block_hashes:
            key = (model, h)
            holders = self._blocks.get(key)
            if holders is None:
                holders = self._blocks[key] = {}
            else:
                self._blocks.move_to_end(key)
            holders[worker_id] = expiry
        while len(self._blocks) > self._max:
            self._blocks.popitem(last=False)
        self._expire(now)

    def _expire(self, now: float) -> None:
        # Every write sets an expiry of now + ttl and moves its key to the end, so the first key's latest
        # expiry is the earliest of all: drop from the front while it has passed. Without this, blocks of
        # prompts seen once stay until `max_blocks` (a frontend's memory and its GC passes grow for an hour).
        while self._blocks:
            holders = next(iter(self._blocks.values()))
            if holders and max(holders.values()) > now:
                break
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        """Blocks remembered (some may have expired but not been dropped yet)."""
        return len(self._blocks)

    def overlaps(self, model: str, block_hashes: Sequence[int], now: float | None = None) -> dict[str, int]:
        """Leading blocks of the chain each worker is believed to hold."""
        now = time.monotonic() if now is None else now
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(block_hashes):
            holders = self._blocks.get((model, h))
            if not holders:
                break
            live = {w for w, exp in holders.items() if exp > now}
            if alive is not None:
                live &= alive
            if not live:
                break
            for w in live:
                out[w] = i + 1
            alive = live
        return out

    def forget_worker(self, worker_id: str) -> None:
        """Drop a dead worker everywhere."""
        for holders in self._blocks.values():
            holders.pop(worker_id, None)
