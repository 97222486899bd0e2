"""bench/disagg's pieces: the long-prompt workload, the systems compared, the percentiles."""

from __future__ import annotations

import pytest

from bench.disagg.__main__ import long_prompt_workload, pct, systems


def test_long_prompt_workload_has_unrelated_prompts_of_the_asked_length() -> None:
    w = long_prompt_workload(20, rate=4.0, prompt_tokens=300, output_tokens=7, salt="t")
    assert [len(it.prompt) for it in w.items] == [300] * 20
    assert {it.max_tokens for it in w.items} == {7}
    # No two prompts share their first block (no prefix a cache could reuse across requests).
    assert len({tuple(it.prompt[:64]) for it in w.items}) == 20
    assert all(a.at <= b.at for a, b in zip(w.items, w.items[1:], strict=False))
    assert long_prompt_workload(20, 4.0, 300, 7, "t").items == w.items  # deterministic per salt


def test_systems_keep_the_worker_total() -> None:
    names = [s[0] for s in systems(4, [(1, 3), (2, 2)], dynamo=True)]
    assert names == ["aggregated 4", "disagg 1:3", "dynamo disagg 1:3", "disagg 2:2", "dynamo disagg 2:2"]
    assert systems(4, [(1, 3)], dynamo=False)[1][2] == ["--prefill-workers", "1", "--decode-workers", "3"]
    with pytest.raises(SystemExit):
        systems(4, [(1, 2)], dynamo=False)


def test_nearest_rank_percentiles() -> None:
    xs = [float(i) for i in range(1, 11)]
    assert (pct(xs, 0.5), pct(xs, 0.9), pct(xs, 0.99)) == (5.0, 9.0, 10.0)
    assert pct([], 0.5) is None
