"""The simulated engine receiving a prefill worker's KV: blocks taken instead of computed, and the link's cost."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstore.hashing import block_hashes, chain_seed
from schemas.kafka import KVFrom
from schemas.kv_events import BlockStored
from tests.unit.sim_support import (
    MODEL,
    MakeEngine,
    RecordingEngine,
    collect,
    drain,
    make_engine,
    prompt,
    req,
    tokenizer,
)
from workers.engine_base import OutputStream
from workers.sim import _Seq
from workers.sim_transfer import admission, received_tokens, transfer_seconds

# The simulated engine's test fixtures (a small in-memory tokenizer, engines stopped after the test), imported so
# pytest finds them here.
__all__ = ["make_engine", "tokenizer"]


class KindsEngine(RecordingEngine):
    """Also records whether each step computed any prefill (which the timing model charges a step for)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefilled: list[bool] = []

    def _step_seconds(self, work: dict[str, tuple[_Seq, int]]) -> float:
        self.prefilled.append(any(seq.num_computed < seq.prefill_end for seq, _n in work.values()))
        return super()._step_seconds(work)


SMOLLM2_BYTES = 30 * 3 * 64 * 2 * 2  # the default model's KV bytes per token (workers/host_tier.py)


def test_transfer_cost_is_bytes_over_bandwidth() -> None:
    # 10 blocks of 64 tokens of the default model over 64 GB/s: 14.7 MB, 230 us.
    assert transfer_seconds(10, 64, SMOLLM2_BYTES, 64.0) == pytest.approx(10 * 64 * SMOLLM2_BYTES / 64e9)
    assert transfer_seconds(10, 64, SMOLLM2_BYTES, 64.0) == pytest.approx(230.4e-6)
    assert transfer_seconds(10, 64, SMOLLM2_BYTES, 0.0) == 0.0  # 0 = free, as Dynamo's mocker
    assert transfer_seconds(0, 64, SMOLLM2_BYTES, 64.0) == 0.0


def test_received_tokens_leave_a_token_to_compute_and_make_it_a_decode() -> None:
    assert received_tokens(None, 101) == 0
    assert received_tokens(KVFrom("p", 100), 101) == 100  # the whole prompt; the prefill worker's token left
    assert received_tokens(KVFrom("p", 100), 100) == 99  # at least one token is always computed here
    assert received_tokens(KVFrom("p", 30), 101) == 30  # no more than the source computed
    # Only the last token left: the sequence decodes from its first step (no prefill step for the others).
    assert admission(hit_tokens=32, received=100, num_tokens=101) == (100, 100)
    # Less received than that (or nothing): the rest is prefilled as usual.
    assert admission(hit_tokens=32, received=30, num_tokens=101) == (32, 101)
    assert admission(hit_tokens=64, received=0, num_tokens=101) == (64, 101)


async def test_received_kv_is_stored_not_computed_and_the_output_is_unchanged(
    make_engine: MakeEngine,
) -> None:
    p = prompt(100)  # 6 full blocks of 16 and 4 tokens
    reference = await collect((await make_engine()).generate(req("ref", p, 12)))
    first = reference.tokens[:1]
    engine = await make_engine(KindsEngine, kv_transfer_bandwidth_gbps=0.0)
    assert isinstance(engine, KindsEngine)
    # The continuation a decode worker gets: prompt, the prefill worker's token, and where the KV is.
    handed = req("d", p, 11, generated_token_ids=first, kv_from=KVFrom("p", 100))
    out = await collect(engine.generate(handed))
    assert first + out.tokens == reference.tokens
    # Only the prefill worker's token was computed here, by a decode step, as every sampled token's KV is.
    assert engine.steps[0] == {"d": 1}
    assert not any(engine.prefilled)
    assert out.outputs[0].cached_tokens == 100  # as vLLM counts KV a connector loaded
    stored = [
        h for b in await drain(engine) for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    assert stored[:6] == block_hashes(p[:96], 16, chain_seed(MODEL))


async def test_the_sequence_waits_for_its_kv_alone_and_cached_blocks_are_not_sent(
    make_engine: MakeEngine,
) -> None:
    bs, kv_bytes = 16, 1_000_000
    # 7 blocks (the last partial) x 16 tokens x 1 MB over 1 GB/s: 112 ms of link time.
    engine = await make_engine(speedup=1.0, kv_bytes_per_token=kv_bytes, kv_transfer_bandwidth_gbps=1.0)
    expected = transfer_seconds(7, bs, kv_bytes, 1.0)
    p = prompt(100, salt=3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stream = engine.generate(req("d", p, 2, generated_token_ids=[5], kv_from=KVFrom("p", 100)))
    assert engine.stats().waiting == 1  # counted as waiting while the KV is on its way
    await collect(stream)
    assert loop.time() - t0 >= expected
    assert (engine.receiver.received_blocks, engine.receiver.transferred_blocks) == (7, 7)
    # Its 6 full blocks are cached here now: a second hand-off of the same prompt sends only the partial one.
    await collect(engine.generate(req("e", p, 2, generated_token_ids=[5], kv_from=KVFrom("p", 100))))
    assert (engine.receiver.received_blocks, engine.receiver.transferred_blocks) == (14, 8)


async def test_the_link_time_is_wall_time_whatever_the_speedup(make_engine: MakeEngine) -> None:
    """--speedup scales the compute model (the steps), not the link between workers, as in Dynamo's mocker."""
    bs, kv_bytes = 16, 1_000_000
    engine = await make_engine(speedup=100.0, kv_bytes_per_token=kv_bytes, kv_transfer_bandwidth_gbps=1.0)
    expected = transfer_seconds(7, bs, kv_bytes, 1.0)  # 112 ms; 1.1 ms if it were divided by the speedup
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await collect(
        engine.generate(req("d", prompt(100, salt=4), 2, generated_token_ids=[5], kv_from=KVFrom("p", 100)))
    )
    assert loop.time() - t0 >= expected


async def test_a_handed_off_sequence_is_announced_once_as_it_enters_its_first_step(
    make_engine: MakeEngine,
) -> None:
    # The decode worker sends the prefill worker's token then (workers/serving.py): one step before the next.
    engine = await make_engine(speedup=1.0, kv_bytes_per_token=1_000_000, kv_transfer_bandwidth_gbps=1.0)
    stream = engine.generate(
        req("d", prompt(100, salt=5), 3, generated_token_ids=[5], kv_from=KVFrom("p", 100))
    )
    assert isinstance(stream, OutputStream)
    seen: list[str] = []
    # Not while its KV is on its way (112 ms here), nor before any output.
    assert stream.when_scheduled(lambda: seen.append(f"scheduled, waiting {engine.stats().waiting}"))
    done = stream.push_to(lambda out: seen.append(f"output {out.token_ids}"))
    assert done is not None
    await done
    assert seen[0] == "scheduled, waiting 0" and len(seen) == 4
    assert all(s.startswith("output") for s in seen[1:])
    # Asked after it was scheduled: at once.
    assert stream.when_scheduled(lambda: seen.append("late"))
    assert seen[-1] == "late"
