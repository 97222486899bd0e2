"""The system's own cost: what Ferry adds to a request when the engine takes no time at all.

`python -m bench.overhead` starts `ferry up` on a free loopback port with the simulated engine sped up so
far (`--speedup 1e6`) that engine time is ~0, then measures, through one frontend:

- time to first token (p50/p90/p99), inter-token latency (p50/p99, the gap between SSE events carrying
  text) and streamed tokens per second (from the `usage` chunk; `ignore_eos` makes every request generate
  exactly `--max-tokens`) at each concurrency level; every level stops after `--requests-per-level`
  requests or `--level-seconds`, whichever comes first;
- the floor to compare with: a produce -> consume round trip through the same Kafka broker (aiokafka);
- whether tokenizing huge prompts stalls other streams: the same concurrency-16 streaming load twice, once
  alone and once while another client keeps sending ~100k-character prompts to /v1/completions.

Each phase runs on a fresh `ferry up` (`--reuse-stack` shares one): Tansu's per-record cost grows with the
length of a partition, so a shared broker would make later phases pay for the records of earlier ones. The
CPU of every stack process, of this client and of the rest of the machine is recorded per phase.

It prints a table, writes JSON (with the machine, Python version and git commit) and draws a PNG plot when
matplotlib is installed (an optional benchmark dependency: `pip install matplotlib`). `--profile DIR`
also samples the frontend and workers with py-spy during the busiest level (this perturbs the numbers).
"""

from bench.overhead.measure import PhaseResult, chat_body, ms, pct, run_streams
from bench.overhead.profile import hotspots, py_spy_binary
from bench.overhead.report import machine_info

__all__ = [
    "PhaseResult",
    "chat_body",
    "hotspots",
    "machine_info",
    "ms",
    "pct",
    "py_spy_binary",
    "run_streams",
]
