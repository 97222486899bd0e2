"""What the routing benchmark's results say about the targets of issue 3 (items 5 and 6): `kv` against
round-robin and the bound, and Ferry's `kv` against Dynamo's on the requests both finished."""

from __future__ import annotations

import math
from typing import Any

REFERENCE_POLICY = "ferry round_robin"
KV_POLICY = "ferry kv"
PEER = "dynamo kv"
LOADED_FACTOR = 3.0  # "round_robin's TTFT p90 is at least 3x its unloaded value"
TTFT_CUT_TARGET = 3.0
OF_BOUND_TARGET = 0.8
# Run-to-run noise on this 2-core shared machine: round_robin on Ferry and on Dynamo (identical requests,
# identical deterministic routing, engines with the same timing model) differed by 0.94-1.10x in TTFT p90.
TTFT_NOISE = 0.10
CACHED_NOISE = 0.01  # absolute, in cached fraction


def _index(runs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["system"], r["run"]): r for r in runs}


def _rate_of(key: str) -> float:
    """The request rate in a run's name; the unloaded reference sorts first."""
    rate = key.split("@")[1]
    return 0.0 if rate == "unloaded" else float(rate)


def evaluate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 3's targets, from the trace runs (and the prefix sweep for the peer comparison)."""
    idx = _index(runs)
    trace_keys = sorted({r["run"] for r in runs if r["kind"] == "trace"}, key=_rate_of)
    out: dict[str, Any] = {}
    rr = [idx.get((REFERENCE_POLICY, k)) for k in trace_keys]
    if trace_keys and all(rr):
        unloaded = rr[0]["ttft_ms"]["p90"]  # type: ignore[index]
        loaded: list[dict[str, Any]] = []
        for key, ref in zip(trace_keys[1:], rr[1:], strict=True):
            p90 = ref["ttft_ms"]["p90"]  # type: ignore[index]
            entry: dict[str, Any] = {
                "run": key,
                "round_robin_ttft_p90_ms": p90,
                "round_robin_vs_unloaded": _ratio(p90, unloaded),
            }
            kv = idx.get((KV_POLICY, key))
            if kv is not None:
                entry["kv_ttft_p90_ms"] = kv["ttft_ms"]["p90"]
                entry["ttft_p90_cut"] = _ratio(p90, kv["ttft_ms"]["p90"])
                entry["kv_of_bound"] = kv["of_bound"]
                entry["pass"] = bool(
                    (entry["ttft_p90_cut"] or 0) >= TTFT_CUT_TARGET
                    and (kv["of_bound"] or 0) >= OF_BOUND_TARGET
                )
            entry["qualifies"] = (entry["round_robin_vs_unloaded"] or 0) >= LOADED_FACTOR
            loaded.append(entry)
        qualifying = [e for e in loaded if e["qualifies"]]
        out["kv_vs_round_robin"] = {
            "target": (
                f"at a rate where {REFERENCE_POLICY} TTFT p90 >= {LOADED_FACTOR:g}x its unloaded value "
                f"(trace@unloaded: the same requests one per worker at a time, first token only), {KV_POLICY} cuts TTFT p90 >= {TTFT_CUT_TARGET:g}x and reaches "
                f">= {OF_BOUND_TARGET:.0%} of the bound"
            ),
            "unloaded_run": trace_keys[0],
            "unloaded_ttft_p90_ms": unloaded,
            "rates": loaded,
            "qualifying_rates": [e["run"] for e in qualifying],
            "result": (
                "no rate loads round_robin enough: raise --trace-rates"
                if not qualifying
                else "kv not run"
                if not any("pass" in e for e in qualifying)
                else ("pass" if all(e.get("pass") for e in qualifying) else "fail")
            ),
        }
    peers = []
    for key in [r["run"] for r in runs if r["system"] == PEER]:
        ours, theirs = idx.get((KV_POLICY, key)), idx[(PEER, key)]
        row: dict[str, Any] = {
            "run": key,
            "dynamo_cached_fraction": theirs["cached_fraction"],
            "dynamo_ttft_p90_ms": theirs["ttft_ms"]["p90"],
        }
        if ours is not None:
            oc, tc = ours["cached_fraction"] or 0.0, theirs["cached_fraction"] or 0.0
            both = _common_cached(ours, theirs)
            if both is not None:
                # A request one system did not finish reports no usage: compare over what both finished.
                oc, tc = both
                row |= {"common_requests": len(_common(ours, theirs)), "ferry_cached_common": round(oc, 4),
                        "dynamo_cached_common": round(tc, 4)}  # fmt: skip
            ot, tt = ours["ttft_ms"]["p90"] or math.inf, theirs["ttft_ms"]["p90"] or math.inf
            row |= {
                "ferry_cached_fraction": ours["cached_fraction"],
                "ferry_ttft_p90_ms": ours["ttft_ms"]["p90"],
                "cached_ok": oc >= tc,
                "ttft_ok": ot <= tt,
                "ok_within_noise": oc >= tc - CACHED_NOISE and ot <= tt * (1 + TTFT_NOISE),
                "ttft_p90_ratio_ferry_over_dynamo": _ratio(ours["ttft_ms"]["p90"], theirs["ttft_ms"]["p90"]),
            }
        # Same engine knobs, same requests: round_robin on both sides shows whether the two engines agree.
        for a, b, name in (
            (REFERENCE_POLICY, "dynamo round_robin", "round_robin_ttft_p90_ferry_over_dynamo"),
        ):
            ra, rb = idx.get((a, key)), idx.get((b, key))
            if ra is not None and rb is not None:
                row[name] = _ratio(ra["ttft_ms"]["p90"], rb["ttft_ms"]["p90"])
        peers.append(row)
    if peers:
        compared = [p for p in peers if "cached_ok" in p]
        out["kv_vs_dynamo"] = {
            "target": f"{KV_POLICY} cached fraction >= {PEER}'s and TTFT p90 <= {PEER}'s, same requests",
            "runs": peers,
            "noise": f"within noise: cached fraction >= dynamo's - {CACHED_NOISE:g} and TTFT p90 <= "
            f"{1 + TTFT_NOISE:g}x dynamo's (Ferry vs. Dynamo round_robin on the same requests differ by up to ~10%)",
            "result": _peer_result(compared),
        }
    return out


def _common(a: dict[str, Any], b: dict[str, Any]) -> set[Any]:
    return set(a.get("tokens_by_request") or {}) & set(b.get("tokens_by_request") or {})


def _common_cached(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float] | None:
    """Cached fractions of two runs over the requests both completed (None without per-request data)."""
    common = _common(a, b)
    if not common:
        return None

    def fraction(run: dict[str, Any]) -> float:
        rows = [run["tokens_by_request"][i] for i in common]
        prompt = sum(p for _, p in rows)
        return sum(c for c, _ in rows) / prompt if prompt else 0.0

    return fraction(a), fraction(b)


def _peer_result(compared: list[dict[str, Any]]) -> str:
    if not compared:
        return "kv not run"
    if all(p["cached_ok"] and p["ttft_ok"] for p in compared):
        return "pass"
    noisy = [p["run"] for p in compared if not p["ok_within_noise"]]
    strict = [p["run"] for p in compared if not (p["cached_ok"] and p["ttft_ok"])]
    if not noisy:
        return "pass within noise (strictly behind at " + ", ".join(strict) + ")"
    return "fail at " + ", ".join(noisy)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 2)


# ---- the machine ------------------------------------------------------------------------------------------
