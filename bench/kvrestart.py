"""`python -m bench.kvrestart`: the cached fraction of requests after an empty Redis restart, vs steady.

Issue 20's case: tenants whose contexts together exceed one worker's KV cache (by default 48 tenants of 12
blocks on 8 sim workers of 400 blocks), so cache-aware routing keeps each tenant's context on a worker.
After a warm-up, the cached fraction (cached prompt tokens / prompt tokens) of `--steady` requests is the
baseline; then Redis is restarted empty on its port and the next `--after` requests (in windows of 50)
are measured the same way, by default without pause. `--pause-s S` idles S seconds after Redis is back: a
frontend counts the prompts it saw finish in the last 2 s as held by their workers (`RECENT_S` in
server/router.py), which without a pause covers every tenant at this request rate, so only with a longer
pause does routing depend on the index alone (Redis, or the frontend's mirror while it is written back).
`--no-kv-log` runs workers and frontend without the KV log (the index then only comes back as blocks are
stored again). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from pathlib import Path

import httpx

from bench.overhead import machine_info
from bench.stack import run_cleanly
from launch.services import Child, free_port, restart_redis, start_broker, start_redis
from schemas.settings import DEFAULT_MODEL_NAME, default_model_path

BLOCK = 64


def _context(tenant: int, blocks: int) -> list[int]:
    rng = random.Random(tenant)
    return [rng.randrange(100, 40000) for _ in range(blocks * BLOCK)]


async def _spawn(name: str, argv: list[str], mark: str) -> Child:
    child = await Child.spawn(name, [sys.executable, "-m", "launch", *argv], echo=False)
    try:
        await child.wait_for_line(lambda line: line.startswith(mark), 120)
    except BaseException:
        await child.stop()
        raise
    return child


async def _window(
    c: httpx.AsyncClient, n: int, args: argparse.Namespace, rng: random.Random, contexts: list[list[int]]
) -> dict[str, float]:
    """`n` requests, `--concurrency` at a time: their cached fraction and failures."""
    prompt_tokens = cached = failed = 0
    todo = list(range(n))

    async def one() -> None:
        nonlocal prompt_tokens, cached, failed
        while todo:
            todo.pop()
            tail = [rng.randrange(100, 40000) for _ in range(rng.randrange(16, 2 * BLOCK))]
            body = {
                "model": DEFAULT_MODEL_NAME,
                "prompt": rng.choice(contexts) + tail,
                "max_tokens": args.max_tokens,
            }
            try:
                r = await c.post("/v1/completions", json=body)
            except httpx.HTTPError:
                failed += 1
                continue
            if r.status_code != 200:
                failed += 1
                continue
            usage = r.json()["usage"]
            prompt_tokens += usage["prompt_tokens"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(args.concurrency)))
    return {
        "requests": n, "failed": failed, "cached_fraction": cached / max(prompt_tokens, 1),
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip


async def main(args: argparse.Namespace) -> dict[str, object]:
    """Start the services, workers and a frontend; measure; stop everything."""
    broker, kafka = await start_broker()
    redis, redis_url = await start_redis()
    prefix = f"kvr{uuid.uuid4().hex[:6]}:"
    common = ["--kafka", kafka, "--redis", redis_url, "--redis-prefix", prefix, "--model-path", args.model_path,
              "--log-level", "warning", *(["--no-kv-log"] if args.no_kv_log else [])]  # fmt: skip
    children: list[Child] = []
    try:
        spawns = [
            _spawn(
                f"w{i}",
                [
                    "worker",
                    "--worker-id",
                    f"w{i}",
                    "--num-blocks",
                    str(args.blocks),
                    "--speedup",
                    repr(args.speedup),
                    "--no-pool",
                    *common,
                ],
                "ferry-worker-ready",
            )
            for i in range(args.workers)
        ]
        children += await asyncio.gather(*spawns)
        port = free_port()
        children.append(
            await _spawn(
                "frontend",
                ["frontend", "--port", str(port), "--frontend-id", "fe-kvr", *common],
                "ferry-frontend-ready",
            )
        )
        rng = random.Random(args.seed)
        contexts = [_context(t, args.context_blocks) for t in range(args.tenants)]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            warm = await _window(c, args.warmup, args, rng, contexts)
            steady = await _window(c, args.steady, args, rng, contexts)
            await redis.stop()
            redis = await restart_redis(redis_url)
            await asyncio.sleep(args.pause_s)  # idle on purpose: see the module docstring
            after = [await _window(c, 50, args, rng, contexts) for _ in range(max(args.after // 50, 1))]
            ready = (await c.get("/ready")).json()
    finally:
        for child in reversed(children):
            await child.stop()
        await redis.stop()
        await broker.stop()
    base = steady["cached_fraction"] or 1e-9
    return {
        "args": vars(args), "warmup": warm, "steady": steady, "after": after,
        "ratios": [a["cached_fraction"] / base for a in after], "kv_index": ready.get("kv_index"),
    }  # fmt: skip


def cli() -> None:
    """Parse the flags, run, print a table and write the JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.kvrestart", description=__doc__)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=400, help="KV blocks per sim worker")
    p.add_argument("--tenants", type=int, default=48)
    p.add_argument("--context-blocks", type=int, default=12, help="blocks of each tenant's shared context")
    p.add_argument("--speedup", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--steady", type=int, default=100)
    p.add_argument("--after", type=int, default=150, help="requests after the restart, in windows of 50")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--pause-s", type=float, default=0.0,
                   help="seconds from Redis being back to the first measured request (default 0)")  # fmt: skip
    p.add_argument(
        "--no-kv-log", action="store_true", help="workers and frontend without the KV log (before)"
    )
    p.add_argument("--model-path", default=default_model_path())
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = run_cleanly(main(args))
    steady = out["steady"]
    assert isinstance(steady, dict)
    print(
        f"kv log: {'off' if args.no_kv_log else 'on'}; pause {args.pause_s:g} s; steady cached fraction {steady['cached_fraction']:.3f}"
    )
    after, ratios = out["after"], out["ratios"]
    assert isinstance(after, list) and isinstance(ratios, list)
    for i, (a, ratio) in enumerate(zip(after, ratios, strict=True)):
        print(
            f"  requests {50 * i + 1}-{50 * i + 50} after the restart: cached {a['cached_fraction']:.3f} "
            f"({ratio:.2f}x steady), failed {a['failed']}, {a['seconds']:.1f}s"
        )
    if args.out is not None:
        out["machine"] = machine_info()  # the commit, and whether the tree was dirty
        args.out.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    cli()
