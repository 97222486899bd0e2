"""The simulated engine's step timing matches Dynamo's published mocker model, and its steps last that time."""

from __future__ import annotations

import pytest

from workers.sim_timing import CATCH_UP_S, StepPacer, decode_ms, prefill_ms, step_seconds


def test_prefill_formula_at_known_points() -> None:
    assert prefill_ms(0) == 0.0
    assert prefill_ms(1) == pytest.approx(4.209989e-7 + 1.518344e-2 + 16.50142)
    assert prefill_ms(1000) == pytest.approx(0.4209989 + 15.18344 + 16.50142)
    assert prefill_ms(8192) == pytest.approx(4.209989e-7 * 8192**2 + 1.518344e-2 * 8192 + 16.50142)


def test_decode_formula_and_floor() -> None:
    assert decode_ms(0.0) == pytest.approx(5.74)
    assert decode_ms(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert decode_ms(1.0) == pytest.approx(-25.74 + 54.01 + 5.74)
    # The parabola goes negative past p ~ 2.2; the model floors it at 1 ms.
    assert decode_ms(2.5) == 1.0


def test_step_time_sums_parts_and_divides_by_speedup() -> None:
    capacity = 16384 * 64
    assert step_seconds(0, 0, 0, capacity) == 0.0
    assert step_seconds(500, 0, 0, capacity) == pytest.approx(prefill_ms(500) / 1000)
    decode_only = step_seconds(0, capacity // 4, 8, capacity)
    assert decode_only == pytest.approx(decode_ms(0.25) / 1000)
    both = step_seconds(500, capacity // 4, 8, capacity, speedup=10.0)
    assert both == pytest.approx((prefill_ms(500) + decode_ms(0.25)) / 10 / 1000)


class _FakeTime:
    """A clock that moves only when told: by the engine's "work" and by sleeps (plus how late they end)."""

    def __init__(self, lateness: float = 0.0) -> None:
        self.now = 100.0
        self.lateness = lateness
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds + self.lateness


async def test_a_step_lasts_its_modelled_time_with_the_engines_own_work_in_it() -> None:
    t = _FakeTime()
    pacer = StepPacer(clock=t.clock, sleep=t.sleep)
    pacer.working()
    t.now += 0.003  # scheduling the first step
    await pacer.step(0.030)
    start = t.now
    t.now += 0.004  # handing out its outputs
    pacer.waiting()
    t.now += 0.050  # waiting for room for outputs: not step time
    pacer.working()
    t.now += 0.001  # scheduling the next step
    await pacer.step(0.030)
    assert t.slept == pytest.approx([0.027, 0.025])
    assert t.now - start == pytest.approx(0.030 + 0.050)


async def test_late_wake_ups_are_made_up_to_a_bound_and_idle_time_resets_the_debt() -> None:
    t = _FakeTime(lateness=0.0005)  # every sleep ends half a millisecond late, as whole-ms timers do
    pacer = StepPacer(clock=t.clock, sleep=t.sleep)
    pacer.working()
    for _ in range(5):
        await pacer.step(0.0348)
    # The first sleep is asked for the whole step, each later one for the step less the last lateness,
    # so the steps average the modelled time.
    assert t.slept == pytest.approx([0.0348] + [0.0343] * 4)
    t.lateness = 0.100  # a stall: at most CATCH_UP_S of it is made up
    await pacer.step(0.0348)
    await pacer.step(0.0348)
    assert t.slept[-1] == pytest.approx(0.0348 - CATCH_UP_S)
    pacer.idle()
    pacer.working()
    await pacer.step(0.0348)
    assert t.slept[-1] == pytest.approx(0.0348)


async def test_work_longer_than_the_step_still_yields_to_the_event_loop() -> None:
    t = _FakeTime()
    pacer = StepPacer(clock=t.clock, sleep=t.sleep)
    pacer.working()
    t.now += 0.010
    await pacer.step(0.000007)  # a step at --speedup 1000 is shorter than the engine's own work
    assert t.slept == [0.0]
