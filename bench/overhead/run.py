"""The Ferry-only run: concurrency levels, the Kafka floor and the tokenization-interference pair."""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from bench.overhead.measure import (
    INTERFERENCE_CONCURRENCY,
    TARGET_TOKENS_PER_S,
    TARGET_TPS_CONCURRENCY,
    TARGET_TTFT_P50_MS,
    PhaseResult,
    chat_body,
    kafka_floor,
    long_prompt_load,
    long_prompts,
    ms,
    pct,
    run_streams,
    scrape_metrics,
    served_model,
    server_means,
    tokenize_ms,
    topic_records,
)
from bench.overhead.profile import hotspots, py_spy_record
from bench.overhead.report import busy_percent, machine_info
from bench.stack import FerryStack
from schemas.names import reply_topic

# ---- the run -------------------------------------------------------------------------------------


async def measure(
    stack: FerryStack, name: str, concurrency: int, args: argparse.Namespace, model: str, seconds: float
) -> PhaseResult:
    """One streaming phase with CPU accounting and the frontend's own timings over the same span."""
    metrics_before = await scrape_metrics(stack)
    before = stack.snapshot()
    stats, wall = await run_streams(
        stack.host, stack.port, concurrency, args.requests_per_level, seconds,
        functools.partial(chat_body, model, args.max_tokens, prompt_words=args.prompt_words),
    )  # fmt: skip
    cpu = stack.usage(before, stack.snapshot())
    server = server_means(metrics_before, await scrape_metrics(stack))
    return PhaseResult(name, concurrency, stats, wall, cpu, {"frontend_metrics_mean_ms": server})


# Histograms of the frontend whose mean over a phase is reported next to the client's view.
@dataclass(frozen=True)
class Phase:
    """One measured phase of the run."""

    name: str
    concurrency: int
    seconds: float
    long_prompts: bool = False  # a second client keeps sending huge prompts meanwhile
    profile_tag: str | None = None  # sample the stack with py-spy under this tag (--profile only)


def plan(args: argparse.Namespace) -> tuple[list[Phase], list[Phase]]:
    """The concurrency levels, then the tokenization-interference pair."""
    top = max(args.concurrency)
    levels = [
        Phase(f"streams c={c}", c, args.level_seconds, profile_tag=f"c{c}" if c == top else None)
        for c in args.concurrency
    ]
    pair: list[Phase] = []
    if args.interference_seconds > 0:
        c = INTERFERENCE_CONCURRENCY
        pair = [
            Phase(f"c={c} alone", c, args.interference_seconds),
            Phase(
                f"c={c} + long prompts",
                c,
                args.interference_seconds,
                long_prompts=True,
                profile_tag="tokenize",
            ),
        ]
    return levels, pair


async def run_phase(
    args: argparse.Namespace, phase: Phase, stack: FerryStack, model: str, model_dir: str | None
) -> tuple[PhaseResult, dict[str, Any]]:
    """Measure one phase on a running stack; returns its result and any py-spy profiles."""
    print(f"{phase.name} ({phase.seconds:g} s) ...", file=sys.stderr)
    profiles: dict[str, Any] = {}
    stop = asyncio.Event()
    load = None
    prompts: list[str] = []
    if phase.long_prompts:
        prompts = long_prompts(args.long_prompt_chars, 4)
        load = asyncio.ensure_future(
            long_prompt_load(stack.host, stack.port, model, prompts, args.long_prompt_clients, stop)
        )
        await asyncio.sleep(0.2)
    spy = None
    if args.profile and phase.profile_tag:
        spy = asyncio.ensure_future(
            py_spy_record(stack.pids, phase.seconds * 0.8, args.profile, phase.profile_tag)
        )
    try:
        result = await measure(stack, phase.name, phase.concurrency, args, model, phase.seconds)
    finally:
        stop.set()
        lp = await load if load is not None else []
    if spy is not None:
        for path in await spy:
            profiles[path.name] = {"file": str(path), **hotspots(path)}
    result.extra["reply_topic_records_after"] = await topic_records(stack.kafka, reply_topic("frontend-0"))
    if phase.long_prompts:
        lat = [t for _, t in lp]
        result.extra["long_prompts"] = {
            "chars": args.long_prompt_chars,
            "clients": args.long_prompt_clients,
            "endpoint": "/v1/completions (max_tokens 1)",
            "requests": len(lp),
            "requests_per_s": round(len(lp) / result.wall_s, 2) if result.wall_s else 0.0,
            "statuses": dict(Counter(str(s) for s, _ in lp)),
            "latency_ms": {"p50": ms(pct(lat, 50)), "p99": ms(pct(lat, 99))},
            "tokenize_ms_in_process": round(tokenize_ms(model_dir, prompts[0]), 2),
        }
    return result, profiles


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every phase, each on a fresh `ferry up` unless --reuse-stack; returns the results document."""
    from workers.sim_timing import decode_ms, prefill_ms

    machine = machine_info()
    machine["busy_before_start_percent"] = await busy_percent(1.0)
    level_phases, pair_phases = plan(args)
    results: list[PhaseResult] = []
    profiles: dict[str, Any] = {}
    floor: dict[str, Any] = {}
    stack: FerryStack | None = None
    model, model_dir = "", None
    try:
        for phase in [*level_phases, *pair_phases]:
            if stack is None or not args.reuse_stack:
                if stack is not None:
                    await stack.stop()
                    stack = None
                t0 = time.perf_counter()
                stack = await FerryStack.start(args.workers, args.speedup)
                print(
                    f"ferry up ready in {time.perf_counter() - t0:.1f} s at {stack.url}; kafka {stack.kafka}; "
                    f"processes {stack.pids}",
                    file=sys.stderr,
                )
                model, model_dir = await served_model(stack)
                if not floor:  # on a fresh broker, before any load
                    print("kafka floor ...", file=sys.stderr)
                    floor = await kafka_floor(stack.kafka, args.floor_round_trips, args.floor_fetch_wait_ms)
                # Connections, topics, code paths: warm, not measured.
                await run_streams(
                    stack.host,
                    stack.port,
                    4,
                    40,
                    3.0,
                    functools.partial(chat_body, model, args.max_tokens, prompt_words=args.prompt_words),
                )
            result, prof = await run_phase(args, phase, stack, model, model_dir)
            results.append(result)
            profiles.update(prof)
    finally:
        if stack is not None:
            print("stopping ferry up ...", file=sys.stderr)
            await stack.stop()

    levels = results[: len(level_phases)]
    interference: dict[str, Any] | None = None
    if pair_phases:
        quiet, loaded = results[len(level_phases) :]
        interference = {
            "concurrency": INTERFERENCE_CONCURRENCY,
            "phases": [quiet.summary(args.max_tokens), loaded.summary(args.max_tokens)],
            "itl_p99_ms_quiet": ms(quiet.itl(99)),
            "itl_p99_ms_loaded": ms(loaded.itl(99)),
            "long_prompts": loaded.extra["long_prompts"],
        }
    summaries = [p.summary(args.max_tokens) for p in levels]
    by_c = {p["concurrency"]: p for p in summaries}
    targets = []
    if 1 in by_c and by_c[1]["ttft_ms"]["p50"] is not None:
        v = by_c[1]["ttft_ms"]["p50"]
        targets.append({"name": "added TTFT p50 at concurrency 1", "value": v, "unit": "ms", "op": "<=",
                        "target": TARGET_TTFT_P50_MS, "met": v <= TARGET_TTFT_P50_MS})  # fmt: skip
    if TARGET_TPS_CONCURRENCY in by_c:
        v = by_c[TARGET_TPS_CONCURRENCY]["tokens_per_s"]
        targets.append({"name": f"streamed tokens/s at concurrency {TARGET_TPS_CONCURRENCY}", "value": v,
                        "unit": "tokens/s", "op": ">=", "target": TARGET_TOKENS_PER_S,
                        "met": v >= TARGET_TOKENS_PER_S})  # fmt: skip
    floor_p50 = floor["produce_consume_ms"]["p50"] or math.nan

    def ratio(x: float | None) -> float | None:
        return None if x is None or math.isnan(floor_p50) else round(x / floor_p50, 2)

    c1 = by_c.get(1) or (summaries[0] if summaries else {"ttft_ms": {"p50": None}, "itl_ms": {"p50": None}})
    engine_ms = (prefill_ms(32) + args.max_tokens * decode_ms(0.0)) / args.speedup
    return {
        "benchmark": "overhead",
        "command": " ".join(["python -m bench.overhead", *sys.argv[1:]]),
        "machine": machine,
        "config": {
            "workers": args.workers,
            "speedup": args.speedup,
            "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words,
            "concurrency": args.concurrency,
            "requests_per_level": args.requests_per_level,
            "level_seconds": args.level_seconds,
            "interference_seconds": args.interference_seconds,
            "fresh_stack_per_phase": not args.reuse_stack,
            "simulated_engine_ms_per_request": engine_ms,
            "client": "bench.sse_client (asyncio.Protocol on uvloop, one keep-alive connection per stream)",
        },
        "kafka_floor": floor,
        "levels": summaries,
        "interference": interference,
        "targets": targets,
        "ratios_vs_kafka_floor": {
            "ttft_p50_c1": ratio(c1["ttft_ms"]["p50"]),
            "itl_p50_c1": ratio(c1["itl_ms"]["p50"]),
        },
        "profiles": profiles or None,
    }
