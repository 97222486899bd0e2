"""`ferry frontend`: one frontend process on uvicorn with uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Generator, Sequence
from types import FrameType
from typing import Any

import uvicorn

from launch.flags import load
from launch.gc_tune import settle_gc
from launch.log_setup import setup_logging
from launch.model_prepare import ModelPrepareError
from launch.model_source import resolve_model
from schemas.settings import FrontendSettings
from server.app import create_app
from server.tenants import TenantsError

READY_MARK = "ferry-frontend-ready"


class ReadyServer(uvicorn.Server):
    """uvicorn with an awaitable 'socket is bound' event (its own startup log comes before binding)."""

    def __init__(
        self, config: uvicorn.Config, announce: bool = False, on_exit: Callable[[], None] | None = None
    ) -> None:
        super().__init__(config)
        self.bound = asyncio.Event()
        self._announce = announce
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM/SIGINT: tell the app first (it refuses new work), then let uvicorn drain."""
        if self._on_exit is not None:
            self._on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """As uvicorn, but a drain that completed after SIGTERM/SIGINT exits 0 instead of re-raising it."""
        with super().capture_signals():
            yield
            # Reached only when serving ended normally, i.e. the drain finished: a clean exit.
            self._captured_signals.clear()

    async def startup(self, sockets: Any = None) -> None:
        """Start as uvicorn does, then signal that connections are accepted."""
        await super().startup(sockets)
        settle_gc()  # the app's lifespan startup is done: the tokenizer, templates and router are built
        self.bound.set()
        if self._announce and not self.should_exit:
            # A line for launchers to wait on, printed whatever the log level.
            print(f"{READY_MARK} http://{self.config.host}:{self.config.port}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and FERRY_* variables, then serve HTTP until SIGTERM/SIGINT."""
    settings = load(FrontendSettings, argv, prog="ferry frontend")
    setup_logging(settings.log_level)
    try:
        app = create_app(resolve_model(settings))
    except (TenantsError, ModelPrepareError) as exc:
        raise SystemExit(f"ferry frontend: {exc}") from None
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level,
        access_log=False,
        # Open streams get this long to finish after SIGTERM.
        timeout_graceful_shutdown=30,
    )

    def drain() -> None:
        # uvicorn stops listening at once; a request that still reaches the app gets 503 shutting_down.
        app.state.gate.draining = True

    ReadyServer(config, announce=True, on_exit=drain).run()
    return 0
