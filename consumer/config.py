"""The service's configuration: one TOML file, validated once at the process edge.

Each subsystem owns its section's model (`engine.config.EngineConfig`, `billing.config.LedgerConfig`);
this module composes them and adds the Kafka, broker, worker and store sections. Every default is
written once, here or in the subsystem's model; `lorabatch config show` prints the effective result.

Lookup order for the file: `--config FILE`, then `$LORABATCH_CONFIG`, then `./lorabatch.toml` if it
exists, else the defaults alone.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from pathlib import Path
from typing import Literal

import tomli_w
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from billing.config import LedgerConfig, url_without_password
from consumer.files import FileUnfit, read_bounded, shown_size
from engine.config import DEVICE_SIZED, EngineConfig, no_bool_for_number

DEFAULT_FILE = Path("lorabatch.toml")
ENV_VAR = "LORABATCH_CONFIG"


class ConfigError(Exception):
    """The configuration file is missing, unparsable or invalid; the message names the key."""

    retriable = False


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    _no_bool_for_number = field_validator("*", mode="before")(no_bool_for_number)


# Kafka's own rule for topic names (kafka.common.internals.Topic): a broker refuses any other, and the worker then waited
# for it for ever, as for a broker down.
TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
TOPIC_RULE = "1 to 249 ASCII letters, digits, '.', '_' or '-' (not '.' or '..')"


def _bad_server(entry: str) -> str | None:
    """Why `entry` of kafka.bootstrap_servers is no host[:port] that aiokafka can dial, or None (aiokafka raised a
    ValueError traceback from `submit` for a port that is not a number, and dialled port 99999)."""
    if not entry:
        return "is empty (a comma too many?)"
    if entry.startswith("["):  # [IPv6]:port
        host, _, rest = entry[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else (None if not rest else "?")
    elif entry.count(":") == 1:
        host, port = entry.split(":")
    else:  # a host name, or a bare IPv6 address: the default port, 9092
        host, port = entry, None
    if not host:
        return "has no host"
    if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        return f"has port {port!r}, not a number from 1 to 65535"
    return None


class KafkaConfig(_Section):
    bootstrap_servers: str = Field("127.0.0.1:9092", description="host:port[,host:port...] of the Kafka cluster")
    jobs_topic: str = "lorabatch.jobs"
    results_topic: str = "lorabatch.results"
    dlq_topic: str = "lorabatch.dlq"
    batches_topic: str = Field("lorabatch.batches", description="batch manifests written by `lorabatch submit`")
    group_id: str = Field("lorabatch-workers", min_length=1)
    partitions: int = Field(4, ge=1, le=1024, description="partitions of each topic the broker command creates")
    compression_type: Literal["none", "gzip", "snappy", "lz4", "zstd"] = Field(
        "gzip", validation_alias=AliasChoices("compression_type", "compression"),
        description="what lorabatch's producers compress with (jobs, results, DLQ records); workers read every codec")
    partition_key: Literal["tenant", "adapter", "adapter-balanced", "request"] = Field(
        "tenant", description="what `lorabatch submit` keys jobs by (see README: partition keys)"
    )
    # At most 256 MiB: the consumer fetches four times this, and Kafka's fetch sizes are 32-bit (2 GiB)
    max_message_bytes: int = Field(1_000_000, ge=1024, le=256 << 20, description="jobs larger than this go to the DLQ "
                                   "(at most 268435456, 256 MiB: fetches take four times this, and Kafka's fetch sizes stop at 2 GiB)")
    session_timeout_ms: int = Field(10_000, ge=1000, description="a worker that sends no heartbeat this long leaves the "
                                    "group, and its partitions go to the others (the broker's group.min/max.session."
                                    "timeout.ms bound it)")
    fetch_max_wait_ms: int = Field(100, ge=1, le=5_000, description="longest a fetch waits at the broker for records "
                                   "(Kafka answers as soon as any arrive; the embedded broker delivered a record 115 ms "
                                   "after it was produced with Kafka's default 500, 16 ms with 100: the latency of a "
                                   "job's way in and of its result's way out)")
    metadata_max_age_ms: int = Field(10_000, ge=500, le=3_600_000, description="how often a worker's consumer reads the "
                                     "topics' partitions anew: partitions added to the jobs topic, or the topic recreated "
                                     "with more of them (a memory-only broker restarted, the topic made again by a "
                                     "producer), are read within this (the Kafka client's default of 5 minutes left their "
                                     "jobs unread that long, without a word)")
    heartbeat_interval_ms: int = Field(3_000, ge=100, description="how often a worker heartbeats; a rebalance reaches "
                                       "the members within one interval, so a shorter one lets a joining or leaving "
                                       "worker take effect sooner (keep it under a third of session_timeout_ms)")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    sasl_username_env: str = Field("LORABATCH_KAFKA_USERNAME", description="environment variable holding the SASL username")
    sasl_password_env: str = Field("LORABATCH_KAFKA_PASSWORD", description="environment variable holding the SASL password")
    sasl_username_file: str = Field("", description="file holding the SASL username (read when its variable is unset)")
    sasl_password_file: str = Field("", description="file holding the SASL password (read when its variable is unset)")
    # Filled by load_settings from the variables or files above, never from the configuration file; never printed.
    sasl_username: SecretStr | None = Field(None, exclude=True)
    sasl_password: SecretStr | None = Field(None, exclude=True)
    ssl_cafile: str = Field("", description="PEM of the CA that signed the brokers' certificates; empty: the system CAs")
    ssl_certfile: str = Field("", description="client certificate PEM, for brokers that require TLS client authentication")
    ssl_keyfile: str = Field("", description="the client certificate's private key PEM")
    ssl_check_hostname: bool = Field(True, description="check that the broker's certificate names the host dialled")

    @field_validator("bootstrap_servers")
    @classmethod
    def _check_bootstrap(cls, value: str) -> str:
        for entry in value.split(","):
            if (why := _bad_server(entry.strip())) is not None:
                where = f"{entry.strip()!r} in {value!r}" if entry.strip() != value else repr(value)
                raise ValueError(f"{where} {why}; write host:port[,host:port...], such as "
                                 f"kafka-1.example.com:9092,kafka-2.example.com:9092")
        return value

    @field_validator("jobs_topic", "results_topic", "dlq_topic", "batches_topic")
    @classmethod
    def _check_topic(cls, value: str) -> str:
        if not TOPIC.fullmatch(value) or value in (".", ".."):
            raise ValueError(f"{value[:80]!r} is not a Kafka topic name: write {TOPIC_RULE}")
        return value

    @model_validator(mode="after")
    def _check_security(self) -> "KafkaConfig":
        topics: dict[str, str] = {}
        for name in ("jobs_topic", "results_topic", "dlq_topic", "batches_topic"):
            if (other := topics.setdefault(getattr(self, name), name)) != name:
                raise ValueError(f"kafka.{name} and kafka.{other} are both {getattr(self, name)!r}: each needs a topic of "
                                 f"its own (a worker would read its own results or dead letters as jobs); rename one")
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(f"kafka.heartbeat_interval_ms = {self.heartbeat_interval_ms} is not under kafka.session_timeout_ms "
                             f"= {self.session_timeout_ms}: the worker would be dropped between heartbeats; keep it under a third")
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if (path := getattr(self, name)) and not Path(path).is_file():
                raise ValueError(f"kafka.{name} = {path!r} is not a readable file; point it at the PEM file, "
                                 f"or leave it empty{' to use the system CAs' if name == 'ssl_cafile' else ''}")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile) and not self.ssl_certfile:
            raise ValueError("kafka.ssl_keyfile is set without kafka.ssl_certfile; set both (TLS client authentication) or neither")
        if self.security_protocol.startswith("SASL_") and (self.sasl_username is None or self.sasl_password is None):
            missing = [n for n in ("username", "password") if getattr(self, f"sasl_{n}") is None]
            raise ValueError(
                f"kafka.security_protocol = {self.security_protocol} needs a SASL {' and '.join(missing)}: set "
                + " and ".join(f"${getattr(self, f'sasl_{n}_env')} (or kafka.sasl_{n}_file)" for n in missing))
        return self


class BrokerConfig(_Section):
    """The embedded Tansu broker that the demo and tests start (production points at a real cluster)."""

    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(9092, ge=1, le=65535)
    state_dir: str = Field(".lorabatch/broker", min_length=1, description="pid file and log of the embedded broker")
    start_timeout_s: float = Field(20.0, gt=0)


# A worker id names the worker's spool file (.lorabatch/spool/<id>.sqlite), its Kafka group.instance.id (Kafka takes
# letters, digits, '.', '_' and '-') and its ledger rows (worker_id columns of 128 characters): a '/' or '..' put the
# spool outside its folder, 300 characters made a file name the filesystem refuses.
WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
WORKER_ID_RULE = "1 to 64 ASCII letters, digits, '.', '_' or '-', the first a letter or digit"


def worker_id_ok(value: str) -> bool:
    """Whether `value` is a usable worker id (WORKER_ID_RULE)."""
    return WORKER_ID.fullmatch(value) is not None


class WorkerConfig(_Section):
    worker_id: str = Field("", description=f"empty: hostname-pid; else {WORKER_ID_RULE}")
    max_batch_size: int = Field(32, ge=1, description="requests in one engine batch")
    max_batch_tokens: int = Field(8192, ge=1, description="prompt + new tokens in one engine batch")
    max_adapters_per_batch: int = Field(8, ge=1, description="distinct adapters in one engine batch")
    max_queued_jobs: int = Field(2048, ge=1, description="partitions pause while more jobs than this wait")
    commit_interval_ms: int = Field(200, ge=0, description="how often finished offsets are committed")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 disables the server")
    metrics_host: str = Field("0.0.0.0", description="the address /metrics, /healthz and /readyz listen on: 0.0.0.0 every "
                              "IPv4 interface, :: every interface (IPv6 and IPv4), 127.0.0.1 this host only, or one "
                              "interface's address")
    registry_refresh_s: float = Field(5.0, gt=0, description="how often the adapter registry is re-read")

    @field_validator("metrics_host")
    @classmethod
    def _check_metrics_host(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address; write one, such as 0.0.0.0 (every IPv4 interface), :: "
                             f"(every interface) or 127.0.0.1 (this host only)") from None
        return value

    max_queued_tokens: int = Field(1_000_000, ge=1, description="partitions pause while more tokens than this wait")
    affinity_slack_tokens: float = Field(512.0, ge=0, description="fairness slack within which a batch prefers resident adapters")
    max_defer_ms: float = Field(250.0, ge=0, description="longest a job is passed over for adapter affinity")
    static_membership: bool = Field(True, description="join with group.instance.id = worker_id, so restarts cause no rebalance")
    revoke_deadline_s: float = Field(10.0, gt=0, description="revoked partitions' running work may finish this long")
    stop_deadline_s: float = Field(15.0, gt=0, description="after SIGTERM, queued jobs keep running this long; then the "
                                   "rest is left to the partitions' next owner (uncommitted) and the running jobs get "
                                   "worker.revoke_deadline_s more to finish, as on a revoke")
    headroom_slots: int = Field(2, ge=0, description="engine slots kept for tenants under their fair share")
    engine_queue_jobs: int | None = Field(None, ge=0, description="jobs handed to the engine beyond the batch it runs, "
                                          "waiting in it to take a place the moment one frees (unset: as many as the "
                                          "engine's batch, so a batch that ends together is refilled in one step; with 0, "
                                          "a freed place waits for the result's round trip through the worker); they are "
                                          "past the fair scheduler's reach")
    engine_process: bool = Field(True, description="run the engine's step loop in a child process of its own (false: "
                                 "a thread of the worker, which shares the interpreter lock with the event loop and the "
                                 "ledger writes and waits for it between its launches)")
    switch_interval_ms: float | None = Field(None, gt=0, le=100, description="the interpreter's thread switch interval "
                                             "while the worker runs (sys.setswitchinterval); none: Python's 5 ms. With "
                                             "engine_process = false, the engine's step loop waits up to this long for "
                                             "the interpreter lock each time the event loop or a ledger write holds it")
    ledger_flush_ms: int = Field(1000, ge=10, description="how often adapter loads and GPU busy time are written")
    engine_stall_s: float = Field(300.0, ge=0, description="an engine process that answers nothing this long (a hung GPU "
                                  "or driver, a deadlock) is killed and replaced: its jobs are answered engine_failed, as "
                                  "after a crash; 0: never. A step, a graph capture or a kernel compile takes far less")
    spool_path: str = Field("", description="the durable local spool of ledger records while the ledger is down; "
                            "empty: .lorabatch/spool/<worker_id, or 'worker'>.sqlite (workers may share one)")
    spool_max_records: int = Field(100_000, ge=1, description="fetching pauses while the spool holds this many records")
    answered_cache: int = Field(10_000, ge=0, description="recent (tenant, request_id) answers kept in memory, so "
                                "a redelivered job is answered without asking the ledger; they take at most 16 KiB "
                                "each on average (10,000: 164 MB), so long answers are kept fewer")
    wait_max_s: float = Field(30.0, gt=0, description="longest pause between attempts to reach the broker, the ledger "
                              "or Redis (the pauses double from 0.5 s up to this)")
    log_check_s: float = Field(2.0, gt=0, description="how often the partitions' log ends and committed offsets are "
                               "checked against the worker's marks (a broker restart, a recreated topic)")

    def spool_file(self) -> Path:
        """The spool's path: `spool_path`, or its default, stable across restarts (a new pid finds what was spooled)."""
        return Path(self.spool_path) if self.spool_path else Path(".lorabatch/spool") / f"{self.worker_id or 'worker'}.sqlite"

    @field_validator("worker_id")
    @classmethod
    def _check_worker_id(cls, value: str) -> str:
        if value and not worker_id_ok(value):
            raise ValueError(f"{value[:80]!r} is not a worker id: write {WORKER_ID_RULE} (it names the spool file and "
                             f"the Kafka group member)")
        return value


class RoutingConfig(_Section):
    cache: Literal["lru", "redis"] = Field("lru", description="where the L1 user / L2 session maps live")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="used when cache = \"redis\"")
    redis_prefix: str = Field("lorabatch:route", description="key prefix, so several deployments can share a Redis")
    cache_entries: int = Field(100_000, ge=1, description="bound per tenant and level (Redis) or in all (LRU)")
    cache_ttl_s: float = Field(3600.0, ge=0.001, le=10 * 365 * 86400,
                               description="a user's or session's adapter is forgotten after this (at least 1 ms, Redis's "
                                           "unit: less was an expiry of 0 ms, which Redis refuses; at most 10 years: Redis "
                                           "refuses an expiry past 2^63 ms)")
    redis_timeout_ms: float = Field(50.0, gt=0, description="a Redis call slower than this counts as Redis down")
    redis_backoff_s: float = Field(1.0, gt=0, description="after a Redis error, route without it for this long")
    redis_start_wait_s: float = Field(30.0, ge=0, description="a worker waits this long for Redis at start, then "
                                      "routes without it (rules and defaults) until it answers")
    breaker_failure_rate: float = Field(0.5, gt=0, le=1, description="an adapter's circuit opens at this failure rate")
    breaker_min_requests: int = Field(5, ge=1, description="... over at least this many requests in the window")
    breaker_window_s: float = Field(60.0, gt=0)
    breaker_cooldown_s: float = Field(15.0, gt=0, description="open this long before a half-open probe")


    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        """What redis-py's from_url takes (it raised ValueError when the worker built its route cache)."""
        from urllib.parse import urlsplit

        parts = urlsplit(value)
        shown = repr(url_without_password(value))
        try:
            port = parts.port
        except ValueError as e:
            raise ValueError(f"{shown} is not a Redis URL ({e}); write redis://HOST:PORT/DB, such as "
                             f"redis://127.0.0.1:6379/0") from None
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"{shown} is not a Redis URL; write redis://HOST:PORT/DB (rediss:// for TLS, or "
                             f"unix:///PATH), such as redis://127.0.0.1:6379/0")
        if port == 0:
            raise ValueError(f"{shown} has port 0; write the Redis server's port, such as redis://127.0.0.1:6379/0")
        return value


class StoreConfig(_Section):
    adapter_dir: str = Field(".lorabatch/adapters", min_length=1, description="the content-addressed adapter store (L3)")


class Settings(_Section):
    kafka: KafkaConfig = KafkaConfig()
    broker: BrokerConfig = BrokerConfig()
    worker: WorkerConfig = WorkerConfig()
    routing: RoutingConfig = RoutingConfig()
    store: StoreConfig = StoreConfig()
    engine: EngineConfig = EngineConfig()
    ledger: LedgerConfig = LedgerConfig()

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        # Against the engine's fields as set here; where the engine derives them from its GPU (engine.sizing), the
        # worker checks again against the sized values when it starts (`check_worker_fits`).
        check_worker_fits(self.worker, self.engine, only_set=True)
        port = self.worker.metrics_port
        local = [e.strip() for e in self.kafka.bootstrap_servers.split(",")
                 if e.strip().rpartition(":")[0].strip("[]") in ("127.0.0.1", "localhost", "::1")]
        if port and any(e.rpartition(":")[2] == str(port) for e in local):
            raise ValueError(f"worker.metrics_port = {port} is the port of the broker this configuration dials on this host "
                             f"(kafka.bootstrap_servers = {self.kafka.bootstrap_servers!r}): the two cannot share it; "
                             f"pick another metrics port, such as 9100")
        return self

    def to_toml(self, *, mask_passwords: bool = False) -> str:
        """The effective settings as TOML; the SASL credentials are left out (read again from their variables or files),
        and so are the engine sizes the configuration does not set (DEVICE_SIZED): written out, they would fix the CPU
        demo's batch and adapter counts on a GPU that derives its own (`config show > lorabatch.toml` did that). With
        `mask_passwords`, the passwords inside ledger.url and routing.redis_url read `***`."""
        data = self.model_dump(mode="json", exclude_none=True)
        for field in DEVICE_SIZED:
            if field not in self.engine.model_fields_set:
                data["engine"].pop(field, None)
        if mask_passwords:
            data["ledger"]["url"] = url_without_password(data["ledger"]["url"])
            data["routing"]["redis_url"] = url_without_password(data["routing"]["redis_url"])
        return tomli_w.dumps(data)


def check_worker_fits(worker: WorkerConfig, engine: EngineConfig, *, only_set: bool = False) -> None:
    """Raise ValueError, naming both keys, if the worker's batches could not fit the engine `engine` describes (with
    `only_set`, against the engine fields the configuration sets, on a GPU the others are derived later)."""
    fixed = engine.model_fields_set if only_set else {"max_loras", "max_batch_size"}
    if "max_loras" in fixed and worker.max_adapters_per_batch > engine.max_loras:
        raise ValueError(
            f"worker.max_adapters_per_batch={worker.max_adapters_per_batch} exceeds engine.max_loras="
            f"{engine.max_loras}: a batch could not fit its adapters; lower the first or raise the second"
        )
    if "max_batch_size" in fixed and worker.max_batch_size > engine.max_batch_size:
        raise ValueError(
            f"worker.max_batch_size={worker.max_batch_size} exceeds engine.max_batch_size="
            f"{engine.max_batch_size}; lower the first or raise the second"
        )


def _describe(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "model_type":  # pydantic's "a valid dictionary or instance of WorkerConfig": in TOML's words
            lines.append(f"  {key}: must be a table, not {e['input']!r}; write it as a [{key}] section")
        elif e["type"] == "extra_forbidden":  # a typo is refused, and the key it was meant to be is named
            lines.append(f"  {key}: {_unknown_key(e['loc'])}")
        elif e["type"] == "value_error":  # our own validators' messages, without pydantic's "Value error, " before them
            lines.append(f"  {key}: {e['ctx']['error']}")
        else:
            lines.append(f"  {key}: {e['msg']}")
    return "\n".join(lines)


def _unknown_key(loc: tuple) -> str:
    """Why the key at `loc` is refused and, when one is close to it, the key that was meant."""
    import difflib

    model: type[BaseModel] = Settings
    for part in loc[:-1]:  # down to the section the key sits in
        model = model.model_fields[str(part)].annotation  # type: ignore[assignment]
    known = [n for n, f in model.model_fields.items() if not f.exclude]
    what = f"a key of the [{'.'.join(map(str, loc[:-1]))}] section" if len(loc) > 1 else "a section of the configuration"
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    if close:
        return f"not {what}; did you mean {close[0]}?"
    listed = f"they are {', '.join(known)}" if len(known) <= 8 else "`lorabatch config show` prints them all"
    return f"not {what}: {listed}"


# Files read whole at start (consumer.files): every key's default written out is some 10 KiB of TOML, a credential a
# line. A device or a FIFO named there is refused, not read for ever.
CONFIG_MAX_BYTES = 1 << 20
CREDENTIAL_MAX_BYTES = 64 << 10


def load_settings(path: str | os.PathLike | None = None, overrides: dict | None = None) -> Settings:
    """Read, merge and validate the configuration once; raise ConfigError naming the bad key."""
    # A path from the environment is said to be one, with its fix: "pass --config" left the operator looking for a
    # flag they never gave.
    came_from, fix = "", "pass --config with"
    if path is None and os.environ.get(ENV_VAR):
        path, came_from, fix = os.environ[ENV_VAR], f" (from ${ENV_VAR})", f"point ${ENV_VAR} at (or pass --config with)"
    elif path is None:
        path = DEFAULT_FILE if DEFAULT_FILE.exists() else None
    data: dict = {}
    source = "the defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        if p.is_dir():
            raise ConfigError(f"config file {p}{came_from} is a directory; {fix} a TOML file (such as {p / 'lorabatch.toml'})")
        if not p.exists():
            raise ConfigError(f"config file {p}{came_from} does not exist; {fix} an existing TOML file")
        try:
            # TOML is UTF-8 by definition; read as bytes and decoded here, so a file in another encoding is named as
            # such rather than ending the command in a UnicodeDecodeError.
            data = tomllib.loads(read_bounded(p, what="config file", limit=CONFIG_MAX_BYTES, fix=(
                f"{fix} a TOML file of at most {shown_size(CONFIG_MAX_BYTES)}")).decode("utf-8"))
        except FileUnfit as e:
            raise ConfigError(str(e)) from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); "
                              f"save it as UTF-8, as TOML requires") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
        except OSError as e:
            raise ConfigError(f"config file {p} cannot be read ({e.strerror}); check its permissions") from e
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[leaf] = value
        # Else the file set the section to a value (`worker = 5`): the override is left out, and validation refuses
        # the section below, naming it, as `config show` does (assigning into it raised TypeError).
    kafka = data.get("kafka")
    if isinstance(kafka, dict):
        _read_credentials(kafka, source)
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, source)) from e


def _read_credentials(kafka: dict, source: str) -> None:
    """Fill kafka.sasl_username / sasl_password from their environment variables, else their files."""
    for name in ("username", "password"):
        if f"sasl_{name}" in kafka:
            raise ConfigError(f"kafka.sasl_{name} in {source}: credentials are not read from the configuration file; "
                              f"set ${kafka.get(f'sasl_{name}_env', KafkaConfig.model_fields[f'sasl_{name}_env'].default)} "
                              f"or name a file in kafka.sasl_{name}_file")
        env = kafka.get(f"sasl_{name}_env", KafkaConfig.model_fields[f"sasl_{name}_env"].default)
        value = os.environ.get(env) if isinstance(env, str) and env else None
        path = kafka.get(f"sasl_{name}_file")
        if value is None and isinstance(path, str) and path:
            try:
                value = read_bounded(path, what=f"kafka.sasl_{name}_file =", limit=CREDENTIAL_MAX_BYTES, fix=(
                    f"point it at a regular file holding only the SASL {name}, or set ${env}")).decode("utf-8").strip()
            except FileUnfit as e:
                raise ConfigError(str(e)) from e
            except UnicodeDecodeError as e:
                raise ConfigError(f"kafka.sasl_{name}_file = {path!r} is not UTF-8 text; point it at a file holding "
                                  f"the SASL {name}, or set ${env}") from e
            except OSError as e:
                raise ConfigError(f"kafka.sasl_{name}_file = {path!r} cannot be read ({e.strerror}); "
                                  f"point it at a file holding the SASL {name}, or set ${env}") from e
        if value is not None and not value.strip() and str(kafka.get("security_protocol", "")).startswith("SASL_"):
            # An empty credential was taken, and the broker's refusal of it was waited for as a broker down.
            held = f"${env}" if os.environ.get(env) is not None else f"kafka.sasl_{name}_file = {path!r}"
            raise ConfigError(f"{held} is empty: kafka.security_protocol = {kafka['security_protocol']} needs the SASL "
                              f"{name} there")
        if value is not None:
            kafka[f"sasl_{name}"] = value
