"""Ferry's router and simulated engines in virtual time: routing results with no machine in the way.

`python -m bench.routing.virtual` replays the same workloads as `python -m bench.routing` (same flags, same
scaling, same requests) through the real `server.router.Router` and N real `workers.sim.SimEngine`s on one
event loop whose clock jumps from timer to timer instead of waiting. Every simulated engine step still
takes the time Dynamo's mocker model gives it, so TTFT, cached fractions and the issue's targets come out
as the end-to-end benchmark would measure them on an infinitely fast, idle machine; a run of minutes of
simulated traffic takes seconds, and two runs of the same command give the same numbers.

What is left out, on purpose: HTTP, Kafka and Redis. Each Kafka hop costs a fixed `--hop-ms` (the
request to the worker and the first token back); KV events reach the index `--event-delay-ms` after the
engine step that caused them; the index is a dict fed by the engines' own KV events instead of Redis. So
the gap between this and the end-to-end benchmark is what the machine and Ferry's transport cost, and
the gap between policies here is routing alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import selectors
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from bench.routing.client import ReplayResult, RequestResult
from bench.routing.run import (
    PlanItem,
    add_workload_arguments,
    build_plan,
    knobs_from,
    plan_settings_from,
    summarize,
)
from bench.routing.systems import EngineKnobs
from bench.routing.targets import REFERENCE_POLICY, evaluate
from bench.workload import WorkItem
from schemas.kafka import GenerateRequest, SamplingParams
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from schemas.settings import RouterSettings
from schemas.status import WorkerStatus
from server.metrics import FrontendMetrics
from server.router import RECENT_S, AllBusy, Decision, PromptMemo, Router
from workers.model_dir import load_model_info
from workers.sim import SimEngine
from workers.sim_config import SimConfig

MODEL = "virtual"

# Policies as (name, router config); the names match bench.routing's systems. A system named
# "ferry <name> key=value ..." is the named one with RouterSettings fields overridden, e.g.
# "ferry kv overlap_weight=1.5 router_temperature=0.05".
POLICIES: dict[str, RouterSettings] = {
    "ferry round_robin": RouterSettings(router_policy="round_robin"),
    "ferry random": RouterSettings(router_policy="random"),
    "ferry least_loaded": RouterSettings(router_policy="least_loaded"),
    "ferry kv": RouterSettings(router_policy="kv"),
    "ferry kv-approx": RouterSettings(router_policy="kv", kv_events=False),
    "ferry kv-index-only": RouterSettings(router_policy="kv", inflight_overlap=False),
    "ferry kv-sequences": RouterSettings(router_policy="kv", decode_load="sequences"),
    "ferry kv-w2": RouterSettings(router_policy="kv", overlap_weight=2.0),
    "ferry kv-w4": RouterSettings(router_policy="kv", overlap_weight=4.0),
}
# Not a router: each request goes to the worker where, reading the engines' own queues and caches, it
# would get its first token soonest (a greedy bound on what knowing everything about the present buys).
ORACLE = "oracle greedy-ttft"


# Router constructor arguments a system name may also override (not settings: fixed in a deployment).
ROUTER_ARGS: dict[str, float] = {"recent_s": RECENT_S}


def router_config(system: str) -> RouterSettings:
    """The router configuration a system name stands for."""
    return _parse_system(system)[0]


def router_args(system: str) -> dict[str, float]:
    """The `ROUTER_ARGS` a system name overrides, e.g. "ferry kv recent_s=0"."""
    return _parse_system(system)[1]


def _parse_system(system: str) -> tuple[RouterSettings, dict[str, float]]:
    words = system.split()
    base = " ".join(words[:2])
    if base not in POLICIES:
        raise ValueError(f"unknown system {system!r}; known: {', '.join([*POLICIES, ORACLE])}")
    config = POLICIES[base]
    overrides: dict[str, Any] = {}
    args: dict[str, float] = {}
    for word in words[2:]:
        key, sep, value = word.partition("=")
        if sep and key in ROUTER_ARGS:
            args[key] = float(value)
            continue
        if not sep or not hasattr(config, key):
            raise ValueError(
                f"{system!r}: {word!r} is not a RouterSettings field=value (nor one of {list(ROUTER_ARGS)})"
            )
        default = getattr(config, key)
        overrides[key] = (
            value.lower() in ("1", "true", "yes") if isinstance(default, bool) else type(default)(value)
        )
    return replace(config, **overrides), args


# ---- a clock that jumps ----------------------------------------------------------------------------------


class _Clock:
    now = 0.0


class _JumpingSelector(selectors.SelectSelector):
    """Answers at once: where the loop would block until its next timer, the clock moves there instead."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)  # the loop's own wake-up pipe
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("virtual time: the loop would wait forever (nothing is scheduled)")
        self._clock.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time: sleeps and timeouts take no wall time. Nothing may wait on I/O."""

    def __init__(self) -> None:
        self._clock = _Clock()
        super().__init__(_JumpingSelector(self._clock))

    def time(self) -> float:
        """Virtual seconds since the loop was made."""
        return self._clock.now


# ---- the cluster -----------------------------------------------------------------------------------------


class MemoryIndex:
    """The KV index's contract (`kvstore.kv_index.KVIndex`) in dicts: (model, block) -> holders, fed by KV
    events. tests/integration/test_kv_index.py checks that it answers like the Redis one."""

    def __init__(self) -> None:
        self._holders: dict[tuple[str, int], set[str]] = {}
        self._held: dict[str, set[tuple[str, int]]] = {}

    def apply(self, worker_id: str, model: str, batch: KVEventBatch) -> None:
        """One engine step's events."""
        held = self._held.setdefault(worker_id, set())
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self._holders.setdefault((model, h), set()).add(worker_id)
                    held.add((model, h))
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._holders.get((model, h), set()).discard(worker_id)
                    held.discard((model, h))
            elif isinstance(ev, AllBlocksCleared):
                for key in held:
                    self._holders[key].discard(worker_id)
                held.clear()

    async def tiered_overlaps(self, model: str, block_hashes: Sequence[int]) -> dict[str, tuple[int, int]]:
        """As KVIndex's: (leading blocks held, of which only on a host tier); this copy has no host tiers."""
        return {w: (n, 0) for w, n in (await self.overlaps(model, block_hashes)).items()}

    async def lookup(
        self, model: str, block_hashes: Sequence[int]
    ) -> tuple[dict[str, tuple[int, int]], str | None]:
        """As KVIndex's: the overlaps and the registry marker (this copy is never emptied: one constant)."""
        return await self.tiered_overlaps(model, block_hashes), "virtual"

    async def overlaps(self, model: str, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of the chain each worker holds (workers holding none are absent)."""
        out: dict[str, int] = {}
        walking: set[str] | None = None
        for i, h in enumerate(block_hashes):
            holders = self._holders.get((model, h), set())
            walking = set(holders) if walking is None else walking & holders
            if not walking:
                break
            for w in walking:
                out[w] = i + 1
        return out


class Chooser(Protocol):
    """What a replay needs of a router (`server.router.Router` has it)."""

    async def choose(self, model: str, workers: list[WorkerStatus], prompt: PromptMemo) -> Decision: ...
    def started(self, d: Decision) -> None: ...
    def prefilled(self, d: Decision) -> None: ...
    def finished(self, d: Decision) -> None: ...


class GreedyOracle:
    """Sends each request where the engines themselves say its first token comes soonest (`ORACLE`)."""

    def __init__(self, engines: dict[str, SimEngine]) -> None:
        self._engines = engines

    async def choose(self, model: str, workers: list[WorkerStatus], prompt: PromptMemo) -> Decision:
        """The worker with the earliest first token for this prompt, as of now."""
        eta = {wid: e.first_token_eta(prompt.tokens) for wid, e in self._engines.items()}
        return Decision(worker_id=min(eta, key=lambda wid: eta[wid]))

    def started(self, d: Decision) -> None:
        """Nothing to account: the engines are read directly."""

    def prefilled(self, d: Decision) -> None:
        """Nothing to account."""

    def finished(self, d: Decision) -> None:
        """Nothing to account."""


@dataclass
class Cluster:
    """N simulated engines, one router, and the index between them."""

    engines: dict[str, SimEngine]
    router: Chooser
    index: MemoryIndex
    block_size: int
    hop_s: float
    event_delay_s: float

    def statuses(self) -> list[WorkerStatus]:
        """What the registry would say about every worker right now."""
        out = []
        for wid, e in self.engines.items():
            st = e.stats()
            out.append(
                WorkerStatus(
                    worker_id=wid, model=MODEL, engine="sim", block_size=st.block_size,
                    total_blocks=st.total_blocks, max_model_len=st.max_model_len, started_at=0.0,
                    heartbeat_at=0.0, running=st.running, waiting=st.waiting, kv_usage=st.kv_usage,
                )
            )  # fmt: skip
        return out

    async def pump_events(self, wid: str) -> None:
        """Feed one engine's KV events into the index, each `event_delay_s` after its step."""
        loop = asyncio.get_running_loop()
        async for batch in self.engines[wid].kv_events():
            if self.event_delay_s > 0:
                loop.call_later(self.event_delay_s, self.index.apply, wid, MODEL, batch)
            else:
                self.index.apply(wid, MODEL, batch)


def build_cluster(system: str, knobs: EngineKnobs, model_path: str, hop_s: float, event_delay_s: float,
                  seed: int) -> Cluster:  # fmt: skip
    """Engines configured as `ferry up` configures its sim workers, and `system`'s router as a frontend has it."""
    import random

    info = load_model_info(model_path)
    sim = SimConfig(
        block_size=knobs.block_size,
        num_blocks=knobs.num_blocks,
        max_num_seqs=knobs.max_num_seqs,
        max_num_batched_tokens=knobs.max_num_batched_tokens,
        speedup=knobs.speedup,
        max_model_len=knobs.max_model_len,
    )
    engines = {
        f"w{i}": SimEngine(MODEL, info.tokenizer, sim, eos_token_id=info.eos_token_id)
        for i in range(knobs.workers)
    }
    index = MemoryIndex()
    router: Chooser
    if system == ORACLE:
        router = GreedyOracle(engines)
    else:
        router = Router(
            router_config(system), FrontendMetrics(), index, rng=random.Random(seed),  # type: ignore[arg-type]
            clock=lambda: asyncio.get_running_loop().time(), **router_args(system),
        )  # fmt: skip
    return Cluster(engines, router, index, knobs.block_size, hop_s, event_delay_s)


async def _serve(cluster: Cluster, item: WorkItem, start: float, res: RequestResult) -> None:
    """One request from the frontend's side: route, one hop to the engine, stream back, one hop."""
    loop = asyncio.get_running_loop()
    router = cluster.router
    while True:
        try:
            d: Decision = await router.choose(
                MODEL, cluster.statuses(), PromptMemo(item.prompt, max_tokens=item.max_tokens)
            )
            break
        except AllBusy:
            await asyncio.sleep(0.1)  # a frontend waits for the next registry refresh
    router.started(d)
    res.worker = d.worker_id
    await asyncio.sleep(cluster.hop_s)
    request = GenerateRequest(
        request_id=f"r{item.index}",
        model=MODEL,
        prompt_token_ids=item.prompt,
        max_tokens=item.max_tokens,
        reply_topic="-",
        sampling=SamplingParams(ignore_eos=True, temperature=0.0),
    )
    generated = 0
    last = math.nan
    try:
        async for out in cluster.engines[d.worker_id].generate(request):
            now = loop.time() + cluster.hop_s  # when the frontend would see it
            if out.token_ids:
                if generated == 0:
                    res.ttft = now - (start + item.at)
                    router.prefilled(d)
                else:
                    res.itls.append(now - last)
                last = now
                generated += len(out.token_ids)
            if out.finish_reason is not None:
                res.ok = out.finish_reason in ("length", "stop")
                res.prompt_tokens = out.prompt_tokens or len(item.prompt)
                res.cached_tokens = out.cached_tokens
                break
    finally:
        router.finished(d)
    res.completion_tokens = generated
    res.e2e = loop.time() + cluster.hop_s - (start + item.at)
    res.finished_at = loop.time() + cluster.hop_s - start


async def replay_virtual(
    cluster: Cluster, items: list[WorkItem], closed_loop: int = 0, deadline_s: float = math.inf
) -> ReplayResult:
    """Every item at its arrival time (or, with `closed_loop` = c, c at a time back to back); what still
    runs `deadline_s` after the start is abandoned (error "deadline"), as bench.routing's client does."""
    loop = asyncio.get_running_loop()
    for e in cluster.engines.values():
        await e.start()
    pumps = [asyncio.create_task(cluster.pump_events(wid)) for wid in cluster.engines]
    start = loop.time()
    results = [RequestResult(it.index, it.at, 0.0, ok=False) for it in items]
    try:
        if closed_loop:
            queue = list(zip(items, results, strict=True))[::-1]

            async def lane() -> None:
                while queue:
                    it, res = queue.pop()
                    res.scheduled = loop.time() - start
                    await _serve(cluster, replace(it, at=res.scheduled), start, res)

            await asyncio.gather(*(lane() for _ in range(closed_loop)))
        else:
            tasks: dict[asyncio.Task[None], RequestResult] = {}
            for it, res in zip(items, results, strict=True):
                delay = start + it.at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks[asyncio.create_task(_serve(cluster, it, start, res))] = res
            _done, late = await asyncio.wait(tasks, timeout=max(0.0, start + deadline_s - loop.time()))
            for t in late:
                t.cancel()
                tasks[t].error = "deadline"
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for e in cluster.engines.values():
            await e.stop()
        await asyncio.gather(*pumps, return_exceptions=True)
    wall = max((r.finished_at for r in results if not math.isnan(r.finished_at)), default=0.0)
    return ReplayResult(results, wall, 0)


def run_one(name: str, item: PlanItem, knobs: EngineKnobs, model_path: str, hop_s: float, event_delay_s: float,
            seed: int, drain_s: float = math.inf) -> dict[str, Any]:  # fmt: skip
    """One policy on one workload, on a fresh cluster and a fresh virtual clock; the run ends `drain_s` after
    its last arrival, as in bench.routing."""
    cluster = build_cluster(name, knobs, model_path, hop_s, event_delay_s, seed)
    loop = VirtualTimeLoop()
    try:
        t0 = time.perf_counter()
        rep = loop.run_until_complete(
            replay_virtual(
                cluster,
                item.workload.items,
                closed_loop=knobs.workers if item.probe else 0,
                deadline_s=item.workload.duration_s + drain_s,
            )
        )
        wall = time.perf_counter() - t0
    finally:
        loop.close()
    summary = summarize(name, item, rep, {"wall_clock_s": round(wall, 2)})
    summary["virtual_s"] = round(rep.wall_s, 2)
    return summary


# ---- the command -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run every policy on every workload of the plan in virtual time; print the table and the targets."""
    from schemas.settings import default_model_path

    p = argparse.ArgumentParser(prog="python -m bench.routing.virtual", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="ferry round_robin,ferry kv",
                   help=f"comma-separated, of: {', '.join([*POLICIES, ORACLE])}; a Ferry policy may be "
                   "followed by RouterSettings overrides, e.g. 'ferry kv overlap_weight=2'")  # fmt: skip
    add_workload_arguments(p, speedup=0.05, trace_rates=(8.0, 14.0, 20.0), prefix_rates=())
    p.add_argument("--hop-ms", type=float, default=2.0, help="one Kafka hop (request out, first token back)")
    p.add_argument("--event-delay-ms", type=float, default=5.0, help="engine step -> KV index")
    p.add_argument("--seeds", type=int, default=1,
                   help="run each system with router seeds 0..N-1 and report the run with the median TTFT p90")  # fmt: skip
    p.add_argument("--model-path", default=default_model_path())
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    for n in names:
        if n != ORACLE:
            try:
                router_config(n)
            except ValueError as exc:
                raise SystemExit(str(exc)) from None
    knobs = knobs_from(args)
    plan = build_plan(plan_settings_from(args, knobs))
    width = max(22, *(len(n) for n in names))
    runs: list[dict[str, Any]] = []
    print(f"{'run':<16} {'system':<{width}} {'ok':>9} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'rr p90 /':>8} "
          f"{'cached':>7} {'of bound':>8} {'busiest':>7} {'virtual s':>9}")  # fmt: skip
    rr_p90: dict[str, float] = {}
    for item in plan:
        for name in names:
            by_seed = sorted(
                (run_one(name, item, knobs, args.model_path, args.hop_ms / 1e3, args.event_delay_ms / 1e3, seed,
                         args.drain_seconds)
                 for seed in range(args.seeds)),
                key=lambda r: math.inf if r["ttft_ms"]["p90"] is None else r["ttft_ms"]["p90"],
            )  # fmt: skip
            s = by_seed[(len(by_seed) - 1) // 2]
            s["ttft_p90_ms_by_seed"] = [r["ttft_ms"]["p90"] for r in by_seed]
            runs.append(s)
            t = s["ttft_ms"]
            p90 = math.inf if t["p90"] is None else t["p90"]
            if name == REFERENCE_POLICY:
                rr_p90[item.key] = p90
            cut = rr_p90.get(item.key, math.nan) / p90 if not item.probe else math.nan
            p50, p99 = (math.inf if v is None else v for v in (t["p50"], t["p99"]))
            print(
                f"{s['run']:<16} {name:<{width}} {s['ok']:>4}/{s['requests']:<4} {p50:>9,.0f} {p90:>8,.0f} "
                f"{p99:>8,.0f} {cut:>8.2f} {s['cached_fraction']:>7.1%} {s['of_bound'] or 0:>8.0%} "
                f"{s['busiest_worker_share'] or 0:>7.1%} {s['virtual_s']:>9.1f}",
                flush=True,
            )
    targets = evaluate(runs)
    print()
    print(json.dumps(targets.get("kv_vs_round_robin", {}), indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "benchmark": "routing, virtual time",
            "command": "python -m bench.routing.virtual " + " ".join(sys.argv[1:] if argv is None else argv),
            "config": {"engine": asdict(knobs), "hop_ms": args.hop_ms, "event_delay_ms": args.event_delay_ms,
                       "seeds": args.seeds},
            "runs": runs,
            "targets": targets,
        }  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
