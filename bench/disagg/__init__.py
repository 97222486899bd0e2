"""Aggregated against disaggregated serving on the simulated engine, with the same number of workers.

`python -m bench.disagg` runs `ferry up` once per system (aggregated, and each prefill:decode ratio) on the
same open-loop workload (a long-prompt / short-answer one, or the scaled conversation trace), and reports
TTFT and ITL p50/p90 and output throughput per worker. See docs/benchmarks.md, "Disaggregated serving".
"""
