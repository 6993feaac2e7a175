"""Prometheus metrics of one worker (README.md, "Metrics"), on a registry of its own.

Label values are bounded: tenants and adapters come from the registry (not from job payloads), and
anything unregistered is counted under UNREGISTERED, which no tenant id can be; routing reasons and DLQ codes are the
closed sets ROUTE_LABELS and DLQ_CODES, anything else counted under OTHER (`WorkerMetrics.route` and `.dead_letter`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from consumer.health import Health, serve
from consumer.routing import REASONS

# The tenant label of jobs whose tenant is not registered. Tenant ids start with a letter or digit: "unknown", the label
# before, was one, and a tenant registered as `unknown` had every unregistered tenant's requests counted as its own.
UNREGISTERED = "(unregistered)"
# A label value outside its closed set (a code added without adding it here): one series, never one per value.
OTHER = "(other)"
# lora_route_decision_total{reason}: the routing reasons, and the codes of the jobs that could not be routed.
ROUTE_ERRORS = ("unknown_tenant", "unknown_adapter", "adapter_forbidden", "no_adapter", "adapter_circuit_open", "routing_failed")
ROUTE_LABELS = REASONS + ROUTE_ERRORS
# lorabatch_dlq_total{code}: jobs that could not be read (intake), results the broker would not take (delivery), usage
# rows the ledger refused.
DLQ_CODES = ("malformed_json", "invalid_job", "message_too_large", "undecodable_batch", "unprocessable", "result_too_large",
             "result_undeliverable", "ledger_rejected")


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lora_request_total", "Requests finished", ["tenant", "adapter", "status"], registry=r)
        self.duration = Histogram(
            "lora_request_duration_seconds", "Arrival to result, per request", ["tenant"], registry=r,
            # to an hour: a batch job queued behind a backlog waits minutes, and its p99 must stay readable
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
        )
        self.route_decisions = Counter("lora_route_decision_total", "Routing decisions", ["reason"], registry=r)
        self.routing_cost = Counter("lora_routing_ms_total", "Routing decision ms of succeeded requests", ["tenant"], registry=r)
        self.lora_cost = Counter("lora_compute_ms_total", "LoRA compute GPU ms of succeeded requests", ["tenant"], registry=r)
        self.cold_start = Histogram(
            "lora_cold_start_duration_ms", "Adapter load time", ["tier"], registry=r,
            buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 5000),
        )
        self.memory_used = Gauge("lora_memory_used_bytes", "Bytes of adapters resident on the device", registry=r)
        self.kv_used_blocks = Gauge("kv_pool_used_blocks", "KV cache blocks in use", registry=r)
        self.kv_hit_rate = Gauge("kv_pool_hit_rate", "Share of prompt tokens found in the prefix cache", registry=r)
        self.warm_pool_hit_rate = Gauge("lora_warm_pool_hit_rate", "Share of adapter requests that found it in memory", registry=r)
        self.dlq = Counter("lorabatch_dlq_total", "Messages sent to the DLQ", ["code"], registry=r)
        self.engine_restarts = Counter("lorabatch_engine_restarts_total", "Engine processes started again after one died",
                                       registry=r)
        self.engine_stalls = Counter("lorabatch_engine_stalls_total", "Engine processes killed for answering nothing for "
                                     "worker.engine_stall_s", registry=r)
        self.worker_id_conflicts = Counter("lorabatch_worker_id_conflicts_total", "Refreshes of this worker's id lease "
                                           "that found another worker holding the id", registry=r)
        self.partitions_lost = Counter("lorabatch_partitions_lost_total", "Partitions the group took from this worker "
                                       "after its session expired (a frozen or starved process)", registry=r)
        self.queue_depth = Gauge("lorabatch_queue_depth", "Jobs waiting for the engine, per tenant", ["tenant"], registry=r)
        self.in_flight = Gauge("lorabatch_in_flight", "Jobs fetched and not yet committed", registry=r)
        self.batches = Counter("lorabatch_batches_total", "Engine batches run", registry=r)
        self.batch_size = Histogram(
            "lorabatch_batch_size", "Requests per engine batch", registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
        )
        self.consumer_lag = Gauge("lorabatch_consumer_lag", "Messages behind the log end, per assigned partition",
                                  ["partition"], registry=r)
        self.route_decision = Histogram(
            "lora_route_decision_seconds", "Time to decide a job's adapter", registry=r,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
        )
        self.route_cache_errors = Counter("lora_route_cache_errors_total", "Routing cache (Redis) failures", registry=r)
        self.route_cache_poisoned = Counter("lora_route_cache_poisoned_total", "Routing cache (Redis) entries passed over "
                                            "or rewritten: a value that is no adapter reference (not UTF-8, too long), or "
                                            "a key of the cache's holding another type", registry=r)
        self.circuit_open = Gauge("lora_adapter_circuits_open", "Adapters whose circuit breaker is open", registry=r)
        # Faults: each wait below has a gauge that is 1 while it lasts and a log line saying what it waits for.
        self.waiting = Gauge("lorabatch_waiting", "1 while the worker waits on this dependency (broker, redis, ledger, spool)", ["on"], registry=r)
        self.retries = Counter("lorabatch_retries_total", "Retries of a failed publish, spool or ledger write, or offset commit", ["what"], registry=r)
        self.undeliverable = Counter("lorabatch_undeliverable_total", "Messages the broker refused even in their small form", registry=r)
        self.spool_records = Gauge("lorabatch_spool_records", "Ledger records waiting in the local spool", registry=r)
        self.ledger_up = Gauge("lorabatch_ledger_up", "1 while the ledger takes writes", registry=r)
        self.spool_up = Gauge("lorabatch_spool_up", "1 while the local spool takes writes; 0 from a write that failed (its "
                              "disk full) until one succeeds", registry=r)
        self.ledger_schema_ok = Gauge("lorabatch_ledger_schema_ok", "0 while the ledger's schema is missing or behind", registry=r)
        self.log_resets = Counter("lorabatch_log_resets_total", "Partitions whose log was reset under the worker's marks", registry=r)
        self.replays = Counter("lorabatch_replayed_results_total", "Jobs answered from a stored result instead of run",
                               ["source"], registry=r)
        self.fetch_errors = Counter("lorabatch_fetch_errors_total", "Fetches from the broker that failed", registry=r)
        # consumer.stages: the seven stages of a job's way through the worker; `stage` takes those seven values only.
        self.stage = Histogram(
            "lorabatch_stage_seconds", "Time of each job in each worker stage (fetch, route, queue, engine, publish, "
            "ledger, commit)", ["stage"], registry=r,
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
        )
        self.stage_dropped = Counter("lorabatch_stage_records_dropped_total", "Jobs whose commit stage was not observed: "
                                     "billed while the worker held its bound of jobs waiting for commits that failed",
                                     registry=r)
        self.gpu_idle = Gauge("lorabatch_gpu_idle_share", "Share of the time the engine held jobs in which its steps "
                              "computed nothing, over the last busy-time window", registry=r)
        self.http_dropped = Counter("lorabatch_http_connections_dropped_total", "Connections to this port closed "
                                    "unanswered: busy (too many open at once) or deadline (open too long)", ["why"],
                                    registry=r)
        self.ledger_up.set(1)
        self.spool_up.set(1)
        self.ledger_schema_ok.set(1)
        self.health = Health(r)  # /healthz and /readyz, served beside /metrics
        self.server = None

    def route(self, reason: str) -> None:
        """Count one routing decision (or failure) under its reason; one outside ROUTE_LABELS under OTHER."""
        self.route_decisions.labels(reason if reason in ROUTE_LABELS else OTHER).inc()

    def dead_letter(self, code: str) -> None:
        """Count one DLQ record under its code; one outside DLQ_CODES under OTHER."""
        self.dlq.labels(code if code in DLQ_CODES else OTHER).inc()

    def _dropped(self, why: str) -> None:
        self.http_dropped.labels(why if why in ("busy", "deadline") else OTHER).inc()

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve /metrics, /healthz and /readyz (consumer.health) on `host`:`port`; an address that cannot be had is a
        ConfigError naming it and the keys that set it."""
        try:
            self.server = serve(port, self.registry, self.health, addr=host, dropped=self._dropped)
        except OSError as e:
            from consumer.config import ConfigError

            raise ConfigError(f"cannot serve metrics on port {port} of {host} ({e.strerror or e}); set "
                              f"worker.metrics_port (or --metrics-port) to a free port, or 0 for none, and "
                              f"worker.metrics_host to an address of this host") from e
