"""One batch request line to the GenerateRequests of a pool item, through the interactive request path.

The body is decoded by the same Structs and templated, tokenized and budgeted by the same
Preprocessor as `/v1/chat/completions` and `/v1/completions`; only the priority (low), the reply
topic (the batch results topic) and the deadline (the batch window) differ.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import msgspec

from schemas.batch import BatchEndpoint, ItemMeta, LineError, OutputLine, ResponseRecord
from schemas.kafka import GenerateRequest, PoolItem, request_encoder
from schemas.openai import (
    json_encoder,
)
from server.errors import APIError, model_not_found
from server.http import decode
from server.kinds import BY_PATH
from server.preprocess import Prepared, Preprocessor


@dataclass(frozen=True)
class PreparedItem:
    """An item ready for the pool: its metadata and the encoded `PoolItem`."""

    index: int
    meta: ItemMeta
    first_prompt: list[int]
    message: bytes


def item_id(batch_id: str, index: int) -> str:
    """Id of the `index`-th item of a batch (file line order, from 0)."""
    return f"{batch_id}:{index}"


def sequence_id(item: str, k: int) -> str:
    """Request id of the k-th sequence of an item."""
    return f"{item}/{k}"


def split_sequence_id(request_id: str) -> tuple[str, int] | None:
    """(item id, k) of a batch sequence's request id; None for anything else."""
    item, sep, k = request_id.rpartition("/")
    if not sep or not k.isdigit():
        return None
    return item, int(k)


def split_item_id(item: str) -> tuple[str, int] | None:
    """(batch id, index) of a file batch's item; None for a Kafka-native item."""
    batch, sep, index = item.rpartition(":")
    if not sep or not batch.startswith("batch_") or not index.isdigit():
        return None
    return batch, int(index)


class ItemPreparer:
    """Decodes, validates, templates and tokenizes batch request bodies for one model."""

    def __init__(
        self, pre: Preprocessor, model: str, results_topic: str, priority: int, frontend_id: str
    ) -> None:
        self.pre = pre
        self.model = model
        self.results_topic = results_topic
        self.priority = priority
        self.frontend_id = frontend_id

    async def prepare(
        self,
        item: str,
        index: int,
        custom_id: str,
        endpoint: BatchEndpoint,
        body: bytes,
        max_model_len: int,
        deadline: float,
        batch_id: str = "",
        reply_topic: str = "",
    ) -> PreparedItem:
        """The pool item for one request body; raises APIError exactly where the HTTP route would."""
        prepared, model, echo = await self._prepared(endpoint, body, max_model_len)
        requests = []
        for pi, ids in enumerate(prepared.prompts):
            for c in range(prepared.n):
                k = pi * prepared.n + c
                requests.append(
                    GenerateRequest(
                        request_id=sequence_id(item, k),
                        model=model,
                        prompt_token_ids=ids,
                        max_tokens=prepared.max_tokens,
                        reply_topic=self.results_topic,
                        sampling=prepared.sampling,
                        index=k,
                        # A request's own priority only ever lowers it further below interactive work.
                        priority=max(self.priority, prepared.priority),
                        deadline=deadline,
                        frontend_id=self.frontend_id,
                    )
                )
        meta = ItemMeta(
            custom_id=custom_id,
            endpoint=endpoint,
            model=model,
            prompt_lens=[len(p) for p in prepared.prompts],
            n=prepared.n,
            logprobs=prepared.sampling.logprobs is not None,
            echo_texts=prepared.prompt_texts if echo else [],
            first_tokens=[p[0] for p in prepared.prompts],
            show_prompt_logprobs=prepared.show_prompt_logprobs,
            reply_topic=reply_topic,
            tools=prepared.tools,
        )
        message = request_encoder.encode(PoolItem(item_id=item, requests=requests, batch_id=batch_id))
        return PreparedItem(index, meta, prepared.prompts[0], message)

    async def _prepared(
        self, endpoint: BatchEndpoint, body: bytes, max_model_len: int
    ) -> tuple[Prepared, str, bool]:
        kind = BY_PATH[endpoint]
        req = decode(kind.decoder, body)
        if req.model != self.model:
            raise model_not_found(req.model)
        if req.stream:
            raise APIError(
                400,
                "Streaming is not available in a batch; leave `stream` unset.",
                param="stream",
                code="invalid_value",
            )
        return await kind.prepare(self.pre, req, max_model_len), req.model, kind.echo(req)


def new_request_id() -> str:
    """The `id` of an output line."""
    return f"batch_req_{secrets.token_hex(12)}"


def response_line(custom_id: str, status: int, body: bytes) -> bytes:
    """An output line carrying the HTTP status and body the request got."""
    line = OutputLine(
        id=new_request_id(),
        custom_id=custom_id,
        response=ResponseRecord(status_code=status, request_id=secrets.token_hex(12), body=msgspec.Raw(body)),
        error=None,
    )
    return json_encoder.encode(line)


def error_line(custom_id: str, err: APIError) -> bytes:
    """An error-file line for a request refused before it ran (as the HTTP route would have)."""
    return response_line(custom_id, err.status, json_encoder.encode(err.body()))


def unrun_line(custom_id: str, code: str, message: str) -> bytes:
    """An error-file line for a request that never ran (expired window, cancelled batch)."""
    line = OutputLine(
        id=new_request_id(), custom_id=custom_id, response=None, error=LineError(code=code, message=message)
    )
    return json_encoder.encode(line)
