"""The soak run: start the stack (and with `--peer vllm`, vLLM's own server after it), soak each, write the results."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from bench.overhead import machine_info
from bench.soak.load import Plan, Target
from bench.soak.peer import ENGINE_SETTINGS, FERRY_VLLM_FLAGS, PEER, peer_path, print_side_by_side, run_peer
from bench.soak.phase import soak
from bench.soak.report import plot, print_summary
from bench.soak.sample import StampedLog
from bench.stack import FerryStack, run_cleanly
from bench.vllm.run import VLLM_ENV


def config(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """The run's settings, the same for Ferry and its peer."""
    return {
        "engine": args.engine,
        "workers": args.workers,
        "speedup": args.speedup,
        "minutes": args.minutes,
        "load": plan.desc,
        "prompt_words": args.prompt_words,
        "max_tokens": args.max_tokens,
        "sample_s": args.sample_s,
        "max_requests": args.max_requests,
        "resume_ttl_s": args.resume_ttl_s,
        "stall_ms": args.stall_ms,
        "engine_settings": ENGINE_SETTINGS if args.engine == "vllm" else None,
        "peer": args.peer,
    }


async def run_ferry(args: argparse.Namespace, machine: dict[str, Any]) -> tuple[dict[str, Any], Plan]:
    """Start `ferry up`, soak it, stop it; the results document and the load it got."""
    extra = list(args.stack_flags)
    if args.engine == "vllm":
        from launch.model_prepare import default_model_dir, prepare_model

        prepare_model(default_model_dir())
        os.environ.update(VLLM_ENV)
        extra = [*FERRY_VLLM_FLAGS, "--ready-timeout-s", "600", *extra]
    if args.resume_ttl_s is not None:
        os.environ["FERRY_RESUME_TTL_S"] = str(args.resume_ttl_s)
    log = StampedLog(args.log)
    stack = await FerryStack.start(args.workers, args.speedup, extra, timeout_s=600.0)
    log.startup("ferry-up", stack.child.tail)
    stack.child.log = log  # type: ignore[assignment]  # a TextIO in all but name
    print(f"ferry up at {stack.url}; processes {stack.pids}; log {args.log}", file=sys.stderr)
    try:
        target = Target("ferry", stack.host, stack.port, stack.child.proc, stack.pids)
        doc, plan = await soak(target, log, args, None, args.profile_dir)
    finally:
        print("stopping ferry up ...", file=sys.stderr)
        await stack.stop()
        log.close()
    cfg = config(args, plan) | {"stack_flags": extra}
    return {"benchmark": "soak", "command": _command(), "machine": machine, "config": cfg, **doc}, plan


async def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Soak Ferry, then (`--peer`) vLLM's server under the same load; each system's results document."""
    # `timeout` or a kill sends SIGTERM: cancel the run, so the system under load is still stopped.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    machine = machine_info()
    ferry, plan = await run_ferry(args, machine)
    _write(ferry, args.out)  # kept should the peer's run fail
    docs = {"ferry": ferry}
    if args.peer:
        doc = await run_peer(args, plan)
        cfg = config(args, plan) | {"workers": 1, "server": "python -m vllm.entrypoints.openai.api_server"}
        docs[PEER] = {"benchmark": "soak", "command": _command(), "machine": machine, "config": cfg, **doc}
        ferry["peer_results"] = str(peer_path(args.out, ".json"))
    return docs


def _command() -> str:
    return " ".join(["python -m bench.soak", *sys.argv[1:]])


def _write(doc: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; `--smoke` and `--engine vllm` change the defaults."""
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--minutes", type=float, default=None, help="length of the load (default 60; --smoke 10; vllm 15)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="a 10-minute run (windows scaled: 2 min, RSS after 3)"
    )
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p.add_argument("--peer", choices=("vllm",), default=None,
                   help="then the same soak against vLLM's own OpenAI server (needs --engine vllm and 1 worker)")  # fmt: skip
    p.add_argument("--workers", type=int, default=None, help="workers (default 2; vllm 1)")
    p.add_argument("--speedup", type=float, default=1000.0, help="sim speedup (default 1000)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="streams back to back; without it, an open-loop rate at --load-fraction of the probed capacity "
                        "(vllm default 4)")  # fmt: skip
    p.add_argument(
        "--load-fraction", type=float, default=0.7, help="share of the probed capacity (default 0.7)"
    )
    p.add_argument(
        "--probe-concurrency", type=int, default=16, help="streams of the capacity probe (default 16)"
    )
    p.add_argument(
        "--probe-seconds", type=float, default=30.0, help="length of the capacity probe (default 30)"
    )
    p.add_argument(
        "--open-loop-cap", type=int, default=64, help="most requests in flight in open loop (default 64)"
    )
    p.add_argument(
        "--warmup-requests", type=int, default=8, help="unmeasured requests first, 2 at a time (default 8)"
    )
    p.add_argument("--max-requests", type=int, default=5_000_000, help="most requests of the soak")
    p.add_argument("--prompt-words", type=int, default=100, help="words per prompt (default 100)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request, ignore_eos (default 128)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS/CPU samples (default 5)")
    p.add_argument("--stall-ms", type=float, default=1000.0, help="TTFT above which a request is a stall")
    p.add_argument("--resume-ttl-s", type=float, default=None, help="FERRY_RESUME_TTL_S for the stack")
    p.add_argument(
        "--profile-at", default="", help="minutes at which to py-spy the frontend and first worker, e.g. 1,9"
    )
    p.add_argument(
        "--profile-seconds", type=float, default=20.0, help="length of each py-spy record (default 20)"
    )
    p.add_argument("--stack-flag", dest="stack_flags", action="append", default=[],
                   help="a flag passed to `ferry up` (repeat; e.g. --stack-flag=--replies-roll-records=2000)")  # fmt: skip
    p.add_argument(
        "--out", type=Path, default=None, help="JSON file (default bench/results/soak-<engine>[-smoke].json)"
    )
    p.add_argument("--plot", type=Path, default=None, help="PNG plot (default next to the JSON)")
    args = p.parse_args(argv)
    vllm = args.engine == "vllm"
    if args.minutes is None:
        args.minutes = 10.0 if args.smoke else 15.0 if vllm else 60.0
    if args.workers is None:
        args.workers = 1 if vllm else 2
    if args.concurrency is None and vllm:
        args.concurrency = 4
    if args.speedup <= 0 or args.minutes <= 0 or args.workers < 1:
        p.error("--speedup, --minutes and --workers must be positive")
    if args.peer and not vllm:
        p.error("--peer vllm needs --engine vllm: the peer is vLLM's own server, compared with a vLLM worker")
    if args.peer and args.workers != 1:
        p.error("--peer vllm needs --workers 1: the peer is one vLLM engine")
    if vllm:
        args.speedup = 1.0
    args.profile_at = [float(x) for x in str(args.profile_at).split(",") if x.strip()]
    stem = f"soak-{args.engine}{'-smoke' if args.smoke else ''}"
    args.out = args.out or Path("bench/results") / f"{stem}.json"
    args.plot = args.plot or args.out.with_suffix(".png")
    args.log = args.out.with_suffix(".log")
    args.profile_dir = args.out.parent / f"{args.out.stem}-profiles"
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak(s) and write the outputs; exit status 1 if Ferry missed a target."""
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for d in (args.profile_dir, peer_path(args.out, "-profiles")) if args.profile_at else ():
        d.mkdir(exist_ok=True)
    docs = run_cleanly(run(args), uv=True)
    for doc in docs.values():
        print_summary(doc)
        for name, prof in (doc.get("profiles") or {}).items():
            print(f"py-spy {name} ({prof['samples']} samples), top self time:")
            for frame, share in prof["self_percent"][:6]:
                print(f"  {share:5.1f}%  {frame}")
    if len(docs) > 1:
        print_side_by_side(docs)
    _write(docs["ferry"], args.out)
    written = [str(args.out)]
    if PEER in docs:
        _write(docs[PEER], peer_path(args.out, ".json"))
        written.append(str(peer_path(args.out, ".json")))
    if plot(docs, args.plot):
        written.append(str(args.plot))
    logs = [str(d["log"]) for d in docs.values()]
    print(f"\nwrote {', '.join(written)}; logs {', '.join(logs)}")
    return 0 if all(t["met"] for t in docs["ferry"]["targets"]) else 1
