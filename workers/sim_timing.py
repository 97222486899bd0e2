"""Step timing of the simulated engine: NVIDIA Dynamo's published mocker model, and the pacing of its steps.

Kept identical to Dynamo's so routing benchmarks against its mocker compare on equal terms.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


def prefill_ms(new_tokens: int) -> float:
    """Milliseconds to prefill `new_tokens` prompt tokens in one step (0 when there are none)."""
    if new_tokens <= 0:
        return 0.0
    t = float(new_tokens)
    return 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142


def decode_ms(kv_fraction: float) -> float:
    """Milliseconds for one decode step when the decoding sequences fill `kv_fraction` of the KV cache."""
    p = kv_fraction
    return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)


def step_seconds(
    prefill_tokens: int,
    decode_context_tokens: int,
    decoding_seqs: int,
    kv_capacity_tokens: int,
    speedup: float = 1.0,
) -> float:
    """Wall time of one engine step: (prefill + decode) / speedup, in seconds."""
    total = prefill_ms(prefill_tokens)
    if decoding_seqs > 0:
        total += decode_ms(decode_context_tokens / kv_capacity_tokens)
    return total / speedup / 1000.0


# How much of the last sleep's lateness the next step makes up: the event loop's whole-millisecond timers and
# short waits for the loop, not a stall (an engine held up for long does not run its next steps faster).
CATCH_UP_S = 0.002


class StepPacer:
    """Makes each simulated step last its modelled time, the engine's own work in it included (as Dynamo's mocker
    sleeps out the rest of each iteration), so the steps' wall times add up to the model's."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._clock = clock
        self._sleep = sleep
        self._spent = 0.0  # the engine's own work since its last sleep ended, seconds
        self._since: float | None = None  # when the work in progress began
        self._late = 0.0  # how much longer than asked the last sleep took

    def working(self) -> None:
        """The engine's own work begins (or resumes after a wait that is not step time)."""
        if self._since is None:
            self._since = self._clock()

    def waiting(self) -> None:
        """The engine waits on something outside its step (room for outputs): not step time."""
        if self._since is not None:
            self._spent += self._clock() - self._since
            self._since = None

    def idle(self) -> None:
        """Nothing to step: the next step starts afresh."""
        self._since = None
        self._spent = self._late = 0.0

    async def step(self, seconds: float) -> None:
        """Sleep out what is left of a step of `seconds`; yields to the event loop even when nothing is."""
        self.waiting()
        delay = max(0.0, seconds - self._spent - min(self._late, CATCH_UP_S))
        start = self._clock()
        await self._sleep(delay)
        now = self._clock()
        self._late = max(0.0, now - start - delay)
        self._spent = 0.0
        self._since = now
