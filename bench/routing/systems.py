"""The systems a routing benchmark compares: Ferry under each router policy, and Dynamo's frontend with its
mocker workers, all with the same engine knobs."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from bench.peers import dynamo
from bench.stack import FerryStack, machine_busy_seconds, process_cpu_seconds

# Ferry's router policies as (system name, `ferry up` flags). A policy is run when `ferry up --help`
# accepts its flags, so a new policy needs only a line here.
FERRY_POLICIES: list[tuple[str, list[str]]] = [
    ("ferry kv", ["--router-policy", "kv", "--kv-events"]),
    ("ferry kv-index-only", ["--router-policy", "kv", "--kv-events", "--no-inflight-overlap"]),
    ("ferry kv-sequences", ["--router-policy", "kv", "--kv-events", "--decode-load", "sequences"]),
    # Cached prefixes read from the index in Redis (one round trip per route), not the frontend's mirror.
    ("ferry kv-redis", ["--router-policy", "kv", "--kv-events", "--kv-lookup", "redis"]),
    ("ferry kv-approx", ["--router-policy", "kv", "--no-kv-events"]),
    # Prefill work (queued and new) weighed 2x / 4x against decode load: TTFT is prefill wait.
    ("ferry kv-w2", ["--router-policy", "kv", "--kv-events", "--overlap-weight", "2"]),
    ("ferry kv-w4", ["--router-policy", "kv", "--kv-events", "--overlap-weight", "4"]),
    ("ferry round_robin", ["--router-policy", "round_robin"]),
    ("ferry random", ["--router-policy", "random"]),
    ("ferry least_loaded", ["--router-policy", "least_loaded"]),
]

# Dynamo's router modes as (system name, `dynamo.frontend` flags).
DYNAMO_MODES: list[tuple[str, list[str]]] = [
    ("dynamo kv", ["--router-mode", "kv"]),
    ("dynamo kv-approx", ["--router-mode", "kv", "--no-router-kv-events"]),
    ("dynamo round_robin", ["--router-mode", "round-robin"]),
]
DEFAULT_DYNAMO = ("dynamo kv",)


@dataclass(frozen=True)
class EngineKnobs:
    """Engine settings given identically to both systems."""

    workers: int = 8
    block_size: int = 64
    num_blocks: int = 4096  # KV blocks per worker
    speedup: float = 0.1  # simulated step time is divided by this
    # Ferry's sim defaults, not flags of `ferry up`; passed explicitly to Dynamo's mocker.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192  # the model's (config.json); Ferry reads it from there

    def ferry_flags(self) -> list[str]:
        """`ferry up` flags."""
        return ["--block-size", str(self.block_size), "--num-blocks", str(self.num_blocks)]


@dataclass(frozen=True)
class SystemSpec:
    """One system under test."""

    name: str
    kind: Literal["ferry", "dynamo"]
    flags: tuple[str, ...]

    @property
    def extra_body(self) -> dict[str, Any] | None:
        """Request fields beyond the common ones: Dynamo names the serving worker only when asked."""
        return {"nvext": {"extra_fields": ["worker_id"]}} if self.kind == "dynamo" else None


def ferry_accepted_flags(python: str = sys.executable, cwd: Path | None = None) -> tuple[set[str], set[str]]:
    """The router policies and the flags `ferry up --help` lists."""
    out = subprocess.run(
        [python, "-m", "launch", "up", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        check=True,
    ).stdout
    m = re.search(r"--router-policy \{([^}]*)\}", out)
    policies = set(m.group(1).split(",")) if m else set()
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", out))
    return policies, flags


def available_systems(cwd: Path | None = None) -> tuple[list[SystemSpec], list[SystemSpec]]:
    """(every system this checkout can run, the default selection)."""
    policies, flags = ferry_accepted_flags(cwd=cwd)
    systems: list[SystemSpec] = []
    for name, argv in FERRY_POLICIES:
        policy = argv[argv.index("--router-policy") + 1]
        if policy in policies and all(a in flags for a in argv if a.startswith("--")):
            systems.append(SystemSpec(name, "ferry", tuple(argv)))
    ferry = list(systems)
    dyn = [SystemSpec(name, "dynamo", tuple(argv)) for name, argv in DYNAMO_MODES]
    default = ferry + [s for s in dyn if s.name in DEFAULT_DYNAMO]
    return ferry + dyn, default


class Running(Protocol):
    """A started system."""

    host: str
    port: int

    @property
    def pids(self) -> dict[str, int]:
        """Process ids by role."""
        ...

    async def stop(self) -> None:
        """Stop every process of the system."""
        ...


@dataclass
class _FerryRunning:
    stack: FerryStack
    host: str = ""
    port: int = 0

    def __post_init__(self) -> None:
        self.host, self.port = self.stack.host, self.stack.port

    @property
    def pids(self) -> dict[str, int]:
        return {"launcher": self.stack.child.proc.pid, **self.stack.pids}

    async def stop(self) -> None:
        await self.stack.stop()


async def start(
    spec: SystemSpec, knobs: EngineKnobs, model_path: str, model_name: str, dynamo_venv: Path | None = None
) -> tuple[Running, dict[str, Any]]:
    """Start `spec` and return it with the exact commands it runs."""
    if spec.kind == "ferry":
        extra = [
            *knobs.ferry_flags(),
            "--model-path",
            model_path,
            "--served-model-name",
            model_name,
            *spec.flags,
        ]
        stack = await FerryStack.start(knobs.workers, knobs.speedup, extra=extra)
        argv = [
            "ferry", "up", "--workers", str(knobs.workers), "--speedup", repr(knobs.speedup), *extra,
        ]  # fmt: skip
        return _FerryRunning(stack), {"ferry_up": argv}
    stack_d = await dynamo.DynamoStack.start(
        model_path=model_path,
        model_name=model_name,
        workers=knobs.workers,
        speedup=knobs.speedup,
        block_size=knobs.block_size,
        num_blocks=knobs.num_blocks,
        max_num_seqs=knobs.max_num_seqs,
        max_num_batched_tokens=knobs.max_num_batched_tokens,
        max_model_len=knobs.max_model_len,
        router_args=list(spec.flags),
        venv=dynamo_venv,
    )
    env = {k: v for k, v in stack_d.env.items() if k != "DYN_FILE_KV"}
    commands = {k: ["python", *argv[1:]] for k, argv in stack_d.argv.items()}
    return stack_d, {"env": {**env, "DYN_FILE_KV": "<fresh temporary directory>"}, **commands}


@dataclass
class CpuMeter:
    """CPU seconds used by a system's processes and by the machine, between `start()` and `stop()`."""

    pids: dict[str, int]
    _t0: float = 0.0
    _procs0: dict[str, float] = field(default_factory=dict)
    _machine0: float = 0.0

    def start(self) -> None:
        """Take the first reading."""
        self._t0 = time.perf_counter()
        self._procs0 = {k: process_cpu_seconds(p) or 0.0 for k, p in self.pids.items()}
        self._machine0 = machine_busy_seconds()

    def stop(self) -> dict[str, float]:
        """Percent of one core used since `start()`: the system's processes together, and the machine."""
        wall = max(time.perf_counter() - self._t0, 1e-9)
        used = sum((process_cpu_seconds(p) or 0.0) - self._procs0.get(k, 0.0) for k, p in self.pids.items())
        machine = machine_busy_seconds() - self._machine0
        return {"system_pct": round(100 * used / wall, 1), "machine_pct": round(100 * machine / wall, 1)}
