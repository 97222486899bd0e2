"""The simulated engine's timing and limits: the model length it accepts, first-token estimates, the host
tier's load, priorities without preemption, the pacer."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer

from schemas.kv_events import BlockStored
from tests.unit.sim_support import (
    EOS,
    MODEL,
    MakeEngine,
    RecordingEngine,
    TimedEngine,
    collect,
    drain,
    make_engine,
    prompt,
    req,
    tokenizer,
)
from workers.sim_config import SimConfig
from workers.sim_timing import StepPacer, step_seconds

# The fixtures, imported so pytest finds them here.
__all__ = ["make_engine", "tokenizer"]


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
