"""The simulated engine's step timing matches Dynamo's published mocker model."""

from __future__ import annotations

import pytest

from workers.sim_timing import decode_ms, prefill_ms, step_seconds


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
