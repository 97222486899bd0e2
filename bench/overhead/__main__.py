"""`python -m bench.overhead`: flags and outputs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.overhead import __doc__ as _DOC
from bench.overhead.peer import PEERS, print_peer_table, run_peer
from bench.overhead.report import plot, print_table
from bench.overhead.run import run
from bench.stack import run_cleanly


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=(_DOC or "").split("\n\n")[0])
    p.add_argument(
        "--concurrency", default="1,16,64", help="comma-separated concurrency levels (default 1,16,64)"
    )
    p.add_argument(
        "--requests-per-level", type=int, default=3000, help="most requests per level (default 3000)"
    )
    p.add_argument("--level-seconds", type=float, default=20.0, help="most seconds per level (default 20)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens every request generates (default 128)")
    p.add_argument("--workers", type=int, default=None,
                   help="sim workers behind the frontend (default 1; 2 with --peer)")  # fmt: skip
    p.add_argument("--speedup", type=float, default=None,
                   help="sim speedup, 1e6 makes engine time ~0 (default 1e6; 1000 with --peer, as Dynamo's mocker "
                        "has no faster setting that keeps its timing)")  # fmt: skip
    p.add_argument("--prompt-words", type=int, default=None,
                   help="words per prompt; 0 = a one-line question (default 0; 100 with --peer)")  # fmt: skip
    p.add_argument("--peer", choices=PEERS, default=None,
                   help="measure Ferry, this peer, Ferry again (A/B/A) at each level instead of the Ferry-only "
                        "phases: `dynamo` (its frontend and mocker) or `ferry` (--peer-tree, --peer-args)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3,
                   help="--peer: rounds alternating Ferry and the peer, Ferry first (default 3: A/B/A); the "
                        "summary gives each level's medians and the ratio of each Ferry round to the peer's beside it")  # fmt: skip
    p.add_argument("--together", action="store_true",
                   help="--peer ferry: each pair of rounds runs both Ferrys at the same time, each with its own "
                        "clients, so both meet the same host (--rounds even: --rounds 6 is three pairs)")  # fmt: skip
    p.add_argument("--peer-tree", type=Path, default=None,
                   help="--peer ferry: the Ferry checkout to run as the peer (default this one)")  # fmt: skip
    p.add_argument("--peer-args", default="", help="--peer ferry: extra `ferry up` flags of the peer")
    p.add_argument("--ferry-args", default="", help="--peer: extra `ferry up` flags of this checkout's Ferry")
    p.add_argument(
        "--floor-round-trips", type=int, default=200, help="Kafka floor samples per series (default 200)"
    )
    p.add_argument("--floor-fetch-wait-ms", type=int, default=100,
                   help="consumer fetch_max_wait_ms of the floor; match the frontend's and workers' (default 100)")  # fmt: skip
    p.add_argument("--interference-seconds", type=float, default=15.0,
                   help="seconds of each tokenization-interference phase; 0 skips it (default 15)")  # fmt: skip
    p.add_argument("--long-prompt-chars", type=int, default=100_000, help="size of the long prompts")
    p.add_argument("--long-prompt-clients", type=int, default=1, help="clients sending long prompts")
    p.add_argument("--reuse-stack", action="store_true",
                   help="run every phase on one `ferry up` instead of a fresh one per phase")  # fmt: skip
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results file (default bench/results/overhead.json; overhead_<peer>.json with --peer)")  # fmt: skip
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG plot (default: beside --out, named like it; '' = none)")  # fmt: skip
    p.add_argument("--profile", type=Path, default=None,
                   help="directory for py-spy profiles of the frontend and workers during the busiest level "
                        "and the interference phase (perturbs the numbers)")  # fmt: skip
    args = p.parse_args(argv)
    args.concurrency = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency needs positive integers")
    peer = args.peer is not None
    if args.peer_tree is not None or args.peer_args:
        if args.peer != "ferry":
            p.error("--peer-tree and --peer-args need --peer ferry")
    if args.peer_tree is not None:
        args.peer_tree = args.peer_tree.resolve()
    if args.rounds < 2 or (args.rounds != 3 and not peer):
        p.error("--rounds needs --peer and at least 2 (one round of each system)")
    if args.together and (args.peer != "ferry" or args.rounds % 2):
        p.error("--together needs --peer ferry and an even --rounds (each pair of rounds runs at once)")
    if args.ferry_args and not peer:
        p.error("--ferry-args needs --peer")
    if peer and args.profile is not None:
        p.error("--profile is not supported with --peer")
    args.workers = args.workers if args.workers is not None else (2 if peer else 1)
    args.speedup = args.speedup if args.speedup is not None else (1000.0 if peer else 1e6)
    args.prompt_words = args.prompt_words if args.prompt_words is not None else (100 if peer else 0)
    if args.out is None:
        args.out = Path(f"bench/results/overhead_{args.peer}.json" if peer else "bench/results/overhead.json")
    if args.plot is None:
        # Beside its JSON: a trial written elsewhere (--out /tmp/x.json) leaves the committed plot alone.
        args.plot = args.out.with_suffix(".png")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its outputs."""
    args = parse_args(argv)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.peer is not None:
        results = run_cleanly(run_peer(args), uv=True)
        print_peer_table(results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.out}")
        return 0
    results = run_cleanly(run(args), uv=True)
    print_table(results)
    if results.get("profiles"):
        print()
        for name, prof in results["profiles"].items():
            print(f"py-spy {name} ({prof['samples']} samples), top self time:")
            for frame, share in prof["self_percent"][:8]:
                print(f"  {share:5.1f}%  {frame}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}", end="")
    if str(args.plot) and str(args.plot) != "." and plot(results, args.plot):
        print(f" and {args.plot}", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
