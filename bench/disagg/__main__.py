"""`python -m bench.disagg`: see the package docstring."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.disagg.dynamo_pd import DynamoPD
from bench.disagg.flow import decode_flow
from bench.disagg.tiers import bounds, host_tier_verdicts, verdict_table
from bench.disagg.versus import versus_dynamo, versus_table
from bench.routing.client import ReplayResult, replay
from bench.routing.run import machine_info
from bench.stack import FerryStack, run_cleanly
from bench.workload import (
    DEFAULT_TRACE,
    TokenBank,
    WorkItem,
    Workload,
    per_worker_hits,
    read_trace,
    trace_workload,
)

REPO = Path(__file__).resolve().parents[2]


def long_prompt_workload(n: int, rate: float, prompt_tokens: int, output_tokens: int, salt: str) -> Workload:
    """`n` unrelated prompts of `prompt_tokens` (no shared prefix) asking for `output_tokens`, Poisson at `rate`.

    `salt` draws the token ids only: every system of a run gets the same arrival times, whose bursts set most
    of a 40-request run's TTFT p90 (each system drew its own before, and Dynamo's TTFT p90 moved 772 -> 1,294
    between two runs of the same command)."""
    bank, rng = TokenBank(64, salt), random.Random(f"arrivals {n} {rate}")
    at, items = 0.0, []
    blocks = -(-prompt_tokens // 64)
    for i in range(n):
        items.append(
            WorkItem(i, at, bank.prompt(range(i * blocks, (i + 1) * blocks), prompt_tokens), output_tokens)
        )
        at += rng.expovariate(rate)
    desc = {"kind": "long_prompt", "requests": n, "rate": rate, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens}  # fmt: skip
    return Workload("long_prompt", items, desc)


def systems(
    workers: int,
    ratios: list[tuple[int, int]],
    dynamo: bool,
    host_blocks: Sequence[int] = (0,),
    decode_caps: Sequence[int] = (0,),
) -> list[tuple[str, int, list[str]]]:
    """(name, aggregated workers, extra `ferry up` flags) of each system: the same total of workers, each
    disaggregated system once per decode batch cap (0: none beyond --max-num-seqs) and each Ferry system once
    per host tier size (0: off). A Dynamo system's flags are its prefill and decode worker counts, then its
    decode mockers' own flags."""
    base: list[tuple[str, int, list[str]]] = [(f"aggregated {workers}", workers, [])]
    for p, d in ratios:
        if p + d != workers:
            raise SystemExit(f"ratio {p}:{d} does not add up to --workers {workers}")
        for cap in decode_caps:
            suffix = f", decode cap {cap}" if cap else ""
            ferry = ["--prefill-workers", str(p), "--decode-workers", str(d)]
            if cap:
                ferry += ["--decode-flags", f"--max-num-seqs {cap}"]
            base.append((f"disagg {p}:{d}{suffix}", 0, ferry))
            if dynamo:
                base.append((f"dynamo disagg {p}:{d}{suffix}", 0, [str(p), str(d), *decode_knobs(cap)]))
    out: list[tuple[str, int, list[str]]] = []
    for name, aggregated, flags in base:
        for h in host_blocks:
            if not h:
                out.append((name, aggregated, flags))
            elif not name.startswith("dynamo"):
                out.append((f"{name}, host {h}", aggregated, [*flags, "--num-host-blocks", str(h)]))
    return out


def decode_knobs(cap: int) -> list[str]:
    """Mocker flags for a decode pool's own batch cap (after the knobs both pools share: the last one wins)."""
    return ["--max-num-seqs", str(cap)] if cap else []


def ferry_flags(args: argparse.Namespace) -> list[str]:
    """The `ferry up` flags every Ferry system of a run shares."""
    return ["--num-blocks", str(args.num_blocks), "--disagg-min-uncached-tokens", str(args.min_uncached),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
            *shlex.split(args.ferry_args)]  # fmt: skip


def dynamo_knobs(args: argparse.Namespace, kv_bytes_per_token: int) -> list[str]:
    """Dynamo's mocker flags for Ferry's sim knobs (and its KV bytes per token and link)."""
    return ["--speedup-ratio", repr(args.speedup), "--block-size", "64", "--num-gpu-blocks-override",
            str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
            str(args.max_num_batched_tokens), "--kv-transfer-bandwidth", "64", "--kv-bytes-per-token",
            str(kv_bytes_per_token)]  # fmt: skip


async def start_dynamo(
    args: argparse.Namespace, prefill: int, decode: int, decode_only: list[str]
) -> DynamoPD:
    """Dynamo's disaggregated mockers with Ferry's sim knobs, and `decode_only` flags for the decode pool."""
    from workers.host_tier import kv_bytes_per_token

    knobs = dynamo_knobs(args, kv_bytes_per_token(args.model_path))
    return await DynamoPD.start(model_path=args.model_path, model_name=args.model_name, prefill=prefill,
                                decode=decode, knobs=knobs, decode_knobs=decode_only)  # fmt: skip


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of `xs`, None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(r: ReplayResult, workers: int) -> dict[str, Any]:
    """TTFT and ITL percentiles (ms), throughput per worker, failures."""
    ok = [x for x in r.results if x.ok]
    ttft = [x.ttft * 1000 for x in ok if not math.isnan(x.ttft)]
    itl = [g * 1000 for x in ok for g in x.itls]
    # The gap after the first token: a disaggregated sequence's hand-off to its decode worker.
    first_gap = [x.itls[0] * 1000 for x in ok if x.itls]
    # Every gap after it: decode steps as delivered, whose spread around the step lengths sets ITL p90 when the
    # p90 sits on one step length (docs/benchmarks.md, "The same with the decode batch capped").
    decode_gaps = [g * 1000 for x in ok for g in x.itls[1:]]
    tokens = sum(x.completion_tokens for x in ok)
    prompt = sum(x.prompt_tokens for x in ok)
    return {
        "requests": len(r.results), "ok": len(ok), "not_sent": r.not_sent, "wall_s": r.wall_s,
        "ttft_p50_ms": pct(ttft, 0.5), "ttft_p90_ms": pct(ttft, 0.9),
        "itl_p50_ms": pct(itl, 0.5), "itl_p90_ms": pct(itl, 0.9), "itl_p99_ms": pct(itl, 0.99),
        "first_gap_p50_ms": pct(first_gap, 0.5), "first_gap_p90_ms": pct(first_gap, 0.9),
        "decode_gap_p10_ms": pct(decode_gaps, 0.1), "decode_gap_p50_ms": pct(decode_gaps, 0.5),
        "decode_gap_p90_ms": pct(decode_gaps, 0.9),
        "output_tok_s_per_worker": tokens / r.wall_s / workers if r.wall_s else None,
        "cached_fraction": round(sum(x.cached_tokens for x in ok) / prompt, 4) if prompt else None,
        # Requests per (first) worker: an uneven spread shows up here, not in the percentiles.
        "per_worker": dict(sorted(Counter(x.worker or "?" for x in ok).items())),
        **decode_flow(ok),
    }  # fmt: skip


def table(rows: dict[str, dict[str, Any]]) -> str:
    """The results as a Markdown table."""

    def f(x: float | None, digits: int = 1) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    def pc(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    lines = ["| system | ok | cached | TTFT p50 | TTFT p90 | ITL p50 | ITL p90 | ITL p99 | 1st gap p50 | out tok/s/worker "
             "| 1st-token CV | decoding at once |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, s in rows.items():
        lines.append(
            f"| {name} | {s['ok']}/{s['requests']} | {pc(s.get('cached_fraction'))} | {f(s['ttft_p50_ms'])} | {f(s['ttft_p90_ms'])} | "
            f"{f(s['itl_p50_ms'])} | {f(s['itl_p90_ms'])} | {f(s.get('itl_p99_ms'))} | {f(s.get('first_gap_p50_ms'))} | "
            f"{f(s['output_tok_s_per_worker'])} | {f(s.get('first_token_cv'), 2)} | {f(s.get('decoding_mean'), 2)} |"
        )
    return "\n".join(lines)


def routed_fraction(workload: Workload, r: ReplayResult) -> float | None:
    """The cached fraction the router's choices allowed: every worker an infinite cache of what it was sent
    (`per_worker_hits`, over the requests that finished). What a host tier can recover lies below it; the
    rest of the gap to the infinite-cache bound was lost to routing, not to eviction."""
    served = {x.index: x.worker for x in r.results if x.ok}
    if not served or None in served.values():
        return None
    prompts = [it.prompt for it in workload.items]
    hits = per_worker_hits(prompts, [served.get(it.index) for it in workload.items], 64)
    total = sum(len(it.prompt) for it in workload.items if it.index in served)
    return round(sum(hits) / total, 4) if total else None


def make_workload(args: argparse.Namespace, rate: float, salt: str) -> Workload:
    """The run's requests at `rate`, token ids drawn with `salt`."""
    if args.workload == "trace":
        return trace_workload(read_trace(args.trace), sample_every=args.sample_every, max_requests=args.requests,
                              salt=salt).at_rate(rate)  # fmt: skip
    return long_prompt_workload(args.requests, rate, args.prompt_tokens, args.output_tokens, salt)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system on the workload at every rate, one after the other."""
    ratios = (
        [(int(a), int(b)) for a, b in (r.split(":") for r in args.ratios.split(","))] if args.ratios else []
    )
    host_blocks = [int(h) for h in args.host_blocks.split(",")]
    decode_caps = [int(c) for c in args.decode_max_num_seqs.split(",")]
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]
    rows: dict[str, dict[str, Any]] = {}
    allowed: dict[str, dict[str, float]] = {}
    workload: Workload | None = None
    machine = machine_info(REPO)  # load average at the start
    for rate in rates:
        # What the requests allow (the same for every system: only the token ids' salt differs).
        prompts = [it.prompt for it in make_workload(args, rate, "bounds").items]
        allowed[f"{rate:g}"] = bounds(prompts, args.workers, args.num_blocks, host_blocks, 64)
        for name, aggregated, extra in systems(args.workers, ratios, args.dynamo, host_blocks, decode_caps):
            if args.no_aggregated and not extra:
                continue
            salt = f"disagg-{name}-{time.time()}"  # a fresh run: nothing cached from the previous system's
            workload = make_workload(args, rate, salt)
            flags = [*ferry_flags(args), *extra]
            stack: FerryStack | DynamoPD
            if name.startswith("dynamo"):
                stack = await start_dynamo(args, int(extra[0]), int(extra[1]), extra[2:])
            else:
                stack = await FerryStack.start(aggregated, args.speedup, flags)
            try:
                await asyncio.sleep(args.settle_seconds)  # let heartbeats settle after the start burst
                result = await replay(
                    stack.host, stack.port, args.model_name, workload.items, deadline_s=args.deadline_s
                )
            finally:
                await stack.stop()
            key = name if len(rates) == 1 else f"{name} @ {rate:g}/s"
            h = int(extra[extra.index("--num-host-blocks") + 1]) if "--num-host-blocks" in extra else 0
            base = name.split(", host ")[0]
            bound = allowed[f"{rate:g}"]["infinite"]
            rows[key] = summary(result, args.workers) | {"rate": rate, "base": base, "host_blocks": h,
                                                          "bound": bound,
                                                          "routed": routed_fraction(workload, result)}  # fmt: skip
            if "--prefill-workers" in extra or name.startswith("dynamo"):
                # A decode worker counts the KV it received as cached (as vLLM counts a connector's): not the
                # cache's hits. The host tier is measured on aggregated workers.
                rows[key]["cached_fraction"] = None
            print(f"{key}: {rows[key]}", flush=True)
    return {
        "command": "python -m bench.disagg " + " ".join(args.argv),
        "machine": machine,
        "workload": workload.description if workload else {},
        "speedup": args.speedup,
        "num_blocks": args.num_blocks,
        "bounds": allowed,
        "systems": rows,
        "host_tier": host_tier_verdicts(rows),
        "versus_dynamo": versus_dynamo(rows),
    }


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run, print the table and write the JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.disagg", description=__doc__)
    p.add_argument("--workers", type=int, default=4, help="simulated workers of every system")
    p.add_argument("--ratios", default="1:3,2:2", help="prefill:decode splits of --workers, comma-separated")
    p.add_argument("--workload", choices=["long", "trace"], default="long")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=6.0, help="mean requests per second")
    p.add_argument(
        "--rates", default="", help="several rates, comma-separated (each system at each); overrides --rate"
    )
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--output-tokens", type=int, default=100)
    p.add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE, help="the conversation trace (--workload trace)"
    )
    p.add_argument("--sample-every", type=int, default=32, help="trace: keep 1 in this many conversations")
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--num-blocks", type=int, default=4096, help="device KV blocks per worker")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=8192,
        help="token budget per engine step, both systems (a prompt longer than it is prefilled in chunks)",
    )  # fmt: skip
    p.add_argument(
        "--max-num-seqs", type=int, default=256,
        help="sequences per engine step, both systems (on a decode worker it bounds the step, so ITL)",
    )  # fmt: skip
    p.add_argument(
        "--decode-max-num-seqs", default="0",
        help="decode pools' own batch caps, comma-separated: every disaggregated system once per cap, both systems "
        "(0: --max-num-seqs)",
    )  # fmt: skip
    p.add_argument("--host-blocks", default="0",
                   help="host tier sizes in blocks per worker, comma-separated: every Ferry system once per size (0: off)")  # fmt: skip
    p.add_argument("--no-aggregated", action="store_true", help="only the disaggregated systems")
    p.add_argument("--min-uncached-tokens", dest="min_uncached", type=int, default=0)
    p.add_argument(
        "--ferry-args", default="", help='more `ferry up` flags for every Ferry system, e.g. "--overlap-weight 2"'
    )
    p.add_argument("--settle-seconds", type=float, default=2.0)
    p.add_argument("--deadline-s", type=float, default=300.0)
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--model-path", default=None, help="for Dynamo's mockers; default: Ferry's default model")
    p.add_argument(
        "--dynamo", action="store_true", help="also Dynamo 1.6.1's disaggregated mockers per ratio"
    )
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "disagg.json")
    args = p.parse_args(argv)
    if args.model_path is None:
        from schemas.settings import default_model_path

        args.model_path = default_model_path()
    args.argv = argv if argv is not None else __import__("sys").argv[1:]
    results = run_cleanly(run(args))
    print(table(results["systems"]))
    if results["host_tier"]:
        print(verdict_table(results["host_tier"]))
    if results["versus_dynamo"]:
        print(versus_table(results["versus_dynamo"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
