"""`python -m bench.tenants [--phase-s S] [--quiet-rps R] [--flood-factor F]`: see the package docstring."""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import io
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.stack import FerryStack, run_cleanly

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
TENANTS = """
[tenants.quiet]
api_keys = ["key-quiet"]

[tenants.flood]
api_keys = ["key-flood"]
max_concurrent = {flood_concurrent}
"""
WORDS = "the a river stone light north quiet flood tenant cloud paper window green market seven".split()


@dataclass
class Result:
    """One request as the client saw it."""

    tenant: str
    status: int  # 0: no response (lost)
    ttft: float = float("nan")
    done: bool = False  # a 200 stream that ended with [DONE]
    usage: dict[str, int] = field(default_factory=dict)


async def one(client: httpx.AsyncClient, tenant: str, rng: random.Random, max_tokens: int) -> Result:
    """One streamed chat of `tenant`: TTFT to its first content delta, its status and its usage."""
    words = " ".join(rng.choice(WORDS) for _ in range(48))
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    res = Result(tenant, 0)
    t0 = time.perf_counter()
    try:
        headers = {"Authorization": f"Bearer key-{tenant}"}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            res.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.status = 599  # an error event inside the stream
                if chunk.get("usage"):
                    u = chunk["usage"]
                    details = u.get("prompt_tokens_details") or {}
                    res.usage = {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                                 "cached_tokens": details.get("cached_tokens") or 0}  # fmt: skip
                for c in chunk.get("choices", []):
                    if res.ttft != res.ttft and (c.get("delta") or {}).get("content"):
                        res.ttft = time.perf_counter() - t0
    except (httpx.HTTPError, OSError):
        pass  # counted as lost unless a status arrived
    return res


async def traffic(
    url: str, rates: dict[str, float], seconds: float, max_tokens: int, seed: int
) -> list[Result]:
    """Open-loop Poisson arrivals of each tenant at its rate for `seconds`; every request awaited (bounded).

    Each tenant draws from a generator of its own: the quiet tenant sends the same schedule in every phase.
    """
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=90, limits=limits) as client:
        tasks: list[asyncio.Task[Result]] = []

        async def arrivals(tenant: str, rate: float) -> None:
            rng = random.Random(f"{seed}-{tenant}")
            end = time.perf_counter() + seconds
            while True:
                await asyncio.sleep(rng.expovariate(rate))
                if time.perf_counter() >= end:
                    return
                tasks.append(asyncio.create_task(one(client, tenant, rng, max_tokens)))

        await asyncio.gather(*(arrivals(t, r) for t, r in rates.items() if r > 0))
        return list(await asyncio.gather(*tasks))


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of the finite values, in ms."""
    v = sorted(x for x in values if x == x)
    if not v:
        return None
    return round(1000 * v[min(len(v) - 1, max(0, round(q * len(v)) - 1))], 1)


def summary(results: list[Result]) -> dict[str, Any]:
    """Per tenant: counts by status, lost requests, TTFT percentiles of the 200s."""
    out: dict[str, Any] = {}
    for tenant in sorted({r.tenant for r in results}):
        mine = [r for r in results if r.tenant == tenant]
        ok = [r for r in mine if r.status == 200 and r.done]
        statuses: dict[str, int] = {}
        for r in mine:
            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
        out[tenant] = {
            "sent": len(mine),
            "ok": len(ok),
            "statuses": statuses,
            "429": sum(r.status == 429 for r in mine),
            "5xx": sum(r.status >= 500 for r in mine),
            "lost": sum(r.status == 0 or (r.status == 200 and not r.done) for r in mine),
            "ttft_p50_ms": pct([r.ttft for r in ok], 0.5),
            "ttft_p90_ms": pct([r.ttft for r in ok], 0.9),
        }
    return out


def response_usage(results: list[Result]) -> dict[str, dict[str, int]]:
    """What the responses said they used, per tenant (the admitted requests: every status but 429 and 401)."""
    out: dict[str, dict[str, int]] = {}
    for r in results:
        if r.status in (0, 401, 429):
            continue
        row = out.setdefault(
            r.tenant, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
        )
        row["requests"] += 1
        for k, v in r.usage.items():
            row[k] += v
    return out


async def ferry_usage(kafka: str, since: float | str) -> dict[str, dict[str, int]]:
    """`ferry usage --since <start> --csv` on the stack's broker, parsed."""
    iso = (
        since
        if isinstance(since, str)
        else dt.datetime.fromtimestamp(since, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    )
    cmd = [sys.executable, "-m", "launch", "usage", "--kafka", kafka, "--since", iso, "--csv"]
    proc = await asyncio.to_thread(
        subprocess.run,
        cmd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"ferry usage failed: {proc.stderr[-500:]}")
    rows = csv.DictReader(io.StringIO(proc.stdout))
    keep = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens")
    return {row["tenant"]: {k: int(row[k]) for k in keep} for row in rows}


async def stack_phases(
    args: argparse.Namespace, tenants_file: Path, fair: bool, phases: list[tuple[str, dict[str, float]]]
) -> dict[str, Any]:
    """Start one stack, run its phases one after the other, then compare `ferry usage` with the responses."""
    extra = [
        "--tenants", str(tenants_file), "--busy-waiting", str(args.busy_waiting),
        "--max-num-seqs", str(args.max_num_seqs), "--busy-wait-s", str(args.busy_wait_s),
        "--tenants-fair" if fair else "--no-tenants-fair",
    ]  # fmt: skip
    if fair and args.tenants_reserve is not None:
        extra += ["--tenants-reserve", str(args.tenants_reserve)]
    stack = await FerryStack.start(args.workers, args.speedup, extra)
    out: dict[str, Any] = {}
    try:
        since = time.time() - 1
        everything: list[Result] = []
        for name, rates in phases:
            results = await traffic(stack.url, rates, args.phase_s, args.max_tokens, args.seed)
            everything += results
            out[name] = summary(results)
            print(f"{name}: {json.dumps(out[name])}", flush=True)
        # Records are sent without waiting (the response is over first): ask again for a while if short.
        seen = response_usage(everything)
        ended = time.perf_counter()
        while True:
            published = await ferry_usage(stack.kafka, since)
            equal = all(published.get(t, {}).get(k) == v for t, row in seen.items() for k, v in row.items())
            if equal or time.perf_counter() - ended > 20:
                break
            await asyncio.sleep(2)
        out["usage_" + ("fair" if fair else "unfair")] = {
            "ferry_usage": published, "responses": seen, "equal": equal,
            # The stack's broker is its own: everything on its usage topic, without --since's seek by time.
            "ferry_usage_whole_topic": await ferry_usage(stack.kafka, "1d"),
            # Warnings and errors of the stack (its last 50 lines of output): a usage record not sent says so.
            "stack_warnings": [line for line in stack.child.tail if "WARNING" in line or "ERROR" in line],
            "seconds_until_equal": round(time.perf_counter() - ended, 1) if equal else None,
        }  # fmt: skip
    finally:
        await stack.stop()
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both stacks' phases, and the ratios the issue's target is about."""
    flood_rps = args.quiet_rps * args.flood_factor
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenants.toml"
        path.write_text(TENANTS.format(flood_concurrent=args.flood_concurrent))
        quiet_only = {"quiet": args.quiet_rps}
        both = {"quiet": args.quiet_rps, "flood": flood_rps}
        fair = await stack_phases(args, path, True, [("alone", quiet_only), ("flood_fair", both)])
        unfair = await stack_phases(args, path, False, [("flood_unfair", both)])
    phases = {**fair, **unfair}
    alone = phases["alone"]["quiet"]["ttft_p90_ms"]

    def ratio(name: str) -> float | None:
        p90 = phases[name]["quiet"]["ttft_p90_ms"]
        return round(p90 / alone, 2) if p90 and alone else None

    return {
        "phases": phases,
        "quiet_ttft_p90_ratio": {"fair": ratio("flood_fair"), "unfair": ratio("flood_unfair")},
    }


def main() -> None:
    """Parse the flags, run, print and write the results JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.tenants", description=__doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--speedup", type=float, default=0.5, help="sim step time divided by this")
    p.add_argument("--max-num-seqs", type=int, default=4, help="sequences a sim worker runs at once")
    p.add_argument("--busy-waiting", type=int, default=1, help="a worker with this many queued is busy")
    p.add_argument("--busy-wait-s", type=float, default=30.0, help="longest wait for a worker before 503")
    p.add_argument("--quiet-rps", type=float, default=1.0)
    p.add_argument("--flood-factor", type=float, default=10.0)
    p.add_argument("--flood-concurrent", type=int, default=24, help="the flood's max_concurrent quota")
    p.add_argument("--tenants-reserve", type=int, help="the fair stack's --tenants-reserve; default Ferry's")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--phase-s", type=float, default=30.0, help="seconds of traffic per phase (3 phases)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tenants.json")
    args = p.parse_args()
    if args.phase_s > 45:
        p.error("--phase-s at most 45 (a run stays under 3 minutes)")
    started = time.time()
    load = [round(x, 1) for x in os.getloadavg()]
    result = run_cleanly(run(args))
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    doc = {
        "bench": "tenants",
        "commit": commit,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus (shared)",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "load_average_at_start": load,
        "command": "python -m bench.tenants " + " ".join(sys.argv[1:]),
        "wall_s": round(time.time() - started, 1),
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({"quiet_ttft_p90_ratio": result["quiet_ttft_p90_ratio"], "wall_s": doc["wall_s"]}))


if __name__ == "__main__":
    main()
