"""Configuration: validated once, errors name the key, `config show` round-trips."""

import tomllib

import pytest

from consumer.config import ConfigError, Settings, load_settings


def test_defaults_validate():
    s = load_settings(None)
    assert s.kafka.jobs_topic == "lorabatch.jobs"
    assert s.worker.max_batch_size <= s.engine.max_batch_size


def test_show_round_trips(tmp_path):
    s = Settings()
    p = tmp_path / "c.toml"
    p.write_text(s.to_toml())
    assert load_settings(p) == s
    assert tomllib.loads(s.to_toml())["kafka"]["group_id"] == "lorabatch-workers"


def test_show_leaves_the_device_sized_engine_fields_unset(tmp_path):
    """`config show > lorabatch.toml` (the README's own step) wrote the CPU demo's batch and adapter counts into the
    file, which then fixed them on a GPU that would derive its own (engine.sizing keeps what the file sets). The fields
    the configuration does not set stay out of what it prints; those it sets stay in."""
    from engine.config import DEVICE_SIZED

    p = tmp_path / "c.toml"
    p.write_text("[engine]\nmax_loras = 16\n[worker]\nmax_adapters_per_batch = 8\n")
    s = load_settings(p)
    engine = tomllib.loads(s.to_toml())["engine"]
    assert engine["max_loras"] == 16 and not (set(DEVICE_SIZED) - {"max_loras"}) & set(engine)
    p.write_text(s.to_toml())
    again = load_settings(p)
    assert again.engine.model_fields_set & set(DEVICE_SIZED) == {"max_loras"} and again == s


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[worker]\nmax_batch_size = 0\n", "worker.max_batch_size"),
        ("[kafka]\nbootstrap = 'x'\n", "kafka.bootstrap"),
        ("[engine]\ndevice = 'tpu'\n", "engine.device"),
        ("[engine]\nadmission_hold_ms = -1\n", "engine.admission_hold_ms"),
        ("[engine]\nload_ahead_share = 0\n", "engine.load_ahead_share"),
        ("[engine]\nload_ahead_share = 'half'\n", "engine.load_ahead_share"),
        ("[worker]\nmax_batch_size = 64\n[engine]\nmax_batch_size = 8\n", "lower the first or raise the second"),
        ("[ledger]\ngpu_price_per_hour = -1\n", "ledger.gpu_price_per_hour"),
        ("[ledger]\ngpu_price_per_hour = 1e30\n", "ledger.gpu_price_per_hour=1E+30 is too large"),
        ("[kafka]\nsession_timeout_ms = 3000\nheartbeat_interval_ms = 3000\n", "kafka.heartbeat_interval_ms = 3000 is not under"),
        ("[kafka]\nsession_timeout_ms = 10\n", "kafka.session_timeout_ms"),
        ("[worker]\nengine_stall_s = -1\n", "worker.engine_stall_s"),
        ("[kafka]\nfetch_max_wait_ms = 0\n", "kafka.fetch_max_wait_ms"),
        ("[kafka]\nmax_message_bytes = 9223372036854775807\n", "kafka.max_message_bytes"),  # the fetch size overflowed int32
        ("[routing]\ncache_ttl_s = 1e-300\n", "routing.cache_ttl_s"),  # was a Redis expiry of 0 ms, which Redis refuses
        ("[engine]\nweight_dtype = 'int4'\n", "engine.weight_dtype"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_bad_config_names_the_key(tmp_path, text, says):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    assert says in str(e.value)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[engine]\nmax_new_tokens = true\n", "engine.max_new_tokens"),  # was 1: every job cut at one token
        ("[worker]\nmax_batch_size = true\n", "worker.max_batch_size"),  # was 1
        ("[worker]\nanswered_cache = false\n", "worker.answered_cache"),  # was 0: the answer cache off
        ("[worker]\nengine_queue_jobs = false\n", "worker.engine_queue_jobs"),
        ("[kafka]\npartitions = true\n", "kafka.partitions"),
        ("[routing]\nbreaker_failure_rate = true\n", "routing.breaker_failure_rate"),  # was 1.0
        ("[engine]\nadmission_hold_ms = false\n", "engine.admission_hold_ms"),
    ],
)
def test_a_boolean_is_no_number(tmp_path, text, key):
    """TOML's true and false are refused where a number goes, naming the key: pydantic's lax mode read them as 1 and 0,
    so `max_new_tokens = true` served every job one token and `answered_cache = false` turned the cache off, silently."""
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    assert f"{key}: " in str(e.value) and "a boolean, not a number" in str(e.value), str(e.value)


def test_booleans_still_set_flags(tmp_path):
    """The flags themselves take true and false as before."""
    p = tmp_path / "c.toml"
    p.write_text("[worker]\nengine_process = false\nstatic_membership = false\n[engine]\nenable_prefix_caching = false\n")
    s = load_settings(p)
    assert (s.worker.engine_process, s.worker.static_membership, s.engine.enable_prefix_caching) == (False, False, False)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    """TOML is UTF-8: a file in another encoding is named as such (a UnicodeDecodeError ended the command)."""
    p = tmp_path / "c.toml"
    p.write_bytes(b"\xff\xfe[worker]\n")
    with pytest.raises(ConfigError, match=r"c.toml is not UTF-8 text .*save it as UTF-8"):
        load_settings(p)


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(ConfigError, match=r"is a directory; pass --config with a TOML file"):
        load_settings(tmp_path)


@pytest.mark.parametrize("name", ["nope.toml", "."])
def test_a_config_path_from_lorabatch_config_names_the_variable(tmp_path, monkeypatch, name):
    """$LORABATCH_CONFIG naming a missing file or a folder: the error says the path came from the variable and to point
    it at a TOML file (it said "pass --config", an option the command was not given)."""
    monkeypatch.setenv("LORABATCH_CONFIG", str(tmp_path / name))
    with pytest.raises(ConfigError, match=r"\(from \$LORABATCH_CONFIG\) (does not exist|is a directory); "
                                          r"point \$LORABATCH_CONFIG at \(or pass --config with\)"):
        load_settings()


@pytest.mark.parametrize("text", ["worker = 5\n", "worker = 'w'\n", "worker = [1]\n"])
def test_an_option_over_a_section_that_is_not_a_table(tmp_path, text):
    """`worker = 5` and `--worker-id w1`: the section is refused as without the option (assigning the option's value
    into the int raised TypeError, which stopped the worker with a traceback)."""
    p = tmp_path / "c.toml"
    p.write_text(text)
    for overrides in ({}, {"worker.worker_id": "w1", "worker.metrics_port": 9100}):
        with pytest.raises(ConfigError, match=r"worker: must be a table, not .*write it as a \[worker\] section"):
            load_settings(p, overrides)


@pytest.mark.parametrize("worker_id", ["../../escape", "a/b", ".hidden", "w" * 65, "ü", "has space", "-x"])
def test_a_worker_id_that_cannot_name_a_file_or_a_group_member(tmp_path, worker_id):
    """worker.worker_id names the spool file and the Kafka group.instance.id: a path in it put the spool outside its
    folder, and 300 characters made a file name sqlite could not open."""
    p = tmp_path / "c.toml"
    p.write_text(f"[worker]\nworker_id = {worker_id!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match=r"worker.worker_id: .*is not a worker id: write 1 to 64"):
        load_settings(p)


@pytest.mark.parametrize("worker_id", ["", "w1", "gpu-3", "adv-0.node_7", "W" * 64])
def test_worker_ids_that_are_taken(worker_id):
    assert load_settings(None, {"worker.worker_id": worker_id}).worker.worker_id == worker_id


def test_overrides_apply():
    s = load_settings(None, {"kafka.bootstrap_servers": "h:1", "engine.device": "cpu"})
    assert s.kafka.bootstrap_servers == "h:1" and s.engine.device == "cpu"


async def test_every_consumer_waits_at_the_broker_as_configured():
    """kafka.fetch_max_wait_ms reaches the consumers lorabatch makes (the worker's, the results readers'): Kafka's
    default 500 ms held each hop of a job through the embedded broker for about 115 ms."""
    from consumer.kafka import make_consumer

    assert Settings().kafka.fetch_max_wait_ms == 100
    s = load_settings(None, {"kafka.fetch_max_wait_ms": 37})
    consumer = make_consumer(s.kafka, group_id=None)
    assert consumer._fetch_max_wait_ms == 37  # aiokafka keeps no public accessor
    await consumer.stop()
