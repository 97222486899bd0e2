"""Autoscaling under a load ramp on simulated workers: the planner against static provisioning at the peak,
static at the mean, and a reactive utilisation rule like a Kubernetes HPA's.

    python -m bench.autoscale --ramp-s 240 --out bench/autoscale/results.json

The offered rate rises linearly from --base-rate to ten times it over the first half of --ramp-s and falls
back over the second half (open loop: arrivals do not wait for answers). Prompts and output lengths come
from the conversation trace (bench/workload.py, scaled down as there). Workers are `sim` engines with a small
--max-num-seqs, so one worker's capacity is a few sequences and the fleet size matters. Each system gets a
fresh broker, Redis and frontend. Reported per system: SLO attainment (share of requests whose TTFT and mean
ITL are both within the targets), worker-seconds (integral of worker processes alive: starting, serving or
draining), time to react (from the first planner interval whose load exceeded the workers' slots to the
first scale-out), failed requests (non-200, an error event, or fewer tokens than asked). With --pools every
system serves through a prefill pool and a decode pool, each sized on its own (one planner per pool).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from bench.overhead import machine_info
from bench.routing.client import request_body
from bench.stack import run_cleanly
from bench.workload import DEFAULT_TRACE, WorkItem, read_trace, trace_workload
from launch.autoscale import LocalWorkers, start_planner
from launch.services import Child, free_port, start_broker, start_redis
from planner.policy import Action, Decision, Observation, Policy, Reason
from schemas.ops_settings import PlannerPolicySettings, PlannerPool
from schemas.settings import WorkerSettings

MODEL = "SmolLM2-135M-Instruct"


class ReactivePolicy(Policy):
    """A Kubernetes HPA's rule: desired = ceil(current x utilisation / target), utilisation being the share of
    the workers' slots in use; scale-in only after a stabilisation window of calm (HPA's default is 5 min;
    scaled here to the ramp). No forecast, no latency input."""

    def __init__(self, config: PlannerPolicySettings, slots: int, window_s: float) -> None:
        super().__init__(config)
        self.slots, self.window_s = slots, window_s
        self._recent: list[tuple[float, int]] = []

    def decide(self, obs: Observation, now: float) -> Decision:
        """The HPA formula with a scale-down stabilisation window (the highest recommendation in it wins)."""
        c = self.config
        current = max(obs.ready + obs.starting, 1)
        utilisation = obs.concurrency / (max(obs.ready, 1) * self.slots)
        want = min(c.max_workers, max(c.min_workers, math.ceil(current * utilisation / c.target_utilisation)))
        self._recent = [(t, w) for t, w in self._recent if now - t < self.window_s] + [(now, want)]
        self.predicted = float(obs.concurrency)
        if want > current and not obs.starting:
            return Decision(want, Action.SCALE_OUT, Reason.LOAD, f"utilisation {utilisation:.2f}")
        stable = max(w for _, w in self._recent)
        if stable < current and not obs.draining:
            return Decision(current - 1, Action.SCALE_IN, Reason.LOW_LOAD, f"utilisation {utilisation:.2f}")
        return Decision(current, Action.HOLD, Reason.STEADY, "")


@dataclasses.dataclass
class Result:
    """One request as the client saw it."""

    at: float
    ok: bool
    ttft: float = math.inf
    itl: float = math.inf
    error: str = ""  # why it failed: an HTTP status, an error event's type, a short stream, a client error


async def one(c: httpx.AsyncClient, item: WorkItem, t0: float) -> Result:
    """Send one streamed completion; time its first token and the mean gap between later ones."""
    start = time.monotonic()
    tokens, first, last = 0, 0.0, 0.0
    try:
        async with c.stream("POST", "/v1/completions", content=request_body(MODEL, item)) as r:
            if r.status_code != 200:
                return Result(start - t0, False, error=f"http {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return Result(start - t0, False, error=str(data["error"].get("type", "error event")))
                if data.get("choices") and data["choices"][0].get("text"):
                    now = time.monotonic()
                    first = first or now
                    last = now
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return Result(start - t0, False, error=type(exc).__name__)
    if tokens != item.max_tokens or not first:
        return Result(start - t0, False, error=f"{tokens} of {item.max_tokens} tokens")
    return Result(start - t0, True, first - start, (last - first) / max(tokens - 1, 1))


# The default model's context, which trace_workload fills up to (prompt + output).
MAX_MODEL_LEN = 8192


def arrivals(ramp_s: float, base: float, seed: int) -> list[float]:
    """Poisson arrival times whose rate rises from base to 10x base at ramp_s/2 and back (thinning)."""
    rng, peak, t = random.Random(seed), 10 * base, 0.0
    out: list[float] = []
    while True:
        t += rng.expovariate(peak)
        if t >= ramp_s:
            return out
        rate = base + (peak - base) * (1 - abs(2 * t / ramp_s - 1))
        if rng.random() < rate / peak:
            out.append(t)


async def _quietly(stop: Callable[[], Awaitable[object]]) -> None:
    """Run one clean-up step; a failing one must not keep the others from running."""
    with contextlib.suppress(Exception):
        await stop()


async def run_system(
    name: str, args: argparse.Namespace, items: list[WorkItem], times: list[float]
) -> dict[str, Any]:
    """Start a fresh stack for one system, replay the ramp, and measure."""
    # Whatever happens, no process of this system outlives it (a failed run left a whole stack running).
    async with contextlib.AsyncExitStack() as cleanup:
        broker, kafka = await start_broker()
        cleanup.push_async_callback(_quietly, broker.stop)
        redis_child, redis = await start_redis()
        cleanup.push_async_callback(_quietly, redis_child.stop)
        worker = WorkerSettings(kafka=kafka, redis=redis, model_path=args.model_path, served_model_name=MODEL,
                                max_num_seqs=args.slots, speedup=args.speedup, heartbeat_interval_s=0.5)  # fmt: skip
        wflags = ["--max-num-seqs", str(args.slots), "--speedup", str(args.speedup), "--heartbeat-interval-s", "0.5",
                  "--model-path", args.model_path, "--drain-grace-s", "60", "--log-level", "warning"]  # fmt: skip

        def spawner(role: str) -> Callable[[str], Awaitable[Child]]:
            def spawn(wid: str) -> Awaitable[Child]:
                return Child.spawn(wid, [sys.executable, "-m", "launch", "worker", "--worker-id", wid, "--kafka",
                                         kafka, "--redis", redis, *(["--role", role] if role else []), *wflags],
                                   echo=False)  # fmt: skip

            return spawn

        # One fleet of aggregated workers, or (--pools) a prefill pool and a decode pool, each its own actuator.
        pools: tuple[PlannerPool, ...] = ("prefill", "decode") if args.pools else ("all",)
        actuators = {
            pool: LocalWorkers(spawner("" if pool == "all" else pool), worker, 120.0, pool) for pool in pools
        }
        for actuator in actuators.values():
            cleanup.push_async_callback(_quietly, actuator.stop_all)
        start = {"peak": args.max_workers, "mean": args.mean_workers}.get(name, args.min_workers)
        policy = PlannerPolicySettings(
            min_workers=args.min_workers, max_workers=args.max_workers, ttft_p90_target_s=args.ttft_s,
            itl_p90_target_s=args.itl_s, planner_interval_s=args.interval_s, worker_capacity=float(args.slots),
            worker_start_s=3.0, scale_out_cooldown_s=3.0, scale_in_cooldown_s=10.0, scale_in_stable=3,
        )  # fmt: skip
        port = free_port()
        front = await Child.spawn("frontend", [sys.executable, "-m", "launch", "frontend", "--port", str(port),
                                               "--kafka", kafka, "--redis", redis, "--model-path", args.model_path,
                                               "--heartbeat-interval-s", "0.5", "--log-level", "warning"], echo=False)  # fmt: skip
        cleanup.push_async_callback(_quietly, front.stop)
        # Watched from now: the frontend may be ready while the workers are still starting.
        front_ready = asyncio.ensure_future(
            front.wait_for_line(lambda ln: ln.startswith("ferry-frontend-ready"), 120)
        )
        for actuator in actuators.values():
            await actuator.scale(start)
        await asyncio.gather(*(m.child.wait_for_line(lambda ln: ln.startswith("ferry-worker-ready"), 120)
                               for a in actuators.values() for m in a.workers.values()))  # fmt: skip
        await front_ready
        url = f"http://127.0.0.1:{port}"
        planners = []
        stop = asyncio.Event()
        tasks: list[asyncio.Task[Any]] = []
        if name in ("planner", "hpa"):
            # With pools, one planner per pool, as `ferry up --autoscale` runs them.
            for actuator in actuators.values():
                local = await start_planner(policy, worker, kafka, redis, actuator)
                cleanup.push_async_callback(_quietly, local.close)
                if name == "hpa":
                    local.planner.policy = ReactivePolicy(policy, args.slots, window_s=args.ramp_s / 8)
                tasks.append(asyncio.create_task(local.planner.run(stop)))
                planners.append(local)
        worker_seconds = 0.0
        samples: list[tuple[float, int]] = []
        by_pool: dict[str, int] = dict.fromkeys(pools, 0)  # the most workers each pool had at once

        async def meter() -> None:
            nonlocal worker_seconds
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.5)  # the sampling period of the worker count
                now = time.monotonic()
                n = sum(len(a.workers) for a in actuators.values())
                for pool, a in actuators.items():
                    by_pool[pool] = max(by_pool[pool], len(a.workers))
                worker_seconds += n * (now - last)
                samples.append((now - t0, n))
                last = now

        t0 = time.monotonic()
        tasks.append(asyncio.create_task(meter()))
        results: list[Result] = []
        async with httpx.AsyncClient(
            base_url=url, timeout=120, limits=httpx.Limits(max_connections=1000)
        ) as c:

            async def fire(at: float, item: WorkItem) -> None:
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))  # the arrival time itself
                results.append(await one(c, item, t0))

            await asyncio.gather(*(fire(at, items[i % len(items)]) for i, at in enumerate(times)))
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        decisions = sorted((d for local in planners for d in local.planner.decisions), key=lambda d: d[0])
        await front.stop()
        drained = [x for a in actuators.values() for x in a.drained]
        crashed = [x for a in actuators.values() for x in a.crashed]
        summary = summarise(name, args, results, worker_seconds, decisions, drained, crashed, samples)
        if args.pools:
            summary["max_workers_by_pool"] = by_pool
            summary["scale_outs_by_pool"] = {
                local.planner.pool: sum(d.action is Action.SCALE_OUT for _, _, d in local.planner.decisions)
                for local in planners
            }
        return summary


def summarise(name: str, args: argparse.Namespace, results: list[Result], worker_seconds: float,
              decisions: list[tuple[float, Observation, Decision]], drained: list[tuple[str, int | None]],
              crashed: list[tuple[str, int | None]], samples: list[tuple[float, int]]) -> dict[str, Any]:  # fmt: skip
    """The numbers of one system."""
    ok = [r for r in results if r.ok]
    within = [r for r in ok if r.ttft <= args.ttft_s and r.itl <= args.itl_s]
    react = None
    if decisions:
        over = next((t for t, o, _ in decisions if o.concurrency > o.ready * args.slots), None)
        out = next(
            (t for t, _, d in decisions if d.action is Action.SCALE_OUT and over is not None and t >= over),
            None,
        )
        react = None if over is None or out is None else round(out - over, 1)
    return {
        "system": name,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "failures": dict(Counter(r.error for r in results if not r.ok)),
        "slo_attainment": round(len(within) / max(len(results), 1), 4),
        "ttft_p90_s": round(_p(sorted(r.ttft for r in ok), 0.9), 3),
        "itl_p90_s": round(_p(sorted(r.itl for r in ok), 0.9), 4),
        "worker_seconds": round(worker_seconds, 1),
        "max_workers_seen": max((n for _, n in samples), default=0),
        "time_to_react_s": react,
        "scale_outs": sum(d.action is Action.SCALE_OUT for _, _, d in decisions),
        "scale_ins": sum(d.action is Action.SCALE_IN for _, _, d in decisions),
        "drained_exit_codes": [code for _, code in drained],
        "crashed": len(crashed),
        "workers_over_time": samples[:: max(1, len(samples) // 60)],
    }


def _p(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else math.nan


async def main(argv: list[str] | None = None) -> int:
    """Run the chosen systems one after another and write the comparison."""
    from launch.model_prepare import default_model_dir

    ap = argparse.ArgumentParser(prog="python -m bench.autoscale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ramp-s", type=float, default=240.0, help="length of the whole ramp (up and down)")
    ap.add_argument("--base-rate", type=float, default=1.0, help="requests/s at both ends; the peak is 10x")
    ap.add_argument("--slots", type=int, default=4, help="--max-num-seqs of each sim worker")
    ap.add_argument("--speedup", type=float, default=1.0, help="sim --speedup")
    ap.add_argument("--min-workers", type=int, default=1)
    ap.add_argument("--max-workers", type=int, default=6)
    ap.add_argument("--mean-workers", type=int, default=3, help="static-at-mean's fixed count")
    ap.add_argument("--ttft-s", type=float, default=1.0, help="TTFT target (p90 for the planner)")
    ap.add_argument("--itl-s", type=float, default=0.1, help="ITL target (p90 for the planner)")
    ap.add_argument("--interval-s", type=float, default=2.0, help="planner interval")
    ap.add_argument("--systems", default="planner,peak,mean,hpa")
    ap.add_argument("--pools", action="store_true",
                    help="a prefill pool and a decode pool instead of aggregated workers: every worker count "
                         "(--min/--max/--mean-workers) is per pool, and the planner systems run one planner per pool")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=64, help="cap on the trace's (scaled) output lengths")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the conversation trace (JSONL)")
    ap.add_argument("--model-path", default=str(default_model_dir()))
    args = ap.parse_args(argv)
    work = trace_workload(read_trace(args.trace), max_requests=5_000, max_model_len=MAX_MODEL_LEN)
    items = []
    for i in work.items:
        # At least 4 tokens, so every request has gaps to time; the prompt gives way where that would
        # overflow the context (the workload fills it to the brim for its own output lengths).
        n = max(4, min(i.max_tokens, args.max_tokens))
        items.append(dataclasses.replace(i, max_tokens=n, prompt=i.prompt[: MAX_MODEL_LEN - n]))
    times = arrivals(args.ramp_s, args.base_rate, args.seed)
    report: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info(),
                              "offered_requests": len(times),
                              "workload": work.description, "systems": []}  # fmt: skip
    for name in args.systems.split(","):
        print(f"== {name}: {len(times)} requests over {args.ramp_s:.0f}s", flush=True)
        summary = await run_system(name, args, items, times)
        print(json.dumps({k: v for k, v in summary.items() if k != "workers_over_time"}), flush=True)
        report["systems"].append(summary)
    peak = next((s for s in report["systems"] if s["system"] == "peak"), None)
    if peak:
        for s in report["systems"]:
            s["worker_seconds_vs_peak"] = round(s["worker_seconds"] / peak["worker_seconds"], 3)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_cleanly(main()))
