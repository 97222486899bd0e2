"""The engines' settings, part of every worker's (schemas/settings.py): what both engines take, and each one's own."""

from __future__ import annotations

import dataclasses

from schemas.setting_help import _help


@dataclasses.dataclass(kw_only=True)
class EngineSettings:
    """Engine: what both engines take (workers/sim.py, workers/vllm_engine.py)."""

    max_model_len: int = dataclasses.field(
        default=0,
        metadata=_help("context length; 0 = the model's own (sim, vllm on a GPU) or 2048 (vllm on CPU)"),
    )
    block_size: int = dataclasses.field(
        default=64, metadata=_help("KV block size in tokens (vllm on CPU: a multiple of 32)")
    )
    max_num_seqs: int = dataclasses.field(default=256, metadata=_help("sequences batched per step"))
    max_num_batched_tokens: int = dataclasses.field(default=8192, metadata=_help("token budget per step"))


@dataclasses.dataclass(kw_only=True)
class SimSettings(EngineSettings):
    """Simulated engine: its SimConfig (workers/sim.py)."""

    num_blocks: int = dataclasses.field(default=16384, metadata=_help("sim: KV blocks in the pool"))
    speedup: float = dataclasses.field(default=1.0, metadata=_help("sim: divide simulated step time by this"))
    num_host_blocks: int = dataclasses.field(
        default=0,
        metadata=_help("sim: KV blocks of the host-memory tier device blocks are evicted to; 0 = off"),
    )
    host_offload_h2d_bandwidth_gbps: float = dataclasses.field(
        default=32.0,
        metadata=_help("sim: GB/s of loading host blocks back to the device, added to the step; 0 = free"),
    )
    host_offload_d2h_bandwidth_gbps: float = dataclasses.field(
        default=0.0,
        metadata=_help("sim: GB/s of offloading evicted blocks to the host, added to the step; 0 = free"),
    )
    kv_bytes_per_token: int = dataclasses.field(
        default=0,
        metadata=_help(
            "sim: KV bytes per token for host and P/D transfers; 0 = from the model's config.json"
        ),
    )
    kv_transfer_bandwidth_gbps: float = dataclasses.field(
        default=64.0,
        metadata=_help(
            "sim: GB/s of receiving a prompt's KV blocks from a prefill worker (delays that sequence only; wall "
            "time, not scaled by --speedup); 0 = free"
        ),
    )


@dataclasses.dataclass(kw_only=True)
class VLLMSettings(EngineSettings):
    """vLLM engine: its VLLMConfig (workers/vllm_config.py)."""

    kv_cache_gib: float = dataclasses.field(
        default=0.0,
        metadata=_help(
            "vllm: KV cache size in GiB; 0 = 1 GiB on CPU, vLLM's --gpu-memory-utilization on a GPU"
        ),
    )
    kv_events_port: int = dataclasses.field(
        default=0, metadata=_help("vllm: loopback port for vLLM's KV events; 0 = any free port")
    )
    max_loras: int = dataclasses.field(
        default=0, metadata=_help("vllm: LoRA adapters one engine step can mix; 0 = LoRA off (faster start)")
    )
    max_lora_rank: int = dataclasses.field(
        default=16, metadata=_help("vllm: largest LoRA rank an adapter may have (8, 16, 32, 64, ...)")
    )
    lora_modules: str = dataclasses.field(
        default="",
        metadata=_help(
            "vllm: LoRA adapters loaded at start, served from the first heartbeat: name=/abs/path ... "
            "(as vLLM's --lora-modules; --max-loras defaults to their number)"
        )
        | {"nargs": "+"},
    )
