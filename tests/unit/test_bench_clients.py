"""bench/clients: reading the load generators' results, deciding failure, the Ferry-vs-vLLM ratios, the tables."""

from __future__ import annotations

from pathlib import Path

from bench.clients.loadgen import Load, aiperf_args, vllm_bench_args
from bench.clients.report import (
    Cell,
    comparison_table,
    comparisons,
    failures,
    parse_aiperf,
    parse_vllm_bench,
    runs_table,
    targets,
)

LOAD = Load(
    requests=4,
    concurrency=2,
    input_len=128,
    output_len=32,
    prefix_len=96,
    num_prefixes=2,
    warmups=1,
    seed=1,
    timeout_s=60,
)


def vllm_result(
    completed: int, failed: int, tok_s: float, ttft: float, errors: list[str] | None = None
) -> dict:
    """The fields of a `vllm bench serve --save-result --save-detailed` JSON the parser reads."""
    return {
        "duration": 2.0,
        "completed": completed,
        "failed": failed,
        "output_throughput": tok_s,
        "p50_ttft_ms": ttft,
        "p99_ttft_ms": ttft * 2,
        "p50_itl_ms": 8.0,
        "p50_e2el_ms": 300.0,
        "errors": errors if errors is not None else [""] * (completed + failed),
    }


def aiperf_export(completed: int, errors: list[tuple[int, str, int]]) -> dict:
    """The fields of aiperf's profile_export_aiperf.json the parser reads."""
    return {
        "completed_request_count": {"unit": "requests", "avg": float(completed)},
        "output_token_throughput": {"unit": "tokens/sec", "avg": 250.0},
        "time_to_first_token": {"unit": "ms", "p50": 120.5, "p99": 186.0},
        "inter_token_latency": {"unit": "ms", "p50": 11.0},
        "request_latency": {"unit": "ms", "p50": 465.0},
        "benchmark_duration": {"unit": "sec", "avg": 2.7},
        "error_summary": [
            {"error_details": {"code": code, "type": "Bad Request", "message": msg}, "count": n}
            for code, msg, n in errors
        ],
    }


def test_vllm_bench_all_completed_is_ok() -> None:
    s = parse_vllm_bench(vllm_result(4, 0, 317.0, 85.4), requests=4)
    assert s.ok
    assert (s.completed, s.failed, s.output_tok_s, s.ttft_p50_ms, s.ttft_p99_ms) == (4, 0, 317.0, 85.4, 170.8)
    assert s.errors == {}


def test_vllm_bench_failures_keep_the_last_line_of_each_error() -> None:
    trace = "Traceback (most recent call last):\n  File x\nValueError: bad chunk"
    s = parse_vllm_bench(vllm_result(2, 2, 100.0, 50.0, ["", "Bad Request", trace, ""]), requests=4)
    assert not s.ok
    assert s.failed == 2
    assert s.errors == {"Bad Request": 1, "ValueError: bad chunk": 1}


def test_vllm_bench_fewer_completed_than_asked_is_a_failure_even_without_errors() -> None:
    s = parse_vllm_bench(vllm_result(3, 0, 100.0, 50.0), requests=4)
    assert not s.ok
    assert s.failed == 1


def test_aiperf_errors_count_as_failures() -> None:
    ok = parse_aiperf(aiperf_export(4, []), requests=4)
    assert ok.ok and ok.ttft_p50_ms == 120.5 and ok.output_tok_s == 250.0 and ok.e2e_p50_ms == 465.0
    bad = parse_aiperf(aiperf_export(4, [(400, "unknown field 'foo'", 3)]), requests=4)
    assert not bad.ok
    assert bad.failed == 3
    assert bad.errors == {"400 Bad Request unknown field 'foo'": 3}


def test_failures_name_the_run_and_its_errors() -> None:
    good = Cell("ferry-sim", "aiperf", "synthetic/chat", 1, parse_aiperf(aiperf_export(4, []), 4))
    bad = Cell("ferry-sim", "vllm-bench", "random/openai", 1,
               parse_vllm_bench(vllm_result(3, 1, 1.0, 1.0, ["", "", "", "Bad Request"]), 4))  # fmt: skip
    crashed = Cell("ferry-vllm", "aiperf", "synthetic/chat", 2, None, error="no result within 60s")
    lines = failures([good, bad, crashed])
    assert lines == [
        "vllm-bench random/openai against ferry-sim (round 1): 3/4 completed, 1 failed: 1x Bad Request",
        "aiperf synthetic/chat against ferry-vllm (round 2): no result: no result within 60s",
    ]
    assert failures([good]) == []


def test_comparison_takes_medians_over_rounds_and_skips_failed_runs() -> None:
    cells = []
    for rnd, (ferry_tok, vllm_tok, ferry_ttft, vllm_ttft) in enumerate(
        [(95.0, 100.0, 60.0, 50.0), (90.0, 100.0, 58.0, 50.0), (99.0, 100.0, 51.0, 50.0)], start=1
    ):
        cells.append(Cell("ferry-vllm", "vllm-bench", "random/openai", rnd,
                          parse_vllm_bench(vllm_result(4, 0, ferry_tok, ferry_ttft), 4)))  # fmt: skip
        cells.append(Cell("vllm-server", "vllm-bench", "random/openai", rnd,
                          parse_vllm_bench(vllm_result(4, 0, vllm_tok, vllm_ttft), 4)))  # fmt: skip
    # A failed round is not compared.
    cells.append(Cell("ferry-vllm", "vllm-bench", "random/openai", 4,
                      parse_vllm_bench(vllm_result(3, 1, 1.0, 900.0), 4)))  # fmt: skip
    cells.append(Cell("vllm-server", "vllm-bench", "random/openai", 4,
                      parse_vllm_bench(vllm_result(4, 0, 100.0, 50.0), 4)))  # fmt: skip
    rows = comparisons(cells)
    assert rows == [
        {
            "client": "vllm-bench",
            "workload": "random/openai",
            "rounds": 3,
            "throughput_ratio": 0.95,
            "added_ttft_p50_ms": 8.0,
        }
    ]
    t = targets(rows)
    assert t["throughput_met"] and t["added_ttft_met"]
    assert t["throughput_ratio_median"] == 0.95 and t["added_ttft_p50_ms_median"] == 8.0
    missed = targets([{**rows[0], "throughput_ratio": 0.9, "added_ttft_p50_ms": 12.0}])
    assert not missed["throughput_met"] and not missed["added_ttft_met"]
    assert "| vllm-bench | random/openai | 3 | 0.950 | 8.0 |" in comparison_table(rows)


def test_runs_table_marks_failed_runs() -> None:
    cells = [
        Cell(
            "ferry-sim", "vllm-bench", "random/openai", 1, parse_vllm_bench(vllm_result(4, 0, 317.0, 85.4), 4)
        ),
        Cell("ferry-sim", "aiperf", "synthetic/chat", 1, parse_aiperf(aiperf_export(4, [(400, "x", 1)]), 4)),
    ]
    table = runs_table(cells).splitlines()
    assert (
        table[2] == "| vllm-bench | random/openai | ferry-sim | 4 / 4 | 317.0 | 85.4 | 170.8 | 8.0 | 300.0 |"
    )
    assert table[3].startswith("| aiperf | synthetic/chat | ferry-sim | 3 / 4 **FAILED** |")


def test_command_lines_stay_on_loopback_and_are_bounded() -> None:
    url = "http://127.0.0.1:8000"
    args = vllm_bench_args(LOAD, "prefix_repetition", "openai-chat", url, Path("/m"), Path("/o"), "r.json")
    assert args[args.index("--endpoint") + 1] == "/v1/chat/completions"
    assert args[args.index("--num-prompts") + 1] == "4"
    assert args[args.index("--prefix-repetition-suffix-len") + 1] == "32"
    assert args[args.index("--tokenizer") + 1] == "/m"
    completions = vllm_bench_args(LOAD, "random", "openai", url, Path("/m"), Path("/o"), "r.json")
    assert completions[completions.index("--endpoint") + 1] == "/v1/completions"
    a = aiperf_args(LOAD, "completions", url, Path("/m"), Path("/a"))
    assert a[a.index("--url") + 1] == url and a[a.index("--request-count") + 1] == "4"
    assert "--no-server-metrics" in a and "--no-gpu-telemetry" in a
