"""What a frontend keeps in Redis so any frontend replica can resume a stream from Kafka."""

from __future__ import annotations

from typing import Literal

import msgspec


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
    frontend_id: str = ""
    continuous_usage: bool = False


stream_record_encoder = msgspec.msgpack.Encoder()
stream_record_decoder: msgspec.msgpack.Decoder[StreamRecord] = msgspec.msgpack.Decoder(StreamRecord)
