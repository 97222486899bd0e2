"""Percentiles for the benchmarks' reports."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np


def pct(values: Iterable[float], q: float) -> float:
    """The q-th percentile (linear interpolation) of the non-NaN values; NaN for none."""
    arr = np.fromiter((v for v in values if not math.isnan(v)), dtype=float)
    return float(np.percentile(arr, q)) if arr.size else math.nan
