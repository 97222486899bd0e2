"""The environment a vLLM EngineCore on a CPU host starts with (no vLLM import here: benchmarks read it too)."""

from __future__ import annotations

import os

# Set for the EngineCore the worker spawns, each variable unless the operator set it.
CPU_ENGINE_ENV = {
    # The model runs eagerly on CPU anyway (enforce_eager), but vLLM's sampler compiles a small op with inductor
    # the first time a request asks for logprobs: on a busy 2-core host that one compile stalled the engine for
    # 8-230 s, long enough for the canary to take the worker for hung. Eager, the op takes milliseconds.
    "TORCHDYNAMO_DISABLE": "1",
    # OpenMP threads that reach the end of a parallel region sleep at once instead of spinning ~3 ms for the
    # next one (libgomp's default). A worker shares its cores with its own Python and often with a broker and a
    # frontend: spinning threads take their CPU, and a thread preempted by them holds its peers at every
    # barrier of every layer (docs/benchmarks.md, "The engine's environment").
    "OMP_WAIT_POLICY": "PASSIVE",
}


def cpu_engine_env() -> None:
    """On CPU, set CPU_ENGINE_ENV for the EngineCore this process spawns, and dynamo's switch for its own.

    A spawned EngineCore reads the variables as it starts (libgomp reads OMP_WAIT_POLICY when it loads), so
    this runs before vLLM starts its engine.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for name, value in CPU_ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    import torch._dynamo

    torch._dynamo.config.disable = os.environ["TORCHDYNAMO_DISABLE"] == "1"
