"""`python -m bench.overhead --peer dynamo` (or `--peer ferry`): Ferry and a peer on the same cores, A/B/A.

`--rounds` rounds (default three), one system at a time, alternating: Ferry, the peer, Ferry, the peer, ... (with
`--together`, see bench/overhead/together.py, each pair of rounds at the same time).
Every round runs the same client
(`bench.sse_client`) at each `--concurrency` level with the same requests (`--prompt-words`-word prompts,
`--max-tokens` tokens, `ignore_eos`), and reads the CPU seconds of every process of the system under test from
/proc, reported per 1,000 streamed tokens. Each level runs on a freshly started system unless `--reuse-stack`.

- `dynamo`: NVIDIA Dynamo's frontend (`--router-mode kv`) and one mocker process with `--workers` workers at
  `--speedup-ratio` = `--speedup` (bench/peers/dynamo.py), against `ferry up --engine sim` with as many workers
  at the same speedup.
- `ferry`: another Ferry, `--peer-tree DIR` (a checkout; default this one) started with `--peer-args`, so a
  change is measured against its base in one run: the A rounds are this checkout, the B round the peer.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bench.overhead.measure import PhaseResult, chat_body, run_streams, served_model
from bench.overhead.peer_summary import summary
from bench.overhead.report import busy_percent, machine_info
from bench.sse_client import StreamStats
from bench.stack import CpuSnapshot, CpuUsage, FerryStack, machine_busy_seconds, tree_cpu_seconds

PEERS = ("dynamo", "ferry")
# Dynamo's KV pool and batch limits, as `python -m bench.peers.dynamo run` sets them; Ferry's sim defaults
# are the same pool (64-token blocks, 16,384 of them).
DYNAMO_BLOCK_SIZE = 64
DYNAMO_NUM_BLOCKS = 16384
DYNAMO_MAX_NUM_SEQS = 256
DYNAMO_MAX_BATCHED_TOKENS = 8192


class System(Protocol):
    """A running system under test: where it listens, its processes, how to stop it."""

    host: str
    port: int

    @property
    def pids(self) -> dict[str, int]: ...

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class Round:
    """One system in the A/B/A order."""

    label: str  # "ferry", "dynamo", "ferry (peer)"
    kind: str  # "ferry" or "dynamo"
    tree: Path | None = None  # another Ferry checkout
    extra: tuple[str, ...] = ()  # extra `ferry up` flags


def rounds(args: argparse.Namespace) -> list[Round]:
    """Ferry, the peer, Ferry, ... (`args.rounds` of them)."""
    ours = Round("ferry", "ferry", None, tuple(shlex.split(args.ferry_args)))
    if args.peer == "dynamo":
        peer = Round("dynamo", "dynamo")
    else:
        peer = Round("ferry (peer)", "ferry", args.peer_tree, tuple(shlex.split(args.peer_args)))
    return [ours if i % 2 == 0 else peer for i in range(args.rounds)]


async def start(r: Round, args: argparse.Namespace) -> System:
    """Start the round's system and wait until it serves."""
    t0 = time.perf_counter()
    system: System
    if r.kind == "dynamo":
        from bench.peers import dynamo
        from schemas.settings import DEFAULT_MODEL_NAME, default_model_path

        system = await dynamo.DynamoStack.start(
            model_path=default_model_path(),
            model_name=DEFAULT_MODEL_NAME,
            workers=args.workers,
            speedup=args.speedup,
            block_size=DYNAMO_BLOCK_SIZE,
            num_blocks=DYNAMO_NUM_BLOCKS,
            max_num_seqs=DYNAMO_MAX_NUM_SEQS,
            max_num_batched_tokens=DYNAMO_MAX_BATCHED_TOKENS,
        )
    else:
        system = await FerryStack.start(args.workers, args.speedup, list(r.extra), tree=r.tree)
    print(f"{r.label} ready in {time.perf_counter() - t0:.1f} s; processes {system.pids}", file=sys.stderr)
    return system


def snapshot(pids: dict[str, int]) -> CpuSnapshot:
    """CPU seconds so far of each process with its descendants, this process and the machine."""
    procs = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
    return CpuSnapshot(time.perf_counter(), procs, time.process_time(), machine_busy_seconds())


async def measure_level(
    system: System, label: str, c: int, args: argparse.Namespace, model: str
) -> dict[str, Any]:
    """One concurrency level: the phase summary plus CPU seconds per 1,000 streamed tokens per process."""
    print(f"{label} c={c} ({args.level_seconds:g} s) ...", file=sys.stderr)
    pids = system.pids
    before = snapshot(pids)
    stats, wall = await run_streams(
        system.host, system.port, c, args.requests_per_level, args.level_seconds, request_body(model, args)
    )
    return level_result(label, c, stats, wall, FerryStack.usage(before, snapshot(pids)), args)


def request_body(model: str, args: argparse.Namespace) -> functools.partial[bytes]:
    """The benchmark's request `i` for `model`: the same prompts and lengths for every system."""
    return functools.partial(chat_body, model, args.max_tokens, prompt_words=args.prompt_words)


async def warm(system: System, args: argparse.Namespace) -> str:
    """A few unmeasured streams on a fresh system; returns the model it serves."""
    model, _ = await served_model(system)  # type: ignore[arg-type]
    await run_streams(system.host, system.port, 4, 40, 3.0, request_body(model, args))
    return model


def level_result(
    label: str, c: int, stats: list[StreamStats], wall: float, cpu: CpuUsage, args: argparse.Namespace
) -> dict[str, Any]:
    """The phase summary of one system's level plus CPU seconds per 1,000 streamed tokens per process."""
    result = PhaseResult(f"{label} c={c}", c, stats, wall, cpu)
    summary = result.summary(args.max_tokens)
    tokens = result.tokens

    def per_1k(percent: float) -> float | None:
        return round(percent / 100.0 * cpu.wall_s / tokens * 1000.0, 4) if tokens else None

    per_process = {name: per_1k(v) for name, v in cpu.processes.items()}
    summary["cpu_s_per_1k_tokens"] = {
        **per_process,
        "system_total": per_1k(sum(cpu.processes.values())),
        "bench_client": per_1k(cpu.bench),
        "other_processes": per_1k(cpu.other),
    }
    summary["system"] = label
    return summary


async def run_round(r: Round, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every level of one round, on a fresh system per level unless --reuse-stack."""
    out: list[dict[str, Any]] = []
    system: System | None = None
    try:
        for c in args.concurrency:
            if system is None or not args.reuse_stack:
                if system is not None:
                    await system.stop()
                    system = None
                system = await start(r, args)
                model = await warm(system, args)
            out.append(await measure_level(system, r.label, c, args, model))
    finally:
        if system is not None:
            await system.stop()
    return out


async def run_peer(args: argparse.Namespace) -> dict[str, Any]:
    """The A/B/A run; returns the results document."""
    if args.peer == "dynamo":
        from bench.peers import dynamo

        info = dynamo.ensure_installed(log=lambda *a: print(*a, file=sys.stderr))
        peer_info: dict[str, Any] = {"dynamo": info.get("version"), "relaxed": info.get("relaxed")}
    else:
        peer_info = {
            "tree": str(args.peer_tree) if args.peer_tree else "this checkout",
            "args": args.peer_args,
        }
        if args.peer_tree is not None:
            peer_info.update(machine_info_of(args.peer_tree))
    machine = machine_info()
    machine["busy_before_start_percent"] = await busy_percent(1.0)
    runs = []
    if args.together:
        from bench.overhead.together import run_together

        runs = await run_together(args)
    else:
        plan = rounds(args)
        for i, r in enumerate(plan):
            print(f"round {i + 1} of {len(plan)}: {r.label}", file=sys.stderr)
            runs.append({"round": i + 1, "system": r.label, "levels": await run_round(r, args)})
    return {
        "benchmark": "overhead-peer",
        "command": " ".join(["python -m bench.overhead", *sys.argv[1:]]),
        "machine": machine,
        "peer": {"kind": args.peer, **peer_info},
        "config": {
            "workers": args.workers,
            "speedup": args.speedup,
            "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words,
            "concurrency": args.concurrency,
            "level_seconds": args.level_seconds,
            "rounds": args.rounds,
            "together": args.together,
            "requests_per_level": args.requests_per_level,
            "ferry_args": args.ferry_args,
            "fresh_system_per_level": not args.reuse_stack,
            "client": "bench.sse_client (asyncio.Protocol on uvloop, one keep-alive connection per stream)",
        },
        "rounds": runs,
        "summary": summary(runs, len(args.concurrency)),
    }


def machine_info_of(tree: Path) -> dict[str, Any]:
    """The commit of another checkout."""
    from bench.overhead.report import git_info

    return {f"tree_{k}": v for k, v in git_info(tree).items()}


def print_peer_table(results: dict[str, Any]) -> None:
    """The side-by-side table (Markdown) and CPU seconds per 1,000 streamed tokens per process."""
    runs = results["rounds"]
    ours = [r for r in runs if r["system"] == "ferry"]
    peers = [r for r in runs if r["system"] != "ferry"]
    name = peers[0]["system"]
    m = results["machine"]
    print()
    print(
        f"Ferry (rounds {', '.join(str(r['round']) for r in ours)}) against {name} "
        f"(rounds {', '.join(str(r['round']) for r in peers)}), "
        f"{results['config']['workers']} workers at speedup {results['config']['speedup']:g}, "
        f"{results['config']['prompt_words']}-word prompts, {results['config']['max_tokens']} tokens; commit "
        f"{(m['commit'] or '?')[:10]}{' (dirty)' if m['dirty'] else ''}, load average {m['loadavg_at_start']}"
    )
    print()
    print(
        f"| streams | Ferry TTFT p50 / p99 (ms) | {name} TTFT p50 / p99 (ms) | Ferry tokens/s | {name} tokens/s "
        f"| Ferry ÷ {name} tokens/s, pairs |"
    )
    print("| --- | --- | --- | --- | --- | --- |")

    def ttft(p: dict[str, Any]) -> str:
        t = p["ttft_ms"]
        return f"{_num(t['p50'])} / {_num(t['p99'])}"

    for i, c in enumerate(results["config"]["concurrency"]):
        mine = [r["levels"][i] for r in ours]
        theirs = [r["levels"][i] for r in peers]
        ratios = ", ".join(f"{x:.2f}×" for x in results["summary"][i]["tokens_per_s_pair_ratios"]) or "–"
        print(
            f"| {c} | {', '.join(ttft(p) for p in mine)} | {', '.join(ttft(p) for p in theirs)} "
            f"| {_tokens(mine)} | {_tokens(theirs)} | {ratios} |"
        )
    print()
    print(f"Medians over the rounds (the last column: the median of each Ferry round ÷ the {name} round beside it):")
    print()
    print(
        f"| streams | Ferry TTFT p50 / p99 (ms) | {name} TTFT p50 / p99 (ms) | Ferry tokens/s | {name} tokens/s "
        f"| ratio of medians | median pair ratio | CPU per 1k tokens, Ferry / {name} |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in results["summary"]:
        a, b = row["ferry"], row["other"]
        print(
            f"| {row['concurrency']} | {_num(a['ttft_p50_ms'])} / {_num(a['ttft_p99_ms'])} "
            f"| {_num(b['ttft_p50_ms'])} / {_num(b['ttft_p99_ms'])} | {_num(a['tokens_per_s'], 0)} "
            f"| {_num(b['tokens_per_s'], 0)} | {_num(row['tokens_per_s_ratio_of_medians'], 2)}× "
            f"| {_num(row['tokens_per_s_pair_ratio_median'], 2)}× "
            f"| {_num(a['cpu_s_per_1k_tokens'], 3)} / {_num(b['cpu_s_per_1k_tokens'], 3)} |"
        )
    print()
    print("CPU seconds per 1,000 streamed tokens:")
    print()
    print("| streams | round | system | per process | system total | client | other |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: |")
    for i, c in enumerate(results["config"]["concurrency"]):
        for r in runs:
            p = r["levels"][i]
            cpu = dict(p["cpu_s_per_1k_tokens"])
            total, client, other = (cpu.pop(k) for k in ("system_total", "bench_client", "other_processes"))
            procs = ", ".join(f"{k} {_num(v, 3)}" for k, v in sorted(cpu.items()))
            print(
                f"| {c} | {r['round']} | {r['system']} | {procs} | {_num(total, 3)} | {_num(client, 3)} | {_num(other, 3)} |"
            )
    failed = [
        (r["system"], p["concurrency"], p["failed"], p["errors"])
        for r in runs
        for p in r["levels"]
        if p["failed"]
    ]
    short = [
        (r["system"], p["concurrency"])
        for r in runs
        for p in r["levels"]
        if p["completion_tokens_not_max_tokens"]
    ]
    for f in failed:
        print(f"WARNING: {f[0]} at {f[1]} streams: {f[2]} requests failed {f[3]}")
    for s in short:
        print(f"WARNING: {s[0]} at {s[1]} streams: some requests did not stream exactly max_tokens tokens")
    busy = m.get("busy_before_start_percent")
    if busy is not None and busy > 20:
        print(
            f"WARNING: the machine was busy before the run ({busy:.0f}% of one core in use by other processes)"
        )


def _tokens(levels: list[dict[str, Any]]) -> str:
    return ", ".join(f"{p['tokens_per_s']:,.0f}" for p in levels)


def _num(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"
