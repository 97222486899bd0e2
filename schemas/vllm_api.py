"""Bodies of the endpoints vLLM's OpenAI server has beside the OpenAI API: `/tokenize`, `/detokenize`,
`/version` and its LoRA paths (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`)."""

from __future__ import annotations

from typing import Any

import msgspec


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /tokenize: a `prompt`, or chat `messages` rendered through the chat template (not both)."""

    model: str | None = None
    prompt: str | None = None
    # Left raw so they decode exactly as a chat completion's fields do (same rules, same error params);
    # empty when not given.
    messages: msgspec.Raw = msgspec.Raw()
    tools: msgspec.Raw = msgspec.Raw()
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # vLLM's defaults: true for a prompt, false for messages (the template writes the special tokens).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    continue_final_message: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The answer of /tokenize."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    """The answer of /detokenize."""

    prompt: str


class VersionResponse(msgspec.Struct):
    """GET /version: Ferry's version (where vLLM's server gives vLLM's)."""

    version: str


class LoadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/load_lora_adapter, vLLM's body."""

    lora_name: str
    lora_path: str
    # vLLM's replace-while-loaded; Ferry refuses a name that is already loaded instead.
    load_inplace: bool = False


class UnloadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/unload_lora_adapter, vLLM's body."""

    lora_name: str
    lora_int_id: int | None = None


tokenize_decoder: msgspec.json.Decoder[TokenizeRequest] = msgspec.json.Decoder(TokenizeRequest)
detokenize_decoder: msgspec.json.Decoder[DetokenizeRequest] = msgspec.json.Decoder(DetokenizeRequest)
load_lora_decoder: msgspec.json.Decoder[LoadLoraRequest] = msgspec.json.Decoder(LoadLoraRequest)
unload_lora_decoder: msgspec.json.Decoder[UnloadLoraRequest] = msgspec.json.Decoder(UnloadLoraRequest)
