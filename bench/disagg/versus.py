"""Ferry's disaggregated systems against Dynamo's in `python -m bench.disagg --dynamo`: issue 21's target that
Ferry's TTFT p90 and ITL p90 are at or below Dynamo's on the same requests.

Every Ferry row is set against every Dynamo row of the same prefill:decode split and rate, so a run with
`--decode-max-num-seqs` compares each decode cap of one system with each of the other: equal settings, and
what one system's setting reaches against the other's.
"""

from __future__ import annotations

import re
from typing import Any

_SPLIT = re.compile(r"disagg (\d+:\d+)")


def split_of(name: str) -> str | None:
    """The prefill:decode split a system's name carries ("disagg 3:1, decode cap 4" -> "3:1"), None if aggregated."""
    m = _SPLIT.search(name)
    return m.group(1) if m else None


def versus_dynamo(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """For each Ferry row with a Dynamo row of the same split and rate: both p90s as ratios to Dynamo's, and
    whether both are at or below them. Rows with a host tier are left out (Dynamo's runs have none)."""
    dynamo = [(k, r) for k, r in rows.items() if r["base"].startswith("dynamo ")]
    out: list[dict[str, Any]] = []
    for name, ferry in rows.items():
        split = split_of(ferry["base"])
        if ferry["base"].startswith("dynamo ") or split is None or ferry.get("host_blocks"):
            continue
        for dyn_name, dyn in dynamo:
            if split_of(dyn["base"]) != split or dyn["rate"] != ferry["rate"]:
                continue
            itl = _ratio(ferry["itl_p90_ms"], dyn["itl_p90_ms"])
            ttft = _ratio(ferry["ttft_p90_ms"], dyn["ttft_p90_ms"])
            out.append(
                {
                    "ferry": name,
                    "dynamo": dyn_name,
                    "itl_p90_ratio": itl,
                    "ttft_p90_ratio": ttft,
                    "both_at_or_below": itl is not None and ttft is not None and itl <= 1 and ttft <= 1,
                }
            )
    return out


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or not theirs else round(ours / theirs, 3)


def versus_table(verdicts: list[dict[str, Any]]) -> str:
    """The verdicts as a Markdown table."""

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}×"

    lines = [
        "| Ferry | Dynamo | ITL p90 ÷ Dynamo's | TTFT p90 ÷ Dynamo's | both at or below |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for v in verdicts:
        met = "yes" if v["both_at_or_below"] else "no"
        lines.append(
            f"| {v['ferry']} | {v['dynamo']} | {x(v['itl_p90_ratio'])} | {x(v['ttft_p90_ratio'])} | {met} |"
        )
    return "\n".join(lines)
