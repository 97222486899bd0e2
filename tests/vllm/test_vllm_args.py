"""vLLM's own engine flags through `ferry worker` and `ferry up` (argument level: nothing is started)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from launch.flags import load_with_engine_flags
from launch.stack import _worker_argv, load_stack
from schemas.settings import WorkerSettings
from workers.engine_choice import build_engine
from workers.vllm_args import EngineFlagError
from workers.vllm_config import VLLMConfig, engine_args
from workers.vllm_engine import VLLMEngine

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'


def _args(cfg: VLLMConfig, on_cpu: bool = True) -> AsyncEngineArgs:
    return engine_args(cfg, Path("/m"), "m", "tcp://127.0.0.1:1", on_cpu=on_cpu)


def test_worker_takes_ferry_and_vllm_flags(model_path: Path) -> None:
    argv = ["--engine", "vllm", "--model", str(model_path), "--max-num-seqs", "3", "--dtype", "bfloat16",
            "--", "--speculative-config", NGRAM, "--tensor-parallel-size", "1"]  # fmt: skip
    settings, flags = load_with_engine_flags(WorkerSettings, argv)
    assert settings.max_num_seqs == 3 and settings.model_path == str(model_path)
    assert flags == ["--dtype", "bfloat16", "--speculative-config", NGRAM, "--tensor-parallel-size", "1"]
    engine = build_engine(settings, flags)
    assert isinstance(engine, VLLMEngine)
    args = _args(engine.config)
    assert (args.max_num_seqs, args.dtype, args.tensor_parallel_size) == (3, "bfloat16", 1)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert args.enforce_eager is True  # Ferry's CPU default where the user gave none


def test_defaults_by_platform() -> None:
    cpu, gpu = _args(VLLMConfig(), on_cpu=True), _args(VLLMConfig(), on_cpu=False)
    assert (cpu.dtype, cpu.enforce_eager, cpu.max_model_len, cpu.kv_cache_memory_bytes) == (
        "float32",
        True,
        2048,
        1 << 30,
    )
    fresh = _args_default()
    assert (gpu.dtype, gpu.enforce_eager, gpu.max_model_len, gpu.kv_cache_memory_bytes) == (
        fresh.dtype, fresh.enforce_eager, fresh.max_model_len, fresh.kv_cache_memory_bytes,
    )  # fmt: skip
    assert gpu.enable_prefix_caching and gpu.kv_events_config is not None and gpu.block_size == 32
    # The user's memory flag replaces Ferry's CPU cache size.
    util = _args(VLLMConfig(engine_flags=("--gpu-memory-utilization", "0.5")), on_cpu=True)
    assert (util.gpu_memory_utilization, util.kv_cache_memory_bytes) == (0.5, None)


def _args_default() -> AsyncEngineArgs:
    return AsyncEngineArgs()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--block-size", "16"], "--block-size is Ferry's"),
        (["--max-num-seqs", "3"], "--max-num-seqs is Ferry's"),
        (["--model", "/x"], "--model-path"),
        (["--no-enable-prefix-caching"], "prefix cache"),
        (["--kv-events-config", '{"enable_kv_cache_events": true}'], "KV events"),
        (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag"),
        (["--dtype", "float7"], "invalid choice: 'float7'"),
        (["--kv-cache-memory-bytes", "1000000"], None),
    ],
)
def test_owned_unknown_and_bad_flags_are_refused(flags: list[str], message: str | None) -> None:
    gib = 0.0
    if message is None:  # allowed alone, refused beside Ferry's own cache size
        VLLMConfig(engine_flags=tuple(flags))
        gib, message = 2.0, "both size the KV cache"
    with pytest.raises(EngineFlagError, match=message):
        VLLMConfig(engine_flags=tuple(flags), kv_cache_gib=gib)


def test_sim_refuses_engine_flags(model_path: Path) -> None:
    with pytest.raises(ValueError, match="need --engine vllm"):
        build_engine(WorkerSettings(model_path=str(model_path)), ["--dtype", "bfloat16"])


def test_up_passes_engine_flags_to_every_worker() -> None:
    stack = load_stack(
        ["--engine", "vllm", "--max-num-seqs", "3", "--enforce-eager", "--", "--dtype", "bfloat16"]
    )
    argv = _worker_argv(stack, "k:1", "redis://r", "worker-0")
    assert argv[argv.index("--max-num-seqs") + 1] == "3"
    assert argv[argv.index("--") :] == ["--", "--enforce-eager", "--dtype", "bfloat16"]


def test_lora_modules_at_start() -> None:
    settings, flags = load_with_engine_flags(
        WorkerSettings, ["--engine", "vllm", "--lora-modules", "a=/x", "b=/y", "--dtype", "float32"]
    )
    assert (settings.lora_modules, flags) == ("a=/x b=/y", ["--dtype", "float32"])
    config = VLLMConfig(lora_modules=settings.lora_modules)
    assert (
        config.loras == {"a": "/x", "b": "/y"} and config.lora_slots == 2
    )  # --max-loras defaults to their number
    assert _args(config).max_loras == 2 and _args(config).enable_lora
    stack = load_stack(["--engine", "vllm", "--lora-modules", "a=/x", "b=/y"])
    argv = _worker_argv(stack, "k:1", "redis://r", "worker-0")
    assert argv[argv.index("--lora-modules") :][:3] == ["--lora-modules", "a=/x", "b=/y"]
    for bad in ("a", "=/x", "a=/x a=/y"):
        with pytest.raises(ValueError, match="--lora-modules"):
            VLLMConfig(lora_modules=bad)
