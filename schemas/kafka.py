"""Messages that travel over Kafka between frontends and workers.

Every topic carries one tagged union, encoded with MessagePack. Fields are only ever added at
the end, with defaults, so older messages still decode.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """How to sample: the OpenAI parameters a worker needs, already validated by the frontend."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True


class GenerateRequest(msgspec.Struct, tag="generate", omit_defaults=True, frozen=True):
    """One sequence to generate, carrying everything a worker needs without asking anyone."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    reply_topic: str
    sampling: SamplingParams = SamplingParams()
    # Choice index within the client's request (n > 1 fans out into one GenerateRequest each).
    index: int = 0
    priority: int = 0
    # Unix time in seconds after which the result is useless to the client; 0 = none.
    deadline: float = 0.0
    lora_name: str | None = None
    # Migration: tokens another worker already generated for this sequence, and the attempt number.
    generated_token_ids: list[int] = []
    attempt: int = 0
    frontend_id: str = ""


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """Abort one request; sent when the client goes away."""

    request_id: str


RequestMessage = GenerateRequest | Cancel


class ErrorInfo(msgspec.Struct, frozen=True):
    """A typed error from a worker: `retriable` means another worker may succeed."""

    code: str
    message: str
    retriable: bool = False


class ChunkUsage(msgspec.Struct, frozen=True):
    """Token accounting for one sequence, sent with its last chunk."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """Logprob of one sampled token and its top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class Chunk(msgspec.Struct, tag="chunk", omit_defaults=True, frozen=True):
    """A piece of one sequence's output; `seq` counts chunks of that request from 0."""

    request_id: str
    seq: int
    token_ids: list[int] = []
    text: str = ""
    finish_reason: FinishReason | None = None
    # The stop string or token that ended the sequence, when one did.
    stop_reason: str | int | None = None
    usage: ChunkUsage | None = None
    error: ErrorInfo | None = None
    worker_id: str = ""
    logprobs: list[TokenLogprob] = []


ReplyMessage = Chunk

request_encoder = msgspec.msgpack.Encoder()
request_decoder: msgspec.msgpack.Decoder[RequestMessage] = msgspec.msgpack.Decoder(RequestMessage)
reply_decoder: msgspec.msgpack.Decoder[Chunk] = msgspec.msgpack.Decoder(Chunk)
