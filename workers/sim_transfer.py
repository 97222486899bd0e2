"""The simulated engine's side of disaggregated serving: receiving a sequence's prompt KV from a prefill worker.

A request whose `kv_from` names a prefill worker takes that worker's leading full prompt blocks instead of
computing them: they count as computed at admission (and as cached tokens, as vLLM counts KV a connector
loaded), are stored in this engine's pool like computed blocks (KV events as usual), and only the rest of
the sequence (the partial last block and the prefill worker's token) is prefilled here. Receiving them
takes `blocks x block_size x kv_bytes_per_token / bandwidth` (the formula the host tier charges its loads,
workers/host_tier.py), for the blocks this engine does not already cache; transfers share one link, in
arrival order. The sequence alone waits for its KV: the engine's other sequences keep stepping meanwhile,
as a NIXL-style transfer overlaps the decode worker's compute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvstore.hashing import block_hashes
from schemas.kafka import KVFrom


def transfer_seconds(blocks: int, block_size: int, kv_bytes_per_token: int, bandwidth_gbps: float) -> float:
    """Link time of moving `blocks` KV blocks; 0 with a non-positive bandwidth (free, as Dynamo's 0)."""
    if bandwidth_gbps <= 0 or blocks <= 0:
        return 0.0
    return blocks * block_size * kv_bytes_per_token / (bandwidth_gbps * 1e9)


def received_blocks(kv_from: KVFrom | None, num_tokens: int, block_size: int) -> int:
    """Leading full blocks of a sequence of `num_tokens` taken from its prefill worker: those it holds,
    leaving at least one token to compute (as a cache hit does)."""
    if kv_from is None:
        return 0
    return max(0, min(kv_from.blocks, (num_tokens - 1) // block_size))


class TransferSettings(Protocol):
    """The fields of SimConfig that shape the incoming KV link."""

    @property
    def block_size(self) -> int: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    @property
    def kv_transfer_bandwidth_gbps(self) -> float: ...
    @property
    def speedup(self) -> float: ...


class KVReceiver:
    """One engine's incoming KV link: how many blocks a sequence receives and when its KV has arrived.

    `cached_prefix` answers how many leading blocks of a hash chain the engine's own pool holds.
    """

    def __init__(self, c: TransferSettings, cached_prefix: Callable[[Sequence[int]], int]) -> None:
        self._block_size = c.block_size
        self._kv_bytes = c.kv_bytes_per_token
        self._gbps = c.kv_transfer_bandwidth_gbps
        self._speedup = c.speedup
        self._cached_prefix = cached_prefix
        self._link_free_at = 0.0
        # Counters for stats and tests.
        self.received_blocks = 0
        self.transferred_blocks = 0

    def receive(
        self, kv_from: KVFrom | None, tokens: list[int], seed: int, arrived: Callable[[], None]
    ) -> int:
        """Start receiving a sequence's KV: returns the blocks it receives; `arrived` is called (soon or at once)
        when they are here. Blocks this engine already caches are not sent again."""
        n = received_blocks(kv_from, len(tokens), self._block_size)
        if n == 0:
            arrived()
            return 0
        hashes = block_hashes(tokens[: n * self._block_size], self._block_size, seed)
        moved = n - self._cached_prefix(hashes)
        self.received_blocks += n
        self.transferred_blocks += moved
        seconds = transfer_seconds(moved, self._block_size, self._kv_bytes, self._gbps) / self._speedup
        if seconds <= 0:
            arrived()
            return n
        now = time.monotonic()
        self._link_free_at = max(now, self._link_free_at) + seconds
        asyncio.get_running_loop().call_later(self._link_free_at - now, arrived)
        return n
