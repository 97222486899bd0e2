"""The OpenAI Files and Batches API bodies, the batch file line formats, and Ferry's batch records.

Public shapes follow the OpenAI API reference (what the official client parses). `ItemMeta` is
Ferry's own: what a coordinator needs to turn an item's chunks into its output line.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.streams import ToolCallMode

BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions"]
BATCH_ENDPOINTS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
FINAL_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})


# ---- files ---------------------------------------------------------------------------------------


class FileObject(msgspec.Struct, kw_only=True):
    """A stored file (`GET /v1/files/{id}`)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: Literal["file"] = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(msgspec.Struct, kw_only=True):
    """`GET /v1/files`."""

    data: list[FileObject]
    object: Literal["list"] = "list"
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(msgspec.Struct, kw_only=True):
    """`DELETE /v1/files/{id}`."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


# ---- batches -------------------------------------------------------------------------------------

MetadataKey = Annotated[str, Meta(max_length=64)]
MetadataValue = Annotated[str, Meta(max_length=512)]


class BatchCreate(msgspec.Struct, kw_only=True):
    """`POST /v1/batches`."""

    input_file_id: str
    endpoint: BatchEndpoint
    completion_window: str
    metadata: Annotated[dict[MetadataKey, MetadataValue], Meta(max_length=16)] | None = None


class BatchRequestCounts(msgspec.Struct, kw_only=True):
    """How many requests a batch has, and how many ended each way."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(msgspec.Struct, kw_only=True):
    """Why a batch failed validation, pointing at the input line."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(msgspec.Struct, kw_only=True):
    """`errors` of a failed batch."""

    data: list[BatchError]
    object: Literal["list"] = "list"


class InputTokensDetails(msgspec.Struct, kw_only=True):
    """Prompt tokens of the whole batch served from the KV cache."""

    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    """Reasoning tokens (always 0 here)."""

    reasoning_tokens: int = 0


class BatchUsage(msgspec.Struct, kw_only=True):
    """Token totals of every completed request of a batch."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class Batch(msgspec.Struct, kw_only=True):
    """A batch as `GET /v1/batches/{id}` returns it."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    object: Literal["batch"] = "batch"
    model: str | None = None
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = msgspec.field(default_factory=BatchRequestCounts)
    metadata: dict[str, str] | None = None
    usage: BatchUsage | None = None


class BatchList(msgspec.Struct, kw_only=True):
    """`GET /v1/batches`, newest first."""

    data: list[Batch]
    object: Literal["list"] = "list"
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


# ---- lines of batch files ------------------------------------------------------------------------


class InputLine(msgspec.Struct, kw_only=True):
    """One line of a batch input file."""

    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class ResponseRecord(msgspec.Struct, kw_only=True):
    """`response` of an output line: the HTTP status and body the request would have had."""

    status_code: int
    request_id: str
    body: msgspec.Raw


class LineError(msgspec.Struct, kw_only=True):
    """`error` of an output line: the request never ran (expired, cancelled)."""

    code: str
    message: str


class OutputLine(msgspec.Struct, kw_only=True):
    """One line of a batch output or error file, and one result message of the Kafka-native path."""

    id: str
    custom_id: str
    response: ResponseRecord | None
    error: LineError | None


class KafkaBatchItem(msgspec.Struct, kw_only=True):
    """A Kafka-native batch item (JSON on `ferry.batch.submit.<model>`): an input line plus a reply topic."""

    custom_id: str
    url: BatchEndpoint
    body: msgspec.Raw
    reply_topic: str
    method: Literal["POST"] = "POST"


# ---- Ferry's own records -------------------------------------------------------------------------


class ItemMeta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What turns one item's chunks into its output line, stored in Redis when the item is submitted."""

    custom_id: str
    endpoint: BatchEndpoint
    model: str
    # Tokens of each prompt; the item has len(prompt_lens) * n sequences.
    prompt_lens: list[int]
    n: int = 1
    logprobs: bool = False
    # Text completions with `echo`: the prompt texts to put in front of each choice.
    echo_texts: list[str] = []
    # Each prompt's first token (echoed prompts' logprobs start with it).
    first_tokens: list[int] = []
    # False when only `echo` with `logprobs` had them computed: `prompt_logprobs` shows only when asked for.
    show_prompt_logprobs: bool = True
    # Kafka-native items: where the result goes.
    reply_topic: str = ""
    # Chat requests with tools: how the output becomes tool calls.
    tools: ToolCallMode | None = None
    # The tenant whose key created the batch, and the key's id: the item's usage is theirs (docs/tenants.md).
    tenant: str = ""
    key_id: str = ""


file_object_decoder: msgspec.msgpack.Decoder[FileObject] = msgspec.msgpack.Decoder(FileObject)
item_meta_decoder: msgspec.msgpack.Decoder[ItemMeta] = msgspec.msgpack.Decoder(ItemMeta)
input_line_decoder: msgspec.json.Decoder[InputLine] = msgspec.json.Decoder(InputLine)
output_line_decoder: msgspec.json.Decoder[OutputLine] = msgspec.json.Decoder(OutputLine)
batch_create_decoder: msgspec.json.Decoder[BatchCreate] = msgspec.json.Decoder(BatchCreate)
kafka_item_decoder: msgspec.json.Decoder[KafkaBatchItem] = msgspec.json.Decoder(KafkaBatchItem)
