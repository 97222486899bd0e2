"""`python -m bench.batch`: batch vs interactive on the same work, and what a running batch costs interactive TTFT.

One `ferry up` with N simulated workers per batch order (`--batch-order prefix`, then `submission`):

1. the workload (R requests over a handful of long system prompts) as one batch through the Batch API:
   completion time and the fraction of prompt tokens served from the KV cache;
2. (prefix stack only) the same workload as interactive requests (C at a time): same two numbers;
3. (prefix stack only) a steady open-loop interactive load (short prompts, streamed) alone, then again
   while a large batch runs: time-to-first-token p50/p90, and the batch items finished during the load.

Every phase uses system prompts of its own, so no phase finds another's prefixes in the cache.
Prints a table and writes `bench/results/batch.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from openai import AsyncOpenAI

from bench.routing.run import machine_info
from bench.stack import FerryStack, run_cleanly

REPO = Path(__file__).resolve().parents[2]
WORDS = (
    "river stone lantern harbor meadow copper signal orbit thunder velvet quarry maple ember canyon "
    "falcon glacier pepper saddle timber violet walnut yonder zephyr anchor bramble cinder dune fjord "
    "garnet hollow island jasper kettle lagoon marble nectar oasis pillar quill ridge summit tundra"
).split()


def text(rng: random.Random, words: int) -> str:
    """Deterministic filler prose of about `words` words."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workload(seed: int, n: int, prompts: int, system_words: int) -> list[dict[str, Any]]:
    """Chat bodies: `n` questions spread round robin over `prompts` long system prompts."""
    rng = random.Random(seed)
    systems = [f"You are assistant {seed}-{p}. " + text(rng, system_words) for p in range(prompts)]
    return [
        {
            "messages": [
                {"role": "system", "content": systems[i % prompts]},
                {"role": "user", "content": f"Question {i}: " + text(rng, 12)},
            ],
        }
        for i in range(n)
    ]


@dataclass
class Outcome:
    """Completion time and cached fraction of one way of running the workload."""

    name: str
    requests: int
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    ok: int

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class TtftRun:
    """TTFT of the steady interactive load in one condition."""

    name: str
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    batch_items_done: int = 0
    batch_done_before: int = 0
    seconds: float = 0.0

    def pct(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        s = sorted(self.ttfts)
        return s[min(len(s) - 1, int(q * len(s)))]


async def run_batch(client: AsyncOpenAI, model: str, bodies: list[dict[str, Any]], max_tokens: int) -> str:
    """Upload and start a batch; returns its id."""
    lines = [
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {**b, "model": model, "max_tokens": max_tokens, "ignore_eos": True},
            }
        )
        for i, b in enumerate(bodies)
    ]
    f = await client.files.create(file=("bench.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    b = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return b.id


async def wait_batch(client: AsyncOpenAI, batch_id: str, limit_s: float) -> Any:
    deadline = time.monotonic() + limit_s
    while True:
        b = await client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        if time.monotonic() > deadline:
            await client.batches.cancel(batch_id)
            raise TimeoutError(f"batch {batch_id} did not finish in {limit_s:.0f}s (cancelled)")
        await asyncio.sleep(0.25)  # poll period


async def batch_phase(
    client: AsyncOpenAI, model: str, name: str, bodies: list[dict[str, Any]], args: Any
) -> Outcome:
    t0 = time.perf_counter()
    batch_id = await run_batch(client, model, bodies, args.max_tokens)
    b = await wait_batch(client, batch_id, args.phase_limit_s)
    seconds = time.perf_counter() - t0
    u = b.usage
    return Outcome(name, len(bodies), seconds, u.input_tokens, u.input_tokens_details.cached_tokens,
                   b.request_counts.completed)  # fmt: skip


async def interactive_phase(
    client: AsyncOpenAI, model: str, bodies: list[dict[str, Any]], args: Any
) -> Outcome:
    sem = asyncio.Semaphore(args.concurrency)
    prompt = cached = ok = 0

    async def one(body: dict[str, Any]) -> None:
        nonlocal prompt, cached, ok
        async with sem:
            try:
                r = await client.chat.completions.create(
                    model=model, max_tokens=args.max_tokens, extra_body={"ignore_eos": True}, **body
                )
            except openai.APIError as exc:
                print(f"interactive request failed: {exc!r}", file=sys.stderr)
                return
        ok += 1
        if r.usage:
            prompt += r.usage.prompt_tokens
            d = r.usage.prompt_tokens_details
            cached += (d.cached_tokens or 0) if d else 0

    t0 = time.perf_counter()
    async with asyncio.timeout(args.phase_limit_s):
        await asyncio.gather(*(one(b) for b in bodies))
    return Outcome("interactive", len(bodies), time.perf_counter() - t0, prompt, cached, ok)


async def steady_load(http: httpx.AsyncClient, model: str, seed: int, args: Any, run: TtftRun) -> None:
    """Open loop: one streamed request every 1/rate seconds for `duration` seconds; records TTFT."""
    rng = random.Random(seed)
    tasks = []

    async def one(i: int) -> None:
        body = {
            "model": model, "stream": True, "max_tokens": args.max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Interactive {seed}-{i}: " + text(rng, args.load_words)}],
        }  # fmt: skip
        t0 = time.perf_counter()
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    run.errors += 1
                    return
                first = True
                async for line in r.aiter_lines():
                    if (
                        first
                        and line.startswith("data:")
                        and '"content":"' in line
                        and '"content":""' not in line
                    ):
                        run.ttfts.append(time.perf_counter() - t0)
                        first = False
        except httpx.HTTPError:
            run.errors += 1

    start = time.perf_counter()
    n = int(args.load_rate * args.load_s)
    for i in range(n):
        delay = start + i / args.load_rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # the open loop's schedule
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    run.seconds = time.perf_counter() - start


async def ttft_phases(client: AsyncOpenAI, http: httpx.AsyncClient, model: str, args: Any) -> list[TtftRun]:
    alone = TtftRun("interactive alone")
    await steady_load(http, model, 101, args, alone)
    busy = TtftRun("interactive + batch")
    batch_id = await run_batch(client, model, workload(7, args.load_batch, args.prompts, args.system_words),
                               args.max_tokens)  # fmt: skip

    async def counts() -> int:
        c = (await client.batches.retrieve(batch_id)).request_counts
        return (c.completed + c.failed) if c else 0

    # Start the load once the batch is really running on the workers.
    deadline = time.monotonic() + args.phase_limit_s
    while time.monotonic() < deadline:
        if await counts() >= args.concurrency:
            break
        await asyncio.sleep(0.2)  # poll period
    before = await counts()
    busy.batch_done_before = before
    await steady_load(http, model, 202, args, busy)
    busy.batch_items_done = await counts() - before
    b = await client.batches.retrieve(batch_id)
    if b.status not in ("completed", "failed", "expired", "cancelled"):
        await client.batches.cancel(batch_id)
    return [alone, busy]


async def one_stack(order: str, args: Any, work_dir: Path) -> dict[str, Any]:
    os.environ["FERRY_BATCH_ORDER"] = order
    os.environ["FERRY_BATCH_DIR"] = str(work_dir / order)
    os.environ["FERRY_POOL_MAX_INFLIGHT"] = str(args.pool_max_inflight)
    stack = await FerryStack.start(args.workers, args.speedup, ["--num-blocks", str(args.num_blocks)], timeout_s=240)
    out: dict[str, Any] = {"order": order}
    try:
        model = args.model
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=2, timeout=600)
        async with httpx.AsyncClient(base_url=stack.url, timeout=600) as http:
            # Warm the path (first tokenizer use, consumer groups settling) with a tiny batch.
            await batch_phase(client, model, "warm-up", workload(1, 8, 1, 20), args)
            bodies = workload(11 if order == "prefix" else 12, args.requests, args.prompts, args.system_words)
            out["batch"] = asdict(await batch_phase(client, model, f"batch ({order} order)", bodies, args))
            print(out["batch"], file=sys.stderr, flush=True)
            if order == "prefix" and "interactive" in args.phases:
                bodies = workload(13, args.requests, args.prompts, args.system_words)
                out["interactive"] = asdict(await interactive_phase(client, model, bodies, args))
                print(out["interactive"], file=sys.stderr, flush=True)
            if order == "prefix" and "ttft" in args.phases:
                out["ttft"] = [
                    asdict(r) | {"p50": r.pct(0.5), "p90": r.pct(0.9)}
                    for r in await ttft_phases(client, http, model, args)
                ]
    finally:
        await stack.stop()
    return out


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| run | requests | completion time (s) | cached prompt tokens |", "| --- | --- | --- | --- |"]
    for r in results:
        for key in ("batch", "interactive"):
            if key in r:
                o = r[key]
                frac = o["cached_tokens"] / o["prompt_tokens"] if o["prompt_tokens"] else 0.0
                rows.append(
                    f"| {o['name']} | {o['ok']}/{o['requests']} | {o['seconds']:.1f} | {100 * frac:.1f}% |"
                )
    rows += ["", "| interactive load | requests | TTFT p50 (ms) | TTFT p90 (ms) | errors | batch items done meanwhile |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in results:
        for t in r.get("ttft", []):
            rows.append(f"| {t['name']} | {len(t['ttfts'])} | {1000 * t['p50']:.0f} | {1000 * t['p90']:.0f} | "
                        f"{t['errors']} | {t['batch_items_done']} |")  # fmt: skip
    return "\n".join(rows)


def save(args: Any, results: list[dict[str, Any]]) -> None:
    """Write what has been measured so far (each stack adds its results)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info(REPO),
                                    "results": results}, indent=2))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run both stacks and report."""
    from schemas.settings import DEFAULT_MODEL_NAME

    p = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--prompts", type=int, default=4, help="distinct long system prompts")
    p.add_argument(
        "--system-words", type=int, default=1200, help="words per system prompt (~1.3 tokens each)"
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64, help="interactive requests in flight at once")
    p.add_argument("--pool-max-inflight", type=int, default=32)
    p.add_argument(
        "--load-rate", type=float, default=4.0, help="steady interactive load, requests per second"
    )
    p.add_argument("--load-s", type=float, default=20.0)
    p.add_argument("--load-words", type=int, default=60)
    p.add_argument("--load-batch", type=int, default=2000, help="batch size running under the steady load")
    p.add_argument("--phase-limit-s", type=float, default=600.0)
    p.add_argument("--orders", default="prefix,submission")
    p.add_argument(
        "--phases", default="batch,interactive,ttft",
        help="of the prefix-order stack: batch (always), interactive, ttft",
    )
    p.add_argument(
        "--num-blocks", type=int, default=16384,
        help="KV blocks per worker; fewer than the prompts need makes the batch order matter for hits",
    )
    p.add_argument("--model", default=DEFAULT_MODEL_NAME)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "batch.json")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="ferry-bench-batch-") as tmp:
        for order in args.orders.split(","):
            results.append(run_cleanly(one_stack(order, args, Path(tmp))))
            save(args, results)
    report = table(results)
    print(report)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
