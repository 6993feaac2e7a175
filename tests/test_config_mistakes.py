"""An operator's configuration mistakes: each is refused when the configuration is loaded, with one line that names
the key and the fix (exit status 2, no traceback), never by a traceback or a wait for ever later on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from consumer.config import ConfigError, load_settings


def _lorabatch(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LORABATCH_CONFIG"}
    return subprocess.run([sys.executable, "-m", "consumer.cli", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2 and "Traceback" not in out.stderr, (out.returncode, out.stderr)
    lines = [x for x in out.stderr.splitlines() if x.strip() and not x.startswith("submitting")]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


def _refused(tmp_path: Path, text: str) -> str:
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    return str(e.value)


@pytest.mark.parametrize(("servers", "says"), [
    ("host:abc", "'host:abc' has port 'abc', not a number from 1 to 65535"),
    ("host:99999", "has port '99999'"),
    ("h:0", "has port '0'"),
    ("", "'' is empty"),
    ("a:1,,b:2", "'' in 'a:1,,b:2' is empty (a comma too many?)"),
    (":9092", "':9092' has no host"),
])
def test_a_bootstrap_server_that_cannot_be_dialled(tmp_path, servers, says):
    """kafka.bootstrap_servers = "host:abc" ended `submit` in aiokafka's ValueError traceback, and "host:99999" or ""
    were dialled (and waited for, by a worker); each is refused at load, naming the key."""
    message = _refused(tmp_path, f'[kafka]\nbootstrap_servers = "{servers}"\n')
    assert "kafka.bootstrap_servers: " in message and says in message and "write host:port[,host:port...]" in message
    assert "Value error" not in message


@pytest.mark.parametrize("servers", ["localhost", "a:1, b:2", "[::1]:9092", "::1", "kafka-1.example.com:9093"])
def test_bootstrap_servers_that_are_taken(servers):
    assert load_settings(None, {"kafka.bootstrap_servers": servers}).kafka.bootstrap_servers == servers


def test_submit_to_a_port_that_is_not_a_number_says_so(tmp_path):
    (tmp_path / "jobs.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "c.toml").write_text('[kafka]\nbootstrap_servers = "kafka:abc"\n')
    line = _error_line(_lorabatch(tmp_path, "submit", "jobs.jsonl", "--tenant", "acme", "-c", "c.toml"))
    assert "kafka.bootstrap_servers: 'kafka:abc' has port 'abc'" in line


@pytest.mark.parametrize(("text", "says"), [
    ('jobs_topic = "jobs"\ndlq_topic = "jobs"\n', "kafka.dlq_topic and kafka.jobs_topic are both 'jobs'"),
    ('results_topic = "lorabatch.jobs"\n', "kafka.results_topic and kafka.jobs_topic are both 'lorabatch.jobs'"),
    ('batches_topic = "lorabatch.dlq"\n', "kafka.batches_topic and kafka.dlq_topic are both"),
    ('jobs_topic = "my jobs"\n', "kafka.jobs_topic: 'my jobs' is not a Kafka topic name"),
    ('dlq_topic = ""\n', "kafka.dlq_topic: '' is not a Kafka topic name"),
    ('results_topic = ".."\n', "kafka.results_topic: '..' is not a Kafka topic name"),
])
def test_topics_that_cannot_work(tmp_path, text, says):
    """A DLQ topic equal to the jobs topic was taken: the worker dead-lettered an unparsable job onto the topic it reads,
    read it again, and so on for ever; a topic name Kafka refuses was waited for as a broker down."""
    assert says in _refused(tmp_path, "[kafka]\n" + text)


@pytest.mark.parametrize(("url", "says"), [
    ("mysql://u:secret@db/ledger", "uses driver 'mysql'"),
    ("postgresql+asyncpg://db/ledger", "uses driver 'postgresql+asyncpg'"),
    ("not a url", "is not a database URL"),
    ("sqlite:///", "is an in-memory SQLite database"),
    ("sqlite://", "is an in-memory SQLite database"),
    ("sqlite:///:memory:", "is an in-memory SQLite database"),
])
def test_a_ledger_url_that_cannot_hold_the_ledger(tmp_path, url, says):
    """ledger.url was first looked at when a command opened the ledger: a worker took an unknown driver for the ledger
    being down and waited for it for ever, and `sqlite:///` (the path left out) was an in-memory ledger that
    `db upgrade` "upgraded to head" and every command and worker then lost at its exit."""
    message = _refused(tmp_path, f'[ledger]\nurl = "{url}"\n')
    assert "ledger.url: " in message and says in message and "sqlite:///PATH/ledger.db" in message
    assert "secret" not in message


def test_db_upgrade_refuses_an_in_memory_ledger(tmp_path):
    (tmp_path / "c.toml").write_text('[ledger]\nurl = "sqlite:///"\n')
    line = _error_line(_lorabatch(tmp_path, "db", "upgrade", "-c", "c.toml"))
    assert "ledger.url: ledger url 'sqlite:///' is an in-memory SQLite database" in line


@pytest.mark.parametrize("where", ["under-a-file", "in-proc"])
async def test_a_store_dir_that_cannot_be_made_ends_the_wait_for_the_ledger(tmp_path, migrated_url, where):
    """store.adapter_dir that cannot be a folder: a worker logged 'waiting for the ledger database ... (FileNotFoundError:
    '/proc/x'); start it, fix ledger.url' every few seconds for ever, and the commands said 'File exists: ...; check the
    path'. Now a ConfigError naming the key ends the wait at its first attempt."""
    import asyncio

    from consumer.waits import wait_for_ledger

    (tmp_path / "afile").write_text("")
    store = str(tmp_path / "afile" / "store") if where == "under-a-file" else "/proc/lorabatch-store"
    s = load_settings(None, {"ledger.url": migrated_url, "store.adapter_dir": store, "worker.wait_max_s": 0.1})
    with pytest.raises(ConfigError, match=r"store.adapter_dir = .* cannot be used as the adapter store's folder .*set it "
                                          r"to a folder this process can create and write"):
        await asyncio.wait_for(wait_for_ledger(s), 20)


def test_tenants_list_names_the_store_dir(tmp_path):
    (tmp_path / "afile").write_text("")
    (tmp_path / "c.toml").write_text(f'[ledger]\nurl = "sqlite:///{tmp_path}/l.db"\n[store]\nadapter_dir = "afile/x"\n')
    assert _lorabatch(tmp_path, "db", "upgrade", "-c", "c.toml").returncode == 0
    line = _error_line(_lorabatch(tmp_path, "tenants", "add", "acme", "-c", "c.toml"))
    assert "store.adapter_dir = 'afile/x' cannot be used" in line


@pytest.mark.parametrize(("field", "value", "says"), [
    ("kv_num_blocks", 10**11, "engine.kv_num_blocks=100000000000"),
    ("host_cache_bytes", 10**15, "engine.host_cache_bytes=1000000000000000 asks for"),
])
def test_engine_sizes_the_machine_cannot_hold(tmp_path, demo_set, field, value, says):
    """engine.kv_num_blocks = 10^11 (and the other pools' sizes) ended `lorabatch generate` and the engine's start in
    torch's 'DefaultCPUAllocator: can't allocate memory' RuntimeError traceback (exit 1); now one error line naming the
    fields that size the allocation, exit 2."""
    (tmp_path / "jobs.jsonl").write_text('{"request_id": "r1", "tenant_id": "t", "prompt": "hi", "max_new_tokens": 2}\n')
    (tmp_path / "c.toml").write_text(f'[engine]\nmodel_dir = "{demo_set["model"]}"\ndevice = "cpu"\n{field} = {value}\n'
                                     f'[worker]\nmax_batch_size = 1\nmax_adapters_per_batch = 1\n')
    line = _error_line(_lorabatch(tmp_path, "generate", "--jobs", "jobs.jsonl", "-c", "c.toml"))
    assert "the engine cannot allocate the memory that" in line and says in line and "to what this machine holds" in line


@pytest.mark.parametrize(("text", "says"), [
    ("[worker]\nmax_batch_sise = 3\n", "worker.max_batch_sise: not a key of the [worker] section; did you mean max_batch_size?"),
    ("[workr]\nmax_batch_size = 3\n", "workr: not a section of the configuration; did you mean worker?"),
    ("[kafka]\nbootstrap = 'h:1'\n", "kafka.bootstrap: not a key of the [kafka] section; did you mean bootstrap_servers?"),
    ("[ledger]\nprice = 1\n", "ledger.price: not a key of the [ledger] section: they are url, gpu_price_per_hour, currency"),
    ("[engine]\nzzz = 1\n", "engine.zzz: not a key of the [engine] section: `lorabatch config show` prints them all"),
])
def test_a_mistyped_key_names_the_key_meant(tmp_path, text, says):
    """A typo was refused as 'Extra inputs are not permitted', which names neither the fault nor the fix."""
    message = _refused(tmp_path, text)
    assert says in message and "Extra inputs" not in message


@pytest.mark.parametrize(("currency", "says"), [("usd", "such as USD"), ("U$D", "such as USD"), ("eur", "such as EUR")])
def test_a_currency_that_is_not_a_code(tmp_path, currency, says):
    """ledger.currency = "usd" was taken: closed invoices keep their code and the finance report refuses a month of two,
    so "usd" and "USD" were two currencies; "U$D" was taken too."""
    message = _refused(tmp_path, f'[ledger]\ncurrency = "{currency}"\n')
    assert f"ledger.currency: {currency!r} is not a currency code: write its three-letter ISO 4217 code in capitals" in message
    assert says in message


def test_a_metrics_port_that_is_the_local_brokers(tmp_path):
    """worker.metrics_port equal to the port of a broker the configuration dials on this host was taken: the worker or
    the broker, whichever starts second, could not bind it. `--metrics-port` is checked alike; a remote broker's port
    is no clash."""
    with pytest.raises(ConfigError, match=r"worker.metrics_port = 9092 is the port of the broker .*pick another"):
        load_settings(None, {"worker.metrics_port": 9092})
    with pytest.raises(ConfigError, match=r"worker.metrics_port = 19092 is the port of the broker"):
        load_settings(None, {"worker.metrics_port": 19092, "kafka.bootstrap_servers": "kafka-1:9092,localhost:19092"})
    assert load_settings(None, {"worker.metrics_port": 9092, "kafka.bootstrap_servers": "kafka-1:9092"}).worker.metrics_port == 9092


@pytest.mark.parametrize("source", ["variable", "file"])
def test_an_empty_sasl_credential_is_named(tmp_path, monkeypatch, source):
    """An empty $LORABATCH_KAFKA_USERNAME (or an empty username file) was taken as the SASL username: the broker's refusal
    came only when a client connected. Now it is named at load."""
    monkeypatch.setenv("LORABATCH_KAFKA_PASSWORD", "pw")
    text = '[kafka]\nsecurity_protocol = "SASL_SSL"\n'
    if source == "variable":
        monkeypatch.setenv("LORABATCH_KAFKA_USERNAME", "")
        says = "$LORABATCH_KAFKA_USERNAME is empty"
    else:
        monkeypatch.delenv("LORABATCH_KAFKA_USERNAME", raising=False)
        (tmp_path / "user").write_text("\n")
        text += f'sasl_username_file = "{tmp_path / "user"}"\n'
        says = "kafka.sasl_username_file = "
    message = _refused(tmp_path, text)
    assert says in message and "is empty: kafka.security_protocol = SASL_SSL needs the SASL username there" in message


@pytest.mark.parametrize(("url", "says"), [
    ("redis://:secret@127.0.0.1:abc/0", "'redis://:***@127.0.0.1:abc/0' is not a Redis URL (Port could not be cast"),
    ("http://cache:6379/0", "'http://cache:6379/0' is not a Redis URL; write redis://HOST:PORT/DB"),
    ("http://cache:6379/0?password=secret", "'http://cache:6379/0?password=***' is not a Redis URL"),
    ("redis://:ab/secret@cache:abc/0", "is not a Redis URL"),
    ("redis://cache:99999/0", "is not a Redis URL (Port out of range"),
    ("redis://cache:0/0", "has port 0"),
])
def test_a_redis_url_redis_cannot_take(tmp_path, url, says):
    """routing.redis_url = "redis://...:abc/0" stopped a worker with routing.cache = "redis" in 'stopped by an unexpected
    error: ValueError: Port could not be cast to integer value' and its traceback, exit 1, once its engine was built; now
    refused at load, the password masked."""
    message = _refused(tmp_path, f'[routing]\ncache = "redis"\nredis_url = "{url}"\n')
    assert "routing.redis_url: " in message and says in message and "secret" not in message


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://:pw@cache.example.com/2", "unix:///run/redis.sock", "redis://cache"])
def test_redis_urls_that_are_taken(url):
    assert load_settings(None, {"routing.redis_url": url}).routing.redis_url == url


@pytest.mark.parametrize(("args", "option"), [
    (("broker", "start", "--port", "70000"), "--port"),
    (("broker", "status", "--port", "-1"), "--port"),
    (("broker", "start", "--partitions", "0"), "--partitions"),
    (("demo", "--port", "70000"), "--port"),
    (("demo", "--jobs", "0"), "--jobs"),
])
def test_an_option_out_of_its_range_is_a_usage_error(tmp_path, args, option):
    """`broker start --port 70000` ended in the socket's OverflowError traceback and `demo --port 70000` in pydantic's
    ValidationError's; `broker start --partitions 0` and `demo --jobs 0` were taken. Each is now the command line's usage
    error naming the option, exit 2, before anything starts."""
    (tmp_path / "c.toml").write_text(f'[broker]\nstate_dir = "{tmp_path / "broker"}"\n')
    out = _lorabatch(tmp_path, *args, *(("-c", "c.toml") if args[0] == "broker" else ()))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"Invalid value for '{option}'" in out.stderr and out.stdout == ""
    assert not (tmp_path / "broker").exists()


def test_tenant_limits_outside_their_columns(tmp_path):
    """`tenants add z --rpm -5` was taken (set_limits refused it; add did not check), and `--tpm 10^20` ended in
    the driver's 'OverflowError: Python int too large to convert to SQLite INTEGER' traceback, exit 1. Both commands
    now refuse a value outside its column's range, naming the field and the range."""
    (tmp_path / "c.toml").write_text(f'[ledger]\nurl = "sqlite:///{tmp_path}/l.db"\n[store]\nadapter_dir = "{tmp_path}/s"\n')
    assert _lorabatch(tmp_path, "db", "upgrade", "-c", "c.toml").returncode == 0
    for args, says in [(("add", "a", "--rpm", "-5"), "requests_per_minute=-5 is out of range; use 0 (unlimited) to 2147483647"),
                       (("add", "b", "--tpm", str(10**20)), f"tokens_per_minute={10**20} is out of range; use 0 (unlimited) to"),
                       (("add", "c", "--weight", str(2**31)), f"weight={2**31} is out of range; use 1 to 2147483647")]:
        assert says in _error_line(_lorabatch(tmp_path, "tenants", *args, "-c", "c.toml"))
    assert _lorabatch(tmp_path, "tenants", "add", "d", "--rpm", "60", "-c", "c.toml").returncode == 0
    line = _error_line(_lorabatch(tmp_path, "tenants", "limits", "d", "--tpm", str(2**63), "-c", "c.toml"))
    assert f"tokens_per_minute={2**63} is out of range" in line
    assert "d " in _lorabatch(tmp_path, "tenants", "list", "-c", "c.toml").stdout


@pytest.mark.parametrize(("key", "value"), [("routing.cache_ttl_s", "inf"), ("worker.wait_max_s", "inf"),
                                            ("engine.adapter_loads_per_s", "inf"), ("worker.revoke_deadline_s", "nan"),
                                            ("engine.adapter_slo_weights.standard", "inf")])
def test_infinity_is_no_setting(tmp_path, key, value):
    """TOML's inf was taken by every float key with only a lower bound: routing.cache_ttl_s = inf with cache = "redis"
    made the worker's route cache raise 'OverflowError: cannot convert float infinity to integer' as it was built."""
    *section, leaf = key.split(".")
    message = _refused(tmp_path, f"[{'.'.join(section)}]\n{leaf} = {value}\n")
    assert f"{key}: Input should be a finite number" in message


def test_a_route_ttl_redis_cannot_set(tmp_path):
    """routing.cache_ttl_s = 1e20 (ms past 2^63) was taken: Redis refuses such an expiry on every write."""
    assert "routing.cache_ttl_s: Input should be less than or equal to 315360000" in _refused(tmp_path, "[routing]\ncache_ttl_s = 1e20\n")


@pytest.mark.parametrize("key", ["store.adapter_dir", "engine.model_dir", "broker.state_dir", "broker.host", "kafka.group_id"])
def test_an_empty_name_is_no_setting(tmp_path, key):
    """store.adapter_dir = "" was taken and made the working directory the adapter store (Path("") is "."), where
    `adapters prune` removes what no adapter names; an empty model folder, broker folder, host or group id was taken too."""
    section, leaf = key.split(".")
    assert f"{key}: String should have at least 1 character" in _refused(tmp_path, f'[{section}]\n{leaf} = ""\n')
