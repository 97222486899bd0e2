"""The simulated engine's knobs (workers/sim.py): its cache, batch limits, timing, output lengths and KV tiers."""

from __future__ import annotations

import msgspec


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of the simulated engine; `seed` salts every output and must match across a model's workers."""

    block_size: int = 64
    num_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    speedup: float = 1.0
    max_model_len: int = 8192
    # Natural output length range, used when ignore_eos is false.
    min_output_tokens: int = 16
    max_output_tokens: int = 256
    seed: int = 0
    # KV-event batches kept for a slow reader before the oldest are dropped.
    max_pending_kv_batches: int = 1024
    # Host-memory KV tier (workers/host_tier.py): 0 blocks = off; a bandwidth of 0 = free transfers.
    num_host_blocks: int = 0
    host_offload_h2d_bandwidth_gbps: float = 32.0
    host_offload_d2h_bandwidth_gbps: float = 0.0
    kv_bytes_per_token: int = 0
    # Disaggregated serving: GB/s of receiving a prompt's KV from a prefill worker (workers/sim_transfer.py).
    kv_transfer_bandwidth_gbps: float = 64.0

    def __post_init__(self) -> None:
        positive = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.speedup <= 0:
            raise ValueError("speedup must be positive")
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            raise ValueError("need 1 <= min_output_tokens <= max_output_tokens")
        if self.max_pending_kv_batches <= 0 or min(self.num_host_blocks, self.kv_bytes_per_token) < 0:
            raise ValueError("need max_pending_kv_batches > 0 and num_host_blocks, kv_bytes_per_token >= 0")
        # Guarantees that any admitted sequence fits alone, so preemption always makes progress.
        if self.max_model_len > self.num_blocks * self.block_size:
            raise ValueError("max_model_len exceeds the KV capacity (num_blocks * block_size)")
