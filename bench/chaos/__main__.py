"""`python -m bench.chaos`: mixed requests against `ferry up` while its processes are killed and restarted.

Workers are SIGKILLed at random and started again under the same id; Redis and (unless --no-broker)
the broker are restarted once each, empty, on their ports. Every request is classified: completed,
refused (503/429 before streaming), failed (accepted, then an error event or a short answer),
duplicated (an event id seen twice, or more tokens than were generated: every request asks for
logprobs, one per token, and is a resumable stream, whose events carry ids) and hung (no end within --deadline-s). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.stack import FerryStack, run_cleanly
from launch.flags import to_argv
from launch.services import Child, start_broker, start_redis
from launch.stack import EMBEDDED_BROKER_DEFAULTS
from schemas.settings import WorkerSettings

MODEL = "SmolLM2-135M-Instruct"
RESUMABLE = {"x-ferry-resumable": "1"}


def _choices(datas: list[str]) -> list[dict[str, Any]]:
    return [ch for d in datas[:-1] for ch in json.loads(d).get("choices", [])]


async def one(c: httpx.AsyncClient, i: int, rng: random.Random, deadline_s: float) -> tuple[str, str]:
    """One streamed request of random length; its outcome, and why where it failed."""
    max_tokens = rng.choice([4, 16, 64, 256])
    words = " ".join(f"w{rng.randrange(5000)}" for _ in range(rng.choice([5, 50, 400])))
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
            "logprobs": True}  # fmt: skip
    ids: list[str] = []
    datas: list[str] = []
    started = ""
    try:
        async with asyncio.timeout(deadline_s):
            # Resumable: only those streams number their events (`id:`), which is how a repeat shows.
            async with c.stream("POST", "/v1/chat/completions", json=body, headers=RESUMABLE) as r:
                if r.status_code in (429, 503):
                    await r.aread()
                    return "refused", f"{r.status_code} {r.json().get('error', {}).get('code')}"
                if r.status_code != 200:
                    return "failed", f"http {r.status_code}"
                started = f"{r.headers.get('x-request-id')} on {r.headers.get('x-ferry-worker')}"
                async for line in r.aiter_lines():
                    if line.startswith("id:"):
                        ids.append(line[3:].strip())
                    elif line.startswith("data:"):
                        datas.append(line[5:].strip())
        if len(ids) != len(set(ids)):
            return "duplicated", ""
        errors = [json.loads(d)["error"] for d in datas if d.startswith('{"error"')]
        if errors:
            return "failed", f"{errors[0].get('code')}: {errors[0].get('message', '')[:90]}"
        if not datas or datas[-1] != "[DONE]":
            return "failed", "no [DONE]"
        # One logprob per token received: a repeated or lost piece shows in this count even on a stream
        # that could not be made resumable (its record unsaved while Redis was down) and so has no ids.
        received = sum(len((ch.get("logprobs") or {}).get("content") or []) for ch in _choices(datas))
        if received > max_tokens:
            return "duplicated", f"{received} tokens received, {max_tokens} sent"
        if received < max_tokens:
            return "failed", f"{received} of {max_tokens} tokens received"
        usage = json.loads(datas[-2]).get("usage") or {}
        if usage.get("completion_tokens") != max_tokens:
            return "failed", f"{usage.get('completion_tokens')} of {max_tokens} tokens"
        return "completed", ""
    except TimeoutError:
        return "hung", f"{started or 'no response'}: {len(ids)} events, {max_tokens} tokens asked"
    except httpx.HTTPError as exc:
        where = f"mid-stream ({started}, {len(ids)} events)" if started else "before the response"
        return "failed", f"{type(exc).__name__} {where}"


# What the frontend did about the chaos: sequences moved (a worker lost, a reply chunk or a request lost),
# replies rolled.
COUNTERS = (
    "ferry_worker_failures_total",
    "ferry_reply_gaps_total",
    "ferry_requests_lost_total",
    "ferry_reply_topic_rolls_total",
)


async def frontend_counters(c: httpx.AsyncClient) -> dict[str, float]:
    """The frontend's failure counters at the end of the run."""
    text = (await c.get("/metrics")).text
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name in COUNTERS
    }


def _service_addresses(stack: FerryStack) -> tuple[str, str]:
    line = next(x for x in stack.child.tail if x.startswith("Kafka "))
    parts = line.split()
    return parts[1], parts[3]


def worker_argv(wid: str, kafka: str, redis: str, speedup: float) -> list[str]:
    """A worker of this benchmark's own, set as `ferry up` sets its children on its embedded broker: the
    stack's frontend writes to rolled request topics, and a worker reading the unrolled one gets nothing."""
    rolled = to_argv(WorkerSettings(**EMBEDDED_BROKER_DEFAULTS), only=EMBEDDED_BROKER_DEFAULTS)
    return [sys.executable, "-m", "launch", "worker", "--worker-id", wid, "--kafka", kafka, "--redis", redis,
            "--speedup", str(speedup), "--log-level", "info", *rolled]  # fmt: skip


async def chaos(stack: FerryStack, args: argparse.Namespace, rng: random.Random, done: asyncio.Event,
                events: list[str], restarted: dict[str, Child]) -> None:  # fmt: skip
    """Kill and restart workers at random; restart Redis and the broker once each, mid-run.

    `ferry up` stops everything when one of its own workers dies, so it runs one worker that is never
    killed and the benchmark starts the others (`restarted`), which it kills and starts again.
    """
    kafka, redis = _service_addresses(stack)
    plan = ["redis", *(["broker"] if args.broker else [])]
    t0 = time.monotonic()
    while not done.is_set():
        await asyncio.sleep(rng.uniform(args.kill_every_s * 0.5, args.kill_every_s * 1.5))  # chaos pacing
        if done.is_set():
            break
        elapsed = time.monotonic() - t0
        if plan and elapsed > args.service_restart_after_s * (3 - len(plan)):
            what = plan.pop(0)
            pid = stack.pids.get("redis" if what == "redis" else "kafka")
            if pid:
                os.kill(pid, signal.SIGKILL)
                port = int((redis if what == "redis" else kafka).rsplit(":", 1)[1].split("/")[0])
                await asyncio.sleep(1.0)  # the outage itself
                child, _ = await (start_redis(port) if what == "redis" else start_broker(port))
                restarted[what] = child
                events.append(f"{elapsed:.1f}s restarted {what}")
            continue
        wid = f"chaos-{rng.randrange(args.workers)}"
        restarted[wid].kill()
        await restarted[wid].proc.wait()
        events.append(f"{elapsed:.1f}s killed {wid}")
        restarted[wid] = await Child.spawn(wid, worker_argv(wid, kafka, redis, args.speedup), echo=False)
        restarted[wid].log = stack.child.log


async def main(args: argparse.Namespace, log_file: TextIO | None) -> dict[str, object]:
    rng = random.Random(args.seed)
    stack = await FerryStack.start(1, args.speedup, ["--migration-limit", str(args.migration_limit)])
    stack.child.log = log_file
    events: list[str] = []
    extra: dict[str, Child] = {}
    try:
        kafka, redis = _service_addresses(stack)
        for k in range(args.workers):
            wid = f"chaos-{k}"
            extra[wid] = await Child.spawn(wid, worker_argv(wid, kafka, redis, args.speedup), echo=False)
            extra[wid].log = log_file
        await asyncio.gather(*(w.wait_for_line(lambda x: x.startswith("ferry-worker-ready"), 120)
                               for w in extra.values()))  # fmt: skip
        done = asyncio.Event()
        chaos_task = asyncio.create_task(chaos(stack, args, rng, done, events, extra))
        sem = asyncio.Semaphore(args.concurrency)
        # Idle connections are dropped before uvicorn's 5 s keep-alive does, or a request written just as
        # the server closes one fails with a ReadError that says nothing about Ferry.
        limits = httpx.Limits(max_connections=args.concurrency, keepalive_expiry=2.0)
        async with httpx.AsyncClient(base_url=stack.url, timeout=args.deadline_s + 5, limits=limits) as c:

            async def bounded(i: int) -> tuple[str, str]:
                async with sem:
                    return await one(c, i, rng, args.deadline_s)

            t0 = time.monotonic()
            results = await asyncio.gather(*(bounded(i) for i in range(args.requests)))
            outcomes = Counter(outcome for outcome, _ in results)
            reasons = Counter(why for outcome, why in results if outcome == "failed")
            refusals = Counter(why for outcome, why in results if outcome == "refused")
            hung = [why for outcome, why in results if outcome == "hung"]
            wall = time.monotonic() - t0
            counters = await frontend_counters(c)
        done.set()
        await chaos_task
    finally:
        for child in extra.values():
            await child.stop(5)
        await stack.stop()
    accepted = args.requests - outcomes["refused"]
    result = {"requests": args.requests, "accepted": accepted, **{k: outcomes[k] for k in
              ("completed", "refused", "failed", "duplicated", "hung")}, "wall_s": round(wall, 1),
              "failures": dict(reasons.most_common()), "refusals": dict(refusals.most_common()), "hung_requests": hung, "frontend": counters, "events": events,
              "args": vars(args)}  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k not in ("events", "args", "frontend", "hung_requests")}))
    print("\n".join(f"hung: {h}" for h in hung))
    print("frontend:", json.dumps(counters))
    print("\n".join(events))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--speedup", type=float, default=20.0)
    p.add_argument("--kill-every-s", type=float, default=5.0)
    p.add_argument("--service-restart-after-s", type=float, default=20.0)
    p.add_argument("--deadline-s", type=float, default=60.0)
    p.add_argument("--broker", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--migration-limit", type=int, default=3, help="the frontend's (Ferry's default: 3)")
    p.add_argument("--out", default="bench/results/chaos.json")
    p.add_argument("--log", help="write every process's output here (ferry up's and the workers')")
    a = p.parse_args()
    with open(a.log, "w") if a.log else contextlib.nullcontext() as log_file:
        Path(a.out).write_text(json.dumps(run_cleanly(main(a, log_file)), indent=1))
