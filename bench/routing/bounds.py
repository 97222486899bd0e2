"""How much of the infinite-cache bound 8 workers with finite caches could reach at all (issue 3, item 5).

`python -m bench.routing.bounds` builds the same trace and prefix workloads as `python -m bench.routing`
(same flags, same scaling) and, for each, prints the cached fraction of prompt tokens under:

- `bound`: one infinite cache that has seen every earlier request (what the benchmark reports);
- `affinity, infinite`: N workers with infinite caches, each request sent to the worker that holds the
  longest prefix of it (ties: the worker sent the fewest prompt tokens so far), load ignored: what is lost
  only because the workers are N separate caches (a prefix is prefilled once per worker that needs it);
- `affinity, LRU`: the same with `--num-blocks` blocks per worker and LRU eviction, as the engines have;
- `round_robin, LRU`: requests dealt in turn, the same finite caches: the baseline's own ceiling;
- `TTFT floor p50/p90`: time to first token if every request found the bound's cached prefix and never
  waited, only its own uncached tokens prefilled in one step of the simulated engine's timing model at
  `--speedup` (the floor of any router's TTFT, before queueing and Ferry's own overhead); and the same with
  round-robin's LRU hits.

No server runs: the numbers follow from the requests alone, so the gap between `bound` and what a router
reaches in the benchmark is either here (unreachable with N finite caches) or in the routing itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.routing.run import PlanSettings, build_plan
from bench.workload import DEFAULT_TRACE, _chain, infinite_cache_hits
from workers.sim_timing import step_seconds


class _LRU:
    """One worker's block cache: `capacity` blocks, least recently used first out (None: unbounded)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def leading(self, chain: Sequence[int], limit: int) -> int:
        n = 0
        while n < limit and chain[n] in self.blocks:
            n += 1
        return n

    def touch(self, chain: Sequence[int]) -> None:
        for h in chain:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        if self.capacity is not None:
            while len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)


def simulate(
    prompts: Sequence[Sequence[int]], workers: int, capacity: int | None, policy: str, bs: int
) -> tuple[float, list[int]]:
    """Cached fraction of prompt tokens with `workers` caches under `policy` ("affinity" or "round_robin"),
    and each prompt's cached tokens."""
    caches = [_LRU(capacity) for _ in range(workers)]
    sent = [0] * workers
    cached = total = 0
    per_prompt: list[int] = []
    for i, prompt in enumerate(prompts):
        chain = _chain(prompt, bs)
        limit = (len(prompt) - 1) // bs if prompt else 0
        hits = [c.leading(chain, limit) for c in caches]
        if policy == "round_robin":
            w = i % workers
        else:
            w = max(range(workers), key=lambda j: (hits[j], -sent[j]))
        cached += hits[w] * bs
        per_prompt.append(hits[w] * bs)
        total += len(prompt)
        sent[w] += len(prompt)
        caches[w].touch(chain)
    return (cached / total if total else 0.0), per_prompt


def ttft_floor_ms(
    prompts: Sequence[Sequence[int]], hits: Sequence[int], speedup: float
) -> tuple[float, float]:
    """p50 and p90 of the prefill time of each prompt's uncached tokens alone (no queueing, no decode)."""
    ms = [step_seconds(len(p) - h, 0, 0, 1, speedup) * 1000.0 for p, h in zip(prompts, hits, strict=True)]
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 90))


def main(argv: list[str] | None = None) -> int:
    """Print (and write) the bounds of every workload of the plan."""
    p = argparse.ArgumentParser(prog="python -m bench.routing.bounds", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker")
    p.add_argument("--speedup", type=float, default=0.1, help="as the benchmark's engines")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--trace-rates", default="16,28,40")
    p.add_argument("--trace-requests", type=int, default=240)
    p.add_argument("--trace-seconds", type=float, default=24.0)
    p.add_argument("--trace-sample-every", type=int, default=32)
    p.add_argument("--prefix-fractions", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--prefix-rates", default="16")
    p.add_argument("--prefix-requests", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    def floats(text: str) -> tuple[float, ...]:
        return tuple(float(x) for x in text.split(",") if x.strip())

    plan = build_plan(
        PlanSettings(
            trace_path=args.trace,
            trace_unloaded=False,
            trace_rates=floats(args.trace_rates),
            trace_requests=args.trace_requests,
            trace_seconds=args.trace_seconds,
            trace_sample_every=args.trace_sample_every,
            prefix_fractions=floats(args.prefix_fractions),
            prefix_rates=floats(args.prefix_rates),
            prefix_requests=args.prefix_requests,
            prefix_input_tokens=2048,
            prefix_output_tokens=32,
            prefix_groups=16,
            block_tokens=args.block_size,
            max_model_len=8192,
        )
    )
    rows: list[dict[str, Any]] = []
    n, cap, bs = args.workers, args.num_blocks, args.block_size
    print(
        f"{'workload':<16} {'bound':>7} {'affinity inf':>13} {'affinity LRU':>13} {'rr LRU':>8} "
        f"{'TTFT floor p50/p90 (bound)':>27} {'(rr LRU)':>16}"
    )
    for it in plan:
        prompts = [x.prompt for x in it.workload.items]
        rr, rr_hits = simulate(prompts, n, cap, "round_robin", bs)
        floor = ttft_floor_ms(prompts, infinite_cache_hits(prompts, bs), args.speedup)
        rr_floor = ttft_floor_ms(prompts, rr_hits, args.speedup)
        row = {
            "run": it.key,
            "requests": len(prompts),
            "bound": round(it.bound().fraction, 4),
            "affinity_infinite": round(simulate(prompts, n, None, "affinity", bs)[0], 4),
            "affinity_lru": round(simulate(prompts, n, cap, "affinity", bs)[0], 4),
            "round_robin_lru": round(rr, 4),
            "ttft_floor_ms": {"p50": round(floor[0], 1), "p90": round(floor[1], 1)},
            "ttft_floor_round_robin_ms": {"p50": round(rr_floor[0], 1), "p90": round(rr_floor[1], 1)},
        }
        rows.append(row)
        print(
            f"{it.key:<16} {row['bound']:>7.1%} {row['affinity_infinite']:>13.1%} {row['affinity_lru']:>13.1%} "
            f"{row['round_robin_lru']:>8.1%} {floor[0]:>14.0f} / {floor[1]:>5.0f} ms {rr_floor[0]:>6.0f} / "
            f"{rr_floor[1]:>5.0f} ms"
        )
    if args.out:
        doc = {
            "command": "python -m bench.routing.bounds " + " ".join(sys.argv[1:] if argv is None else argv)
        }
        args.out.write_text(
            json.dumps(
                doc | {"workers": n, "num_blocks": cap, "speedup": args.speedup, "rows": rows}, indent=2
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
