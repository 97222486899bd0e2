"""The routing benchmark proper: the same workloads against every system, one system at a time, and each run's
summary (what the results say about the targets: bench/routing/targets.py)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.routing.client import ReplayResult, RequestResult, closed_loop, replay
from bench.routing.systems import CpuMeter, EngineKnobs, SystemSpec, start
from bench.stats import pct
from bench.workload import (
    DEFAULT_TRACE,
    CacheBound,
    TokenBank,
    WorkItem,
    Workload,
    infinite_cache_hits,
    per_worker_hits,
    prefix_sources,
    prefix_workload,
    read_trace,
    trace_workload,
)

# ---- the plan ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanItem:
    """One measured run: a workload at a rate, identical for every system."""

    kind: str  # "trace" or "prefix"
    workload: Workload
    bound_hits: tuple[int, ...]  # per request: cached tokens under an infinite cache
    rate: float
    prefix_fraction: float | None = None
    block_size: int = 64
    probe: bool = False  # closed loop, one request per worker at a time: the unloaded reference

    def bound(self, indices: set[int] | None = None) -> CacheBound:
        """The infinite-cache bound over all requests, or over `indices` (with every request seen)."""
        items = self.workload.items
        if indices is None:
            return CacheBound(sum(self.bound_hits), self.workload.prompt_tokens())
        cached = sum(self.bound_hits[it.index] for it in items if it.index in indices)
        return CacheBound(cached, sum(len(it.prompt) for it in items if it.index in indices))

    @property
    def key(self) -> str:
        """Names the run across systems."""
        if self.probe:
            return "trace@unloaded" if self.kind == "trace" else f"prefix{self.prefix_fraction:g}@unloaded"
        if self.kind == "trace":
            return f"trace@{self.rate:g}"
        return f"prefix{self.prefix_fraction:g}@{self.rate:g}"


@dataclass(frozen=True)
class PlanSettings:
    """What to run."""

    trace_path: Path
    trace_unloaded: bool  # also the prefix sweep's unloaded reference, when the sweep runs
    trace_rates: tuple[float, ...]
    trace_requests: int
    trace_seconds: float
    trace_sample_every: int
    prefix_fractions: tuple[float, ...]
    prefix_rates: tuple[float, ...]
    prefix_requests: int
    prefix_input_tokens: int
    prefix_output_tokens: int
    prefix_groups: int
    block_tokens: int
    max_model_len: int


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def add_workload_arguments(
    p: argparse.ArgumentParser,
    *,
    speedup: float,
    trace_rates: tuple[float, ...],
    prefix_rates: tuple[float, ...],
) -> None:
    """The engine and workload flags bench.routing and bench.routing.virtual share (same flags, same plan)."""
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--speedup", type=float, default=speedup, help="simulated step time / this (both engines)")
    p.add_argument("--block-size", type=int, default=64, help="KV block size = tokens per trace hash id")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker (both engines)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--unloaded", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the unloaded reference: the trace's requests (and, with --prefix-rates, each prefix "
                   "fraction's), one per worker at a time, max_tokens 1")  # fmt: skip
    p.add_argument(
        "--trace-rates", type=_floats, default=trace_rates, help="request rates of the trace replay"
    )
    p.add_argument("--trace-requests", type=int, default=240, help="most trace requests per run")
    p.add_argument("--trace-seconds", type=float, default=24.0,
                   help="a rate r so low that trace-requests would take longer replays r * this of them, evenly spaced")  # fmt: skip
    p.add_argument(
        "--trace-sample-every", type=int, default=32, help="keep 1 in N conversations of the trace"
    )
    p.add_argument("--prefix-fractions", type=_floats, default=(0.1, 0.3, 0.5, 0.7, 0.9))
    p.add_argument(
        "--prefix-rates", type=_floats, default=prefix_rates, help="request rates of the prefix sweep"
    )
    p.add_argument("--prefix-requests", type=int, default=64)
    p.add_argument("--prefix-input-tokens", type=int, default=2048)
    p.add_argument("--prefix-output-tokens", type=int, default=32)
    p.add_argument("--prefix-groups", type=int, default=16, help="distinct shared prefixes")
    p.add_argument(
        "--drain-seconds", type=float, default=30.0, help="how long a run may take after its last arrival"
    )


def knobs_from(args: argparse.Namespace) -> EngineKnobs:
    """The engine knobs `add_workload_arguments` parsed."""
    return EngineKnobs(
        workers=args.workers, block_size=args.block_size, num_blocks=args.num_blocks, speedup=args.speedup
    )


def plan_settings_from(args: argparse.Namespace, knobs: EngineKnobs) -> PlanSettings:
    """The plan `add_workload_arguments` parsed."""
    return PlanSettings(
        trace_path=args.trace,
        trace_unloaded=args.unloaded,
        trace_rates=tuple(sorted(args.trace_rates)),
        trace_requests=args.trace_requests,
        trace_seconds=args.trace_seconds,
        trace_sample_every=args.trace_sample_every,
        prefix_fractions=args.prefix_fractions,
        prefix_rates=args.prefix_rates,
        prefix_requests=args.prefix_requests,
        prefix_input_tokens=args.prefix_input_tokens,
        prefix_output_tokens=args.prefix_output_tokens,
        prefix_groups=args.prefix_groups,
        block_tokens=args.block_size,
        max_model_len=knobs.max_model_len,
    )


def build_plan(s: PlanSettings) -> list[PlanItem]:
    """Every run, with its requests generated once so every system gets exactly the same ones.

    Trace runs replay the first `trace_requests` requests of the sampled trace; a rate r so low that this
    would take longer than `trace_seconds` replays an evenly spaced subset of r * trace_seconds of them
    instead (same length mix, same time span), so low rates stay short. Every run has its own token salt,
    so no run can hit blocks that an earlier run left in a cache.
    """
    plan: list[PlanItem] = []
    if s.trace_rates or s.trace_unloaded:
        records = read_trace(s.trace_path)
    if s.trace_unloaded:
        # The unloaded reference: the same requests, one per worker at a time, first token only.
        wl = trace_workload(
            records,
            block_tokens=s.block_tokens,
            sample_every=s.trace_sample_every,
            max_requests=s.trace_requests,
            max_model_len=s.max_model_len,
            salt="trace@unloaded",
        )
        wl = replace(wl, items=[replace(it, max_tokens=1) for it in wl.items])
        plan.append(PlanItem("trace", wl, _bound(wl, s.block_tokens), 0.0, None, s.block_tokens, probe=True))
    if s.trace_rates:
        for rate in s.trace_rates:
            wl = trace_workload(
                records,
                block_tokens=s.block_tokens,
                sample_every=s.trace_sample_every,
                max_requests=s.trace_requests,
                max_model_len=s.max_model_len,
                salt=f"trace@{rate:g}",
            )
            n = max(2, min(s.trace_requests, math.ceil(rate * s.trace_seconds)))
            if n < len(wl.items):
                wl = wl.strided(n)
            wl = wl.at_rate(rate)
            plan.append(PlanItem("trace", wl, _bound(wl, s.block_tokens), rate, None, s.block_tokens))
    if s.prefix_rates and s.trace_unloaded:
        # The sweep's unloaded reference: each fraction's requests one per worker at a time, first token only.
        for f in s.prefix_fractions:
            wl = prefix_workload(
                f,
                requests=s.prefix_requests,
                input_tokens=s.prefix_input_tokens,
                output_tokens=1,
                groups=s.prefix_groups,
                block_tokens=s.block_tokens,
                salt=f"prefix{f:g}@unloaded",
            )
            plan.append(
                PlanItem("prefix", wl, _bound(wl, s.block_tokens), 0.0, f, s.block_tokens, probe=True)
            )
    for rate in s.prefix_rates:
        for f in s.prefix_fractions:
            wl = prefix_workload(
                f,
                requests=s.prefix_requests,
                input_tokens=s.prefix_input_tokens,
                output_tokens=s.prefix_output_tokens,
                groups=s.prefix_groups,
                rate=rate,
                block_tokens=s.block_tokens,
                salt=f"prefix{f:g}@{rate:g}",
            )
            plan.append(PlanItem("prefix", wl, _bound(wl, s.block_tokens), rate, f, s.block_tokens))
    return plan


def _bound(wl: Workload, block_size: int) -> tuple[int, ...]:
    return tuple(infinite_cache_hits((it.prompt for it in wl.items), block_size))


# ---- statistics -------------------------------------------------------------------------------------------


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1000.0, 2)


def _dist_ms(values: Sequence[float]) -> dict[str, float | None]:
    return {f"p{q}": _ms(pct(values, q)) for q in (50, 90, 99)}


def ttft_samples(results: Sequence[RequestResult]) -> list[float]:
    """Time to first token of every request that completed or was still running at the run's deadline.

    A request cut off by the deadline counts with its first token if it had one, and as +inf (later than
    any measured value) if not: leaving it out would flatter whichever system is slowest.
    """
    out = [r.ttft for r in results if r.ok]
    out += [math.inf if math.isnan(r.ttft) else r.ttft for r in results if not r.ok and r.error == "deadline"]
    return out


def ttft_dist_ms(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 in ms where the samples may hold +inf (None: the percentile lies past the deadline)."""
    arr = np.sort(np.asarray(values, dtype=float))
    out: dict[str, float | None] = {}
    for q in (50, 90, 99):
        if not arr.size:
            out[f"p{q}"] = None
            continue
        k = q / 100 * (arr.size - 1)
        lo, hi = arr[math.floor(k)], arr[math.ceil(k)]
        out[f"p{q}"] = (
            None if math.isinf(hi) else round(float(lo + (hi - lo) * (k - math.floor(k))) * 1000.0, 2)
        )
    return out


def summarize(system: str, item: PlanItem, rep: ReplayResult, cpu: dict[str, float]) -> dict[str, Any]:
    """The reported numbers of one run."""
    ok = [r for r in rep.results if r.ok]
    failed = [r for r in rep.results if not r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    expected = {it.index: it.max_tokens for it in item.workload.items}
    short = sum(1 for r in ok if r.completion_tokens != expected[r.index])
    itls = [g for r in ok for g in r.itls]
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    workers = Counter(r.worker for r in ok if r.worker)
    # Where requests went and where they failed: an overloaded worker shows up here, not in the percentiles.
    failed_on = Counter(r.worker or "?" for r in failed)
    errors = Counter((r.error or f"HTTP {r.status}")[:120] for r in failed)
    # Cached fraction over the prompts of requests that finished, and the bound over the same requests.
    bound_ok = item.bound({r.index for r in ok})
    cached_fraction = cached / prompt if prompt else math.nan
    # Where the cache hits went: an infinite cache per worker over what the router sent it, and of the hits
    # routing missed, how many came from a request whose prefill had not finished when this one was sent.
    routed_fraction = missed_inflight = math.nan
    if ok and all(r.worker for r in ok):
        routed_fraction, missed_inflight = _routing_losses(item, rep, ok, prompt)
    return {
        "system": system,
        "run": item.key,
        "kind": item.kind,
        "rate_rps": item.rate,
        "prefix_fraction": item.prefix_fraction,
        "requests": len(item.workload.items),
        "ok": len(ok),
        "failed": len(failed),
        "not_sent": rep.not_sent,
        "errors": dict(errors.most_common(5)),
        "wrong_length": short,
        "ttft_ms": ttft_dist_ms(ttft_samples(rep.results)),
        # Of the TTFT samples, requests the deadline cut off before their first token.
        "ttft_censored": sum(
            1 for r in rep.results if not r.ok and r.error == "deadline" and math.isnan(r.ttft)
        ),
        "itl_ms": _dist_ms(itls),
        "tpot_ms_p50": _ms(pct(tpot, 50)),
        "e2e_ms": _dist_ms([r.e2e for r in ok]),
        "throughput": {
            "output_tokens_per_s": round(out_tokens / rep.wall_s, 1) if rep.wall_s > 0 else None,
            "requests_per_s": round(len(ok) / rep.wall_s, 2) if rep.wall_s > 0 else None,
        },
        "wall_s": round(rep.wall_s, 2),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_fraction": _round(cached_fraction),
        "bound_fraction": _round(bound_ok.fraction),
        "of_bound": _round(cached_fraction / bound_ok.fraction) if bound_ok.fraction > 0 else None,
        # Infinite cache per worker, over what the router actually sent each worker: bound - this is lost
        # to routing choices, this - cached_fraction is lost inside the engines (eviction, timing).
        "routed_bound_fraction": _round(routed_fraction),
        # Part of (bound - routed): hits whose source request had not yet produced its first token (its
        # prompt blocks were not cached anywhere yet) when this request was sent.
        "missed_while_source_prefilling": _round(missed_inflight),
        "send_lateness_ms_p99": _ms(pct([r.lateness for r in rep.results], 99)),
        "cpu": cpu,
        "workers_used": len(workers) or None,
        "busiest_worker_share": _round(max(workers.values()) / len(ok)) if workers else None,
        "ok_per_worker": dict(sorted(workers.items())),
        "failed_per_worker": dict(sorted(failed_on.items())),
        # Per completed request: [cached, prompt] tokens, so two systems compare over the same requests.
        "tokens_by_request": {r.index: [r.cached_tokens, r.prompt_tokens] for r in ok},
    }


def _routing_losses(
    item: PlanItem, rep: ReplayResult, ok: list[RequestResult], prompt_tokens: int
) -> tuple[float, float]:
    """(routed bound fraction, fraction of prompt tokens missed while their source was still prefilling)."""
    items = item.workload.items
    prompts = [it.prompt for it in items]
    by_index = {r.index: r for r in rep.results}
    worker = {r.index: r.worker for r in ok}
    routed = per_worker_hits(prompts, [worker.get(it.index) for it in items], item.block_size)
    sources = prefix_sources(prompts, item.block_size)

    def sent(r: RequestResult) -> float:
        return r.scheduled + r.lateness

    inflight = 0
    for r in ok:
        lost = item.bound_hits[r.index] - routed[r.index]
        source = sources[r.index]
        src = by_index.get(source) if source is not None else None
        if lost > 0 and src is not None and not (src.ok and sent(src) + src.ttft <= sent(r)):
            inflight += lost
    total = sum(routed[r.index] for r in ok)
    return (total / prompt_tokens, inflight / prompt_tokens) if prompt_tokens else (math.nan, math.nan)


def _round(x: float) -> float | None:
    return None if x is None or math.isnan(x) else round(x, 4)


# ---- running ---------------------------------------------------------------------------------------------


async def warm_up(host: str, port: int, model: str, workers: int) -> None:
    """A few short requests so that connections, topics and caches of code paths exist before measuring."""
    bank = TokenBank(64, f"warmup-{time.time_ns()}")
    items = [WorkItem(i, 0.05 * i, bank.prompt([i], 64), 4) for i in range(2 * workers)]
    await replay(host, port, model, items, request_timeout_s=60.0, deadline_s=90.0)


async def run_system(
    spec: SystemSpec,
    plan: list[PlanItem],
    knobs: EngineKnobs,
    *,
    model_path: str,
    model_name: str,
    drain_s: float,
    settle_s: float,
    log: Any = print,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start `spec`, run every plan item on it in order, stop it."""
    t0 = time.monotonic()
    running, commands = await start(spec, knobs, model_path, model_name)
    started_s = time.monotonic() - t0
    summaries: list[dict[str, Any]] = []
    try:
        await warm_up(running.host, running.port, model_name, knobs.workers)
        for item in plan:
            await asyncio.sleep(settle_s)
            meter = CpuMeter(running.pids)
            meter.start()
            if item.probe:
                rep = await closed_loop(
                    running.host,
                    running.port,
                    model_name,
                    item.workload.items,
                    concurrency=knobs.workers,
                    extra_body=spec.extra_body,
                )
            else:
                rep = await replay(
                    running.host,
                    running.port,
                    model_name,
                    item.workload.items,
                    deadline_s=item.workload.duration_s + drain_s,
                    extra_body=spec.extra_body,
                )
            summary = summarize(spec.name, item, rep, meter.stop())
            summaries.append(summary)
            log(_progress(summary))
    finally:
        await running.stop()
    return summaries, {"commands": commands, "startup_s": round(started_s, 1)}


def _progress(s: dict[str, Any]) -> str:
    t = s["ttft_ms"]
    cf = s["cached_fraction"]
    return (
        f"  {s['system']:<20} {s['run']:<16} ok {s['ok']}/{s['requests']}  TTFT p50/p90 "
        f"{t['p50']}/{t['p90']} ms  cached {cf if cf is None else f'{cf:.1%}'} "
        f"(routed {s['routed_bound_fraction']}, bound {s['bound_fraction']:.1%})  cpu {s['cpu']['system_pct']}%/{s['cpu']['machine_pct']}%"
    )


# ---- targets ---------------------------------------------------------------------------------------------


def machine_info(repo: Path) -> dict[str, Any]:
    """Cores, memory, load, Python and the checkout, for the results file."""

    def git(*args: str) -> str:
        try:
            r = subprocess.run(
                ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=False
            )
            return r.stdout.strip()
        except OSError:
            return ""

    mem_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    except OSError:
        pass
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem_kb / 2**20, 1),
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }
