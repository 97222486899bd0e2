"""One vLLM-engine system under a fixed load, variant by variant in one run: engine environment A/B/A.

`python -m bench.vllm.variants --variant ferry --variant "ferry GOMP_SPINCOUNT=300000" --variant ferry`

A variant is a system (`ferry`: `ferry up` with one vLLM worker; `vllm`: vLLM's own OpenAI server) and the
environment variables it starts with on top of the engine settings both systems share (bench.soak.peer; the
CPU environment Ferry's worker gives its EngineCore, workers/cpu_env.py, is given to vLLM's server too). Each variant runs on a
freshly started system: `--streams` clients stream chat completions back to back (100-word prompts,
`--max-tokens` with `ignore_eos`) for `--warmup-s`, then for `--seconds` measured. Reported per variant:
requests and output tokens per minute, and CPU (each process with its children, so a worker includes its
EngineCore) in % of one core and in ms per output token. Run the variants alternating (A, B, A) so that a
change in the machine's other load shows up as a difference between the two A runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.overhead import machine_info
from bench.soak.load import make_body
from bench.soak.peer import FERRY_VLLM_FLAGS, PEER_FLAGS
from bench.sse_client import Connection, stream_stats
from bench.stack import FerryStack, run_cleanly, tree_cpu_seconds
from bench.vllm.run import VLLM_ENV, start_vllm
from schemas.settings import DEFAULT_MODEL_NAME

START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 300.0


@dataclass
class Variant:
    """A system and the environment variables it starts with."""

    label: str
    system: str
    env: dict[str, str]

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """`SYSTEM [NAME=VALUE ...]`."""
        system, *pairs = spec.split()
        if system not in ("ferry", "vllm"):
            raise argparse.ArgumentTypeError(f"unknown system {system!r} in {spec!r} (ferry or vllm)")
        env: dict[str, str] = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep or not name:
                raise argparse.ArgumentTypeError(f"{pair!r} in {spec!r} is not NAME=VALUE")
            env[name] = value
        return cls(spec, system, env)


@dataclass
class Running:
    """A started system: where it serves, its processes by role, and how to stop it."""

    host: str
    port: int
    pids: dict[str, int]
    stop: Callable[[], Awaitable[None]]


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """`extra` in this process's environment (which `ferry up` inherits) while starting a system."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


async def start(variant: Variant, model_dir: Path) -> Running:
    """Start the variant's system with its environment."""
    if variant.system == "vllm":
        srv = await start_vllm(model_dir, START_TIMEOUT_S, PEER_FLAGS, variant.env)
        return Running(srv.host, srv.port, {"vllm-server": srv.root_pid}, srv.stop)
    with _environ({**VLLM_ENV, **variant.env}):
        stack = await FerryStack.start(
            1, 1.0, [*FERRY_VLLM_FLAGS, "--ready-timeout-s", str(START_TIMEOUT_S)], timeout_s=START_TIMEOUT_S
        )
    return Running(stack.host, stack.port, dict(stack.pids), stack.stop)


async def load(
    running: Running, streams: int, seconds: float, body: Callable[[int], bytes]
) -> dict[str, int]:
    """`streams` clients back to back for `seconds`: requests that succeeded, failed, and their output tokens."""
    deadline = time.perf_counter() + seconds
    counts = {"ok": 0, "failed": 0, "output_tokens": 0}
    issued = 0

    async def client() -> None:
        nonlocal issued
        conn = Connection(running.host, running.port)
        try:
            while time.perf_counter() < deadline:
                issued += 1
                stats = stream_stats(
                    await conn.post_json("/v1/chat/completions", body(issued), REQUEST_TIMEOUT_S)
                )
                counts["ok" if stats.ok else "failed"] += 1
                counts["output_tokens"] += stats.completion_tokens
        finally:
            conn.close()

    await asyncio.gather(*(client() for _ in range(streams)))
    return counts


async def measure(variant: Variant, args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """Start the variant, warm it up, measure it, stop it."""
    print(f"{variant.label}: starting ...", file=sys.stderr, flush=True)
    running = await start(variant, model_dir)
    body = make_body(DEFAULT_MODEL_NAME, args.prompt_words, args.max_tokens)
    try:
        await load(running, args.streams, args.warmup_s, body)
        cpu0 = {role: tree_cpu_seconds(pid) for role, pid in running.pids.items()}
        t0 = time.perf_counter()
        counts = await load(running, args.streams, args.seconds, body)
        wall = time.perf_counter() - t0
        cpu = {role: tree_cpu_seconds(pid) - cpu0[role] for role, pid in running.pids.items()}
    finally:
        await running.stop()
    tokens = max(counts["output_tokens"], 1)
    result = {
        "variant": variant.label,
        "system": variant.system,
        "env": variant.env,
        "wall_s": round(wall, 1),
        **counts,
        "requests_per_min": round(60 * counts["ok"] / wall, 2),
        "output_tokens_per_s": round(counts["output_tokens"] / wall, 2),
        "cpu_percent": {role: round(100 * s / wall, 1) for role, s in cpu.items()},
        "cpu_percent_total": round(100 * sum(cpu.values()) / wall, 1),
        "cpu_ms_per_output_token": round(1000 * sum(cpu.values()) / tokens, 2),
    }
    print(_row(result), file=sys.stderr, flush=True)
    return result


def _row(r: dict[str, Any]) -> str:
    procs = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["cpu_percent"].items()))
    return (
        f"{r['variant']}: {r['ok']} ok / {r['failed']} failed in {r['wall_s']:.0f} s, {r['requests_per_min']:.1f}"
        f" requests/min, {r['output_tokens_per_s']:.1f} tokens/s; CPU {r['cpu_percent_total']:.0f} % ({procs}),"
        f" {r['cpu_ms_per_output_token']:.1f} ms per output token"
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant in order; the results document."""
    from launch.model_prepare import default_model_dir, prepare_model

    model_dir = prepare_model(default_model_dir())
    machine = machine_info()
    results = [await measure(v, args, model_dir) for v in args.variants]
    return {
        "benchmark": "vllm.variants",
        "command": " ".join(["python -m bench.vllm.variants", *sys.argv[1:]]),
        "machine": machine,
        "config": {
            k: getattr(args, k) for k in ("streams", "seconds", "warmup_s", "prompt_words", "max_tokens")
        },
        "results": results,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(
        prog="python -m bench.vllm.variants", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--variant", dest="variants", type=Variant.parse, action="append", required=True,
                   help='"SYSTEM [NAME=VALUE ...]", SYSTEM ferry or vllm; repeat, in the order to run')  # fmt: skip
    p.add_argument("--streams", type=int, default=4, help="clients streaming back to back (default 4)")
    p.add_argument("--seconds", type=float, default=120.0, help="measured time per variant (default 120)")
    p.add_argument("--warmup-s", type=float, default=20.0, help="unmeasured load first (default 20)")
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("bench/results/vllm_variants.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the variants and write the results file."""
    args = parse_args(argv)
    doc = run_cleanly(run(args))
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(r["failed"] == 0 for r in doc["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
