"""The service's configuration: one TOML file, validated once at the process edge.

Each subsystem owns its section's model (`engine.config.EngineConfig`, `billing.config.LedgerConfig`);
this module composes them and adds the Kafka, broker, worker and store sections. Every default is
written once, here or in the subsystem's model; `lorabatch config show` prints the effective result.

Lookup order for the file: `--config FILE`, then `$LORABATCH_CONFIG`, then `./lorabatch.toml` if it
exists, else the defaults alone.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from billing.config import LedgerConfig
from engine.config import EngineConfig

DEFAULT_FILE = Path("lorabatch.toml")
ENV_VAR = "LORABATCH_CONFIG"


class ConfigError(Exception):
    """The configuration file is missing, unparsable or invalid; the message names the key."""

    retriable = False


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KafkaConfig(_Section):
    bootstrap_servers: str = Field("127.0.0.1:9092", description="host:port[,host:port...] of the Kafka cluster")
    jobs_topic: str = "lorabatch.jobs"
    results_topic: str = "lorabatch.results"
    dlq_topic: str = "lorabatch.dlq"
    batches_topic: str = Field("lorabatch.batches", description="batch manifests written by `lorabatch submit`")
    group_id: str = "lorabatch-workers"
    partitions: int = Field(4, ge=1, le=1024, description="partitions of each topic the broker command creates")
    compression: Literal["gzip", "none"] = "gzip"
    partition_key: Literal["tenant", "adapter", "request"] = Field(
        "tenant", description="what `lorabatch submit` keys jobs by (see README: partition keys)"
    )
    max_message_bytes: int = Field(1_000_000, ge=1024, description="jobs larger than this go to the DLQ")


class BrokerConfig(_Section):
    """The embedded Tansu broker that the demo and tests start (production points at a real cluster)."""

    host: str = "127.0.0.1"
    port: int = Field(9092, ge=1, le=65535)
    state_dir: str = Field(".lorabatch/broker", description="pid file and log of the embedded broker")
    start_timeout_s: float = Field(20.0, gt=0)


class WorkerConfig(_Section):
    worker_id: str = Field("", description="empty: hostname-pid")
    max_batch_size: int = Field(32, ge=1, description="requests in one engine batch")
    max_batch_tokens: int = Field(8192, ge=1, description="prompt + new tokens in one engine batch")
    max_wait_ms: int = Field(50, ge=0, description="a bucket closes this long after its first job arrived")
    max_adapters_per_batch: int = Field(8, ge=1, description="distinct adapters in one engine batch")
    max_queued_jobs: int = Field(2048, ge=1, description="partitions pause while more jobs than this wait")
    commit_interval_ms: int = Field(200, ge=0, description="how often finished offsets are committed")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 disables the server")
    registry_refresh_s: float = Field(5.0, gt=0, description="how often the adapter registry is re-read")


class StoreConfig(_Section):
    adapter_dir: str = Field(".lorabatch/adapters", description="the content-addressed adapter store (L3)")


class Settings(_Section):
    kafka: KafkaConfig = KafkaConfig()
    broker: BrokerConfig = BrokerConfig()
    worker: WorkerConfig = WorkerConfig()
    store: StoreConfig = StoreConfig()
    engine: EngineConfig = EngineConfig()
    ledger: LedgerConfig = LedgerConfig()

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        if self.worker.max_batch_size > self.engine.max_batch_size:
            raise ValueError(
                f"worker.max_batch_size={self.worker.max_batch_size} exceeds engine.max_batch_size="
                f"{self.engine.max_batch_size}; lower the first or raise the second"
            )
        return self

    def to_toml(self) -> str:
        return tomli_w.dumps(self.model_dump(mode="json", exclude_none=True))


def _describe(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {key}: {e['msg']}")
    return "\n".join(lines)


def load_settings(path: str | os.PathLike | None = None, overrides: dict | None = None) -> Settings:
    """Read, merge and validate the configuration once; raise ConfigError naming the bad key."""
    if path is None:
        path = os.environ.get(ENV_VAR) or (DEFAULT_FILE if DEFAULT_FILE.exists() else None)
    data: dict = {}
    source = "the defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass --config with an existing TOML file")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, source)) from e
