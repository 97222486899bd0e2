"""Settings of the operator tools: `ferry up` itself, the planner's policy and process (`ferry planner`,
`ferry up --autoscale`) and `ferry usage`. Declared like every other group in schemas/settings.py, one declaration per setting."""

from __future__ import annotations

import dataclasses
from typing import Literal

from schemas.settings import CommonSettings, _help


@dataclasses.dataclass(kw_only=True)
class PlannerPolicySettings:
    """Autoscaling: the planner's targets and limits (planner/policy.py); `ferry up --autoscale` takes them."""

    min_workers: int = dataclasses.field(default=1, metadata=_help("fewest workers the planner keeps"))
    max_workers: int = dataclasses.field(default=8, metadata=_help("most workers the planner starts"))
    ttft_p90_target_s: float = dataclasses.field(
        default=1.0, metadata=_help("SLO: 90th percentile of time to first token, seconds")
    )
    itl_p90_target_s: float = dataclasses.field(
        default=0.05, metadata=_help("SLO: 90th percentile of inter-token latency, seconds")
    )
    planner_interval_s: float = dataclasses.field(
        default=5.0, metadata=_help("seconds between two observations and decisions of the planner")
    )
    target_utilisation: float = dataclasses.field(
        default=0.75, metadata=_help("size workers to run at this share of their estimated capacity")
    )
    scale_in_utilisation: float = dataclasses.field(
        default=0.5,
        metadata=_help("remove a worker only when the others would run below this share of capacity"),
    )
    scale_out_cooldown_s: float = dataclasses.field(
        default=10.0, metadata=_help("least time between two scale-outs")
    )
    scale_in_cooldown_s: float = dataclasses.field(
        default=30.0, metadata=_help("least time from any scaling to a scale-in")
    )
    scale_in_stable: int = dataclasses.field(
        default=3, metadata=_help("intervals in a row that fewer workers must suffice before one drains")
    )
    worker_capacity: float = dataclasses.field(
        default=16.0,
        metadata=_help(
            "concurrent sequences one worker is first assumed to hold within the targets; learnt from then on"
        ),
    )
    worker_start_s: float = dataclasses.field(
        default=10.0,
        metadata=_help("how long a new worker takes to be ready; load is forecast this far ahead"),
    )
    kv_usage_high: float = dataclasses.field(
        default=0.9, metadata=_help("mean KV usage of the workers at which one more is started")
    )
    batch_max_workers: int = dataclasses.field(
        default=2, metadata=_help("workers batch backlog may add above what interactive load needs")
    )
    batch_horizon_s: float = dataclasses.field(
        default=300.0, metadata=_help("size batch workers to clear the pool topic's backlog within this long")
    )


PlannerActuator = Literal["none", "kubernetes"]
PlannerPool = Literal["all", "prefill", "decode"]


@dataclasses.dataclass(kw_only=True)
class PlannerSettings(CommonSettings, PlannerPolicySettings):
    """Settings of the planner process (`ferry planner`)."""

    frontends: str = dataclasses.field(
        default="",
        metadata=_help(
            "comma-separated frontend URLs whose /metrics give TTFT and ITL; empty = every frontend of the model "
            "announced in the registry (unless --prometheus)"
        ),
    )
    prometheus: str = dataclasses.field(
        default="", metadata=_help("Prometheus URL to query TTFT, ITL and request rate from")
    )
    planner_pool: PlannerPool = dataclasses.field(
        default="all",
        metadata=_help(
            "the workers this planner sizes: all of the model's; prefill = its prefill workers (by TTFT); decode = "
            "the others (by ITL). With both pools, run one planner per pool, each with its own Deployment"
        ),
    )
    actuator: PlannerActuator = dataclasses.field(
        default="none",
        metadata=_help(
            "none = only publish ferry_planner_desired_workers (for KEDA); kubernetes = patch a Deployment"
        ),
    )
    k8s_api: str = dataclasses.field(
        default="", metadata=_help("Kubernetes API URL; empty = the pod's service account (in-cluster)")
    )
    k8s_namespace: str = dataclasses.field(
        default="", metadata=_help("namespace of the worker Deployment; empty = the pod's own")
    )
    k8s_deployment: str = dataclasses.field(
        default="ferry-worker", metadata=_help("name of the worker Deployment to scale")
    )
    planner_host: str = dataclasses.field(default="127.0.0.1", metadata=_help("bind address of /metrics"))
    planner_port: int = dataclasses.field(default=9200, metadata=_help("port of the planner's /metrics"))


UsageGroup = Literal["tenant", "model", "key"]


@dataclasses.dataclass(kw_only=True)
class UsageSettings:
    """`ferry usage`: tenants' usage summed from the usage topic (cost attribution)."""

    kafka: str = dataclasses.field(default="127.0.0.1:9092", metadata=_help("Kafka bootstrap servers"))
    since: str = dataclasses.field(
        default="24h",
        metadata=_help(
            "from when: a duration back from now (`90m`, `24h`, `7d`) or an ISO time (UTC if no zone)"
        ),
    )
    by: UsageGroup = dataclasses.field(
        default="tenant", metadata=_help("group by tenant, model or key (key id)")
    )
    csv: bool = dataclasses.field(default=False, metadata=_help("CSV instead of a table"))


@dataclasses.dataclass(kw_only=True)
class StackSettings:
    """Settings of `ferry up` itself (it also takes the frontend's and the workers')."""

    workers: int = dataclasses.field(
        default=2,
        metadata=_help("number of aggregated workers (role both) to start; may be 0 with the pools below"),
    )
    prefill_workers: int = dataclasses.field(
        default=0, metadata=_help("number of prefill workers (role prefill, disaggregated serving) to start")
    )
    decode_workers: int = dataclasses.field(
        default=0, metadata=_help("number of decode workers (role decode, disaggregated serving) to start")
    )
    prefill_flags: str = dataclasses.field(
        default="",
        metadata=_help(
            "flags given to the prefill workers only, after those every worker gets (where both set one, "
            "this wins): `ferry worker` flags, then vLLM engine flags after `--`, e.g. "
            "\"--max-num-batched-tokens 8192 -- --kv-transfer-config '{...}'\""
        ),
    )
    decode_flags: str = dataclasses.field(
        default="",
        metadata=_help(
            "flags given to the decode workers only, as --prefill-flags are to the prefill workers, e.g. "
            '"--max-num-seqs 64"'
        ),
    )
    kafka: str = dataclasses.field(
        default="", metadata=_help("use this Kafka instead of starting the embedded broker")
    )
    redis: str = dataclasses.field(
        default="", metadata=_help("use this Redis instead of starting an embedded one")
    )
    monitor: bool = dataclasses.field(
        default=False,
        metadata=_help(
            "also start Prometheus (`make prometheus` installs it) scraping the stack through discovery"
        ),
    )
    ready_timeout_s: float = dataclasses.field(
        default=120.0, metadata=_help("give up if the stack is not ready within this many seconds")
    )
    autoscale: bool = dataclasses.field(
        default=False,
        metadata=_help(
            "run the planner: --workers is the starting count, between --min-workers and --max-workers (with "
            "--prefill-workers and --decode-workers, one planner per pool, each pool between them)"
        ),
    )
