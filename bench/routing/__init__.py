"""Routing benchmark (issue 3, items 5 and 6): router policies of Ferry, and Dynamo's KV router, on the same
requests and the same simulated engines.

`python -m bench.routing` replays a scaled-down sample of the Mooncake conversation trace at several request
rates and a synthetic shared-prefix sweep against `ferry up --workers 8` once per router policy, and against
NVIDIA Dynamo 1.6.1 (`dynamo.frontend --router-mode kv` + `dynamo.mocker --num-workers 8`, installed into
its own venv by `bench.peers.dynamo`), one system after the other in one run. It reports time to first
token p50/p90/p99, inter-token latency, throughput, the cached fraction of prompt tokens the engines
reported and the best cached fraction any router could reach (an infinite cache that has seen every earlier
request), checks the targets, and writes JSON, a table and two PNG plots.

`python -m bench.routing decision` is the separate micro-benchmark of the router's decision time with 64
workers and one million indexed blocks (`bench.routing.decision`).
"""
