"""The two kinds of generation endpoint, chat and text completions, each described once.

Everything that differs between them is here: the path, the request type, how a request is turned into
prompts, its id prefix, and the shape of its events and whole body. One handler, one stream writer and
one collector serve both (server/endpoints.py, server/responses.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from schemas.openai import ChatCompletion, Completion, chat_request_decoder, completion_request_decoder
from server.logprobs import LogprobFormatter
from server.preprocess import Prepared, Preprocessor
from server.responses import EventsFactory
from server.shapes import ChatEvents, CompletionEvents, Finished, chat_completion, text_completion


@dataclass(frozen=True)
class Kind:
    """One generation endpoint."""

    # Also what a resume record and a batch file line call it.
    name: Literal["chat", "completion"]
    path: str
    # The `endpoint` label of the frontend's request metrics.
    metric: str
    id_prefix: str
    decoder: msgspec.json.Decoder[Any]
    prepare: Callable[[Preprocessor, Any, int], Awaitable[Prepared]]
    # Whether a request puts its prompts in front of the output (completions' `echo`).
    echo: Callable[[Any], bool]
    events: EventsFactory
    whole: Callable[[Finished, LogprobFormatter], ChatCompletion | Completion]


CHAT = Kind(
    name="chat",
    path="/v1/chat/completions",
    metric="chat",
    id_prefix="chatcmpl",
    decoder=chat_request_decoder,
    prepare=lambda pre, req, max_len: pre.chat(req, max_len),
    echo=lambda req: False,
    events=ChatEvents,
    whole=chat_completion,
)

COMPLETION = Kind(
    name="completion",
    path="/v1/completions",
    metric="completions",
    id_prefix="cmpl",
    decoder=completion_request_decoder,
    prepare=lambda pre, req, max_len: pre.completion(req, max_len),
    echo=lambda req: bool(req.echo),
    events=CompletionEvents,
    whole=text_completion,
)

KINDS: dict[str, Kind] = {k.name: k for k in (CHAT, COMPLETION)}
BY_PATH: dict[str, Kind] = {k.path: k for k in (CHAT, COMPLETION)}
