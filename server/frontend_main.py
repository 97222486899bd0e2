"""`ferry frontend`: one frontend process on uvicorn with uvloop."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import uvicorn

from schemas.settings import FrontendSettings, load
from server.app import create_app


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and FERRY_* variables, then serve HTTP until SIGTERM/SIGINT."""
    settings = load(FrontendSettings, argv, prog="ferry frontend")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    uvicorn.run(
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
    return 0
