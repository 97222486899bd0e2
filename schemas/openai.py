"""The OpenAI HTTP API: requests as clients send them, responses and stream chunks as OpenAI returns them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from schemas.structured import ResponseFormat, StructuredOutputsRequest

# Ranges follow the OpenAI API reference; anything outside is a 400 before a worker sees it. JSON integers
# have no size limit and msgspec keeps them exact, so every integer gets an upper bound too: a value that
# does not fit the MessagePack int64 of a Kafka message must fail here, not in the producer.
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
N = Annotated[int, Meta(ge=1, le=128)]
MaxTokens = Annotated[int, Meta(ge=1, le=2**31 - 1)]
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
# vLLM's convention: -1 (or 0) turns top-k off.
TopK = Annotated[int, Meta(ge=-1, le=2**31 - 1)]
Priority = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]


class FieldError(ValueError):
    """A rule across fields that msgspec cannot express; `field` is relative to the Struct that raised it.

    Raised from `__post_init__`, it reaches the caller as the `__cause__` of a msgspec.ValidationError whose
    path names that Struct, so the HTTP error can name the exact field (`messages[2].content`).
    """

    def __init__(self, field: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.field = field
        self.code = code


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """`stream_options`: whether the last chunk (and, with vLLM's `continuous_usage_stats`, every chunk)
    carries usage."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    # OpenAI pads chunks against length side channels unless this is false; Ferry never pads, so either
    # value gets unpadded chunks.
    include_obfuscation: bool | None = None


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    """A text content part of a chat message."""

    text: str


class ImageURLPart(msgspec.Struct, tag_field="type", tag="image_url"):
    """An image content part; parsed so that it can be refused with a clear message."""

    image_url: dict[str, str | None]


class InputAudioPart(msgspec.Struct, tag_field="type", tag="input_audio"):
    """An audio content part; parsed so that it can be refused with a clear message."""

    input_audio: dict[str, str]


ContentPart = TextPart | ImageURLPart | InputAudioPart

Role = Literal["system", "developer", "user", "assistant", "tool"]


class MessageFunctionCall(msgspec.Struct):
    """The function an earlier assistant turn called: `arguments` is JSON text (an object is taken too)."""

    name: str
    arguments: str | dict[str, Any] | None = None


class MessageToolCall(msgspec.Struct):
    """A tool call of an earlier assistant turn, as a client sends it back."""

    id: str
    function: MessageFunctionCall
    type: str = "function"

    def __post_init__(self) -> None:
        if self.type != "function":
            raise FieldError("type", f"Only tool calls of type 'function' are supported, not '{self.type}'.")


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """One message of a conversation."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None

    def __post_init__(self) -> None:
        # OpenAI lets only an assistant message (one that made tool calls) go without content.
        if self.content is None and self.role != "assistant":
            raise FieldError("content", f"A message with role '{self.role}' needs `content`.")
        if isinstance(self.content, list) and not self.content:
            raise FieldError("content", "`content` must not be an empty array.")
        if self.tool_calls is not None and self.role != "assistant":
            raise FieldError("tool_calls", "Only an assistant message can carry `tool_calls`.")
        if self.role == "tool" and not self.tool_call_id:
            raise FieldError("tool_call_id", "A message with role 'tool' needs `tool_call_id`.")


class FunctionDefinition(msgspec.Struct):
    """The function a tool offers: its name, what it does, and a JSON Schema of its arguments."""

    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct):
    """One entry of `tools`; only functions are supported."""

    type: str
    function: FunctionDefinition | None = None

    def __post_init__(self) -> None:
        if self.type != "function":
            raise FieldError("type", f"Only tools of type 'function' are supported, not '{self.type}'.")
        if self.function is None:
            raise FieldError("function", "A tool of type 'function' needs `function`.")


class NamedFunction(msgspec.Struct):
    """The function a named `tool_choice` forces."""

    name: str


class NamedToolChoice(msgspec.Struct):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    function: NamedFunction
    type: str = "function"

    def __post_init__(self) -> None:
        if self.type != "function":
            raise FieldError(
                "type", f"Only a tool_choice of type 'function' is supported, not '{self.type}'."
            )


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by chat and text completions (OpenAI's, plus vLLM's common extensions).

    A field nobody declared is a 400 naming it; fields Ferry knows but does not support are declared below
    `UNSUPPORTED` and refused unless they hold their "off" value (server/structured_request.py).
    """

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: N = 1
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # Token id (as a string, as OpenAI takes it) -> bias in [-100, 100]; checked against the vocabulary.
    logit_bias: dict[str, float] | None = None
    # Metadata about the caller (OpenAI uses them for abuse monitoring and stored completions): accepted,
    # with no effect on the output.
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    # OpenAI's processing tier: Ferry serves every request the same way, which is what "auto" and
    # "default" ask for; the others are refused.
    service_tier: str | None = None
    # OpenAI stores a completion for later retrieval with `store: true`; Ferry keeps nothing.
    store: bool | None = None
    # A routing hint for OpenAI's prompt cache; Ferry routes by the cached blocks themselves.
    prompt_cache_key: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions, sent by clients through `extra_body`.
    top_k: TopK = -1
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    priority: Priority = 0
    structured_outputs: StructuredOutputsRequest | None = None
    # Logprobs of every prompt token with this many alternatives (vLLM's extension; not on streams, as in
    # vLLM; at most 20, vLLM's default `max_logprobs`).
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # vLLM's guided-decoding fields from before `structured_outputs` (vLLM 0.32 ignores them; Ferry
    # honours them, so older clients get the constraint they asked for).
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # ---- UNSUPPORTED: known to OpenAI or vLLM, refused unless off (server/structured_request.py) ----
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    prompt_cache_retention: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    cache_salt: Any = None
    vllm_xargs: Any = None

    def __post_init__(self) -> None:
        # As OpenAI and vLLM do: options of a stream are a mistake on a request that does not stream.
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "`stream_options` is only allowed when `stream` is true.")
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs", "`prompt_logprobs` are not available when `stream` is true.")


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    # Extra variables for the model's chat template (vLLM's extension), e.g. `enable_thinking`.
    chat_template_kwargs: dict[str, Any] | None = None
    # ---- UNSUPPORTED (chat only) ----
    continue_final_message: Any = None
    chat_template: Any = None
    documents: Any = None
    add_special_tokens: Any = None
    echo: Any = None
    # Tool calling (validated against each other and the messages in server/tools.py).
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "`top_logprobs` needs `logprobs` set to true.")


# msgspec allows one array type per union, so the four OpenAI prompt shapes (a string, strings,
# token ids, lists of token ids) decode as one and are told apart when the request is preprocessed.
PromptInput = str | list[str | TokenId | list[TokenId]]


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: PromptInput
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    # ---- UNSUPPORTED (completions only) ----
    best_of: Any = None


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    """Prompt tokens served from the KV cache."""

    cached_tokens: int = 0


class Usage(msgspec.Struct):
    """Token accounting of a whole request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    """One alternative token in chat logprobs."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    """One sampled token in chat logprobs."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    """`choices[].logprobs` of a chat completion."""

    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(msgspec.Struct):
    """`choices[].logprobs` of a text completion (the legacy format)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(msgspec.Struct):
    """The function a tool call calls, with its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    """One tool call of a whole chat completion."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class AssistantMessage(msgspec.Struct):
    """The message of a non-streamed chat choice."""

    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    # Omitted unless the model called tools.
    tool_calls: list[ToolCall] | UnsetType = UNSET


class PromptLogprob(msgspec.Struct):
    """vLLM's logprob entry of one token at one prompt position."""

    logprob: float
    rank: int | None
    decoded_token: str


# Per prompt position (the first has none): token id (as a string, a JSON key) -> its entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatChoice(msgspec.Struct):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, kw_only=True):
    """A whole chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    # vLLM's extension, present when the request asked for `prompt_logprobs`.
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    """A piece of a streamed tool call's function: the name once, then pieces of the arguments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A piece of one streamed tool call; its first piece carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    """What a chat stream chunk adds to one choice."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    """One choice of a chat stream chunk."""

    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One `chat.completion.chunk` event."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str | None = None
    # UNSET is omitted; None is sent as null (every chunk when include_usage is on, as OpenAI does).
    usage: Usage | UnsetType | None = UNSET


class CompletionChoice(msgspec.Struct):
    """One choice of a text completion, whole or as a stream delta."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's extension, present when the request asked for `prompt_logprobs` (never on stream chunks).
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class Completion(msgspec.Struct, kw_only=True):
    """A text completion, or one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: Usage | UnsetType | None = UNSET


class ModelCard(msgspec.Struct, kw_only=True):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ferry"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(msgspec.Struct):
    """The body of an OpenAI-style error."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """`{"error": {...}}`, the shape every 4xx/5xx body and in-band stream error takes."""

    error: ErrorDetail


json_encoder = msgspec.json.Encoder()
chat_request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_request_decoder = msgspec.json.Decoder(CompletionRequest)
