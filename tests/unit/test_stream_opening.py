"""The opening of a stream (chat's role chunk, completions' echoed prompt) goes out with the first output, as
vLLM sends it: a client that times its first token must not see an event before the engine produced one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from schemas.kafka import Chunk
from server.logprobs import LogprobFormatter
from server.responses import stream
from server.router import Decision
from server.shapes import ChatEvents, CompletionEvents
from server.streams import Sequence, StreamSpec


class GatedSource:
    """A ChunkSource whose chunks come only when the test releases them."""

    id, created, model = "r", 0, "m"

    def __init__(self, spec: StreamSpec, chunks: list[Chunk]) -> None:
        self.spec = spec
        self.metrics = None
        self.release = asyncio.Event()
        self._chunks = chunks
        self._seq = Sequence("r/0", 0, 0, Decision("w"), 3)

    async def chunks(self) -> AsyncIterator[list[tuple[Sequence, Chunk]]]:
        """One batch with every chunk, once released."""
        await self.release.wait()
        yield [(self._seq, c) for c in self._chunks]

    async def close(self) -> None:
        """Nothing to close."""


def bodies(data: bytes) -> list[Any]:
    """The JSON payloads of the `data:` lines in `data` ([DONE] as a string)."""
    lines = [ln.removeprefix(b"data: ") for ln in data.split(b"\n") if ln.startswith(b"data: ")]
    return [ln.decode() if ln == b"[DONE]" else json.loads(ln) for ln in lines]


async def first_write(events_of: Any, spec: StreamSpec) -> list[Any]:
    """The bodies of the stream's first write; asserts nothing was written before the output came."""
    src = GatedSource(
        spec, [Chunk("r/0", 0, token_ids=[7], text="Hi"), Chunk("r/0", 1, finish_reason="stop")]
    )
    out = cast(
        AsyncGenerator[bytes, None],
        stream(cast(Any, src), events_of(src, cast(LogprobFormatter, None), True)),
    )
    first = asyncio.ensure_future(anext(out))
    await asyncio.sleep(0)  # let the writer run as far as it can without output
    await asyncio.sleep(0)
    assert not first.done(), "an event was written before any output"
    src.release.set()
    data = await first
    await out.aclose()
    return bodies(data)


async def test_chat_role_chunk_comes_with_the_first_token() -> None:
    sent = await first_write(ChatEvents, StreamSpec(n=1, prompt_lens=[3]))
    deltas = [b["choices"][0]["delta"] for b in sent if isinstance(b, dict)]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1]["content"] == "Hi"


async def test_completion_echo_comes_with_the_first_token() -> None:
    # In the first token's own chunk, as vLLM sends it.
    sent = await first_write(CompletionEvents, StreamSpec(n=1, prompt_lens=[3], prompt_texts=["Say "]))
    assert [b["choices"][0]["text"] for b in sent if isinstance(b, dict)][:2] == ["Say Hi", ""]
