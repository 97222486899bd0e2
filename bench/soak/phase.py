"""One system's soak: warm it up, settle the load (or take the one given), load it for the set time, sum it up."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from bench.soak.load import Load, Plan, Target, make_body, probe, served_model
from bench.soak.report import Windows, add_cpu_per_request, per_minute, rss_slopes, stalls, targets
from bench.soak.sample import Sampler, StampedLog, processes, py_spy

_STACK_SERVICES = ("kafka", "redis", "frontend")


async def soak(
    target: Target, log: StampedLog, args: argparse.Namespace, plan: Plan | None, profile_dir: Path
) -> tuple[dict[str, Any], Plan]:
    """Warm `target` up, settle the load (probing its capacity) unless `plan` is given, soak it while
    sampling its processes; the results and the load used (to give another system the same)."""
    model = await served_model(target)
    body = make_body(model, args.prompt_words, args.max_tokens)
    capacity: dict[str, Any] | None = None
    if args.warmup_requests:  # a cold engine's first steps are slow (vLLM on CPU: seconds): not measured
        t = time.perf_counter()
        warm = Load(target, body, t, args.warmup_requests)
        await warm.closed(2, t + 300.0)
        _say(target, f"warm-up: {args.warmup_requests} requests in {time.perf_counter() - t:.1f} s")
    if plan is None and args.concurrency:
        plan = Plan(args.concurrency, None, f"{args.concurrency} streams back to back")
    elif plan is None:
        _say(target, f"capacity probe: {args.probe_concurrency} streams for {args.probe_seconds:g} s ...")
        capacity = await probe(target, body, args.probe_concurrency, args.probe_seconds)
        rate = args.load_fraction * capacity["requests_per_s"]
        plan = Plan(None, rate, f"{rate:.1f} req/s open loop ({args.load_fraction:g} x probed "
                    f"{capacity['requests_per_s']} req/s)")  # fmt: skip
    _say(target, f"soak: {plan.desc} for {args.minutes:g} min ...")
    t0 = time.perf_counter()
    log.t0 = t0
    # Lines from before the load are stamped since the system started: they would overlap the load's times.
    before = len(log.lines)
    sampler = Sampler(processes(target.pids), t0)
    stop = asyncio.Event()
    load = Load(target, body, t0, args.max_requests)
    deadline = t0 + args.minutes * 60.0
    profiling = [asyncio.ensure_future(_profile_at(target, t0 + m * 60.0, args.profile_seconds, profile_dir,
                                                   f"min{m:g}")) for m in args.profile_at]  # fmt: skip
    helpers = [
        asyncio.ensure_future(sampler.run(args.sample_s, stop)),
        asyncio.ensure_future(load.watch_stack()),
        asyncio.ensure_future(_progress(target, load, t0)),
    ]
    profiles: dict[str, Any] = {}
    try:
        if plan.concurrency:
            await load.closed(plan.concurrency, deadline)
        else:
            assert plan.rate is not None
            await load.open(plan.rate, args.open_loop_cap, deadline)
        if load.stack_exited_at is not None:
            _say(target, f"exited {load.stack_exited_at:.0f} s into the load; see {log.path}")
        for fut in profiling:
            if fut.done():
                profiles.update(fut.result())
            else:
                fut.cancel()
        stop.set()
        await helpers[0]
    finally:
        for task in [*helpers, *profiling]:
            task.cancel()
    wall = time.perf_counter() - t0
    win = Windows.for_minutes(args.minutes)
    rows = add_cpu_per_request(per_minute(load.outcomes, int(args.minutes)), sampler.samples)
    slopes = rss_slopes(sampler.samples, win.settle_min)
    doc = {
        "system": target.name,
        "model": model,
        "capacity_probe": capacity,
        "wall_s": round(wall, 1),
        "requests": len(load.outcomes),
        "shed_by_client": load.shed,
        "stack_exited_at_s": None if load.stack_exited_at is None else round(load.stack_exited_at, 1),
        "errors": sorted({o.error or "?" for o in load.outcomes if not o.ok})[:10],
        "windows": {"window_min": win.window_min, "settle_min": win.settle_min},
        "per_minute": rows,
        "rss_slope_mb_per_min": slopes,
        "cpu_percent_mean": sampler.cpu_mean(),
        "targets": targets(rows, slopes, win),
        "stalls": stalls(load.outcomes, log.lines[before:], args.stall_ms / 1000.0),
        "log": str(log.path),
        "samples": sampler.samples,
        "profiles": profiles or None,
    }
    return doc, plan


def _say(target: Target, what: str) -> None:
    print(f"{target.name}: {what}", file=sys.stderr)


def profiled(pids: dict[str, int]) -> dict[str, int]:
    """The processes `--profile-at` samples: Ferry's frontend and first worker, or vLLM's server."""
    engines = sorted(k for k in pids if k not in _STACK_SERVICES)
    return {k: v for k, v in pids.items() if k == "frontend" or engines[:1] == [k]}


async def _profile_at(target: Target, at: float, seconds: float, out_dir: Path, tag: str) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    pids = profiled(target.pids)
    _say(target, f"py-spy {tag}: {pids}")
    return await py_spy(pids, seconds, out_dir, tag)


async def _progress(target: Target, load: Load, t0: float) -> None:
    last = 0
    while True:
        await asyncio.sleep(60.0)
        done = load.outcomes[last:]
        last = len(load.outcomes)
        tokens = sum(o.tokens for o in done if o.ok)
        _say(target, f"  minute {(time.perf_counter() - t0) / 60:.0f}: {len(done)} requests, "
                     f"{tokens / 60:.0f} tokens/s, {sum(1 for o in done if not o.ok)} failed")  # fmt: skip
