"""Bodies of the frontend's admin API (`/v1/admin/*`): LoRA adapters, in the shape of vLLM's own endpoints."""

from __future__ import annotations

from typing import Literal

import msgspec


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """POST /v1/admin/load_lora_adapter, as vLLM's `/v1/load_lora_adapter` plus an optional worker."""

    lora_name: str
    # A directory on the workers' hosts holding a PEFT LoRA adapter (adapter_config.json + weights).
    lora_path: str
    # Load onto this worker only; by default onto every live worker of the model that serves LoRA.
    worker_id: str | None = None


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """POST /v1/admin/unload_lora_adapter, as vLLM's `/v1/unload_lora_adapter` plus an optional worker."""

    lora_name: str
    # Unload from this worker only; by default from every worker that holds the adapter.
    worker_id: str | None = None
    # vLLM's body carries it too; unused (the name identifies the adapter).
    lora_int_id: int | None = None


class LoraAdapter(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One adapter as the admin API reports it."""

    object: Literal["lora_adapter"] = "lora_adapter"
    lora_name: str
    base_model: str
    # Workers that hold it (after a load or unload: the workers that did what was asked).
    workers: list[str]
    lora_path: str | None = None


class LoraAdapterList(msgspec.Struct, kw_only=True):
    """GET /v1/admin/lora_adapters."""

    object: Literal["list"] = "list"
    data: list[LoraAdapter]


load_lora_decoder: msgspec.json.Decoder[LoadLoraAdapterRequest] = msgspec.json.Decoder(LoadLoraAdapterRequest)
unload_lora_decoder: msgspec.json.Decoder[UnloadLoraAdapterRequest] = msgspec.json.Decoder(
    UnloadLoraAdapterRequest
)
