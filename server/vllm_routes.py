"""The endpoints vLLM's OpenAI server has beside the OpenAI API, which vLLM's clients call: `/tokenize`,
`/detokenize`, `/version`, and its LoRA paths `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Chat messages are tokenized by the same path as a chat completion (template, tools, chat_template_kwargs),
so `/tokenize` counts exactly the prompt tokens a request would use. The LoRA paths go through the same
exchange as `/v1/admin/*` (server/lora_admin.py) and need the admin key like them (server/auth.py).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import sys

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from schemas.admin import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from schemas.openai import chat_request_decoder
from schemas.vllm_api import (
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    detokenize_decoder,
    load_lora_decoder,
    tokenize_decoder,
    unload_lora_decoder,
)
from server.errors import APIError
from server.frontend import Frontend
from server.http import decode, json_response, read_body, route
from server.structured_request import unsupported

# Tokenizing is not generating: the context length does not limit what /tokenize may count.
_NO_LIMIT = sys.maxsize


@functools.cache
def _version() -> str:
    return importlib.metadata.version("ferry")


async def _encode(fe: Frontend, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > fe.settings.tokenize_threshold_chars:
        return await asyncio.to_thread(fe.model.encode, text, add_special_tokens)
    return fe.model.encode(text, add_special_tokens)


async def _chat_ids(fe: Frontend, model: str, body: TokenizeRequest) -> list[int]:
    """The prompt tokens of a chat, prepared exactly as /v1/chat/completions prepares it."""
    if body.continue_final_message:
        raise unsupported("continue_final_message", "Unsupported parameter: 'continue_final_message'.")
    fields: dict[str, object] = {
        "model": model,
        "messages": body.messages,
        "add_generation_prompt": body.add_generation_prompt,
    }
    if body.tools:
        fields["tools"] = body.tools
    if body.chat_template_kwargs is not None:
        fields["chat_template_kwargs"] = body.chat_template_kwargs
    req = decode(chat_request_decoder, msgspec.json.encode(fields))
    prepared = await fe.pre.chat(req, _NO_LIMIT)
    if body.add_special_tokens:
        return await _encode(fe, prepared.prompt_texts[0], True)
    return prepared.prompts[0]


async def tokenize(fe: Frontend, request: Request) -> Response:
    """POST /tokenize: the token ids of a `prompt`, or of chat `messages` through the chat template."""
    body = decode(tokenize_decoder, await read_body(request, fe.settings.max_body_bytes))
    model = body.model or fe.settings.served_model_name
    max_len = fe.max_model_len(model)
    if (body.prompt is None) == (not body.messages):
        raise APIError(400, "Give either 'prompt' or 'messages'.", param="prompt", code="invalid_value")
    if body.prompt is not None:
        for name in ("tools", "chat_template_kwargs"):
            if getattr(body, name):
                raise APIError(400, f"'{name}' needs 'messages'.", param=name, code="invalid_value")
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await _encode(fe, body.prompt, add)
    else:
        ids = await _chat_ids(fe, model, body)
    strs = [fe.model.tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    return json_response(TokenizeResponse(count=len(ids), max_model_len=max_len, tokens=ids, token_strs=strs))


async def detokenize(fe: Frontend, request: Request) -> Response:
    """POST /detokenize: the text of token ids (special tokens included, as vLLM's)."""
    body = decode(detokenize_decoder, await read_body(request, fe.settings.max_body_bytes))
    fe.max_model_len(body.model or fe.settings.served_model_name)  # 404 for a model not served here
    vocab = fe.model.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(
            400,
            f"Token id {bad} is not in the vocabulary (0 to {vocab - 1}).",
            param="tokens",
            code="invalid_value",
        )
    return json_response(DetokenizeResponse(fe.model.decode(body.tokens, skip_special_tokens=False)))


async def version(fe: Frontend, request: Request) -> Response:
    """GET /version."""
    return json_response(VersionResponse(_version()))


async def load_lora_adapter(fe: Frontend, request: Request) -> Response:
    """POST /v1/load_lora_adapter: vLLM's body and answer; loads onto every live worker with LoRA slots."""
    body = decode(load_lora_decoder, await read_body(request, fe.settings.max_body_bytes))
    if body.load_inplace:
        raise unsupported(
            "load_inplace", "Unsupported parameter: 'load_inplace'; unload the adapter, then load it again."
        )
    await fe.lora_admin.load(LoadLoraAdapterRequest(lora_name=body.lora_name, lora_path=body.lora_path))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name.strip()}' added successfully.")


async def unload_lora_adapter(fe: Frontend, request: Request) -> Response:
    """POST /v1/unload_lora_adapter: vLLM's body and answer; unloads from every worker holding it."""
    body = decode(unload_lora_decoder, await read_body(request, fe.settings.max_body_bytes))
    await fe.lora_admin.unload(UnloadLoraAdapterRequest(lora_name=body.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name.strip()}' removed successfully.")


def routes() -> list[Route]:
    """Every route of this module."""
    return [
        Route("/tokenize", route("tokenize")(tokenize), methods=["POST"]),
        Route("/detokenize", route("detokenize")(detokenize), methods=["POST"]),
        Route("/version", route("version")(version), methods=["GET"]),
        Route("/v1/load_lora_adapter", route("admin")(load_lora_adapter), methods=["POST"]),
        Route("/v1/unload_lora_adapter", route("admin")(unload_lora_adapter), methods=["POST"]),
    ]
