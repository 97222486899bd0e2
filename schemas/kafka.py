"""Messages that travel over Kafka between frontends and workers.

Every topic carries one tagged union, encoded with MessagePack. Fields are only ever added at
the end, with defaults, so older messages still decode.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

FinishReason = Literal["stop", "length", "abort", "error"]


class StructuredOutput(msgspec.Struct, omit_defaults=True, frozen=True):
    """A constraint on the shape of the output (vLLM's structured outputs); exactly one field is set.

    The frontend has validated it; an engine that cannot honour a kind answers a non-retriable error.
    """

    # A JSON Schema, as JSON text (schemas are arbitrary JSON: text keeps the wire type simple).
    json_schema: str | None = None
    # Any JSON object (`response_format: {"type": "json_object"}`).
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    # An EBNF grammar, in the dialects vLLM's structured-output backends accept.
    grammar: str | None = None


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
    # Added fields (defaults keep older messages decodable).
    logit_bias: dict[int, float] = {}
    min_p: float = 0.0
    # No EOS, stop token or stop string ends the sequence before this many tokens.
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    # Top alternatives to show for every prompt token (vLLM's `prompt_logprobs`); None: none computed.
    prompt_logprobs: int | None = None


class KVFrom(msgspec.Struct, frozen=True):
    """Where a disaggregated sequence's prompt KV cache comes from: the prefill worker that computed it."""

    worker_id: str
    # Leading prompt tokens whose KV that worker computed (the receiving engine takes it instead of computing
    # it): the whole prompt, in blocks of the model's block size, the last one possibly partial.
    tokens: int
    # What the receiving engine's KV connector needs to fetch it, as the prefill engine's connector wrote it
    # (vLLM's kv_transfer_params: NIXL's engine, host, port and block ids); opaque to Ferry. None where the
    # connector finds the KV by itself (shared storage, the simulated link) or the frontend wrote the KVFrom.
    connector: dict[str, Any] | None = None


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
    # Sequence number of this attempt's first chunk: a migrated request continues its stream's count.
    seq_base: int = 0
    # Disaggregated serving: a prefill-only attempt (max_tokens 1) ends its first token without a finish
    # reason, as the sequence goes on on a decode worker; that worker's attempt names the KV's source.
    prefill_only: bool = False
    kv_from: KVFrom | None = None
    # Decode-first hand-off: the prefill-only attempt sends its token straight to this decode worker (a
    # `Release`), which holds this sequence's next attempt parked; that attempt is `parked` until released.
    release_to: str = ""
    parked: bool = False


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """Abort one request; sent when the client goes away."""

    request_id: str
    # Only this attempt of it (running or parked); -1: whichever runs.
    attempt: int = -1


class LoadLora(msgspec.Struct, tag="lora_load", frozen=True):
    """Load a LoRA adapter from a directory on the worker's host; answered with a LoraAck."""

    op_id: str
    lora_name: str
    lora_path: str
    # The asking frontend's admin topic (schemas.names.admin_topic).
    reply_topic: str


class UnloadLora(msgspec.Struct, tag="lora_unload", frozen=True):
    """Forget a LoRA adapter; requests already running with it finish. Answered with a LoraAck."""

    op_id: str
    lora_name: str
    reply_topic: str


class EngineControl(msgspec.Struct, tag="engine_control", frozen=True):
    """vLLM's admin operations on one worker: sleep (leave routing, free the engine's memory), wake_up,
    reset_prefix_cache. Answered with a LoraAck whose `lora_name` is the operation."""

    op_id: str
    op: Literal["sleep", "wake_up", "reset_prefix_cache"]
    reply_topic: str
    # vLLM's sleep level: 1 offloads the weights and drops the KV cache, 2 drops both.
    level: int = 1


class ErrorInfo(msgspec.Struct, frozen=True):
    """A typed error from a worker: `retriable` means another worker may succeed."""

    code: str
    message: str
    retriable: bool = False


# A worker's last chunk with one of these codes ends its attempt, not the sequence: the worker can no longer run
# it, and the frontend moves it to another worker (server/streams.py). `ENGINE_DEAD`: the engine died with the
# sequence in it, which makes the sequence a suspect (a request that kills every engine it meets is not moved
# again and again); `WORKER_STOPPED`: the worker stops on a fatal error of its own.
ENGINE_DEAD = "engine_dead"
WORKER_STOPPED = "worker_stopped"
ATTEMPT_LOST = frozenset({ENGINE_DEAD, WORKER_STOPPED})
# A sequence (or batch item) whose engine died this many times while it had produced nothing there ends with
# REPEATED_ENGINE_DEATH instead of being run again: it is the likeliest cause (server/losses.py). One death
# alone says little: whatever started in the same step as the cause dies with it.
ENGINE_DEATHS_LIMIT = 2
REPEATED_ENGINE_DEATH = "repeated_engine_death"


class ChunkUsage(msgspec.Struct, frozen=True):
    """Token accounting for one sequence, sent with its last chunk."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Where the sequence's time went on its worker (seconds, worker clock): waiting in the engine's queue,
    # scheduling to first token, first token to last. 0 from a worker that does not say.
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """Logprob of one sampled token and its top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []
    # The token's rank in the vocabulary (1 = most likely), where the engine says (prompt logprobs show it).
    rank: int | None = None


class Chunk(msgspec.Struct, tag="chunk", omit_defaults=True, frozen=True):
    """A piece of one sequence's output; `seq` counts chunks of that request from 0, and a chunk stands for
    `span` of them (`seq` is the first's)."""

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
    # Logprobs of each prompt token given the ones before it (None for the first), on a sequence's first
    # chunk when the request asked for `prompt_logprobs`.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # The GenerateRequest attempt that produced it. A chunk with seq == -1 is the frontend's migration
    # marker: from here on only chunks of this attempt count (server/streams.py).
    attempt: int = 0
    # How many of the sequence's chunks this one carries: a worker sends a sequence's consecutive chunks of one
    # record as one (workers/outbox.py), so a reader decodes and handles one struct, not one per token.
    span: int = 1

    @property
    def end(self) -> int:
        """The `seq` of the chunk that follows this one."""
        return self.seq + self.span


class Chunks(msgspec.Struct, tag="chunks", frozen=True):
    """Chunks of several sequences bound for one topic, in the order they were produced: one record instead
    of one per chunk, which is what a busy worker's producer and a frontend's reader spend their time on."""

    items: list[Chunk]


ReplyMessage = Chunk | Chunks


class Release(msgspec.Struct, tag="release", frozen=True):
    """A prefill worker's word to a decode worker: the parked `attempt` of `request_id` starts now, after
    `chunk` (the prefill worker's token, which the decode worker sends again as its attempt's first chunk, so
    the frontend gets it from whichever attempt lands first), with the prompt's KV from `kv_from`."""

    request_id: str
    attempt: int
    chunk: Chunk
    kv_from: KVFrom


RequestMessage = GenerateRequest | Cancel | LoadLora | UnloadLora | EngineControl | Release


def joined_chunk(run: list[Chunk]) -> Chunk:
    """A sequence's consecutive chunks as one: their tokens, text and logprobs in order, the first's `seq` and prompt
    logprobs, the last's ending; it stands for as many chunks as they did."""
    head, last = run[0], run[-1]
    return Chunk(
        request_id=head.request_id,
        seq=head.seq,
        token_ids=[t for c in run for t in c.token_ids],
        text="".join([c.text for c in run]),
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        usage=last.usage,
        error=last.error,
        worker_id=head.worker_id,
        logprobs=[e for c in run for e in c.logprobs],
        prompt_logprobs=head.prompt_logprobs,
        attempt=head.attempt,
        span=sum(c.span for c in run),
    )


def chunks_of(message: ReplyMessage) -> list[Chunk]:
    """The chunks a reply record carries, in order."""
    return message.items if isinstance(message, Chunks) else [message]


request_encoder = msgspec.msgpack.Encoder()
request_decoder: msgspec.msgpack.Decoder[RequestMessage] = msgspec.msgpack.Decoder(RequestMessage)
reply_decoder: msgspec.msgpack.Decoder[ReplyMessage] = msgspec.msgpack.Decoder(ReplyMessage)


# ---- ferry.pool.<model>: undirected batch work ---------------------------------------------------


class PoolItem(msgspec.Struct, tag="pool_item", omit_defaults=True, frozen=True):
    """One batch item: every sequence of one OpenAI request, run together on whichever worker takes it.

    The requests' `reply_topic` is the batch results topic; their ids are `<item_id>/<k>` for the
    k-th sequence, so the coordinator can tell which item a chunk belongs to.
    """

    item_id: str
    requests: list[GenerateRequest]
    # The batch the item belongs to ("" for a Kafka-native item): workers skip items of stopped batches.
    batch_id: str = ""


PoolMessage = PoolItem

pool_decoder: msgspec.msgpack.Decoder[PoolMessage] = msgspec.msgpack.Decoder(PoolMessage)


# ---- ferry.admin.<frontend_id>: answers to control messages ------------------------------------


class LoraAck(msgspec.Struct, tag="lora_ack", omit_defaults=True, frozen=True):
    """A worker's answer to LoadLora or UnloadLora: `error` is None when it did what was asked."""

    op_id: str
    worker_id: str
    lora_name: str
    error: ErrorInfo | None = None
    # The adapters the worker holds after the operation.
    adapters: list[str] = []


AdminReply = LoraAck

admin_reply_decoder: msgspec.msgpack.Decoder[AdminReply] = msgspec.msgpack.Decoder(AdminReply)
