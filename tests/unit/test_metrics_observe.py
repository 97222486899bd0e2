"""observe_times: n observations of one value at the cost of one, exactly as `observe` called n times."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from server.metrics import observe_times

BUCKETS = (0.001, 0.005, 0.01, 0.1)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value
        for metric in registry.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize("value", [0.0, 0.001, 0.0011, 0.0999, 0.1, 7.5])
def test_observe_times_matches_observe_called_n_times(value: float) -> None:
    # Values on a bucket's bound, just past it, and past the last bound (+Inf) land where observe puts them.
    ra, rb = CollectorRegistry(), CollectorRegistry()
    ha = Histogram("gap", "g", ["m"], buckets=BUCKETS, registry=ra)
    hb = Histogram("gap", "g", ["m"], buckets=BUCKETS, registry=rb)
    for _ in range(5):
        ha.labels("x").observe(value)
    ha.labels("x").observe(0.003)
    observe_times(hb.labels("x"), value, 5)
    observe_times(hb.labels("x"), 0.003, 1)
    a, b = _samples(ra), _samples(rb)
    assert a.keys() == b.keys()
    for key, count in a.items():
        # The sum of five additions and one product of the same value may differ in the last bit.
        assert b[key] == pytest.approx(count, rel=1e-12), key
