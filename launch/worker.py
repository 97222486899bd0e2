"""`ferry worker`: one worker process."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence

import uvloop

from launch.flags import load
from schemas.settings import WorkerSettings
from workers.engine_choice import build_engine
from workers.worker import Worker


async def _amain(settings: WorkerSettings) -> int:
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.set)
    worker = Worker(settings, build_engine(settings), settings.engine)
    return await worker.run(shutdown)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and FERRY_* variables, then run one worker until SIGTERM/SIGINT."""
    settings = load(WorkerSettings, argv, prog="ferry worker")
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    return uvloop.run(_amain(settings))
