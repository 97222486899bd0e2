"""`python -m bench.soak`: sustained load on a `ferry up` stack for a set time, to see whether it drifts.

The stack (embedded broker, Redis, frontend, N workers) runs under a steady load for `--minutes` (default
60; `--smoke` 10): either `--concurrency N` streams back to back, or, without it, an open-loop arrival rate at
`--load-fraction` (default 0.7) of the capacity a short probe measured first. Every `--sample-s` seconds
every process's RSS and CPU are read (psutil, a process and its descendants); every request's TTFT, tokens
and outcome are kept, and summed per minute. The stack's log lines are written with their time since the
start of the load, and requests with a stalled first token are listed with the log lines around them.

The issue's targets are checked over windows proportional to the run (10 minutes of a 60-minute run, 2 of a
10-minute smoke): tokens/s of the last window >= 0.95x the first; TTFT p99 of every minute <= 2x the first
minute's; the least-squares RSS slope of every process after the settling time <= 1 MB/min; 0 failed
requests. Writes JSON and a PNG plot under bench/results/ and prints a summary.

`--engine vllm` runs the real engine (the default model, `make model`) with one worker at a few streams
(default 15 minutes, 4 streams); with `--peer vllm`, then the same soak (client, load, minutes, sampling,
engine settings) against vLLM's own OpenAI server, written next to Ferry's as `<name>-peer.json` and shown
side by side (bench/soak/peer.py). `--profile-at 1,9` samples the frontend and the first worker with py-spy
(`dump`, then `record --nonblocking`) at those minutes.
"""
