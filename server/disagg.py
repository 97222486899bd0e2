"""Disaggregated prefill and decode: which worker prefills a sequence, and which decodes it.

When the live workers of a model include prefill workers (`ferry worker --role prefill`), a sequence that
will decode gets two decisions: a decode worker (role decode or both), chosen first by the usual `kv` cost
among those workers (decode load, and what of the prompt it caches: a conversation's earlier turns were
decoded there); and, unless the prompt's uncached part on that worker is shorter than
`--disagg-min-uncached-tokens` (then it prefills there itself: conditional disaggregation, also taken when
every prefill worker is busy), a prefill worker chosen by the same cost among the prefill workers, charged
prefill only. The sequence starts on the
prefill worker as a one-token, prefill-only attempt; its token is the client's first (when: `--disagg-first-token`), and
the frontend then moves the sequence to the decode worker with a `kv_from` descriptor (server/migration.py,
`Mover.hand_off`). Aggregated routing and every migration choose among the workers that decode only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from schemas.kafka import KVFrom
from schemas.status import WorkerStatus
from server.router import AllBusy, Decision, PromptMemo, Router

# How a sequence was placed: aggregated (no prefill workers, or nothing to decode), prefilled on a prefill
# worker and decoded elsewhere, or prefilled locally on its decode worker (short uncached part).
Mode = Literal["off", "remote", "local"]


@dataclass
class Placement:
    """Where a sequence starts, and where it moves once its first token arrived (remote prefill only)."""

    first: Decision
    decode: Decision | None = None
    mode: Mode = "off"
    # What the decode worker is told of the prompt's KV: the prefill worker and the prompt tokens it computes.
    kv_from: KVFrom | None = None


def serving(workers: list[WorkerStatus]) -> list[WorkerStatus]:
    """The workers that take whole sequences (and migrations): every role but prefill-only."""
    return [w for w in workers if w.role != "prefill"]


async def place(router: Router, model: str, workers: list[WorkerStatus], memo: PromptMemo) -> Placement:
    """Choose the worker(s) of one sequence; raises as Router.choose does (AllBusy, 503 without workers)."""
    prefill = [w for w in workers if w.role == "prefill"]
    decoders = serving(workers)
    decodes = memo.max_tokens is None or memo.max_tokens > 1
    if not prefill or not decodes or not decoders:
        # Nothing to decode: a prefill worker serves it whole as well as any (and better, caching it).
        return Placement(await router.choose(model, workers if not decodes else decoders, memo))
    decode = await router.choose(model, decoders, memo)
    block_size = decoders[0].block_size
    uncached = len(memo.tokens) - decode.predicted_cached_blocks * block_size
    if uncached < router.config.disagg_min_uncached_tokens:
        return Placement(decode, mode="local")
    prefill_memo = PromptMemo(
        memo.tokens, memo.lora_name, max_tokens=1, hashes=memo.hashes, overtake=memo.overtake
    )
    try:
        first = await router.choose(model, prefill, prefill_memo)
    except AllBusy:
        # Every prefill worker is over a busy threshold: better prefilled by the decode worker now than queued.
        return Placement(decode, mode="local")
    # The decode worker computes nothing of the prompt: it receives it all.
    decode = dataclasses.replace(decode, prefill_tokens=0)
    return Placement(first, decode, "remote", KVFrom(first.worker_id, len(memo.tokens)))
