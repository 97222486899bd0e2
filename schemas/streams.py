"""What a frontend keeps in Redis so any frontend replica can resume a stream from Kafka."""

from __future__ import annotations

from typing import Literal

import msgspec


class ToolCallMode(msgspec.Struct, omit_defaults=True, frozen=True):
    """How a chat request's output becomes tool calls (server/tools.py decides, server/tool_parsers/ does it).

    `auto`: the model may call tools in its own format, read by the parser `parser`; `required`: the
    output is a JSON array of {name, parameters} (structured decoding enforces it); `named`: the output is
    the arguments of `function`.
    """

    choice: Literal["auto", "required", "named"]
    parser: str = ""
    function: str = ""
    # False: only the first call is kept (OpenAI's `parallel_tool_calls: false`).
    parallel: bool = True


class StreamRecord(msgspec.Struct, omit_defaults=True, frozen=True):
    """Where a resumable request's chunks are and how to turn them back into the same SSE events."""

    # The replies topic (partition 0) and an offset at or before the request's first chunk.
    topic: str
    offset: int
    kind: Literal["chat", "completion"]
    model: str
    created: int
    n: int
    prompt_lens: list[int]
    include_usage: bool = False
    logprobs: bool = False
    # Completions with echo=True: the prompt texts the stream starts with.
    echo_texts: list[str] = []
    # Each prompt's first token (echoed prompts' logprobs start with it).
    first_tokens: list[int] = []
    frontend_id: str = ""
    continuous_usage: bool = False
    # Chat requests with tools: how the output becomes tool calls.
    tools: ToolCallMode | None = None
    # Sequences (choice indices) whose prefill worker's token waited for their decode worker (server/streams.py).
    held_first: list[int] = []


stream_record_encoder = msgspec.msgpack.Encoder()
stream_record_decoder: msgspec.msgpack.Decoder[StreamRecord] = msgspec.msgpack.Decoder(StreamRecord)
