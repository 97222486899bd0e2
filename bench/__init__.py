"""Benchmarks of Ferry: each module prints a table, writes JSON and can draw a PNG plot."""
