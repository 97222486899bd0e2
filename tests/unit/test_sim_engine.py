"""The simulated engine: scheduling, determinism, stop conditions, migration, aborts, KV events."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvstore.hashing import block_hashes, chain_seed
from schemas.kafka import GenerateRequest, SamplingParams
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from workers.engine import EngineDead, EngineError, EngineOutput
from workers.sim import SimEngine, _Seq, _Step
from workers.sim_config import SimConfig
from workers.sim_timing import StepPacer, step_seconds

MODEL = "sim-test"
EOS = 0
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Ferry streams tokens from Kafka to clients.",
    "Prefix caching keeps blocks of the prompt; the router sends requests where blocks live.",
    "héllo wörld, 日本語のテキスト, emoji ☃ and numbers 0123456789.",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A small byte-level BPE trained in memory (no downloads)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    assert tok.token_to_id("<|endoftext|>") == EOS
    return tok


class RecordingEngine(SimEngine):
    """Records what each step scheduled and which sequences were preempted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[dict[str, int]] = []
        self.victims: list[str] = []

    def _schedule(self) -> _Step | None:
        step = super()._schedule()
        if step is not None:
            self.steps.append({rid: n for rid, (_, n) in step.work.items()})
        return step

    def _preempt(self, seq: _Seq) -> None:
        self.victims.append(seq.request.request_id)
        super()._preempt(seq)


class CrashingEngine(SimEngine):
    """Fails inside its step loop, as a bug would."""

    def _complete(self, step: _Step) -> None:
        raise RuntimeError("boom")


MakeEngine = Callable[..., Awaitable[RecordingEngine]]


@pytest.fixture
async def make_engine(tokenizer: Tokenizer) -> AsyncIterator[MakeEngine]:
    engines: list[SimEngine] = []

    async def make(engine_cls: type[SimEngine] = RecordingEngine, **overrides: Any) -> Any:
        settings: dict[str, Any] = {
            "speedup": 1e9,
            "block_size": 16,
            "num_blocks": 256,
            "max_model_len": 1024,
            "min_output_tokens": 4,
            "max_output_tokens": 24,
        }
        engine = engine_cls(MODEL, tokenizer, SimConfig(**(settings | overrides)), eos_token_id=EOS)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7 + salt * 31) % 390 for i in range(n)]


def req(rid: str, tokens: list[int], max_tokens: int = 16, **kw: Any) -> GenerateRequest:
    sampling = kw.pop("sampling", SamplingParams(ignore_eos=True))
    return GenerateRequest(rid, MODEL, tokens, max_tokens, "replies", sampling=sampling, **kw)


@dataclass
class Result:
    outputs: list[EngineOutput] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def last(self) -> EngineOutput:
        return self.outputs[-1]


async def collect(stream: AsyncIterator[EngineOutput]) -> Result:
    result = Result()
    async for out in stream:
        result.outputs.append(out)
    return result


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


async def drain(engine: SimEngine) -> list[KVEventBatch]:
    await engine.stop()
    return [batch async for batch in engine.kv_events()]


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


def test_config_rejects_a_model_len_the_pool_cannot_hold() -> None:
    with pytest.raises(ValueError, match="KV capacity"):
        SimConfig(block_size=16, num_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match="min_output_tokens"):
        SimConfig(min_output_tokens=10, max_output_tokens=5)


async def test_first_token_eta_follows_the_queue_and_the_cache(make_engine: MakeEngine) -> None:
    engine = await make_engine(speedup=1.0)
    cap = engine.config.num_blocks * engine.config.block_size
    p = prompt(40)
    # Idle: one step that prefills the whole prompt.
    assert engine.first_token_eta(p) == pytest.approx(step_seconds(40, 0, 0, cap))
    # Queued behind another prompt (not yet scheduled): both are prefilled in the same step.
    ahead = engine.generate(req("ahead", prompt(300, 1), 4))
    assert engine.first_token_eta(p) == pytest.approx(step_seconds(340, 0, 0, cap))
    await collect(ahead)
    await collect(engine.generate(req("warm", p, 4)))
    # Its first two 16-token blocks are cached now: only the rest of a longer prompt is prefilled.
    assert engine.first_token_eta([*p, *prompt(8, 2)]) == pytest.approx(step_seconds(48 - 32, 0, 0, cap))


class TimedEngine(RecordingEngine):
    """Also records each step's simulated seconds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds: list[float] = []

    def _schedule(self) -> _Step | None:
        step = super()._schedule()
        if step is not None:
            self.seconds.append(step.seconds)
        return step


async def test_host_tier_serves_an_evicted_prefix_and_charges_the_load(make_engine: MakeEngine) -> None:
    # 16 bytes per block at 1e-9 GB/s (1 B/s): loading a block costs 16 s, / speedup 1e9.
    engine = await make_engine(
        TimedEngine,
        num_blocks=8,
        max_model_len=128,
        num_host_blocks=32,
        kv_bytes_per_token=1,
        host_offload_h2d_bandwidth_gbps=1e-9,
    )
    assert isinstance(engine, TimedEngine)
    a = prompt(50)
    await collect(engine.generate(req("a1", a, 2)))
    # b needs 7 of the 8 blocks: 5 free ones, then a's 2 tail blocks are evicted to the host.
    await collect(engine.generate(req("b", prompt(100, 5), 2)))
    before = len(engine.seconds)
    again = await collect(engine.generate(req("a2", a, 2, index=1)))
    assert again.last.cached_tokens == 48
    # 1 block from the device and 2 from the host: the step prefills 2 tokens and loads 2 blocks.
    assert engine.seconds[before] == pytest.approx(step_seconds(2, 0, 0, 128, 1e9) + 32 / 1e9)
    host = [
        e for b in await drain(engine) for e in b.events if isinstance(e, BlockStored) and e.medium == "CPU"
    ]
    assert host


async def test_a_better_waiting_request_preempts_nothing_as_in_vllm(make_engine: MakeEngine) -> None:
    # vLLM's V1 scheduler under the priority policy (0.32: Scheduler.schedule) preempts only when a *running*
    # request cannot get KV blocks; a waiting request stops admission when the running set is full
    # (max_num_seqs) or its blocks do not fit, whatever its priority. The sim does the same.
    full = await make_engine(max_num_seqs=2)
    low = [full.generate(req(rid, prompt(10, i), 30, priority=5)) for i, rid in enumerate("AB")]
    for s in low:
        await anext(s)  # both running (their first tokens), 29 to go
    late = [full.generate(req("C", prompt(10, 7), 2, priority=5)), full.generate(req("H", prompt(10, 8), 2))]
    done = await asyncio.gather(*(collect(s) for s in low + late))
    assert all(r.last.finish_reason == "length" for r in done)
    assert full.victims == []
    order = list(dict.fromkeys(rid for step in full.steps for rid in step))
    assert order == ["A", "B", "H", "C"]  # H waits for a slot, then goes ahead of the earlier C
    # KV short for a waiting request: it waits too, and preempts nobody.
    tiny = await make_engine(block_size=4, num_blocks=10, max_model_len=40)
    a = tiny.generate(req("A", prompt(24, 1), 8, priority=5))
    await anext(a)  # running, holding 7 of the 10 blocks
    first = asyncio.ensure_future(collect(a))
    await collect(tiny.generate(req("H", prompt(24, 2), 2)))
    assert (await first).last.finish_reason == "length"
    assert tiny.victims == []
    steps_of = (
        [i for i, step in enumerate(tiny.steps) if "H" in step],
        [i for i, s in enumerate(tiny.steps) if "A" in s],
    )
    assert min(steps_of[0]) > max(steps_of[1])  # H ran once A had ended and freed its blocks


async def test_every_step_sleeps_through_the_engines_pacer(tokenizer: Tokenizer) -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(0)

    config = SimConfig(speedup=1.0, block_size=16, num_blocks=256, max_model_len=1024)
    engine = RecordingEngine(MODEL, tokenizer, config, eos_token_id=EOS)
    # A clock that stands still: the engine's own work takes no time, so each step sleeps its whole model time.
    engine.pacer = StepPacer(clock=lambda: 0.0, sleep=sleep)
    await engine.start()
    try:
        result = await collect(engine.generate(req("a", prompt(20), 3)))
    finally:
        await engine.stop()
    assert len(result.tokens) == 3 and engine.steps == [{"a": 20}, {"a": 1}, {"a": 1}]
    capacity = 256 * 16
    assert slept == pytest.approx(
        [step_seconds(20, 0, 0, capacity), step_seconds(0, 21, 1, capacity), step_seconds(0, 22, 1, capacity)]
    )
