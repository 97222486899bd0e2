"""`ferry frontend`: one frontend process on uvicorn with uvloop."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

import uvicorn

from schemas.settings import FrontendSettings, load
from server.app import create_app

READY_MARK = "ferry-frontend-ready"


class ReadyServer(uvicorn.Server):
    """uvicorn with an awaitable 'socket is bound' event (its own startup log comes before binding)."""

    def __init__(self, config: uvicorn.Config, announce: bool = False) -> None:
        super().__init__(config)
        self.bound = asyncio.Event()
        self._announce = announce

    async def startup(self, sockets: Any = None) -> None:
        """Start as uvicorn does, then signal that connections are accepted."""
        await super().startup(sockets)
        self.bound.set()
        if self._announce and not self.should_exit:
            # A line for launchers to wait on, printed whatever the log level.
            print(f"{READY_MARK} http://{self.config.host}:{self.config.port}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and FERRY_* variables, then serve HTTP until SIGTERM/SIGINT."""
    settings = load(FrontendSettings, argv, prog="ferry frontend")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level,
        access_log=False,
        # Open streams get this long to finish after SIGTERM.
        timeout_graceful_shutdown=30,
    )
    ReadyServer(config, announce=True).run()
    return 0
