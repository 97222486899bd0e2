"""bench/disagg's pieces: the long-prompt workload, the systems compared, the percentiles."""

from __future__ import annotations

import argparse

import pytest

from bench.disagg.__main__ import dynamo_knobs, ferry_flags, long_prompt_workload, pct, summary, systems
from bench.disagg.flow import decode_flow, decoding_at_once, first_token_cv
from bench.disagg.tiers import bounds, gap_closed, host_tier_verdicts
from bench.disagg.versus import versus_dynamo, versus_table
from bench.routing.client import ReplayResult, RequestResult


def test_long_prompt_workload_has_unrelated_prompts_of_the_asked_length() -> None:
    w = long_prompt_workload(20, rate=4.0, prompt_tokens=300, output_tokens=7, salt="t")
    assert [len(it.prompt) for it in w.items] == [300] * 20
    assert {it.max_tokens for it in w.items} == {7}
    # No two prompts share their first block (no prefix a cache could reuse across requests).
    assert len({tuple(it.prompt[:64]) for it in w.items}) == 20
    assert all(a.at <= b.at for a, b in zip(w.items, w.items[1:], strict=False))
    assert long_prompt_workload(20, 4.0, 300, 7, "t").items == w.items  # deterministic per salt
    # Another salt: other token ids, the same arrival times (systems compared on one arrival pattern).
    other = long_prompt_workload(20, 4.0, 300, 7, "u")
    assert [it.at for it in other.items] == [it.at for it in w.items]
    assert other.items[0].prompt != w.items[0].prompt


def test_systems_keep_the_worker_total() -> None:
    names = [s[0] for s in systems(4, [(1, 3), (2, 2)], dynamo=True)]
    assert names == ["aggregated 4", "disagg 1:3", "dynamo disagg 1:3", "disagg 2:2", "dynamo disagg 2:2"]
    assert systems(4, [(1, 3)], dynamo=False)[1][2] == ["--prefill-workers", "1", "--decode-workers", "3"]
    with pytest.raises(SystemExit):
        systems(4, [(1, 2)], dynamo=False)


def test_every_disaggregated_system_runs_once_per_decode_cap_on_its_decode_pool_only() -> None:
    runs = systems(4, [(3, 1)], dynamo=True, decode_caps=(0, 4))
    assert [r[0] for r in runs] == [
        "aggregated 4", "disagg 3:1", "dynamo disagg 3:1", "disagg 3:1, decode cap 4", "dynamo disagg 3:1, decode cap 4"
    ]  # fmt: skip
    assert runs[1][2] == ["--prefill-workers", "3", "--decode-workers", "1"]
    assert runs[3][2][-2:] == ["--decode-flags", "--max-num-seqs 4"]
    assert runs[2][2] == ["3", "1"]
    assert runs[4][2] == ["3", "1", "--max-num-seqs", "4"]


def test_nearest_rank_percentiles() -> None:
    xs = [float(i) for i in range(1, 11)]
    assert (pct(xs, 0.5), pct(xs, 0.9), pct(xs, 0.99)) == (5.0, 9.0, 10.0)
    assert pct([], 0.5) is None


def test_every_ferry_system_runs_once_per_host_tier_size() -> None:
    runs = systems(4, [(2, 2)], dynamo=True, host_blocks=(0, 512))
    assert [r[0] for r in runs] == [
        "aggregated 4", "aggregated 4, host 512", "disagg 2:2", "disagg 2:2, host 512", "dynamo disagg 2:2"
    ]  # fmt: skip
    assert runs[1][2] == ["--num-host-blocks", "512"]
    assert runs[3][2][-2:] == ["--num-host-blocks", "512"]


def test_gap_closed_is_the_share_of_the_way_to_the_bound() -> None:
    assert gap_closed(0.2, 0.35, 0.5) == pytest.approx(0.5)
    assert gap_closed(0.2, 0.2, 0.5) == 0.0
    assert gap_closed(0.5, 0.5, 0.5) is None  # nothing to close


def test_host_tier_verdicts_pair_each_run_with_its_tierless_twin() -> None:
    def row(base: str, rate: float, h: int, cached: float) -> dict[str, object]:
        return {"base": base, "rate": rate, "host_blocks": h, "cached_fraction": cached, "bound": 0.4,
                "ttft_p90_ms": 100.0 + h}  # fmt: skip

    rows = {
        "a @ 1": row("a", 1.0, 0, 0.1), "a, host 8 @ 1": row("a", 1.0, 8, 0.3),
        "a @ 2": row("a", 2.0, 0, 0.2), "a, host 8 @ 2": row("a", 2.0, 8, 0.25),
    }  # fmt: skip
    v = {x["system"]: x for x in host_tier_verdicts(rows)}
    assert set(v) == {"a, host 8 @ 1", "a, host 8 @ 2"}
    assert v["a, host 8 @ 1"]["gap_closed"] == pytest.approx(2 / 3, abs=1e-3)
    assert v["a, host 8 @ 1"]["target_met"] and not v["a, host 8 @ 2"]["target_met"]
    assert v["a, host 8 @ 1"]["ttft_p90_off_ms"] == 100.0


def test_bounds_grow_with_the_cache_up_to_the_infinite_one() -> None:
    # Two prompts of 4 blocks each, each asked 3 times in turn: one worker with a 4-block LRU cache holds one.
    from bench.workload import TokenBank

    bank = TokenBank(64, "t")
    a, b = bank.prompt(range(0, 4), 256), bank.prompt(range(10, 14), 256)
    b_ = bounds([a, b] * 3, workers=1, device_blocks=4, host_blocks=[4], block_size=64)
    assert b_["lru_4"] == 0.0
    assert b_["lru_8"] == b_["infinite"] == pytest.approx(4 * 3 * 64 / (6 * 256))


def test_both_systems_get_the_same_step_budget() -> None:
    args = argparse.Namespace(
        num_blocks=4096, min_uncached=0, max_num_batched_tokens=512, max_num_seqs=4, speedup=0.2,
        ferry_args="--overlap-weight 2",
    )  # fmt: skip
    ferry, dynamo = ferry_flags(args), dynamo_knobs(args, 23040)
    for flags in (ferry, dynamo):
        assert flags[flags.index("--max-num-batched-tokens") + 1] == "512"
        assert flags[flags.index("--max-num-seqs") + 1] == "4"
    assert dynamo[dynamo.index("--num-gpu-blocks-override") + 1] == ferry[ferry.index("--num-blocks") + 1]
    assert ferry[-2:] == ["--overlap-weight", "2"]  # --ferry-args: Ferry's systems only


def _result(first_at: float, decode_s: float, tokens: int = 5) -> RequestResult:
    return RequestResult(
        0, first_at - 0.5, 0.0, ok=True, ttft=0.5, itls=[decode_s / (tokens - 1)] * (tokens - 1)
    )


def test_decode_flow_tells_bursty_hand_offs_from_even_ones() -> None:
    even = [_result(float(t), 1.5) for t in range(6)]  # one every second, 1.5 s of decoding each
    assert first_token_cv(even) == pytest.approx(0.0)
    # Over the 6.5 s from the first first token to the last last one: two at once for 0.5 s of each second
    # after the first, one the rest.
    assert decoding_at_once(even) == pytest.approx({1: 4.0 / 6.5, 2: 2.5 / 6.5})
    bursty = [_result(t, 1.5) for t in (0.0, 0.1, 0.2, 3.0, 3.1, 3.2)]
    cv = first_token_cv(bursty)
    assert cv is not None and cv > 1.0  # burstier than Poisson
    flow = decode_flow(bursty)
    assert flow["decoding_mean"] > decode_flow(even)["decoding_mean"]  # type: ignore[operator]
    assert decoding_at_once(bursty)[3] == pytest.approx(2.6 / 3.4)  # three at once most of the busy time
    assert first_token_cv(even[:2]) is None and decode_flow([])["decoding_mean"] is None


def test_decode_gaps_leave_out_the_hand_off() -> None:
    # Hand-offs of 100 ms, then decode steps of 30 and 40 ms: the decode gaps are the steps alone.
    results = [
        RequestResult(i, 0.0, 0.0, ok=True, ttft=0.5, itls=[0.1, 0.03, 0.04, 0.03, 0.04], completion_tokens=6)
        for i in range(5)
    ]
    s = summary(ReplayResult(results, wall_s=2.0, not_sent=0), workers=1)
    assert s["decode_gap_p10_ms"] == pytest.approx(30.0)
    assert s["decode_gap_p90_ms"] == pytest.approx(40.0)
    assert s["first_gap_p50_ms"] == pytest.approx(100.0)


def test_each_ferry_split_is_set_against_each_dynamo_row_of_its_split_and_rate() -> None:
    def row(base: str, rate: float, ttft: float, itl: float, h: int = 0) -> dict[str, object]:
        return {"base": base, "rate": rate, "host_blocks": h, "ttft_p90_ms": ttft, "itl_p90_ms": itl}

    rows = {
        "aggregated 4": row("aggregated 4", 1.0, 900.0, 40.0),
        "disagg 3:1": row("disagg 3:1", 1.0, 2000.0, 64.0),
        "disagg 3:1, decode cap 4": row("disagg 3:1, decode cap 4", 1.0, 3000.0, 53.0),
        "disagg 3:1, host 512": row("disagg 3:1", 1.0, 1.0, 1.0, h=512),
        "disagg 2:2": row("disagg 2:2", 1.0, 500.0, 30.0),
        "dynamo disagg 3:1": row("dynamo disagg 3:1", 1.0, 4000.0, 58.0),
        "dynamo disagg 3:1 @ 2/s": row("dynamo disagg 3:1", 2.0, 1.0, 1.0),
    }
    got = versus_dynamo(rows)
    assert [(v["ferry"], v["dynamo"]) for v in got] == [
        ("disagg 3:1", "dynamo disagg 3:1"), ("disagg 3:1, decode cap 4", "dynamo disagg 3:1")
    ]  # fmt: skip
    ratios = [(v["itl_p90_ratio"], v["ttft_p90_ratio"], v["both_at_or_below"]) for v in got]
    assert ratios == [(1.103, 0.5, False), (0.914, 0.75, True)]
    assert "| disagg 3:1, decode cap 4 | dynamo disagg 3:1 | 0.91× | 0.75× | yes |" in versus_table(got)
