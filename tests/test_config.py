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
        ("[kafka]\nsession_timeout_ms = 3000\nheartbeat_interval_ms = 3000\n", "kafka.heartbeat_interval_ms = 3000 is not under"),
        ("[kafka]\nsession_timeout_ms = 10\n", "kafka.session_timeout_ms"),
        ("[worker]\nengine_stall_s = -1\n", "worker.engine_stall_s"),
        ("[kafka]\nfetch_max_wait_ms = 0\n", "kafka.fetch_max_wait_ms"),
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


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


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
