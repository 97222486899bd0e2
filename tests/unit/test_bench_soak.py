"""bench.soak's arithmetic: per-minute rows, RSS slopes and the issue's targets (issue 23)."""

import math

from bench.soak.report import Outcome, Windows, cpu_per_request, per_minute, rss_slopes, stalls, targets


def _steady(minutes: int, per_min: int, tokens: int, ttft: float) -> list[Outcome]:
    out = []
    for m in range(minutes):
        for k in range(per_min):
            t = m * 60.0 + k * (60.0 / per_min)
            out.append(Outcome(t, t + 0.5, ttft, True, tokens, None))
    return out


def test_windows_scale_with_the_run() -> None:
    assert Windows.for_minutes(60) == Windows(10, 10)
    assert Windows.for_minutes(10) == Windows(2, 3)
    assert Windows.for_minutes(15) == Windows(3, 4)


def test_a_steady_run_meets_every_target() -> None:
    rows = per_minute(_steady(10, 60, 100, 0.05), 10)
    assert [r["tokens_per_s"] for r in rows] == [100.0] * 10
    samples = [
        {"t": t, "processes": {"frontend": {"rss_mb": 100.0, "cpu_pct": 10.0}}} for t in range(0, 600, 5)
    ]
    got = targets(rows, rss_slopes(samples, 3), Windows(2, 3))
    assert all(t["met"] for t in got), got


def test_drift_stalls_leaks_and_failures_are_each_missed() -> None:
    outcomes = _steady(8, 60, 100, 0.05) + _steady(2, 60, 50, 0.05)
    for o in outcomes[-120:]:  # the last two minutes: half the tokens, and shifted back in time
        o.start += 8 * 60.0
        o.end += 8 * 60.0
    outcomes[300].ttft = 0.5  # one stall in minute 5 drives its p99 over 2x
    outcomes.append(Outcome(30.0, 31.0, math.nan, False, 0, "boom"))
    rows = per_minute(outcomes, 10)
    samples = [
        {"t": t, "processes": {"kafka": {"rss_mb": 50.0 + t / 30.0, "cpu_pct": 5.0}}}
        for t in range(0, 600, 5)
    ]
    slopes = rss_slopes(samples, 3)
    assert slopes["kafka"] is not None and abs(slopes["kafka"] - 2.0) < 1e-6  # 1 MB per 30 s
    by_name = {t["name"].split(" ")[0]: t for t in targets(rows, slopes, Windows(2, 3))}
    assert not by_name["tokens/s"]["met"] and by_name["tokens/s"]["value"] == 0.5
    assert not by_name["worst"]["met"] and by_name["worst"]["minutes_over"] == [5]
    assert not by_name["steepest"]["met"] and by_name["steepest"]["process"] == "kafka"
    assert not by_name["failed"]["met"] and by_name["failed"]["value"] == 1


def test_stalls_merge_into_episodes_with_their_log_lines() -> None:
    slow = [
        Outcome(10.0, 12.0, 1.5, True, 1),
        Outcome(10.5, 12.0, 1.2, True, 1),
        Outcome(40.0, 42.0, 1.1, True, 1),
    ]
    log = [(9.0, "replies: new requests reply to t.3"), (20.0, "unrelated"), (39.5, "deleted retired topics")]
    eps = stalls([*slow, Outcome(11.0, 11.5, 0.01, True, 1)], log, threshold_s=1.0)
    assert [(e["requests"], e["worst_ttft_ms"]) for e in eps] == [(2, 1500.0), (1, 1100.0)]
    assert "new requests reply" in eps[0]["log"][0] and "deleted" in eps[1]["log"][0]


def test_cpu_per_request_divides_each_minutes_cpu_by_its_requests() -> None:
    rows = per_minute(_steady(2, 60, 100, 0.05) + _steady(1, 30, 100, 0.05), 2)  # 90 requests end in minute 0
    samples = [{"t": float(t), "processes": {"frontend": {"rss_mb": 1.0, "cpu_pct": 50.0}}, "loadavg_1m": 2.0}
               for t in range(5, 125, 5)]  # fmt: skip
    got = cpu_per_request(samples, rows)
    # Each minute: 60 s at half a core, over 90 and then 60 requests.
    assert got[0]["frontend"] == round(1000.0 * 0.5 * 60 / 90, 2)
    assert got[1]["frontend"] == round(1000.0 * 0.5 * 60 / 60, 2)
    assert got[1]["loadavg_1m"] == 2.0
