"""The declaration of every setting: one settings object per process, grouped by concern.

Each field of a settings class becomes a flag (`worker_id` -> `--worker-id`) whose default comes from
the environment (`FERRY_WORKER_ID`) and then from the class (launch/flags.py reads them). The launcher
passes settings to child processes as flags, so the names here are a contract between processes.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path
from typing import Any, Literal

from schemas.engine_settings import SimSettings, VLLMSettings
from schemas.setting_help import _help
from schemas.status import WorkerRole

ENV_PREFIX = "FERRY_"

RouterPolicy = Literal["kv", "round_robin", "random", "least_loaded"]
KVLookup = Literal["mirror", "redis"]
DecodeLoad = Literal["distinct", "sequences"]
DisaggFirstToken = Literal["decode", "prefill"]
EngineName = Literal["sim", "vllm"]
# vLLM's names of the tool-call formats the frontend reads (server/tool_parsers/); "" = none.
ToolCallParser = Literal["", "hermes", "llama3_json", "mistral"]


def values_of(settings: object, group: type[Any]) -> dict[str, Any]:
    """What `settings` holds for the fields of `group`, one of the settings groups it is made of."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(group)}


def default_home() -> Path:
    """Where Ferry keeps prepared models and other local state."""
    return Path(os.environ.get("FERRY_HOME", Path.home() / ".cache" / "ferry"))


def default_model_path() -> str:
    """The directory `ferry model prepare` builds the default model into."""
    return os.environ.get("FERRY_MODEL_DIR", str(default_home() / "models" / DEFAULT_MODEL_NAME))


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_served_name(model_path: str) -> str:
    """The name clients ask for when none is set: a GGUF file's name without `.gguf` (the name of the
    directory it is converted into), else the default model's, whatever the directory."""
    path = Path(model_path)
    return path.stem if path.suffix.lower() == ".gguf" and not path.is_dir() else DEFAULT_MODEL_NAME


@dataclasses.dataclass(kw_only=True)
class CommonSettings:
    """Where the shared services are."""

    kafka: str = dataclasses.field(default="127.0.0.1:9092", metadata=_help("Kafka bootstrap servers"))
    redis: str = dataclasses.field(default="redis://127.0.0.1:6379/0", metadata=_help("Redis URL"))
    redis_prefix: str = dataclasses.field(default="ferry:", metadata=_help("prefix of every Redis key"))
    model_path: str = dataclasses.field(
        default_factory=default_model_path,
        metadata=_help(
            "model directory (tokenizer, config), or a GGUF file: converted once into a directory under "
            "$FERRY_HOME/models named after the file, which later starts reuse",
            default=f"$FERRY_HOME/models/{DEFAULT_MODEL_NAME}",
        ),
    )
    served_model_name: str = dataclasses.field(
        default="",
        metadata=_help(
            "model name clients ask for",
            default=f"{DEFAULT_MODEL_NAME}; for a GGUF --model, the file name without .gguf",
        ),
    )
    heartbeat_interval_s: float = dataclasses.field(
        default=1.0, metadata=_help("seconds between worker heartbeats; a worker is dead after 3 missed")
    )
    log_level: str = dataclasses.field(default="info", metadata=_help("debug, info, warning, error"))
    kafka_fetch_wait_ms: int = dataclasses.field(
        default=5,
        metadata=_help(
            "longest a consumer's fetch waits for data; keep small with brokers that do not answer a "
            "waiting fetch as soon as data arrives"
        ),
    )
    doorbell: bool = dataclasses.field(
        default=True,
        metadata=_help(
            "idle readers on the token path stop fetching until there is something to read: a worker's "
            "requests until a frontend or prefill worker rings it through Redis pub/sub, a frontend's "
            "replies until it opens a stream and, between a stream's records, until a worker rings it, "
            "and a frontend's caught-up KV log reader until a worker writes to the log "
            "(a sleeping reader still fetches once a second, every 250 ms while a stream is open); "
            "--no-doorbell = fetch every --kafka-fetch-wait-ms however idle"
        ),
    )
    pool_partitions: int = dataclasses.field(
        default=16,
        metadata=_help(
            "partitions of each ferry.pool.<model> topic (batch work); at least the number of workers that "
            "should share it"
        ),
    )
    request_roll_s: float = dataclasses.field(
        default=0.0,
        metadata=_help(
            "send requests to a fresh per-worker topic every this many seconds of the wall clock and delete "
            "the read ones (the embedded broker never trims a topic); frontends and workers must use the "
            "same value and clocks that agree to well within it; 0 = one topic per worker. `ferry up` "
            "starting its embedded broker passes 60 to its children unless this is set"
        ),
    )
    pool_roll_s: float = dataclasses.field(
        default=0.0,
        metadata=_help(
            "write batch items and their results to fresh ferry.pool.<model>.e<epoch> and "
            "ferry.batch.results.<model>.e<epoch> topics every this many seconds of the wall clock and delete "
            "each past epoch once its consumer group has read all of it (the embedded broker never trims a "
            "topic); frontends and workers must use the same value; 0 = one topic each for good. `ferry up` "
            "starting its embedded broker passes 3600 to its children unless this is set"
        ),
    )
    kv_log: bool = dataclasses.field(
        default=True,
        metadata=_help(
            "workers also write their KV events and snapshots to ferry.kv.<model>.e<epoch>; frontends keep a "
            "copy and write it back into a Redis that came back empty; --no-kv-log = Redis only"
        ),
    )
    kv_log_roll_s: float = dataclasses.field(
        default=60.0,
        metadata=_help(
            "a fresh KV log topic every this many seconds of the wall clock, each opening with every "
            "worker's snapshot; older ones are deleted (frontends and workers must agree)"
        ),
    )
    kafka_request_retention_s: float = dataclasses.field(
        default=3600.0,
        metadata=_help(
            "retention.ms of the request and admin topics Ferry creates (Kafka deletes older records)"
        ),
    )
    kafka_batch_retention_s: float = dataclasses.field(
        default=172_800.0,
        metadata=_help(
            "retention.ms of the pool and batch topics Ferry creates; longer than the longest batch window"
        ),
    )
    kafka_retention_bytes: int = dataclasses.field(
        default=1 << 30,
        metadata=_help("retention.bytes (per partition) of every topic Ferry creates; -1 = no size bound"),
    )

    def __post_init__(self) -> None:
        # Every process derives the same name from the same --model, so a frontend and its workers agree.
        if not self.served_model_name:
            self.served_model_name = default_served_name(self.model_path)


@dataclasses.dataclass(kw_only=True)
class RouterSettings:
    """Routing: how a frontend picks a worker (server/router.py)."""

    router_policy: RouterPolicy = dataclasses.field(
        default="kv", metadata=_help("how to pick a worker: kv = longest cached prefix weighed against load")
    )
    overlap_weight: float = dataclasses.field(
        default=1.0, metadata=_help("kv: weight of prefill work (uncached prompt blocks) against decode load")
    )
    host_block_weight: float = dataclasses.field(
        default=0.75,
        metadata=_help("kv: a cached block on a worker's host tier counts as this much of a device block"),
    )
    disagg_min_uncached_tokens: int = dataclasses.field(
        default=0,
        metadata=_help(
            "disaggregated serving: a prompt with fewer uncached tokens than this on its decode worker is "
            "prefilled there instead of on a prefill worker; 0 = always a prefill worker (Dynamo's "
            "conditional threshold is 2048)"
        ),
    )
    disagg_first_token: DisaggFirstToken = dataclasses.field(
        default="decode",
        metadata=_help(
            "disaggregated serving: when the client gets a sequence's first token: decode = as its decode "
            "worker starts it, one decode step before the second (the stream keeps the decode worker's pace, as "
            "Dynamo and vLLM's P/D proxy stream it); prefill = as soon as the prefill worker has it (time to "
            "first token shorter by the hand-off, the first inter-token gap longer by as much)"
        ),
    )
    router_temperature: float = dataclasses.field(
        default=0.0, metadata=_help("kv: 0 = always the cheapest worker; > 0 samples by softmax of cost")
    )
    kv_events: bool = dataclasses.field(
        default=True,
        metadata=_help(
            "kv: use the workers' KV events in Redis; --no-kv-events = the router's own decisions"
        ),
    )
    kv_lookup: KVLookup = dataclasses.field(
        default="mirror",
        metadata=_help(
            "kv: where a route's cached prefixes are read: mirror = this frontend's copy of the KV log once it "
            "has caught up (no round trip; Redis until then and without --kv-log), redis = the index in Redis"
        ),
    )
    approx_ttl_s: float = dataclasses.field(
        default=120.0, metadata=_help("kv --no-kv-events: how long a routed prompt counts as cached")
    )
    inflight_overlap: bool = dataclasses.field(
        default=True,
        metadata=_help("kv: count prompt blocks of sequences this frontend sent a worker as held there"),
    )
    decode_load: DecodeLoad = dataclasses.field(
        default="distinct",
        metadata=_help("kv: charge decode load per distinct block (as engines store it) or per sequence"),
    )
    decode_reread_weight: float = dataclasses.field(
        default=0.1,
        metadata=_help(
            "kv, --decode-load distinct: weight of the blocks decode steps read again (a prefix several "
            "decoding sequences share, read once per sequence); 0 = none, 1 = as --decode-load sequences"
        ),
    )
    busy_kv_usage: float = dataclasses.field(
        default=0.95, metadata=_help("skip workers whose KV usage is at least this")
    )
    busy_waiting: int = dataclasses.field(
        default=0, metadata=_help("skip workers with at least this many waiting requests; 0 = no limit")
    )


@dataclasses.dataclass(kw_only=True)
class BatchSettings:
    """Batch API: files, batches and their items (server/batch/)."""

    batch_dir: str = dataclasses.field(
        default="", metadata=_help("directory of uploaded and result files; empty = $FERRY_HOME/files")
    )
    batch_windows: str = dataclasses.field(
        default="24h",
        metadata=_help("completion windows a batch may ask for, comma-separated (e.g. 24h,10s)"),
    )
    batch_priority: int = dataclasses.field(
        default=100,
        metadata=_help("engine priority of batch items; interactive requests default to 0, lower runs first"),
    )
    batch_order: Literal["prefix", "submission"] = dataclasses.field(
        default="prefix",
        metadata=_help(
            "prefix = items sharing a prompt prefix run together on one worker; submission = file order"
        ),
    )
    batch_cancel_grace_s: float = dataclasses.field(
        default=5.0,
        metadata=_help("a cancelling batch is cancelled once every item is accounted for or after this long"),
    )
    batch_max_file_bytes: int = dataclasses.field(
        default=200 << 20, metadata=_help("largest file accepted by POST /v1/files")
    )
    batch_max_requests: int = dataclasses.field(
        default=50_000, metadata=_help("most requests in one batch file")
    )
    batch_api: bool = dataclasses.field(
        default=True,
        metadata=_help(
            "serve the Files and Batches API; off: a frontend for interactive traffic only, in no batch "
            "consumer group (batch routes answer 404)"
        ),
    )
    batch_kafka_intake: bool = dataclasses.field(
        default=True, metadata=_help("take Kafka-native batch items from ferry.batch.submit.<model>")
    )


@dataclasses.dataclass(kw_only=True)
class FrontendSettings(CommonSettings, RouterSettings, BatchSettings):
    """Settings of one frontend process (`ferry frontend`)."""

    host: str = dataclasses.field(default="127.0.0.1", metadata=_help("HTTP bind address"))
    port: int = dataclasses.field(default=8000, metadata=_help("HTTP port (`ferry up`: 0 = any free port)"))
    frontend_id: str = dataclasses.field(
        default_factory=lambda: f"fe-{secrets.token_hex(4)}",
        metadata=_help("unique id; names this frontend's replies topic", default="fe-<random>"),
    )
    replies_roll_records: int = dataclasses.field(
        default=4_000,
        metadata=_help(
            "start a fresh replies topic after this many records (the embedded broker's fetches slow down "
            "as a partition grows); 0 = one topic for the frontend's life"
        ),
    )
    busy_wait_s: float = dataclasses.field(
        default=5.0, metadata=_help("when every worker is busy, wait this long for one before 503")
    )
    max_queued_requests: int = dataclasses.field(
        default=256, metadata=_help("requests that may wait for a non-busy worker at once; more get 503")
    )
    max_concurrent_requests: int = dataclasses.field(
        default=2048, metadata=_help("requests in flight before new ones get 503")
    )
    max_body_bytes: int = dataclasses.field(default=8 << 20, metadata=_help("largest accepted request body"))
    sse_keepalive_s: float = dataclasses.field(
        default=15.0, metadata=_help("send an SSE comment after this long without data")
    )
    request_timeout_s: float = dataclasses.field(
        default=600.0, metadata=_help("give up on a request with no progress for this long")
    )
    kafka_timeout_s: float = dataclasses.field(
        default=5.0, metadata=_help("how long a produce may take before the request gets 503")
    )
    migration_limit: int = dataclasses.field(
        default=3,
        metadata=_help("times a sequence may move to another worker after its worker died; 0 = never"),
    )
    delivery_check_s: float = dataclasses.field(
        default=10.0,
        metadata=_help(
            "a request with no answer this long is looked up in its worker's topic; if the broker lost it "
            "(restarted empty), it is sent again"
        ),
    )
    resume_grace_s: float = dataclasses.field(
        default=30.0,
        metadata=_help(
            "a resumable stream (header `x-ferry-resumable: 1`) keeps running this long after its client "
            "left, and as long as a resumed reader is attached"
        ),
    )
    resume_ttl_s: float = dataclasses.field(
        default=600.0, metadata=_help("how long a resumable stream can be resumed after it started")
    )
    tokenize_threshold_chars: int = dataclasses.field(
        default=2048, metadata=_help("tokenize prompts longer than this off the event loop")
    )
    log_prompts: bool = dataclasses.field(
        default=False,
        metadata=_help(
            "write prompt texts to the log (at info); when off, no prompt text or token id is logged"
        ),
    )
    api_keys: str = dataclasses.field(
        default="",
        metadata=_help(
            "comma-separated API keys; when set, every route but /health, /ready, /metrics and /openapi.json "
            "needs `Authorization: Bearer <key>`; prefer the variable (flags show in `ps`)"
        ),
    )
    admin_key: str = dataclasses.field(
        default="",
        metadata=_help(
            "key for /v1/admin/* (and every other route); unset with --api-keys = admin routes closed"
        ),
    )
    tenants: str = dataclasses.field(
        default="",
        metadata=_help(
            "tenants file (TOML, docs/tenants.md): `[tenants.<name>]` with api_keys, weight, "
            "requests_per_minute, tokens_per_minute, max_concurrent, priority; when set, only its keys (and "
            "the admin key) are accepted, and --api-keys must be empty"
        ),
    )
    tenants_fail_open: bool = dataclasses.field(
        default=True,
        metadata=_help(
            "while Redis does not answer, admit tenants' requests without checking their quotas (logged, "
            "metric ferry_tenant_quota_unchecked); --no-tenants-fail-open refuses them with 503 instead"
        ),
    )
    tenants_fair: bool = dataclasses.field(
        default=True,
        metadata=_help(
            "while every worker is busy, admit tenants' requests in weighted-fair order, and give each an engine "
            "priority by its tenant's standing (docs/tenants.md); --no-tenants-fair admits them in arrival order "
            "with the body's priority, as without tenants (for comparison)"
        ),
    )
    tenants_reserve: int = dataclasses.field(
        default=1,
        metadata=_help(
            "running slots per worker (of its --max-num-seqs) kept free for the tenant of best standing while it "
            "is active: the tenants behind it wait in the fair queue rather than fill them (docs/tenants.md); "
            "nothing is kept while a single tenant is active; 0 = keep none"
        ),
    )
    chat_template: str = dataclasses.field(
        default="",
        metadata=_help(
            "chat template instead of the model's own: a file, a template shipped with Ferry (`hermes`: "
            "ChatML with tools, for the default model), or the template text; empty = the model's"
        ),
    )
    tool_call_parser: ToolCallParser = dataclasses.field(
        default="",
        metadata=_help(
            "how to read tool calls in the model's output for `tool_choice: auto` (hermes, llama3_json, "
            "mistral, as vLLM's --tool-call-parser); empty = auto tool choice is refused"
        ),
    )


@dataclasses.dataclass(kw_only=True)
class PoolSettings:
    """Batch work: the ferry.pool.<model> consumer (workers/pool_consumer.py)."""

    pool: bool = dataclasses.field(
        default=True, metadata=_help("take batch work from ferry.pool.<model> when there is spare capacity")
    )
    pool_max_inflight: int = dataclasses.field(
        default=32, metadata=_help("most batch sequences this worker runs at once")
    )
    pool_max_kv_usage: float = dataclasses.field(
        default=0.8, metadata=_help("take no batch work while KV usage is at least this")
    )
    pool_session_timeout_s: float = dataclasses.field(
        default=6.0, metadata=_help("a worker silent for this long loses its batch partitions to the others")
    )


@dataclasses.dataclass(kw_only=True)
class WorkerSettings(CommonSettings, SimSettings, VLLMSettings, PoolSettings):
    """Settings of one worker process (`ferry worker`)."""

    worker_id: str = dataclasses.field(
        default_factory=lambda: f"w-{secrets.token_hex(4)}",
        metadata=_help("unique id; names this worker's requests topic", default="w-<random>"),
    )
    engine: EngineName = dataclasses.field(
        default="sim", metadata=_help("inference engine: sim (simulated) or vllm (needs vLLM installed)")
    )
    role: WorkerRole = dataclasses.field(
        default="both",
        metadata=_help(
            "disaggregated serving: prefill (prompts only), decode (continues prefilled sequences, prefills "
            "short prompts itself) or both (aggregated); with --engine vllm, prefill and decode need vLLM's "
            "--kv-transfer-config (the connector that moves the prompt's KV)"
        ),
    )
    busy_fetch_wait_ms: int = dataclasses.field(
        default=50,
        metadata=_help(
            "while the engine is busy (beyond sequences with one token to go), the inbox's fetch waits up to "
            "half the engine's step, at most this long (never less than --kafka-fetch-wait-ms): fewer "
            "wake-ups on the engine's cores; 0 = off"
        ),
    )
    reply_linger_ms: float = dataclasses.field(
        default=2.0,
        metadata=_help(
            "send reply records at most this often (Kafka's linger.ms, for the outbox): when the engine steps "
            "faster, one record carries several steps' tokens; a sequence's first token, a worker's only "
            "sequence and an engine whose steps take longer never wait; 0 = every step's output at once"
        ),
    )
    metrics_host: str = dataclasses.field(default="127.0.0.1", metadata=_help("bind address of /metrics"))
    metrics_port: int = dataclasses.field(default=0, metadata=_help("port of /metrics; 0 = any free port"))
    drain_grace_s: float = dataclasses.field(
        default=30.0, metadata=_help("on SIGTERM, how long in-flight requests may take to finish")
    )
    canary_wait_s: float = dataclasses.field(
        default=10.0,
        metadata=_help(
            "send a one-token canary generation after this many seconds idle (or busy with no token); 0 = off"
        ),
    )
    canary_timeout_s: float = dataclasses.field(
        default=10.0,
        metadata=_help(
            "a canary with no token within this long means a hung engine: the worker exits with 1"
        ),
    )
