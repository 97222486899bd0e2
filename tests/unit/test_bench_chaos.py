"""bench.chaos's own workers: set as `ferry up` sets the workers of its embedded broker."""

from __future__ import annotations

from bench.chaos.__main__ import worker_argv
from launch.flags import load_with_engine_flags
from launch.stack import EMBEDDED_BROKER_DEFAULTS
from schemas.settings import WorkerSettings


def test_chaos_workers_read_the_topics_the_stacks_frontend_writes() -> None:
    # Without the stack's request roll they read the unrolled topic, where its frontend writes nothing: every
    # request routed to them waited for the delivery check and moved on (bench.chaos missed its target).
    argv = worker_argv("chaos-0", "127.0.0.1:1", "redis://127.0.0.1:2/0", 20.0)
    settings, _ = load_with_engine_flags(WorkerSettings, argv[argv.index("worker") + 1 :], prog="ferry worker")
    for name, value in EMBEDDED_BROKER_DEFAULTS.items():
        assert getattr(settings, name) == value, name
