"""The protocol every engine implements, and the records it yields."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, Protocol, TypeVar

import msgspec

from schemas.kafka import ENGINE_DEAD, FinishReason, GenerateRequest, TokenLogprob
from schemas.kv_events import KVEventBatch


class EngineOutput(msgspec.Struct):
    """New output of one sequence since its previous EngineOutput (a delta)."""

    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # Known once the prompt has been scheduled; repeated on the final output.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = []
    # On the first output, when the request asked for them (Chunk.prompt_logprobs).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Seconds the sequence waited in the engine's queue before it was first scheduled; on the first
    # output, 0 if the engine does not know.
    queued_s: float = 0.0
    # On a prefill-only sequence's final output: what a decode engine's KV connector needs to fetch the
    # prompt's KV (KVFrom.connector), where the engine's connector says.
    kv_transfer: dict[str, Any] | None = None


class EngineStats(msgspec.Struct):
    """A snapshot of engine load, reported in heartbeats and metrics."""

    running: int
    waiting: int
    kv_usage: float
    prefix_hit_rate: float
    total_blocks: int
    block_size: int
    max_model_len: int
    # Speculative decoding since the engine started (0 without it): proposals, draft tokens, accepted ones.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class EngineError(Exception):
    """A request-level failure; `retriable` means another worker may succeed."""

    def __init__(self, code: str, message: str, retriable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retriable = retriable


class EngineDead(EngineError):
    """The engine itself failed: the worker must leave the registry and exit."""

    def __init__(self, message: str) -> None:
        super().__init__(ENGINE_DEAD, message, retriable=True)


class _Startable(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


_S = TypeVar("_S", bound=_Startable)


class EngineLifecycle:
    """`async with engine:` for any engine: start on entry, stop on exit."""

    async def __aenter__(self: _S) -> _S:
        await self.start()
        return self

    async def __aexit__(
        self: _Startable,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


class Engine(Protocol):
    """What the worker needs from an engine (simulated or vLLM)."""

    async def start(self) -> None:
        """Load the model and start background stepping."""

    async def stop(self) -> None:
        """Abort everything and release resources."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[EngineOutput]:
        """Stream deltas of one sequence until it finishes; abort it if the iterator is closed early."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop one request and free its blocks; a no-op if it is unknown or done."""

    def pace_outputs(self, room: Callable[[], Awaitable[None]]) -> None:
        """Have the engine await `room()` before it makes more outputs in its own loop (outputs it hands over
        inside its step); an engine whose outputs are only iterated is paced by its readers instead."""

    def kv_events(self) -> AsyncIterator[KVEventBatch]:
        """Batches of KV events in Ferry block hashes, one per engine step that changed the cache."""
        ...

    def stats(self) -> EngineStats:
        """Current load."""
        ...

    async def check_health(self) -> None:
        """Raise EngineDead if the engine can no longer serve."""
