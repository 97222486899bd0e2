"""Drain during a pool-group join: a worker told to stop while its batch pool consumer is still joining its
model's group exits 0 within a bound, even when the join itself cannot end soon.

The join cannot end while a member the broker still counts has not rejoined: here that member is a plain
consumer of the group with a long session timeout, frozen with SIGSTOP (a busy or stuck worker elsewhere).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid
from pathlib import Path

import pytest

from bus.topics import ensure_topics
from launch.services import Child
from schemas.names import pool_group, pool_topic
from tests.harness import worker_process
from tests.integration.test_batch_api import model_name

pytestmark = pytest.mark.integration

# The frozen member holds the join until its session timeout drops it (the broker, Tansu, also takes half of
# it for the member's own first join); a worker's JoinGroup gives up after aiokafka's 40 s request timeout.
FROZEN_SESSION_MS = 24_000
# How long a drain gives the join (the worker's pool session timeout, shortened here) ...
POOL_SESSION_S = 3.0
# ... plus the rest of the exit: well below the frozen member's session, counted from its freeze.
EXIT_BOUND_S = 10.0

# A group member that joins, says so, and is then frozen by the test (so it never rejoins).
MEMBER = """
import asyncio, sys
from aiokafka import AIOKafkaConsumer
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

async def main(kafka, group, topic, session_ms):
    c = AIOKafkaConsumer(topic, bootstrap_servers=kafka, group_id=group, enable_auto_commit=False,
                         session_timeout_ms=session_ms, rebalance_timeout_ms=session_ms,
                         heartbeat_interval_ms=1000, partition_assignment_strategy=(RangePartitionAssignor,))
    await c.start()
    while not c.assignment():
        await c.getmany(timeout_ms=100)
    print("member-joined", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


async def test_sigterm_while_the_pool_group_join_cannot_end_exits_0(
    kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    model = model_name()
    group, topic = pool_group(model), pool_topic(model)
    await ensure_topics(kafka, {topic: 16})
    member = await Child.spawn(
        "member", [sys.executable, "-c", MEMBER, kafka, group, topic, str(FROZEN_SESSION_MS)], echo=False
    )
    worker: Child | None = None
    try:
        await member.wait_for_line(lambda line: line == "member-joined", 60)
        member.proc.send_signal(signal.SIGSTOP)
        wid = f"w-join-{uuid.uuid4().hex[:6]}"
        worker = await worker_process(
            wid, kafka, redis_url, prefix, model_path, "--served-model-name", model, "--log-level", "info",
            "--pool-session-timeout-s", str(POOL_SESSION_S),
        )
        # Ready means subscribed, not joined: the join starts in the consumer's background and cannot end
        # before the frozen member's session does. The broker reports no group state to wait on (Tansu answers
        # DescribeGroups with "Unknown"), so the signal comes 2 s into the join, as in the case reported.
        await asyncio.sleep(2.0)
        worker.proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(worker.proc.wait(), EXIT_BOUND_S)
        except TimeoutError:
            raise AssertionError(
                f"the worker did not exit within {EXIT_BOUND_S:.0f}s of SIGTERM; last output:\n"
                + "\n".join(worker.tail[-20:])
            ) from None
        assert code == 0, "\n".join(worker.tail[-20:])
        # The case under test: the join was still held when the drain gave up on it.
        assert any("join did not end within" in line for line in worker.tail), "\n".join(worker.tail[-20:])
    finally:
        member.kill()
        await member.stop()
        if worker is not None:
            await worker.stop()
