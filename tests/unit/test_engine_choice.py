"""A worker's engine is built from its settings group (workers/engine_choice.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from schemas.engine_settings import SimSettings
from schemas.settings import WorkerSettings
from workers.engine_choice import build_engine
from workers.model_dir import load_model_info
from workers.sim import SimEngine


def test_sim_engine_takes_every_sim_setting(model_path: Path) -> None:
    settings = WorkerSettings(
        model_path=str(model_path), block_size=16, num_blocks=512, max_num_seqs=3, max_num_batched_tokens=99,
        speedup=2.5, max_model_len=1000, kv_bytes_per_token=5, kv_transfer_bandwidth_gbps=3.0,
    )  # fmt: skip
    engine = build_engine(settings)
    assert isinstance(engine, SimEngine)
    for f in dataclasses.fields(SimSettings):
        assert getattr(engine.config, f.name) == getattr(settings, f.name), f.name


def test_max_model_len_zero_is_the_models_own(model_path: Path) -> None:
    engine = build_engine(WorkerSettings(model_path=str(model_path)))
    assert isinstance(engine, SimEngine)
    assert engine.config.max_model_len == load_model_info(str(model_path)).max_position_embeddings


def test_transfer_bytes_per_token_come_from_the_model_unless_given(model_path: Path) -> None:
    # Host-tier loads and P/D transfers (--kv-transfer-bandwidth-gbps, on by default) both need them.
    derived = build_engine(WorkerSettings(model_path=str(model_path), num_host_blocks=8))
    given = build_engine(WorkerSettings(model_path=str(model_path), num_host_blocks=8, kv_bytes_per_token=7))
    off = build_engine(WorkerSettings(model_path=str(model_path), kv_transfer_bandwidth_gbps=0))
    assert isinstance(derived, SimEngine) and isinstance(given, SimEngine) and isinstance(off, SimEngine)
    # The default model, SmolLM2-135M: 30 layers x 3 KV heads x 64 head dim x 2 (K and V) x 2 bytes (bf16).
    assert derived.config.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2
    assert given.config.kv_bytes_per_token == 7
    assert off.config.kv_bytes_per_token == 0
    pd = build_engine(WorkerSettings(model_path=str(model_path)))
    assert isinstance(pd, SimEngine) and pd.config.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2


def test_vllm_worker_refuses_a_disaggregated_role_without_a_kv_connector(model_path: Path) -> None:
    settings = WorkerSettings(model_path=str(model_path), engine="vllm", role="decode")
    with pytest.raises(ValueError, match="--role decode with --engine vllm needs a KV connector"):
        build_engine(settings)
    with pytest.raises(ValueError, match="needs a KV connector"):
        build_engine(settings, ["--dtype", "float32"])
