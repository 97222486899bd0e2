"""The canary on the real vLLM engine: a one-token probe answers in time; with vLLM's EngineCore process
stopped (SIGSTOP: alive, so vLLM's own check_health passes, but stepping nothing) the probe fails with
CanaryFailed within its deadline; once the process runs again the engine answers again."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import TYPE_CHECKING

import psutil
import pytest

from schemas.settings import DEFAULT_MODEL_NAME as BASE
from workers.canary import Canary, CanaryFailed

if TYPE_CHECKING:
    from workers.vllm_engine import VLLMEngine

pytestmark = pytest.mark.vllm


def _engine_core() -> int:
    """The pid of this process's vLLM EngineCore child (the session engine's)."""
    kids = psutil.Process().children()
    cores = [p.pid for p in kids if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]
    assert len(cores) == 1, f"expected one EngineCore child, found {kids}"
    return cores[0]


async def test_the_canary_answers_and_catches_a_stopped_engine_core(vllm_engine: VLLMEngine) -> None:
    idle = asyncio.Event()
    idle.set()
    canary = Canary(vllm_engine, BASE, "vllm-canary", idle, lambda: 0.0, wait_s=0, timeout_s=30)
    await canary.probe()
    assert canary.sent == 1 and 0 < canary.last_seconds < 30
    core = _engine_core()
    os.kill(core, signal.SIGSTOP)
    try:
        await vllm_engine.check_health()  # the process lives: vLLM's own check cannot tell
        canary.timeout_s = 2.0
        with pytest.raises(CanaryFailed, match="within 2s"):
            await canary.probe()
    finally:
        os.kill(core, signal.SIGCONT)
    canary.timeout_s = 30
    await canary.probe()  # the aborted probe left nothing behind: the engine answers again
    assert canary.sent == 3
