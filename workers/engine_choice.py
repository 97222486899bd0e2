"""Which engine a worker runs: the one its settings name, configured from the model directory and settings."""

from __future__ import annotations

from schemas.settings import WorkerSettings
from workers.engine import Engine
from workers.model_dir import load_model_info


def build_engine(settings: WorkerSettings) -> Engine:
    """The engine `settings.engine` names, configured from the model directory and settings."""
    if settings.engine == "vllm":
        # Imported only here: vLLM is an optional install and takes seconds to import.
        from workers.vllm_engine import VLLMConfig, VLLMEngine

        vllm_config = VLLMConfig(
            block_size=settings.block_size,
            max_model_len=settings.max_model_len or VLLMConfig().max_model_len,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            kv_cache_gib=settings.kv_cache_gib,
            kv_events_port=settings.kv_events_port,
            max_loras=settings.max_loras,
            max_lora_rank=settings.max_lora_rank,
        )
        return VLLMEngine(settings.served_model_name, settings.model_path, vllm_config)

    from workers.sim import SimConfig, SimEngine

    info = load_model_info(settings.model_path)
    max_len = settings.max_model_len or info.max_position_embeddings
    config = SimConfig(
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        speedup=settings.speedup,
        max_model_len=max_len,
    )
    return SimEngine(settings.served_model_name, info.tokenizer, config, eos_token_id=info.eos_token_id)
