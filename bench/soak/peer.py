"""`--peer vllm`: the same soak against vLLM's own OpenAI server right after Ferry's, and the two side by side.

Both get the same engine settings: those of bench.vllm (ARCHITECTURE.md, "Engines") given explicitly to both,
since vLLM's own defaults for the scheduler limits differ between its server and an engine built in-process,
plus what Ferry's worker sets for itself on CPU (workers/vllm_config.py) that vLLM's server would not.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

import psutil

from bench.soak.load import Plan, Target
from bench.soak.phase import soak
from bench.soak.sample import StampedLog
from bench.vllm.run import BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, start_vllm
from bench.vllm.run import ENGINE_SETTINGS as VLLM_ENGINE

PEER = "vllm-server"
# `ferry up` with one vLLM worker; fp32, eager mode, prefix caching and a 1 GiB KV cache are its CPU defaults.
FERRY_VLLM_FLAGS = [
    "--engine", "vllm", "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
]  # fmt: skip
# On top of bench.vllm's server settings: Ferry's worker schedules by priority (workers/vllm_config.py), which
# vLLM's server would not.
PEER_FLAGS = ["--scheduling-policy", "priority"]
# What both systems' engines run with, for the results.
ENGINE_SETTINGS: dict[str, Any] = {**VLLM_ENGINE, "scheduling_policy": "priority"}
START_TIMEOUT_S = 600.0


def peer_path(out: Path, suffix: str) -> Path:
    """The peer's file next to Ferry's: soak-vllm.json -> soak-vllm-peer.json (and .log, -profiles)."""
    return out.with_name(f"{out.stem}-peer{suffix}")


async def run_peer(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """Start vLLM's server, soak it with `plan` (Ferry's load), stop it and everything it started."""
    from launch.model_prepare import default_model_dir, prepare_model

    model_dir = prepare_model(default_model_dir())
    log = StampedLog(peer_path(args.out, ".log"))
    print(f"{PEER}: starting vLLM's OpenAI server ...", file=sys.stderr)
    srv = await start_vllm(model_dir, START_TIMEOUT_S, PEER_FLAGS)
    assert srv.child is not None
    log.startup(PEER, srv.child.tail)
    srv.child.log = log  # type: ignore[assignment]  # a TextIO in all but name
    descendants: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        descendants = psutil.Process(srv.root_pid).children(recursive=True)
    print(f"{PEER} at http://{srv.host}:{srv.port}; pid {srv.root_pid}; log {log.path}", file=sys.stderr)
    try:
        target = Target(PEER, srv.host, srv.port, srv.child.proc, {PEER: srv.root_pid})
        doc, _ = await soak(target, log, args, plan, peer_path(args.out, "-profiles"))
    finally:
        print(f"stopping {PEER} ...", file=sys.stderr)
        await srv.stop()
        for p in descendants:  # an EngineCore left behind by a server that had to be killed
            with contextlib.suppress(psutil.Error):
                p.kill()
        log.close()
    return doc


def _target(doc: dict[str, Any], prefix: str) -> dict[str, Any]:
    return next(t for t in doc["targets"] if t["name"].startswith(prefix))


def _cpu_per_request(row: dict[str, Any] | None) -> float | None:
    cpu = (row or {}).get("cpu_ms_per_request") or {}
    return round(sum(cpu.values()) / 1000.0, 2) if cpu else None


def side_by_side(docs: dict[str, dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """The targets and what explains them, one row per measure with a value per system."""
    tok = [_target(d, "tokens/s") for d in docs.values()]
    ttft = [_target(d, "worst minute") for d in docs.values()]
    rss = [_target(d, "steepest") for d in docs.values()]
    win = next(iter(docs.values()))["windows"]
    rows = [d["per_minute"] for d in docs.values()]
    return [
        ("requests", [d["requests"] for d in docs.values()]),
        (f"tokens/s, first {win['window_min']} min", [t["first"] for t in tok]),
        (f"tokens/s, last {win['window_min']} min", [t["last"] for t in tok]),
        ("tokens/s last / first (>= 0.95)", [t["value"] for t in tok]),
        ("TTFT p99 of minute 0 (ms)", [t["first_ms"] for t in ttft]),
        ("TTFT p99 of the worst minute (ms)", [t["worst_ms"] for t in ttft]),
        ("TTFT p99 worst / first (<= 2)", [t["value"] for t in ttft]),
        (
            f"steepest RSS slope after min {win['settle_min']} (MB/min)",
            [None if t["value"] is None else f"{t['value']:+.2f} ({t['process']})" for t in rss],
        ),
        ("failed requests", [_target(d, "failed")["value"] for d in docs.values()]),
        ("CPU s per request, minute 0", [_cpu_per_request(r[0] if r else None) for r in rows]),
        ("CPU s per request, last minute", [_cpu_per_request(r[-1] if r else None) for r in rows]),
        ("CPU % of one core, mean", [round(sum(d["cpu_percent_mean"].values()), 1) for d in docs.values()]),
    ]


def print_side_by_side(docs: dict[str, dict[str, Any]]) -> None:
    """Each system's targets in a column, then every process's RSS slope."""
    first = next(iter(docs.values()))
    print(f"\nSide by side: the same client and load ({first['config']['load']}, "
          f"{first['config']['minutes']:g} min), one system after the other")  # fmt: skip
    print(f"{'':<44}" + "".join(f"{name:>22}" for name in docs))
    for label, values in side_by_side(docs):
        print(f"{label:<44}" + "".join(f"{'-' if v is None else v!s:>22}" for v in values))
    for name, doc in docs.items():
        slopes = sorted(doc["rss_slope_mb_per_min"].items())
        txt = ", ".join(f"{k} {v:+.2f}" if v is not None else f"{k} -" for k, v in slopes)
        print(f"RSS slopes of {name} (MB/min): {txt}")
