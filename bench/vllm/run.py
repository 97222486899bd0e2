"""Ferry (`ferry up` with one vLLM worker) against vLLM's own OpenAI server, side by side in one run.

Both systems serve the default model with the CPU settings ARCHITECTURE.md records: float32, eager mode,
block size 32, max_model_len 2048, VLLM_CPU_KVCACHE_SPACE=1, VLLM_ENABLE_V1_MULTIPROCESSING=0, prefix
caching on, and the scheduler limits Ferry's worker uses (256 sequences, 8192 tokens per step). Both are
started once and stay up; the same streamed chat requests (`ignore_eos`, exactly `--max-tokens` tokens
each, from bench/overhead.py) go to one system at a time at concurrency 1, 4 and 8.

The machine may be shared with other work, so the measurement is interleaved: every round runs each
concurrency level on both systems back to back, alternating which goes first, and each cell stops after
`concurrency x --waves` requests or `--cell-seconds`. Noise then falls on both systems alike; results pool
the rounds, and the ratios are also given per round (median). Reported per system and level: time to
first token p50/p99 (client side, to the first event carrying text) and output tokens/s (completion
tokens / wall time of the cell); then Ferry's throughput / vLLM's and Ferry's added TTFT (p50 - p50).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.overhead import PhaseResult, chat_body, machine_info, ms
from bench.sse_client import Connection, StreamStats, stream_stats
from bench.stack import FerryStack, run_cleanly, tree_cpu_seconds
from launch.services import Child, free_port
from schemas.settings import DEFAULT_MODEL_NAME
from workers.cpu_env import CPU_ENGINE_ENV

TARGET_THROUGHPUT_RATIO = 0.9  # Ferry's tokens/s >= 0.9 x vLLM's own server (issue 4, item 7)
TARGET_ADDED_TTFT_MS = 10.0  # Ferry's TTFT p50 - vLLM's TTFT p50
SYSTEMS = ("ferry", "vllm")

# The engine settings both systems get (ARCHITECTURE.md, "Engines").
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
# What the engines of both systems run with, for the results (the server's flags in start_vllm, Ferry's
# worker's from its settings, workers/vllm_config.py and workers/cpu_env.py, whose environment the server gets
# too).
ENGINE_SETTINGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "block_size": BLOCK_SIZE,
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": MAX_NUM_SEQS,
    "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
    "enable_prefix_caching": True,
    **VLLM_ENV,
    **CPU_ENGINE_ENV,
}


@dataclass
class Server:
    """One system under test: where it listens and how to stop it."""

    name: str
    host: str
    port: int
    stop: Any  # async callable
    # The process that was started; it and all its descendants make up the system (for CPU accounting).
    root_pid: int = 0
    child: Child | None = None  # the started process, when this benchmark started it (not `ferry up`)

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the system's processes (broker, Redis, EngineCore included)."""
        return tree_cpu_seconds(self.root_pid)


async def start_ferry(timeout_s: float) -> tuple[Server, FerryStack]:
    """`ferry up` with one vLLM worker."""
    extra = [
        "--engine", "vllm", "--workers", "1", "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(MAX_MODEL_LEN), "--ready-timeout-s", str(timeout_s),
    ]  # fmt: skip
    stack = await FerryStack.start(workers=1, speedup=1.0, extra=extra, timeout_s=timeout_s)
    return Server("ferry", stack.host, stack.port, stack.stop, stack.child.proc.pid), stack


async def start_vllm(
    model_dir: Path, timeout_s: float, extra: Sequence[str] = (), env: dict[str, str] | None = None
) -> Server:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`; the `vllm` script fails with vllm-cpu),
    with `extra` flags and `env` variables on top of the settings above."""
    port = free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", DEFAULT_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
        *extra,
    ]  # fmt: skip
    child = await Child.spawn(
        "vllm-server", argv, echo=False, env={**VLLM_ENV, **CPU_ENGINE_ENV, **(env or {})}
    )
    try:
        await child.wait_for_line(lambda line: "Application startup complete" in line, timeout_s)
    except BaseException:
        await child.stop(10)
        raise

    async def stop() -> None:
        await child.stop(30)

    return Server("vllm", "127.0.0.1", port, stop, child.proc.pid, child)


async def run_cell(
    srv: Server,
    concurrency: int,
    max_requests: int,
    seconds: float,
    timeout_s: float,
    body: Callable[[int], bytes],
) -> tuple[list[StreamStats], float]:
    """`concurrency` users on keep-alive connections, each streaming one request after another, until
    `max_requests` were issued or `seconds` passed; returns every request's stats and the wall time."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    issued = 0
    stats: list[StreamStats] = []
    last_end = t0

    async def user() -> None:
        nonlocal issued, last_end
        conn = Connection(srv.host, srv.port)
        try:
            while issued < max_requests and loop.time() < t0 + seconds:
                issued += 1
                started = time.perf_counter()
                try:
                    resp = await conn.post_json("/v1/chat/completions", body(issued), timeout_s)
                    stats.append(stream_stats(resp))
                except (OSError, TimeoutError) as exc:
                    nan, took = math.nan, time.perf_counter() - started
                    stats.append(StreamStats(0, False, nan, nan, [], took, 0, 0, 0, repr(exc)))
                last_end = loop.time()
        finally:
            conn.close()

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return stats, last_end - t0


def _prompt(base: int, max_tokens: int, i: int) -> bytes:
    return chat_body(DEFAULT_MODEL_NAME, max_tokens, base + i)


@dataclass
class Cell:
    """One system at one concurrency, pooled over rounds."""

    rounds: list[PhaseResult] = field(default_factory=list)

    def pooled(self, name: str, concurrency: int) -> PhaseResult:
        """All rounds as one phase: every request's stats, the summed wall time."""
        stats = [s for r in self.rounds for s in r.stats]
        pooled = PhaseResult(name, concurrency, stats, sum(r.wall_s for r in self.rounds))
        cpu = sum(r.extra.get("cpu_s", 0.0) for r in self.rounds)
        pooled.extra["cpu_s"] = round(cpu, 2)
        # What a token costs in CPU, whatever share of the machine the system got meanwhile.
        pooled.extra["cpu_ms_per_token"] = round(1000 * cpu / pooled.tokens, 2) if pooled.tokens else None
        return pooled


async def measure(
    servers: dict[str, Server],
    levels: list[int],
    rounds: int,
    waves: int,
    cell_s: float,
    max_tokens: int,
    timeout_s: float,
    after_round: Callable[[dict[tuple[str, int], Cell], int], None],
) -> dict[tuple[str, int], Cell]:
    """Interleaved rounds: each level on both systems back to back, alternating who goes first."""
    cells = {(name, c): Cell() for name in servers for c in levels}
    for r in range(rounds):
        for li, c in enumerate(levels):
            order = list(SYSTEMS) if (r + li) % 2 == 0 else list(reversed(SYSTEMS))
            # Both systems get the same prompts in a cell; no prompt repeats across cells.
            base = (r * len(levels) + li) * 100_000
            for name in order:
                srv = servers[name]
                body = functools.partial(_prompt, base, max_tokens)
                cpu0 = srv.cpu_seconds()
                stats, wall = await run_cell(srv, c, c * waves, cell_s, timeout_s, body)
                phase = PhaseResult(f"{name}@{c}", c, stats, wall)
                phase.extra["cpu_s"] = srv.cpu_seconds() - cpu0
                cells[(name, c)].rounds.append(phase)
                s = phase.summary(max_tokens)
                print(
                    f"round {r + 1}/{rounds} {name:>5} c={c}: {s['ok']}/{s['requests']} ok, "
                    f"{s['tokens_per_s']} tok/s, TTFT p50 {s['ttft_ms']['p50']} ms, "
                    f"CPU {phase.extra['cpu_s']:.1f} s {s['errors'] or ''}",
                    flush=True,
                )
        after_round(cells, r + 1)
    return cells


def report(cells: dict[tuple[str, int], Cell], levels: list[int], max_tokens: int) -> dict[str, Any]:
    """Pooled summaries, ratios (pooled and per-round medians), and the targets."""
    rows: list[dict[str, Any]] = []
    for c in levels:
        pooled = {name: cells[(name, c)].pooled(f"{name}@{c}", c) for name in SYSTEMS}
        summary = {name: p.summary(max_tokens) for name, p in pooled.items()}
        f, v = pooled["ferry"], pooled["vllm"]
        ratio = f.tokens_per_s / v.tokens_per_s if v.tokens_per_s else math.nan
        added = f.ttft(50) - v.ttft(50)
        per_round = [
            a.tokens_per_s / b.tokens_per_s
            for a, b in zip(cells[("ferry", c)].rounds, cells[("vllm", c)].rounds, strict=True)
            if b.tokens_per_s
        ]
        added_rounds = [
            a.ttft(50) - b.ttft(50)
            for a, b in zip(cells[("ferry", c)].rounds, cells[("vllm", c)].rounds, strict=True)
        ]
        rows.append(
            {
                "concurrency": c,
                "ferry": summary["ferry"],
                "vllm": summary["vllm"],
                "throughput_ratio": round(ratio, 3),
                "throughput_ratio_round_median": round(statistics.median(per_round), 3)
                if per_round
                else None,
                "added_ttft_p50_ms": ms(added),
                "cpu_per_token_ratio": (
                    round(summary["ferry"]["cpu_ms_per_token"] / summary["vllm"]["cpu_ms_per_token"], 3)
                    if summary["ferry"]["cpu_ms_per_token"] and summary["vllm"]["cpu_ms_per_token"]
                    else None
                ),
                "added_ttft_p50_ms_round_median": ms(statistics.median(added_rounds))
                if added_rounds
                else None,
            }
        )
    worst_ratio = min(r["throughput_ratio"] for r in rows)
    c1 = next((r for r in rows if r["concurrency"] == 1), rows[0])
    return {
        "rows": rows,
        "targets": {
            "throughput_ratio_min": TARGET_THROUGHPUT_RATIO,
            "throughput_ratio_worst": worst_ratio,
            "throughput_met": worst_ratio >= TARGET_THROUGHPUT_RATIO,
            "added_ttft_p50_ms_max": TARGET_ADDED_TTFT_MS,
            "added_ttft_p50_ms_at_c1": c1["added_ttft_p50_ms"],
            "added_ttft_met": c1["added_ttft_p50_ms"] is not None
            and c1["added_ttft_p50_ms"] <= TARGET_ADDED_TTFT_MS,
        },
    }


def print_table(result: dict[str, Any]) -> None:
    """The results as a plain-text table."""
    print()
    print(
        f"{'c':>3} {'system':>6} {'ok':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
        f"{'CPU ms/tok':>10}"
    )
    for row in result["rows"]:
        for name in SYSTEMS:
            s = row[name]
            print(
                f"{row['concurrency']:>3} {name:>6} {s['ok']:>3}/{s['requests']:<3} {s['tokens_per_s']!s:>8} "
                f"{s['ttft_ms']['p50']!s:>9} {s['ttft_ms']['p99']!s:>9} {s['itl_ms']['p50']!s:>8} "
                f"{s['cpu_ms_per_token']!s:>10}"
            )
        print(
            f"    ferry/vllm throughput {row['throughput_ratio']} (round median "
            f"{row['throughput_ratio_round_median']}), added TTFT p50 {row['added_ttft_p50_ms']} ms "
            f"(round median {row['added_ttft_p50_ms_round_median']} ms), CPU per token "
            f"{row['cpu_per_token_ratio']}x"
        )
    t = result["targets"]
    print(
        f"\ntargets: throughput ratio >= {t['throughput_ratio_min']}: worst {t['throughput_ratio_worst']} "
        f"({'met' if t['throughput_met'] else 'NOT met'}); added TTFT p50 <= {t['added_ttft_p50_ms_max']} ms "
        f"at c=1: {t['added_ttft_p50_ms_at_c1']} ms ({'met' if t['added_ttft_met'] else 'NOT met'})"
    )


async def amain(
    args: argparse.Namespace, levels: list[int]
) -> tuple[dict[tuple[str, int], Cell], dict[str, Any]]:
    """Start both systems, warm them up, measure interleaved rounds, stop both."""
    from launch.model_prepare import default_model_dir, prepare_model

    model_dir = prepare_model(default_model_dir())
    # Ferry's worker reads the same variables (its engine sets the second by default as well).
    os.environ.update(VLLM_ENV)
    machine = machine_info()
    t0 = time.monotonic()
    started = await asyncio.gather(start_ferry(args.start_timeout_s), start_vllm(model_dir, args.start_timeout_s),
                                   return_exceptions=True)  # fmt: skip
    servers: dict[str, Server] = {}
    for item in started:
        if isinstance(item, tuple):
            servers["ferry"] = item[0]
        elif isinstance(item, Server):
            servers["vllm"] = item
    try:
        failures = [x for x in started if isinstance(x, BaseException)]
        if failures:
            raise failures[0]
        print(f"both systems up in {time.monotonic() - t0:.0f}s; warming up", flush=True)
        for srv in servers.values():
            await run_cell(srv, 1, 2, 60, args.request_timeout_s, functools.partial(_prompt, -1000, 8))
        cells = await measure(
            servers,
            levels,
            args.rounds,
            args.waves,
            args.cell_seconds,
            args.max_tokens,
            args.request_timeout_s,
            # Results so far are on disk after every round, should the run be cut short.
            lambda cells, done: write(result_of(args, levels, cells, machine, done), Path(args.out)),
        )
    finally:
        await asyncio.gather(*(s.stop() for s in servers.values()), return_exceptions=True)
    return cells, machine


def write(result: dict[str, Any], out: Path) -> None:
    """The results as JSON."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


def result_of(
    args: argparse.Namespace,
    levels: list[int],
    cells: dict[tuple[str, int], Cell],
    machine: dict[str, Any],
    rounds_done: int,
) -> dict[str, Any]:
    """The report with the run's configuration and machine."""
    result = report(cells, levels, args.max_tokens)
    result["config"] = {
        "command": " ".join(["python -m bench.vllm", *sys.argv[1:]]),
        "rounds": args.rounds,
        "rounds_completed": rounds_done,
        "waves": args.waves,
        "cell_seconds": args.cell_seconds,
        "max_tokens": args.max_tokens,
        "concurrency": levels,
        "engine": ENGINE_SETTINGS,
        "interleaved": "each round runs every level on both systems back to back, alternating the order",
    }
    result["machine"] = {**machine, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}
    return result


def finish(
    args: argparse.Namespace, levels: list[int], cells: dict[tuple[str, int], Cell], machine: dict[str, Any]
) -> None:
    """Report, print and write the results."""
    result = result_of(args, levels, cells, machine, args.rounds)
    write(result, Path(args.out))
    print_table(result)


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run."""
    p = argparse.ArgumentParser(prog="python -m bench.vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated concurrency levels")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--waves", type=int, default=3, help="requests per cell = concurrency x waves")
    p.add_argument("--cell-seconds", type=float, default=90.0, help="no new requests in a cell after this")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (ignore_eos)")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="give up on one request after this")
    p.add_argument(
        "--start-timeout-s", type=float, default=300.0, help="give up if a system is not up by then"
    )
    p.add_argument("--out", default="bench/results/vllm.json", help="where to write the JSON results")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    cells, machine = run_cleanly(amain(args, levels))
    finish(args, levels, cells, machine)
    return 0
