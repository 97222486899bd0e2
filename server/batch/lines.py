"""One item's chunks to its output line: collects each sequence's run and builds the OpenAI response body.

An item may run more than once (a worker died, a partition moved): the chunks of one run are told
apart by the worker that sent them, and the first run that ends cleanly wins. A run that a stopping
or dying worker cut short is dropped; the pool delivers the item again.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from schemas.batch import ItemMeta
from schemas.kafka import ATTEMPT_LOST, Chunk, ErrorInfo
from schemas.openai import Usage, json_encoder
from server.errors import APIError, error_status
from server.kinds import BY_PATH
from server.logprobs import LogprobFormatter
from server.responses import absorb
from server.shapes import ChoiceState, Finished

# Errors that mean "this worker stopped before finishing", not "this request failed": the item comes back.
INTERRUPTED = ATTEMPT_LOST | {"worker_died"}


@dataclass
class _Run:
    chunks: dict[int, Chunk] = field(default_factory=dict)
    end: int | None = None  # the seq after the run's last chunk, once that came

    def complete(self) -> bool:
        # A chunk may carry several (`span`): the run is whole when the ones it has cover 0 to its end.
        return self.end is not None and sum(c.span for c in self.chunks.values()) == self.end


@dataclass
class ItemResult:
    """The outcome of an item: a line for the output file (ok) or the error file."""

    ok: bool
    body: bytes
    status: int
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    aborted: bool = False


@dataclass
class ItemChunks:
    """Chunks of every sequence of one item, by sequence index and worker."""

    first_offset: int
    runs: dict[int, dict[str, _Run]] = field(default_factory=dict)
    done: dict[int, list[Chunk]] = field(default_factory=dict)
    error: ErrorInfo | None = None
    aborted: bool = False
    seen_at: float = field(default_factory=time.monotonic)

    def add(self, k: int, chunk: Chunk) -> None:
        """Take one chunk of sequence k."""
        if k in self.done:
            return
        runs = self.runs.setdefault(k, {})
        run = runs.get(chunk.worker_id)
        if run is None or (chunk.seq == 0 and 0 in run.chunks and run.chunks[0] != chunk):
            # A new run (or the same worker running the item again after a restart).
            run = runs[chunk.worker_id] = _Run()
        run.chunks[chunk.seq] = chunk
        if chunk.finish_reason is not None:
            run.end = chunk.end
        if not run.complete():
            return
        ordered = [run.chunks[i] for i in sorted(run.chunks)]
        last = ordered[-1]
        if last.error is not None and last.error.code in INTERRUPTED:
            del runs[chunk.worker_id]
            return
        if last.error is not None:
            self.error = last.error
        elif last.finish_reason == "abort":
            self.aborted = True
        self.done[k] = ordered
        del self.runs[k]

    def finished(self, sequences: int) -> bool:
        """Every sequence has its final run, or one failed (which decides the item)."""
        return self.error is not None or self.aborted or len(self.done) >= sequences


def sequences_of(meta: ItemMeta) -> int:
    """How many sequences an item has."""
    return len(meta.prompt_lens) * meta.n


def build(meta: ItemMeta, item: ItemChunks, fmt: LogprobFormatter) -> ItemResult:
    """The response body of a finished item (the same JSON the HTTP route answers)."""
    if item.error is not None:
        err: APIError = error_status(item.error)
        return ItemResult(False, json_encoder.encode(err.body()), err.status)
    if item.aborted:
        return ItemResult(False, b"", 0, aborted=True)
    states: dict[int, ChoiceState] = {}
    for k in range(sequences_of(meta)):
        state = states[k] = ChoiceState()
        absorb(state, item.done.get(k, []))
    kind = BY_PATH[meta.endpoint]
    done = Finished(
        f"{kind.id_prefix}-{secrets.token_hex(12)}", int(time.time()), meta.model, states, meta.logprobs,
        meta.prompt_lens, meta.n, meta.echo_texts or None, meta.tools, meta.first_tokens, meta.show_prompt_logprobs,
    )  # fmt: skip
    body = kind.whole(done, fmt)
    usage = body.usage
    assert isinstance(usage, Usage)  # a whole body always has one
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ItemResult(
        True, json_encoder.encode(body), 200, usage.prompt_tokens, cached or 0, usage.completion_tokens
    )
