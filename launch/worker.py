"""`ferry worker`: one worker process."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

import uvloop

from launch.flags import load_with_engine_flags
from launch.gc_tune import settle_gc
from launch.log_setup import setup_logging
from launch.model_prepare import ModelPrepareError
from launch.model_source import resolve_model
from schemas.settings import WorkerSettings
from workers.engine import Engine
from workers.engine_choice import build_engine
from workers.worker import Worker


async def _amain(settings: WorkerSettings, engine: Engine) -> int:
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.set)
    worker = Worker(settings, engine, settings.engine)
    return await worker.run(shutdown)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, vLLM engine flags and FERRY_* variables, then run one worker until SIGTERM/SIGINT."""
    settings, engine_flags = load_with_engine_flags(WorkerSettings, argv, prog="ferry worker")
    setup_logging(settings.log_level)
    try:
        # Before anything connects: a --model that is no model, a flag vLLM does not know, or one Ferry
        # owns, is refused here.
        settings = resolve_model(settings)
        engine = build_engine(settings, engine_flags)
    except (ValueError, ModelPrepareError) as e:
        print(f"ferry worker: error: {e}", file=sys.stderr)
        return 2
    settle_gc()  # the engine and its model files are loaded
    return uvloop.run(_amain(settings, engine))
