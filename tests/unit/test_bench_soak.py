"""bench.soak's arithmetic: per-minute rows, RSS slopes and the issue's targets (issue 23)."""

import math
from pathlib import Path
from typing import Any

import pytest

from bench.soak.peer import peer_path, side_by_side
from bench.soak.phase import profiled
from bench.soak.report import (
    Outcome,
    Windows,
    add_cpu_per_request,
    cpu_per_request,
    per_minute,
    rss_slopes,
    stalls,
    targets,
)
from bench.soak.run import parse_args


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
    idle = cpu_per_request(samples, per_minute([], 2))  # no request ended: no CPU per request either
    assert idle == [{"loadavg_1m": 2.0}, {"loadavg_1m": 2.0}]


def test_cpu_per_request_goes_into_each_minutes_row() -> None:
    rows = per_minute(_steady(2, 60, 100, 0.05), 2)
    samples = [{"t": float(t), "processes": {"w": {"rss_mb": 1.0, "cpu_pct": 100.0}}, "loadavg_1m": 1.5}
               for t in range(5, 125, 5)]  # fmt: skip
    got = add_cpu_per_request(rows, samples)
    assert [r["cpu_ms_per_request"] for r in got] == [{"w": 1000.0}, {"w": 1000.0}]  # 60 s of a core / 60
    assert [r["loadavg_1m"] for r in got] == [1.5, 1.5]


def test_peer_needs_the_vllm_engine_and_one_worker(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--peer", "vllm"])
    assert exc.value.code == 2
    assert "--peer vllm needs --engine vllm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--engine", "vllm", "--peer", "vllm", "--workers", "2"])
    assert "--workers 1" in capsys.readouterr().err
    args = parse_args(["--engine", "vllm", "--peer", "vllm", "--minutes", "2", "--out", "/tmp/x/soak.json"])
    assert (args.peer, args.workers, args.concurrency) == ("vllm", 1, 4)
    assert parse_args(["--engine", "vllm"]).peer is None
    assert peer_path(args.out, ".json") == Path("/tmp/x/soak-peer.json")
    assert peer_path(args.out, ".log") == Path("/tmp/x/soak-peer.log")


def test_profiled_processes_are_the_frontend_and_first_engine() -> None:
    pids = {"kafka": 1, "redis": 2, "frontend": 3, "w1": 5, "w0": 4}
    assert profiled(pids) == {"frontend": 3, "w0": 4}
    assert profiled({"vllm-server": 9}) == {"vllm-server": 9}


def _doc(tokens_first: float, tokens_last: float, failed: int, mb_per_min: float) -> dict[str, Any]:
    outcomes = _steady(1, 60, int(tokens_first), 0.05) + _steady(2, 60, int(tokens_last), 0.1)[60:]
    outcomes += [Outcome(70.0, 71.0, math.nan, False, 0, "boom")] * failed
    rows = per_minute(outcomes, 2)
    samples = [
        {"t": float(t), "processes": {"p": {"rss_mb": 100.0 + mb_per_min * t / 60.0, "cpu_pct": 50.0}}}
        for t in range(5, 125, 5)
    ]
    add_cpu_per_request(rows, samples)
    win = Windows(1, 1)
    return {"requests": len(outcomes), "windows": {"window_min": 1, "settle_min": 1}, "per_minute": rows,
            "targets": targets(rows, rss_slopes(samples, 1), win), "cpu_percent_mean": {"p": 50.0}}  # fmt: skip


def test_side_by_side_puts_each_systems_targets_in_a_column() -> None:
    table = dict(side_by_side({"ferry": _doc(100, 50, 1, 3.0), "vllm-server": _doc(100, 100, 0, 0.5)}))
    assert table["tokens/s last / first (>= 0.95)"] == [0.5, 1.0]
    assert table["TTFT p99 worst / first (<= 2)"] == [2.0, 2.0]
    assert table["failed requests"] == [1, 0]
    assert table["steepest RSS slope after min 1 (MB/min)"] == ["+3.00 (p)", "+0.50 (p)"]
    # 30 CPU seconds per minute over 60 requests, then 61 (one failed) and 60 in the last minute.
    assert table["CPU s per request, minute 0"] == [0.5, 0.5]
    assert table["CPU s per request, last minute"] == [0.49, 0.5]
