"""`ferry up`'s worker supervisor: a worker that exits is started again under its name, ever more slowly while it
keeps dying soon after it started, at once again after it ran a while; one that never gets ready is killed."""

from __future__ import annotations

import asyncio
from typing import Any

from launch.supervise import FIRST_DELAY_S, MAX_DELAY_S, STABLE_S, WorkerSupervisor


class FakeProc:
    def __init__(self) -> None:
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return await self.exited


class FakeChild:
    """A worker process: exits when the test says, gets ready (or not) as the test says."""

    def __init__(self, name: str, ready: bool = True) -> None:
        self.name = name
        self.proc = FakeProc()
        self.ready = ready
        self.killed = False

    async def wait_for_line(self, predicate: Any, timeout_s: float) -> str:
        if not self.ready:
            raise TimeoutError(f"{self.name} was not ready after {timeout_s:.0f}s")
        return "ferry-worker-ready"

    def kill(self) -> None:
        self.killed = True
        if not self.proc.exited.done():
            self.proc.exited.set_result(-9)


async def test_a_crash_loop_backs_off_and_a_stable_worker_restarts_at_once() -> None:
    now = [0.0]
    delays: list[float] = []
    spawned: list[FakeChild] = []
    step = asyncio.Event()

    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    async def spawn(name: str) -> Any:
        child = FakeChild(name)
        spawned.append(child)
        step.set()
        return child

    workers: list[Any] = [FakeChild("worker-0")]
    sup = WorkerSupervisor(workers, spawn, 5.0, clock=lambda: now[0], sleep=sleep)
    task = asyncio.create_task(sup.run())

    async def dies(after_s: float) -> None:
        now[0] += after_s
        step.clear()
        workers[0].proc.exited.set_result(1)
        await step.wait()

    try:
        for _ in range(7):  # dies a second after every start
            await dies(1.0)
        await dies(STABLE_S)  # then ran a while before it died
        assert delays == [FIRST_DELAY_S, 2.0, 4.0, 8.0, 16.0, MAX_DELAY_S, MAX_DELAY_S, FIRST_DELAY_S]
        assert [c.name for c in spawned] == ["worker-0"] * 8 and workers[0] is spawned[-1]
        assert sup.restarts == 8
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_restart_that_never_gets_ready_is_killed_and_tried_again() -> None:
    spawned: list[FakeChild] = []
    ready_again = asyncio.Event()

    async def sleep(seconds: float) -> None:
        pass

    async def spawn(name: str) -> Any:
        child = FakeChild(name, ready=bool(spawned))  # the first restart hangs before its ready line
        spawned.append(child)
        if child.ready:
            ready_again.set()
        return child

    first = FakeChild("decode-1")
    workers: list[Any] = [first]
    task = asyncio.create_task(WorkerSupervisor(workers, spawn, 5.0, sleep=sleep).run())
    try:
        first.proc.exited.set_result(1)
        await asyncio.wait_for(ready_again.wait(), 5)
        assert spawned[0].killed and not spawned[1].killed
        assert workers == [spawned[1]]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
