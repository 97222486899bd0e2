"""What a worker publishes about itself in the Redis registry."""

from __future__ import annotations

from typing import Literal

import msgspec

# What a worker does in disaggregated serving: only prefills, only decodes (prefilling short prompts itself),
# or both (aggregated).
WorkerRole = Literal["prefill", "decode", "both"]

# A worker's status key lives this many heartbeat intervals: a worker is dead once it missed them all.
HEARTBEAT_MISSES = 3


class WorkerStatus(msgspec.Struct, omit_defaults=True):
    """One heartbeat: identity, capacity and load of a worker."""

    worker_id: str
    model: str
    engine: str
    block_size: int
    total_blocks: int
    max_model_len: int
    started_at: float
    heartbeat_at: float
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    draining: bool = False
    lora_adapters: list[str] = []
    metrics_url: str = ""
    # How often this worker heartbeats (0: not said, an older worker).
    heartbeat_interval_s: float = 0.0
    role: WorkerRole = "both"
    # Sequences the engine runs at once (--max-num-seqs; 0: not said, an older worker): the fair queue keeps
    # some of them free for tenants under their share (server/tenants_fair.py).
    max_num_seqs: int = 0


class FrontendStatus(msgspec.Struct, omit_defaults=True):
    """A frontend's announcement in the registry: where to reach it (for Prometheus service discovery)."""

    frontend_id: str
    model: str
    url: str
    metrics_url: str
    heartbeat_at: float


status_encoder = msgspec.msgpack.Encoder()
status_decoder: msgspec.msgpack.Decoder[WorkerStatus] = msgspec.msgpack.Decoder(WorkerStatus)
frontend_decoder: msgspec.msgpack.Decoder[FrontendStatus] = msgspec.msgpack.Decoder(FrontendStatus)
