"""The simulated engine's host-memory KV tier: device blocks evicted to a larger, slower LRU store.

A cached device block the pool evicts is copied here (device -> host, d2h); a prompt whose next blocks are
here after its device-cached prefix loads them back (h2d) instead of recomputing them, and the step that
does so takes longer by the bytes moved over the link's bandwidth. Its blocks are announced as KV events
with medium MEDIUM_HOST, so the router can weigh them below device blocks. Modelled after Dynamo's mocker
(`--num-host-blocks`, `--host-offload-{h2d,d2h}-bandwidth-gbps`, `--kv-bytes-per-token`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

# vLLM's default dtype ("auto") serves float32 checkpoints in 16 bits on a GPU, so their KV cache is 16-bit too.
_DTYPE_BYTES = {"float32": 2, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1, "int8": 1}


def kv_bytes_per_token(model_path: str | Path) -> int:
    """KV bytes one token takes, from the model's config.json: layers x kv heads x head dim x 2 (K, V) x dtype bytes."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg.get("num_attention_heads", 1))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return layers * kv_heads * head_dim * 2 * _DTYPE_BYTES.get(dtype, 2)


class HostTier:
    """LRU set of block hashes held in host memory, with the cost of moving blocks over the link."""

    def __init__(self, num_blocks: int, block_bytes: int, h2d_gbps: float, d2h_gbps: float) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._block_bytes = block_bytes
        # Non-positive bandwidth: the transfer is free (overlapped with compute), as in Dynamo's mocker.
        self._h2d_bps = h2d_gbps * 1e9
        self._d2h_bps = d2h_gbps * 1e9
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._seconds = 0.0
        # Counters for stats and tests.
        self.loaded_blocks = 0
        self.offloaded_blocks = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def hashes(self) -> list[int]:
        """Every hash held (for resynchronising an index, not per step)."""
        return list(self._lru)

    def leading(self, hashes: Sequence[int]) -> int:
        """Number of leading `hashes` held here."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def offload(self, block_hash: int) -> tuple[bool, list[int]]:
        """Copy an evicted device block here: (newly stored?, hashes dropped to make room)."""
        if block_hash in self._lru:
            # Already here (it was loaded back and kept): no copy, only recency.
            self._lru.move_to_end(block_hash)
            return False, []
        self._lru[block_hash] = None
        self.offloaded_blocks += 1
        if self._d2h_bps > 0:
            self._seconds += self._block_bytes / self._d2h_bps
        dropped: list[int] = []
        while len(self._lru) > self.num_blocks:
            dropped.append(self._lru.popitem(last=False)[0])
        return True, dropped

    def load(self, hashes: Sequence[int]) -> None:
        """Copy these held blocks back to the device (the host copies stay, most recently used)."""
        for h in hashes:
            self._lru.move_to_end(h)
        self.loaded_blocks += len(hashes)
        if self._h2d_bps > 0:
            self._seconds += len(hashes) * self._block_bytes / self._h2d_bps

    def clear(self) -> None:
        """Drop every block."""
        self._lru.clear()

    def take_seconds(self) -> float:
        """Link time of the transfers since the previous call."""
        s, self._seconds = self._seconds, 0.0
        return s


class HostTierSettings(Protocol):
    """The fields of SimConfig that shape the host tier."""

    @property
    def block_size(self) -> int: ...
    @property
    def num_host_blocks(self) -> int: ...
    @property
    def host_offload_h2d_bandwidth_gbps(self) -> float: ...
    @property
    def host_offload_d2h_bandwidth_gbps(self) -> float: ...
    @property
    def kv_bytes_per_token(self) -> int: ...


def host_tier(c: HostTierSettings) -> HostTier | None:
    """The host tier a simulated engine's settings ask for; None when it has 0 host blocks (off)."""
    if c.num_host_blocks == 0:
        return None
    bandwidths = (c.host_offload_h2d_bandwidth_gbps, c.host_offload_d2h_bandwidth_gbps)
    return HostTier(c.num_host_blocks, c.block_size * c.kv_bytes_per_token, *bandwidths)
