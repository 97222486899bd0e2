"""Wire types: OpenAI requests and responses, Kafka messages, names."""

from __future__ import annotations

import json

import msgspec
import pytest

from schemas.kafka import (
    Cancel,
    Chunk,
    ChunkUsage,
    GenerateRequest,
    reply_decoder,
    request_decoder,
    request_encoder,
)
from schemas.names import pool_topic, reply_topic, request_topic, slug
from schemas.openai import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Delta,
    TextPart,
    Usage,
    chat_request_decoder,
    completion_request_decoder,
    json_encoder,
)
from server.errors import from_validation_error


def test_chat_request_accepts_what_clients_send() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "bob"},
        ],
        "max_completion_tokens": 5, "temperature": 0.2, "top_p": 0.9, "n": 2, "stop": ["x"], "seed": 1,
        "stream": True, "stream_options": {"include_usage": True}, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "logprobs": True, "top_logprobs": 3, "user": "u",
    }
    req = chat_request_decoder.decode(json.dumps(body))
    assert req.messages[1].content == [TextPart("hi")]
    assert req.stream_options is not None and req.stream_options.include_usage
    assert (req.n, req.top_logprobs, req.max_completion_tokens) == (2, 3, 5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, "presence_penalty"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ],
)
def test_chat_request_violations_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(msgspec.ValidationError) as exc:
        chat_request_decoder.decode(json.dumps(body))
    err = from_validation_error(exc.value)
    assert err.status == 400 and err.param == param


def test_completion_prompt_shapes_decode() -> None:
    for prompt in ["a", ["a", "b"], [1, 2], [[1, 2], [3]]]:
        assert completion_request_decoder.decode(json.dumps({"model": "m", "prompt": prompt})).prompt == prompt


def test_stream_chunk_matches_openai_layout() -> None:
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[ChatChunkChoice(0, Delta(content="hi"))])
    out = json.loads(json_encoder.encode(chunk))
    assert list(out) == ["id", "object", "created", "model", "choices", "system_fingerprint"]
    assert out["choices"][0] == {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}
    with_usage = ChatCompletionChunk(id="c", created=1, model="m", choices=[], usage=Usage(1, 2, 3))
    assert json.loads(json_encoder.encode(with_usage))["usage"]["total_tokens"] == 3
    null_usage = ChatCompletionChunk(id="c", created=1, model="m", choices=[], usage=None)
    assert json.loads(json_encoder.encode(null_usage))["usage"] is None


def test_kafka_messages_round_trip_as_a_tagged_union() -> None:
    req = GenerateRequest("r1", "m", [1, 2, 3], 8, "ferry.replies.fe")
    assert request_decoder.decode(request_encoder.encode(req)) == req
    assert request_decoder.decode(request_encoder.encode(Cancel("r1"))) == Cancel("r1")
    chunk = Chunk("r1", 3, [5], "x", "stop", usage=ChunkUsage(3, 1, 0))
    assert reply_decoder.decode(request_encoder.encode(chunk)) == chunk


def test_old_messages_still_decode_when_fields_are_added() -> None:
    # A GenerateRequest written with only the required fields (as an older sender would).
    old = msgspec.msgpack.encode({"type": "generate", "request_id": "r", "model": "m", "prompt_token_ids": [1],
                                  "max_tokens": 1, "reply_topic": "t"})
    decoded = request_decoder.decode(old)
    assert isinstance(decoded, GenerateRequest) and decoded.attempt == 0


def test_topic_names_are_kafka_safe() -> None:
    assert slug("org/Model 7B:v1") == "org-Model-7B-v1"
    assert request_topic("w 1") == "ferry.requests.w-1"
    assert reply_topic("fe") == "ferry.replies.fe"
    assert pool_topic("a/b") == "ferry.pool.a-b"
