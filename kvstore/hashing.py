"""Chained block hashes shared by the router and every engine.

h_i = xxh3_64(h_{i-1} || token ids of block i as little-endian u32), starting from a seed derived
from the model name and the LoRA adapter, over full blocks only. Router and workers compute the
same values from the same token ids, whatever the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

_LE_U32 = np.dtype("<u4")


def chain_seed(model: str, lora_name: str | None = None) -> int:
    """The h_{-1} of every chain for one model and adapter."""
    return xxhash.xxh3_64_intdigest(f"ferry\x00{model}\x00{lora_name or ''}".encode())


def hash_block(parent: int, token_ids: Sequence[int] | np.ndarray) -> int:
    """Hash of one block given its parent's hash."""
    data = parent.to_bytes(8, "little") + np.asarray(token_ids, dtype=_LE_U32).tobytes()
    return xxhash.xxh3_64_intdigest(data)


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    seed: int,
    parent: int | None = None,
) -> list[int]:
    """Hashes of every full block of `token_ids`, chained from `parent` (or the seed)."""
    arr = np.asarray(token_ids, dtype=_LE_U32)
    n_full = len(arr) // block_size
    h = seed if parent is None else parent
    out: list[int] = []
    raw = arr[: n_full * block_size].tobytes()
    step = block_size * 4
    digest = xxhash.xxh3_64_intdigest
    for i in range(n_full):
        h = digest(h.to_bytes(8, "little") + raw[i * step : (i + 1) * step])
        out.append(h)
    return out
