"""The two load generators as the benchmark drives them: the workloads, their command lines, one run each.

- `vllm bench serve` (bench/clients/vllm_cli.py): datasets `random` and `prefix_repetition`, backends
  `openai-chat` (/v1/chat/completions) and `openai` (/v1/completions); streamed, `--ignore-eos`, a fixed
  number of prompts at a fixed concurrency, the tokenizer from the local model directory.
- `aiperf profile`: synthetic prompts, endpoint types `chat` and `completions`, streamed, `ignore_eos`,
  token counts from the server's usage (`--use-server-token-count`), no server-metrics scraping and no GPU
  telemetry (both would poll other URLs), a fixed request count at a fixed concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from bench.clients import aiperf
from bench.clients.report import Cell, parse_aiperf, parse_vllm_bench
from bench.clients.vllm_cli import DONE
from schemas.settings import DEFAULT_MODEL_NAME

VLLM_BENCH = "vllm-bench"
AIPERF = "aiperf"

# (dataset, backend) pairs of `vllm bench serve`; the backend picks the endpoint.
VLLM_WORKLOADS = (
    ("random", "openai-chat"),
    ("random", "openai"),
    ("prefix_repetition", "openai-chat"),
    ("prefix_repetition", "openai"),
)
_VLLM_ENDPOINT = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
AIPERF_WORKLOADS = ("chat", "completions")


@dataclass(frozen=True)
class Load:
    """How much each run sends: the same for every client, workload and system."""

    requests: int
    concurrency: int
    input_len: int
    output_len: int
    prefix_len: int
    num_prefixes: int
    warmups: int
    seed: int
    timeout_s: float


def vllm_bench_args(
    load: Load, dataset: str, backend: str, url: str, model_dir: Path, out_dir: Path, name: str
) -> list[str]:
    """`vllm bench serve` arguments for one run, saving its result as `out_dir/name`."""
    if dataset == "random":
        data = [
            "--dataset-name", "random",
            "--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len),
        ]  # fmt: skip
    elif dataset == "prefix_repetition":
        data = [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(load.prefix_len),
            "--prefix-repetition-suffix-len", str(max(load.input_len - load.prefix_len, 1)),
            "--prefix-repetition-num-prefixes", str(load.num_prefixes),
            "--prefix-repetition-output-len", str(load.output_len),
        ]  # fmt: skip
    else:
        raise ValueError(f"unknown dataset {dataset}")
    return [
        "--backend", backend, "--endpoint", _VLLM_ENDPOINT[backend],
        "--base-url", url, "--model", DEFAULT_MODEL_NAME, "--tokenizer", str(model_dir),
        *data,
        "--num-prompts", str(load.requests), "--max-concurrency", str(load.concurrency),
        "--request-rate", "inf", "--num-warmups", str(load.warmups), "--ignore-eos", "--seed", str(load.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", name,
        "--disable-tqdm",
    ]  # fmt: skip


def aiperf_args(load: Load, endpoint: str, url: str, model_dir: Path, artifact_dir: Path) -> list[str]:
    """`aiperf profile` arguments for one run."""
    return [
        "profile", "--model", DEFAULT_MODEL_NAME, "--url", url,
        "--endpoint-type", endpoint, "--streaming", "--tokenizer", str(model_dir),
        "--isl", str(load.input_len), "--isl-stddev", "0", "--osl", str(load.output_len), "--osl-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
        "--concurrency", str(load.concurrency), "--request-count", str(load.requests),
        "--warmup-request-count", str(load.warmups), "--random-seed", str(load.seed),
        "--request-timeout-seconds", str(load.timeout_s),
        "--artifact-dir", str(artifact_dir), "--ui", "none",
        "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "2",
    ]  # fmt: skip


class VllmBench:
    """One long-lived `python -m bench.clients.vllm_cli --lines` process that runs `vllm bench serve`s."""

    def __init__(self, proc: asyncio.subprocess.Process, log: TextIO) -> None:
        self.proc = proc
        self.log = log

    @classmethod
    async def start(cls, log: TextIO, timeout_s: float = 600.0) -> VllmBench:
        """Start the process and wait until vLLM is imported."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.clients.vllm_cli", "--lines",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        runner = cls(proc, log)
        try:
            await asyncio.wait_for(runner._until_done(), timeout_s)
        except BaseException:
            await runner.stop()
            raise
        return runner

    async def _until_done(self) -> str:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.log.write(line + "\n")
            if line.startswith(DONE + " "):
                return line.split()[1]
        raise RuntimeError(f"vllm bench process exited with code {await self.proc.wait()}")

    async def run(self, system: str, rnd: int, load: Load, dataset: str, backend: str, url: str,
                  model_dir: Path) -> Cell:  # fmt: skip
        """One `vllm bench serve` run; its saved result read back."""
        workload = f"{dataset}/{backend}"
        with tempfile.TemporaryDirectory(prefix="ferry-vllm-bench-") as tmp:
            args = vllm_bench_args(load, dataset, backend, url, model_dir, Path(tmp), "result.json")
            command = "vllm bench serve " + shlex.join(args)
            cell = Cell(system, VLLM_BENCH, workload, rnd, None, command=command)
            self.log.write(f"\n=== {system} round {rnd}: {command}\n")
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(args) + "\n").encode())
            await self.proc.stdin.drain()
            try:
                rc = await asyncio.wait_for(self._until_done(), load.timeout_s)
            except TimeoutError:
                cell.error = f"no result within {load.timeout_s:.0f}s"
                await self.stop()
                return cell
            result = Path(tmp) / "result.json"
            if rc != "0" or not result.is_file():
                cell.error = f"vllm bench serve exited with {rc} (see the log)"
                return cell
            cell.summary = parse_vllm_bench(json.loads(result.read_text()), load.requests)
            return cell

    async def stop(self) -> None:
        """Close stdin (the process then exits); kill it if it does not."""
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()


async def run_aiperf(system: str, rnd: int, load: Load, endpoint: str, url: str, model_dir: Path,
                     log: TextIO) -> Cell:  # fmt: skip
    """One `aiperf profile` run in its own virtual environment; its JSON export read back."""
    exe = str(aiperf.venv_bin(aiperf.default_venv(), "aiperf"))
    with tempfile.TemporaryDirectory(prefix="ferry-aiperf-") as tmp:
        args = aiperf_args(load, endpoint, url, model_dir, Path(tmp))
        cell = Cell(system, AIPERF, f"synthetic/{endpoint}", rnd, None, command="aiperf " + shlex.join(args))
        log.write(f"\n=== {system} round {rnd}: {cell.command}\n")
        log.flush()
        proc = await asyncio.create_subprocess_exec(
            exe,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            cwd=tmp,
            start_new_session=True,  # aiperf starts worker processes: a timeout ends the whole group
        )
        try:
            rc = await asyncio.wait_for(proc.wait(), load.timeout_s)
        except TimeoutError:
            cell.error = f"no result within {load.timeout_s:.0f}s"
            return cell
        finally:
            # aiperf's own worker processes too, whatever state it ended in.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        export = Path(tmp) / aiperf.EXPORT_NAME
        if not export.is_file():
            cell.error = f"aiperf exited with {rc} and wrote no {aiperf.EXPORT_NAME} (see the log)"
            return cell
        cell.summary = parse_aiperf(json.loads(export.read_text()), load.requests)
        if rc != 0:
            cell.error = f"aiperf exited with {rc}"
        return cell
