"""`python -m bench.routing [run|decision] ...`: see the package docstring."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.routing import report
from bench.routing.run import (
    add_workload_arguments,
    build_plan,
    knobs_from,
    machine_info,
    plan_settings_from,
    run_system,
)
from bench.routing.systems import SystemSpec, available_systems
from bench.routing.targets import evaluate
from bench.stack import run_cleanly

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags of the end-to-end benchmark."""
    from schemas.settings import DEFAULT_MODEL_NAME, default_model_path

    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__)
    p.add_argument("--systems", default="default",
                   help="comma-separated system names, 'default' or 'all'; 'list' prints them")  # fmt: skip
    add_workload_arguments(p, speedup=0.1, trace_rates=(16.0, 28.0, 40.0), prefix_rates=(16.0,))
    p.add_argument("--settle-seconds", type=float, default=1.0, help="pause before each run")
    p.add_argument("--model-path", default=default_model_path())
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "routing.json")
    p.add_argument("--plot-prefix", type=Path, default=REPO / "bench" / "results" / "routing",
                   help="writes <prefix>_ttft.png and <prefix>_cache.png")  # fmt: skip
    return p.parse_args(argv)


def select(text: str) -> list[SystemSpec]:
    """The systems named on the command line."""
    every, default = available_systems(cwd=REPO)
    if text == "default":
        return default
    if text == "all":
        return every
    by_name = {s.name: s for s in every}
    if text == "list":
        print("available:", ", ".join(by_name), "\ndefault:", ", ".join(s.name for s in default))
        raise SystemExit(0)
    chosen = []
    for name in (n.strip() for n in text.split(",")):
        if name not in by_name:
            raise SystemExit(f"unknown or unavailable system {name!r}; available: {', '.join(by_name)}")
        chosen.append(by_name[name])
    return chosen


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system on every run of the plan; the results document."""
    systems = select(args.systems)
    knobs = knobs_from(args)
    settings = plan_settings_from(args, knobs)
    machine = machine_info(REPO)
    peer: dict[str, Any] | None = None
    if any(s.kind == "dynamo" for s in systems):
        from bench.peers import dynamo

        print(f"checking the Dynamo {dynamo.VERSION} install in {dynamo.default_venv()} ...", flush=True)
        info = await asyncio.to_thread(dynamo.ensure_installed)
        peer = {k: v for k, v in info.items() if k != "freeze"}
    plan = build_plan(settings)
    # The unloaded probe's pace is set by the engines, not the trace clock: count it as its request count
    # of sub-second first tokens spread over the workers.
    est = len(systems) * sum(
        (len(it.workload.items) / args.workers if it.probe else it.workload.duration_s)
        + args.settle_seconds
        + 3
        for it in plan
    )
    print(
        f"{len(systems)} systems x {len(plan)} runs ({', '.join(it.key for it in plan)}); "
        f"about {est / 60:.0f} min of traffic plus drains",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    per_system: dict[str, Any] = {}
    t0 = time.monotonic()
    for spec in systems:
        print(f"{spec.name}: starting", flush=True)
        try:
            summaries, info = await run_system(
                spec,
                plan,
                knobs,
                model_path=args.model_path,
                model_name=args.model_name,
                drain_s=args.drain_seconds,
                settle_s=args.settle_seconds,
            )
        except Exception as exc:
            print(f"{spec.name}: FAILED: {exc}", flush=True)
            per_system[spec.name] = {"error": str(exc)[-2000:]}
            continue
        runs += summaries
        per_system[spec.name] = info
    order = {it.key: i for i, it in enumerate(plan)}
    sysorder = {s.name: i for i, s in enumerate(systems)}
    runs.sort(key=lambda r: (order[r["run"]], sysorder[r["system"]]))
    workloads: dict[str, Any] = {}
    for it in plan:
        workloads.setdefault(it.kind, it.workload.description | {"rate_rps": None})
        workloads[f"{it.key}"] = {
            "requests": len(it.workload.items),
            "duration_s": round(it.workload.duration_s, 1),
            "prompt_tokens": it.workload.prompt_tokens(),
            "bound_fraction": round(it.bound().fraction, 4),
        }
    return {
        "benchmark": "routing",
        "command": "python -m bench.routing " + " ".join(sys.argv[1:]),
        "machine": machine,
        "elapsed_s": round(time.monotonic() - t0, 1),
        "config": {
            "engine": asdict(knobs),
            "systems": [asdict(s) for s in systems],
            "plan": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
            "prefix_rates": list(args.prefix_rates),
            "drain_s": args.drain_seconds,
            "client": "bench.sse_client on uvloop: open loop, streamed /v1/completions with token-id prompts, "
            "ignore_eos, max_tokens = the workload's output length, temperature 0",
        },
        "peer": peer,
        "systems": per_system,
        "workloads": workloads,
        "runs": runs,
        "targets": evaluate(runs),
    }


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    """Run the end-to-end benchmark, or the decision micro-benchmark (`decision ...`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["decision"]:
        from bench.routing.decision import main as decision_main

        return decision_main(argv[1:])
    if argv[:1] == ["run"]:
        argv = argv[1:]
    args = parse_args(argv)

    results = _clean(run_cleanly(run(args), uv=True))
    print()
    print(report.table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    written = report.plot(
        results,
        args.plot_prefix.with_name(args.plot_prefix.name + "_ttft.png"),
        args.plot_prefix.with_name(args.plot_prefix.name + "_cache.png"),
    )
    print(f"\nwrote {args.out}" + "".join(f", {p}" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
