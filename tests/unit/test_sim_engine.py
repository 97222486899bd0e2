"""The simulated engine: determinism, stop conditions, migration, logprobs, KV events, scheduling, aborts."""

from __future__ import annotations

import asyncio
import math

import pytest
from tokenizers import Tokenizer

from kvstore.hashing import block_hashes, chain_seed
from schemas.kafka import SamplingParams
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.unit.sim_support import (
    EOS,
    MODEL,
    CrashingEngine,
    MakeEngine,
    collect,
    drain,
    make_engine,
    prompt,
    req,
    tokenizer,
)
from workers.engine import EngineDead, EngineError
from workers.sim import SimEngine
from workers.sim_config import SimConfig

# The fixtures, imported so pytest finds them here.
__all__ = ["make_engine", "tokenizer"]


async def test_same_request_same_tokens_and_index_or_seed_change_them(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    p = prompt(40)
    first = await collect(engine.generate(req("a", p, 20)))
    again = await collect(engine.generate(req("b", p, 20)))
    other_index = await collect(engine.generate(req("c", p, 20, index=1)))
    other_seed = await collect(
        engine.generate(req("d", p, 20, sampling=SamplingParams(ignore_eos=True, seed=7)))
    )
    assert len(first.tokens) == 20
    assert (first.last.finish_reason, first.last.stop_reason) == ("length", None)
    assert again.tokens == first.tokens and again.text == first.text
    assert other_index.tokens != first.tokens
    assert other_seed.tokens != first.tokens
    assert EOS not in first.tokens


async def test_lagging_consumer_gets_merged_deltas(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    p = prompt(30)
    streamed = await collect(engine.generate(req("s", p, 10)))
    slow = engine.generate(req("slow", p, 10))
    # Both run in the same steps; "slow" is not read until the longer one is done.
    await collect(engine.generate(req("long", prompt(30, 1), 30)))
    merged = await collect(slow)
    assert len(merged.outputs) == 1
    assert merged.tokens == streamed.tokens and merged.text == streamed.text
    assert merged.last.finish_reason == "length"
    assert merged.last.prompt_tokens == 30


async def test_natural_length_ends_with_eos(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    lengths = set()
    for salt in range(6):
        r = await collect(engine.generate(req(f"n{salt}", prompt(20, salt), 100, sampling=SamplingParams())))
        assert (r.last.finish_reason, r.last.stop_reason) == ("stop", None)
        assert r.tokens[-1] == EOS and EOS not in r.tokens[:-1]
        assert 4 <= len(r.tokens) <= 24
        assert "<|endoftext|>" not in r.text
        lengths.add(len(r.tokens))
    assert len(lengths) > 1


async def test_max_tokens_wins_over_natural_length(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    r = await collect(engine.generate(req("m", prompt(20), 2, sampling=SamplingParams())))
    assert len(r.tokens) == 2
    assert r.last.finish_reason == "length"


async def test_migration_continues_the_same_sequence(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    p = prompt(37)
    full = await collect(engine.generate(req("orig", p, 10)))
    rest = await collect(engine.generate(req("moved", p, 6, generated_token_ids=full.tokens[:4], attempt=1)))
    assert rest.tokens == full.tokens[4:]
    assert rest.last.finish_reason == "length"
    # A naturally ending sequence ends at the same EOS after migration.
    natural = await collect(engine.generate(req("nat", p, 100, sampling=SamplingParams())))
    moved = await collect(
        engine.generate(req("nat2", p, 96, sampling=SamplingParams(), generated_token_ids=natural.tokens[:4]))
    )
    assert moved.tokens == natural.tokens[4:]
    assert moved.last.finish_reason == "stop"


async def test_stop_string_cuts_output(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    p = prompt(25)
    plain = await collect(engine.generate(req("plain", p, 40)))
    assert len(plain.text) > 20
    stop = plain.text[12:15]
    cut = plain.text.find(stop)
    r = await collect(
        engine.generate(req("stop", p, 40, sampling=SamplingParams(ignore_eos=True, stop=[stop])))
    )
    assert (r.last.finish_reason, r.last.stop_reason) == ("stop", stop)
    assert r.text == plain.text[:cut]
    assert r.tokens == plain.tokens[: len(r.tokens)]


async def test_logprobs_are_plausible_and_deterministic(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    sampling = SamplingParams(ignore_eos=True, logprobs=3)
    a = await collect(engine.generate(req("a", prompt(20), 8, sampling=sampling)))
    b = await collect(engine.generate(req("b", prompt(20), 8, sampling=sampling)))
    entries = [lp for o in a.outputs for lp in o.logprobs]
    assert [lp.token_id for lp in entries] == a.tokens
    assert entries == [lp for o in b.outputs for lp in o.logprobs]
    for lp in entries:
        assert len(lp.top) == 3
        assert lp.top[0] == (lp.token_id, lp.logprob)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1.0
        assert len({t for t, _ in lp.top}) == 3
    none = await collect(engine.generate(req("c", prompt(20), 2, sampling=SamplingParams(ignore_eos=True))))
    assert all(o.logprobs == [] for o in none.outputs)


async def test_cached_tokens_hit_rate_and_usage(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    p = prompt(50)  # 3 full blocks of 16 and 2 tokens
    cold = await collect(engine.generate(req("cold", p, 5)))
    warm = await collect(engine.generate(req("warm", p, 5, index=1)))
    for r, cached in ((cold, 0), (warm, 48)):
        assert (r.outputs[0].prompt_tokens, r.outputs[0].cached_tokens) == (50, cached)
        assert (r.last.prompt_tokens, r.last.cached_tokens) == (50, cached)
    stats = engine.stats()
    assert stats.prefix_hit_rate == pytest.approx(48 / 100)
    assert (stats.running, stats.waiting, stats.kv_usage) == (0, 0, 0.0)
    assert (stats.total_blocks, stats.block_size, stats.max_model_len) == (256, 16, 1024)
    # A block-aligned prompt recomputes its last block, so it can never be fully cached.
    aligned = prompt(48, 2)
    await collect(engine.generate(req("al1", aligned, 2)))
    r = await collect(engine.generate(req("al2", aligned, 2)))
    assert r.last.cached_tokens == 32



async def test_kv_events_match_router_hashes(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    p = prompt(40)
    r = await collect(engine.generate(req("a", p, 30)))
    lora = await collect(engine.generate(req("b", p, 2, lora_name="adapter")))
    batches = await drain(engine)
    events = [e for b in batches for e in b.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    base = [e for e in stored if e.lora_name is None]
    # 40 prompt tokens + 29 computed outputs (the last sampled token is never computed): 4 blocks.
    expected = block_hashes([*p, *r.tokens], 16, chain_seed(MODEL))[:4]
    assert [h for e in base for h in e.block_hashes] == expected
    chained = [None, *expected]
    for e in base:
        assert e.parent_hash == chained[expected.index(e.block_hashes[0])]
    lora_hashes = [h for e in stored if e.lora_name == "adapter" for h in e.block_hashes]
    assert lora_hashes == block_hashes([*p, *lora.tokens], 16, chain_seed(MODEL, "adapter"))[:2]
    assert events[-1] == AllBlocksCleared()
    assert not any(isinstance(e, BlockRemoved) for e in events)


async def test_eviction_emits_removed_tail_first(make_engine: MakeEngine) -> None:
    engine = await make_engine(num_blocks=8, max_model_len=128)
    a = prompt(64)
    ra = await collect(engine.generate(req("a", a, 10)))
    await collect(engine.generate(req("b", prompt(96, 5), 10)))
    events = [e for b in await drain(engine) for e in b.events]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    ha = block_hashes([*a, *ra.tokens], 16, chain_seed(MODEL))
    # a held 5 blocks (4 full + 1 partial); b needs 7: 4 free ones, then a's cached tail first.
    assert removed == [ha[3], ha[2], ha[1]]


async def test_batch_limits_chunked_prefill_and_decode_first(make_engine: MakeEngine) -> None:
    engine = await make_engine(max_num_seqs=2, max_num_batched_tokens=32)
    streams = [
        engine.generate(req("A", prompt(20, 1), 3)),
        engine.generate(req("B", prompt(20, 2), 10)),
        engine.generate(req("C", prompt(40, 3), 3)),
    ]
    results = await asyncio.gather(*(collect(s) for s in streams))
    assert [len(r.tokens) for r in results] == [3, 10, 3]
    steps = engine.steps
    assert steps[:5] == [
        {"A": 20, "B": 12},  # B's prompt is chunked to fit the budget
        {"A": 1, "B": 8},  # A decodes, B finishes its prefill; C waits for a slot
        {"A": 1, "B": 1},
        {"B": 1, "C": 31},  # A finished: C is admitted with what the decode left of the budget
        {"B": 1, "C": 9},
    ]
    assert all(len(s) <= 2 and sum(s.values()) <= 32 for s in steps)


async def test_admission_follows_priority_then_arrival(make_engine: MakeEngine) -> None:
    engine = await make_engine(max_num_seqs=1)
    specs = [("B", 5), ("C", 0), ("D", 5), ("E", 0)]
    streams = [engine.generate(req(rid, prompt(10, i), 2, priority=pr)) for i, (rid, pr) in enumerate(specs)]
    assert (engine.stats().waiting, engine.stats().running) == (4, 0)
    await asyncio.gather(*(collect(s) for s in streams))
    order = list(dict.fromkeys(rid for step in engine.steps for rid in step))
    assert order == ["C", "E", "B", "D"]


async def test_preemption_under_a_tiny_pool_keeps_outputs(make_engine: MakeEngine) -> None:
    big = await make_engine(block_size=4)
    tiny = await make_engine(block_size=4, num_blocks=10, max_model_len=40)
    specs = [("A", 0), ("B", 1), ("C", 0)]
    solo = [await collect(big.generate(req(rid, prompt(8, i), 20))) for i, (rid, _) in enumerate(specs)]
    streams = [tiny.generate(req(rid, prompt(8, i), 20, priority=pr)) for i, (rid, pr) in enumerate(specs)]
    crowded = await asyncio.gather(*(collect(s) for s in streams))
    assert tiny.victims, "three sequences of 7 blocks cannot share 10 blocks without preemption"
    # The lowest priority goes first; the oldest top-priority sequence is never evicted.
    assert tiny.victims[0] == "B"
    assert "A" not in tiny.victims
    for alone, shared in zip(solo, crowded, strict=True):
        assert shared.tokens == alone.tokens and shared.text == alone.text
        assert shared.last.finish_reason == "length"
    stats = tiny.stats()
    assert (stats.running, stats.waiting, stats.kv_usage) == (0, 0, 0.0)


async def test_abort_frees_blocks_and_is_idempotent(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    stream = engine.generate(req("x", prompt(100), 500))
    first = await anext(stream)
    assert first.token_ids and first.prompt_tokens == 100
    assert engine.stats().running == 1 and engine.stats().kv_usage > 0
    await engine.abort("x")
    await engine.abort("x")
    await engine.abort("unknown")
    rest = await collect(stream)
    assert rest.last.finish_reason == "abort"
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_usage) == (0, 0, 0.0)
    # The id is free again once the request is gone.
    assert (await collect(engine.generate(req("x", prompt(10), 2)))).last.finish_reason == "length"


async def test_closing_the_stream_early_aborts(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    stream = engine.generate(req("y", prompt(100), 500))
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert (engine.stats().running, engine.stats().kv_usage) == (0, 0.0)
    # Closing before reading anything aborts too.
    unread = engine.generate(req("z", prompt(100), 500))
    assert engine.stats().waiting == 1
    await unread.aclose()  # type: ignore[attr-defined]
    assert (engine.stats().waiting, engine.stats().running) == (0, 0)


async def test_cancelling_the_consumer_aborts(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(req("c", prompt(100), 500)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (engine.stats().running, engine.stats().kv_usage) == (0, 0.0)


async def test_request_errors(make_engine: MakeEngine, tokenizer: Tokenizer) -> None:
    engine = await make_engine()
    with pytest.raises(EngineError) as info:
        engine.generate(req("long", prompt(1000), 100))
    assert (info.value.code, info.value.retriable) == ("context_length_exceeded", False)
    with pytest.raises(EngineError) as info:
        engine.generate(req("moved", prompt(900), 100, generated_token_ids=prompt(30)))
    assert info.value.code == "context_length_exceeded"
    stream = engine.generate(req("dup", prompt(10), 500))
    with pytest.raises(EngineError) as info:
        engine.generate(req("dup", prompt(10), 5))
    assert info.value.code == "duplicate_request"
    await engine.abort("dup")
    await collect(stream)
    with pytest.raises(EngineError) as info:
        engine.generate(req("empty", [], 5))
    assert info.value.code == "invalid_request"
    idle = SimEngine(MODEL, tokenizer, SimConfig(), eos_token_id=EOS)
    with pytest.raises(EngineDead):
        idle.generate(req("early", prompt(10), 5))


async def test_slow_kv_reader_loses_batches_then_gets_a_snapshot(make_engine: MakeEngine) -> None:
    engine = await make_engine(max_pending_kv_batches=2)
    p = prompt(40)
    r = await collect(engine.generate(req("a", p, 100)))
    assert engine.kv_batches_dropped > 0
    snapshot = await anext(aiter(engine.kv_events()))
    assert snapshot.events[0] == AllBlocksCleared()
    (stored,) = snapshot.events[1:]
    assert isinstance(stored, BlockStored)
    # 40 + 99 computed tokens: 8 full blocks, all still cached.
    assert set(stored.block_hashes) == set(block_hashes([*p, *r.tokens], 16, chain_seed(MODEL))[:8])


async def test_step_loop_crash_fails_requests_and_health(
    make_engine: MakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await make_engine(CrashingEngine)
    with pytest.raises(EngineDead):
        await collect(engine.generate(req("a", prompt(10), 5)))
    assert "step loop crashed" in caplog.text
    with pytest.raises(EngineDead):
        await engine.check_health()
    with pytest.raises(EngineDead):
        engine.generate(req("b", prompt(10), 5))
    assert [b async for b in engine.kv_events()] == []


async def test_stop_aborts_everything(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    streams = [engine.generate(req(f"r{i}", prompt(30, i), 500)) for i in range(3)]
    await anext(streams[0])
    await engine.stop()
    for s in streams:
        assert (await collect(s)).last.finish_reason == "abort"
    with pytest.raises(EngineDead):
        await engine.check_health()
