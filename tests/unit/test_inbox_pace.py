"""A busy worker's inbox fetches less often: its fetch wait follows the engine's step."""

from __future__ import annotations

from types import SimpleNamespace

from bus.log_watch import FetchWaitAdjuster
from workers.inbox import busy_wait_cap_ms, fetch_wait_ms


def test_the_wait_is_the_base_while_idle_and_half_a_step_while_busy_within_the_cap() -> None:
    assert fetch_wait_ms(5, 50, busy=False, step_s=0.2) == 5
    assert fetch_wait_ms(5, 50, busy=True, step_s=0.2) == 50  # the cap
    assert fetch_wait_ms(5, 50, busy=True, step_s=0.04) == 20
    assert fetch_wait_ms(5, 50, busy=True, step_s=0.001) == 5  # never below the base
    assert fetch_wait_ms(5, 50, busy=True, step_s=0.0) == 5  # no step measured yet
    assert fetch_wait_ms(5, 0, busy=True, step_s=0.2) == 5  # off
    assert fetch_wait_ms(100, 50, busy=True, step_s=0.2) == 100  # a base above the cap wins


def test_a_decode_worker_does_not_pace_its_inbox() -> None:
    assert busy_wait_cap_ms("decode", 50) == 0
    assert fetch_wait_ms(5, busy_wait_cap_ms("decode", 50), busy=True, step_s=0.04) == 5
    assert busy_wait_cap_ms("prefill", 50) == busy_wait_cap_ms("both", 50) == 50


def fake_consumer(wait_ms: int) -> SimpleNamespace:
    return SimpleNamespace(
        _fetcher=SimpleNamespace(_fetch_max_wait_ms=wait_ms), assignment=lambda: [], paused=lambda: set()
    )


async def test_a_new_base_applies_at_once_unless_the_reader_is_stretched_then_after() -> None:
    consumer = fake_consumer(5)
    stretch = FetchWaitAdjuster(consumer, "test")  # type: ignore[arg-type]
    stretch.set_base(30)
    assert consumer._fetcher._fetch_max_wait_ms == 30
    # Stretched for a lagging log: the stretch holds until the reader caught up, then the new base.
    stretch.stretched = True
    consumer._fetcher._fetch_max_wait_ms = 500
    stretch.set_base(40)
    assert consumer._fetcher._fetch_max_wait_ms == 500
    await stretch.after_poll(False)  # nothing assigned lags: caught up
    assert not stretch.stretched and consumer._fetcher._fetch_max_wait_ms == 40

