"""Which of vLLM's KV connectors run on this machine's vLLM build (the CPU one here)?

`python -m bench.vllm.connectors` starts the real engine (`vllm.LLM`, the default model, fp32, eager) once per
case, each in a process of its own, and prints one line per case: whether the engine came up, whether a
generation ran, and what the connector did.

- `pd-producer` / `pd-consumer`: disaggregated prefill and decode through vLLM's example shared-storage
  connector (`ExampleConnector`): the producer prefills a prompt and writes its KV cache to files, a second
  engine (the consumer) reads them back instead of computing them, which shows as `num_cached_tokens` on a
  prompt it has never seen.
- `offloading`: the OffloadingConnector (KV offload to host memory, `kv_offloading_size`).
- `simple-offload`: the SimpleCPUOffloadConnector (the same idea, a simpler implementation).

Each case needs the model directory (`ferry model prepare`) and takes 1-3 minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from schemas.settings import default_model_path

CASES = ("pd-producer", "pd-consumer", "offloading", "simple-offload")
PROMPT = "Ferries cross the harbour every morning and carry commuters to the city. " * 12
_GIB = 1 << 30


def _engine_kwargs(case: str, store: str) -> dict[str, Any]:
    """The connector part of vLLM's engine arguments for one case."""
    from vllm.config import KVTransferConfig

    shared = {"shared_storage_path": store}
    if case == "pd-producer":
        return {"kv_transfer_config": KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_producer",
                                                       kv_connector_extra_config=shared)}  # fmt: skip
    if case == "pd-consumer":
        return {"kv_transfer_config": KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_consumer",
                                                       kv_connector_extra_config=shared)}  # fmt: skip
    if case == "offloading":
        return {"kv_offloading_size": 1, "kv_offloading_backend": "native"}
    return {"kv_transfer_config": KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                                                   kv_connector_extra_config={"cpu_bytes_to_use": _GIB // 4})}  # fmt: skip


def run_case(case: str, model: str, store: str) -> dict[str, Any]:
    """Start the engine with the case's connector and generate once; what happened, as a dict."""
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    out: dict[str, Any] = {"case": case}
    try:
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=2048, enable_prefix_caching=True,
                  kv_cache_memory_bytes=_GIB, **_engine_kwargs(case, store))  # fmt: skip
        out["init_s"] = round(time.monotonic() - started, 1)
        result = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
        out.update(ok=True, text=result.outputs[0].text, prompt_tokens=len(result.prompt_token_ids or []),
                   cached_tokens=result.num_cached_tokens)  # fmt: skip
        if case == "pd-producer":
            out["files_written"] = sum(len(files) for _, _, files in os.walk(store))
    except Exception as exc:
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    return out


def root_cause(stderr: str) -> str:
    """The first exception line the engine's own processes logged: the main process only says they failed."""
    for line in stderr.splitlines():
        text = line.split("] ", 1)[-1].strip()
        if ("Error: " in text or text.startswith("Exception: ")) and "initialization failed" not in text:
            return text
    return ""


def main(argv: list[str] | None = None) -> int:
    """Run every case (or those named) in a process of its own and print what each did."""
    p = argparse.ArgumentParser(prog="python -m bench.vllm.connectors", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--model", default=default_model_path())
    p.add_argument("--timeout-s", type=float, default=600.0, help="per case")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: run this case, print JSON
    p.add_argument("--store", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_case(args.one, args.model, args.store)), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="ferry-kv-connectors-") as store:
        for case in args.cases.split(","):
            cmd = [
                sys.executable,
                "-m",
                "bench.vllm.connectors",
                "--one",
                case,
                "--model",
                args.model,
                "--store",
                store,
            ]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s,
                                      cwd=Path(__file__).resolve().parents[2])  # fmt: skip
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
                result = json.loads(lines[-1][7:]) if lines else {"case": case, "ok": False,
                                                                  "error": (done.stderr or "no output")[-800:]}  # fmt: skip
                if not result.get("ok"):
                    result["root_cause"] = root_cause(done.stderr)
            except subprocess.TimeoutExpired:
                result = {"case": case, "ok": False, "error": f"no result within {args.timeout_s:.0f}s"}
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
