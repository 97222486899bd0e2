"""From a validated OpenAI request to token ids, a token budget and sampling parameters."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jinja2
import msgspec

from schemas.kafka import SamplingParams
from schemas.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ImageURLPart,
    InputAudioPart,
    SamplingFields,
    TextPart,
)
from schemas.streams import ToolCallMode
from server.errors import APIError
from server.model_files import ModelFiles
from server.structured_request import (
    check_min_tokens,
    logit_bias,
    refuse_unsupported,
    structured_output,
    template_kwargs,
)
from server.tools import plan as plan_tools

# OpenAI's default for /v1/completions; chat defaults to whatever the context leaves.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Prepared:
    """A request ready to be fanned out: one token list per prompt, `n` choices each."""

    prompts: list[list[int]]
    prompt_texts: list[str]
    max_tokens: int
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    priority: int
    # vLLM's `stream_options.continuous_usage_stats` (with include_usage): usage on every chunk.
    continuous_usage: bool = False
    # Chat requests with tools: how the output becomes tool calls (server/tools.py).
    tools: ToolCallMode | None = None
    # False when prompt logprobs are computed only for `echo` with `logprobs`: the `prompt_logprobs` field
    # of the response shows only when the request asked for it.
    show_prompt_logprobs: bool = True
    # Sent to a worker even while every worker counts as busy: its engine priority goes ahead of requests
    # waiting there (a tenant's turn, server/tenants_fair.py).
    overtake: bool = False


def _flatten_content(content: str | list[Any] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[str] = []
    for j, part in enumerate(content):
        if isinstance(part, TextPart):
            parts.append(part.text)
        elif isinstance(part, ImageURLPart | InputAudioPart):
            raise APIError(
                400,
                "This model accepts only text content parts.",
                param=f"messages[{index}].content[{j}]",
                code="unsupported_content",
            )
    return "\n".join(parts)


def _arguments(arguments: str | dict[str, Any] | None) -> dict[str, Any]:
    # As vLLM hands them to templates: an object, not OpenAI's JSON text. Text that is no JSON object
    # becomes {} (as vLLM does), so a malformed call in the history cannot make every later turn fail.
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template (as vLLM builds them): content parts joined into text,
    assistant tool calls with their arguments as objects, tool results with the id of the call they answer."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": m.role, "content": _flatten_content(m.content, i)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": tc.id, "type": "function",
                 "function": {"name": tc.function.name, "arguments": _arguments(tc.function.arguments)}}
                for tc in m.tool_calls
            ]  # fmt: skip
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(s == "" for s in stops):
        raise APIError(400, "Stop sequences must not be empty strings.", param="stop", code="invalid_value")
    return stops


def _sampling(req: SamplingFields, logprobs: int | None, vocab_size: int) -> SamplingParams:
    refuse_unsupported(req)
    check_min_tokens(req)
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        stop=_stop_list(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=logit_bias(req, vocab_size),
        min_p=req.min_p or 0.0,
        min_tokens=req.min_tokens,
        structured=structured_output(req),
    )


def _continuous_usage(req: SamplingFields) -> bool:
    # As vLLM: continuous usage only counts together with include_usage.
    opts = req.stream_options
    return bool(opts and opts.include_usage and opts.continuous_usage_stats)


def _budget(requested: int | None, longest_prompt: int, max_model_len: int, param: str, what: str) -> int:
    if longest_prompt >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
            f"resulted in {longest_prompt} tokens. Please reduce the length of the {what}.",
            param=param,
            code="context_length_exceeded",
        )
    if requested is None:
        return max_model_len - longest_prompt
    if longest_prompt + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{longest_prompt + requested} tokens ({longest_prompt} in the {what}, {requested} in the "
            f"completion). Please reduce the length of the {what} or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


class Preprocessor:
    """Applies the chat template and tokenizes, off the event loop when the prompt is long."""

    def __init__(self, model: ModelFiles, threshold_chars: int, tool_call_parser: str = "") -> None:
        self.model = model
        self._threshold = threshold_chars
        self._tool_call_parser = tool_call_parser
        # One thread: long prompts may use at most one of the cores the event loop also needs.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > self._threshold:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self.model.encode, text, add_special_tokens)
        return self.model.encode(text, add_special_tokens)

    async def chat(self, req: ChatCompletionRequest, max_model_len: int) -> Prepared:
        """Template, tokenize and budget a chat request."""
        tools = plan_tools(req, self._tool_call_parser)
        messages = chat_messages(req)
        kwargs = template_kwargs(req)
        size = sum(len(m["content"]) for m in messages)
        try:
            if size > self._threshold:
                loop = asyncio.get_running_loop()
                text = await loop.run_in_executor(
                    self._pool,
                    lambda: self.model.render_chat(messages, req.add_generation_prompt, tools.tools, **kwargs),
                )
            else:
                text = self.model.render_chat(messages, req.add_generation_prompt, tools.tools, **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            # The model's template refused the conversation (roles out of order, say) or failed on what the
            # request gave it (a chat_template_kwargs value of the wrong type): the client's error.
            raise APIError(
                400, f"The model's chat template rejected these messages: {exc}", param="messages",
                code="invalid_value",
            ) from None
        # The template already wrote the special tokens.
        ids = await self._encode(text, add_special_tokens=False)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        allowed = _budget(requested, len(ids), max_model_len, "messages", "messages")
        max_tokens = self.model.generation_defaults.budget(requested, allowed)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        sampling = self.model.generation_defaults.fill(_sampling(req, logprobs, self.model.vocab_size), req)
        if tools.structured is not None:
            # A forced tool call's schema takes the place of any response_format (as vLLM does).
            sampling = msgspec.structs.replace(sampling, structured=tools.structured)
        if tools.keep_special_tokens:
            sampling = msgspec.structs.replace(sampling, skip_special_tokens=False)
        return Prepared(
            prompts=[ids],
            prompt_texts=[text],
            max_tokens=max_tokens,
            sampling=sampling,
            n=req.n,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            priority=req.priority,
            continuous_usage=_continuous_usage(req),
            tools=tools.mode,
        )

    async def completion(self, req: CompletionRequest, max_model_len: int) -> Prepared:
        """Tokenize (or accept token ids) and budget a text completion request."""
        if req.suffix:
            raise APIError(400, "`suffix` is not supported by this model.", param="suffix", code="unsupported")
        prompts, texts = await self._prompts(req.prompt, echo=bool(req.echo))
        longest = max(len(p) for p in prompts)
        requested = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        max_tokens = _budget(requested, longest, max_model_len, "prompt", "prompt")
        sampling = _sampling(req, req.logprobs, self.model.vocab_size)
        if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
            # An echoed prompt's tokens come with logprobs like the output's, streamed too (as vLLM does).
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=req.logprobs)
        return Prepared(
            prompts=prompts,
            prompt_texts=texts,
            max_tokens=max_tokens,
            sampling=self.model.generation_defaults.fill(sampling, req),
            n=req.n,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            priority=req.priority,
            continuous_usage=_continuous_usage(req),
            show_prompt_logprobs=req.prompt_logprobs is not None,
        )

    async def _prompts(self, prompt: str | list[Any], echo: bool) -> tuple[list[list[int]], list[str]]:
        """The four OpenAI prompt shapes, as token lists and their texts; a token-id prompt's text is decoded
        only for an `echo` (nothing else reads it; otherwise it is "" and costs nothing on the event loop)."""
        vocab = self.model.vocab_size
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif not prompt:
            raise APIError(400, "The prompt must not be empty.", param="prompt", code="invalid_value")
        elif all(isinstance(p, int) for p in prompt):
            items = [list(prompt)]
        elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            items = list(prompt)
        else:
            raise APIError(
                400,
                "The prompt must be a string, a list of strings, a list of token ids, or a list of lists of "
                "token ids.",
                param="prompt",
                code="invalid_type",
            )
        prompts: list[list[int]] = []
        texts: list[str] = []
        for item in items:
            if isinstance(item, str):
                ids = await self._encode(item, add_special_tokens=True)
                text = item
            else:
                ids = list(item)
                if any(t >= vocab for t in ids):
                    raise APIError(
                        400,
                        f"Token ids must be below the vocabulary size {vocab}.",
                        param="prompt",
                        code="invalid_value",
                    )
                text = self.model.decode(ids, skip_special_tokens=False) if echo else ""
            if not ids:
                raise APIError(400, "The prompt must not be empty.", param="prompt", code="invalid_value")
            prompts.append(ids)
            texts.append(text)
        return prompts, texts
