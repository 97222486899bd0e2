"""Which engine a worker runs: the one its settings name, built from that engine's settings group.

SimConfig and VLLMConfig take the fields of SimSettings and VLLMSettings under the same names, so a setting
added to a group reaches its engine without a copy here (and fails at start-up if the engine lacks it).
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.engine_settings import SimSettings, VLLMSettings
from schemas.settings import WorkerSettings, values_of
from workers.engine import Engine
from workers.model_dir import load_model_info

# vLLM's flag for the KV connector, whole (a JSON object) or one key at a time (`--kv-transfer-config.kv_role`).
_KV_TRANSFER_FLAGS = ("--kv-transfer-config", "--kv-transfer-config.kv_connector")


def kv_connector_given(engine_flags: Sequence[str]) -> bool:
    """Whether vLLM's engine flags name a KV connector (what moves a prompt's KV between P/D engines)."""
    return any(flag.split("=", 1)[0] in _KV_TRANSFER_FLAGS for flag in engine_flags)


def build_engine(settings: WorkerSettings, engine_flags: Sequence[str] = ()) -> Engine:
    """The engine `settings.engine` names; a max_model_len of 0 becomes the engine's own. `engine_flags` are
    vLLM's own engine flags (`--dtype bfloat16`), which only the vLLM engine takes."""
    if settings.engine == "vllm":
        if settings.role != "both" and not kv_connector_given(engine_flags):
            # The prompt's KV travels between the engines through vLLM's KV connector, which Ferry does not
            # choose: on vLLM's CPU build NIXL and the example shared-storage one run (docs/architecture.md).
            raise ValueError(
                f"--role {settings.role} with --engine vllm needs a KV connector between the engines: pass "
                "vLLM's --kv-transfer-config after -- (for example "
                '\'{"kv_connector":"NixlConnector","kv_role":"kv_producer"}\' on prefill workers and '
                '"kv_consumer" on decode workers)'
            )
        # Imported only here: vLLM is an optional install and takes seconds to import.
        from workers.vllm_config import VLLMConfig
        from workers.vllm_engine import VLLMEngine

        vllm_config = VLLMConfig(**values_of(settings, VLLMSettings), engine_flags=tuple(engine_flags))
        return VLLMEngine(settings.served_model_name, settings.model_path, vllm_config)
    if engine_flags:
        raise ValueError(f"vLLM engine flags need --engine vllm: {' '.join(engine_flags)}")
    if settings.lora_modules:
        raise ValueError("--lora-modules needs --engine vllm: the simulated engine serves no adapters")

    from workers.host_tier import kv_bytes_per_token
    from workers.sim import SimEngine
    from workers.sim_config import SimConfig

    info = load_model_info(settings.model_path)
    max_len = settings.max_model_len or info.max_position_embeddings
    values = values_of(settings, SimSettings) | {"max_model_len": max_len}
    transfers = settings.num_host_blocks or settings.kv_transfer_bandwidth_gbps > 0
    if transfers and not settings.kv_bytes_per_token:
        values["kv_bytes_per_token"] = kv_bytes_per_token(settings.model_path)
    config = SimConfig(**values)
    return SimEngine(settings.served_model_name, info.tokenizer, config, eos_token_id=info.eos_token_id)
