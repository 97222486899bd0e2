"""bench/routing: the virtual-time model (a clock that jumps, the real router over real simulated engines
on it) and the TTFT statistics both benchmarks report."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

from bench.routing.client import RequestResult
from bench.routing.run import PlanItem, ttft_dist_ms, ttft_samples
from bench.routing.systems import EngineKnobs
from bench.routing.virtual import ORACLE, VirtualTimeLoop, router_config, run_one
from bench.workload import infinite_cache_hits, prefix_workload


def test_the_clock_jumps_from_timer_to_timer() -> None:
    loop = VirtualTimeLoop()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        woke.append((name, loop.time()))

    async def main() -> None:
        await asyncio.gather(sleeper("c", 3600.0), sleeper("a", 10.0), sleeper("b", 20.5))

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert woke == [("a", 10.0), ("b", 20.5), ("c", 3600.0)]


def test_waiting_on_what_never_comes_is_an_error_not_a_hang() -> None:
    loop = VirtualTimeLoop()

    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    try:
        with pytest.raises(RuntimeError, match="wait forever"):
            loop.run_until_complete(main())
    finally:
        loop.close()


def test_system_names_carry_router_overrides() -> None:
    assert router_config("ferry kv overlap_weight=2 inflight_overlap=false").overlap_weight == 2.0
    assert router_config("ferry kv overlap_weight=2 inflight_overlap=false").inflight_overlap is False
    assert router_config("ferry round_robin").router_policy == "round_robin"
    with pytest.raises(ValueError, match="not a RouterSettings"):
        router_config("ferry kv overlap=2")
    with pytest.raises(ValueError, match="unknown system"):
        router_config("ferry nearest")


def test_a_replay_through_the_real_router(model_path: Path) -> None:
    # Four groups of a 90 % shared prefix on two workers: the kv router keeps each group on one worker
    # and finds its cache; round-robin deals them out and prefills each prefix on both.
    wl = prefix_workload(0.9, requests=32, input_tokens=512, output_tokens=4, groups=4, rate=4.0)
    item = PlanItem("prefix", wl, tuple(infinite_cache_hits((it.prompt for it in wl.items), 64)), 4.0, 0.9)
    knobs = EngineKnobs(workers=2, num_blocks=512, speedup=1.0)
    runs = {
        name: run_one(name, item, knobs, str(model_path), hop_s=0.002, event_delay_s=0.005, seed=0)
        for name in ("ferry round_robin", "ferry kv", ORACLE)
    }
    for r in runs.values():
        assert r["ok"] == 32 and r["wrong_length"] == 0
        assert r["virtual_s"] >= wl.duration_s
    assert runs["ferry round_robin"]["ok_per_worker"] == {"w0": 16, "w1": 16}
    # Round-robin prefills every prefix on both workers; kv each prefix once: all the bound.
    assert runs["ferry round_robin"]["of_bound"] < 0.9
    assert runs["ferry kv"]["of_bound"] == 1.0


def test_requests_cut_off_by_the_deadline_count_toward_ttft() -> None:
    nan = math.nan
    results = [RequestResult(i, 0.0, 0.0, ok=True, ttft=0.1 * (i + 1)) for i in range(8)]
    results += [
        RequestResult(8, 0.0, 0.0, ok=False, error="deadline", ttft=2.0),  # its first token came
        RequestResult(9, 0.0, 0.0, ok=False, error="deadline", ttft=nan),  # none: later than anything
        RequestResult(10, 0.0, 0.0, ok=False, status=503, ttft=nan),  # refused: no TTFT at all
    ]
    samples = ttft_samples(results)
    assert len(samples) == 10 and samples[-1] == math.inf
    dist = ttft_dist_ms(samples)
    assert dist["p50"] == pytest.approx(550.0)  # as numpy's linear percentile of 0.1 .. 0.8, 2.0, inf
    assert dist["p90"] is None and dist["p99"] is None  # past the deadline: not a number to compare
    assert ttft_dist_ms([0.1, 0.2, 0.3])["p90"] == pytest.approx(float(np.percentile([100, 200, 300], 90)))
