"""The engine's sizes derived from its device (engine.sizing): on CUDA the fields the configuration leaves unset come from
the device's memory, the model and the host's cores; fields it sets keep their values; the CPU keeps the defaults."""

import pytest
import torch

from consumer.config import ConfigError, WorkerConfig, check_worker_fits, load_settings
from engine.api import EngineError
from engine.bench.build import model_config
from engine.config import EngineConfig
from engine.sizing import AUTO_MAX_BATCH, AUTO_MAX_LORAS, DeviceMemory, activation_reserve_bytes, checkpoint_bytes, derive

GB = 10**9
CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU
H200 = 143 * GB


def _by_field(lines):
    return {d.field: d for d in lines}


def test_the_cpu_keeps_the_defaults_and_says_so():
    cfg = EngineConfig(max_batch_size=4)
    sized, lines = derive(cfg, model_config("llama-1b"), torch.device("cpu"), torch.float32, None)
    assert sized == cfg
    got = _by_field(lines)
    assert got["max_batch_size"].value == 4 and got["max_batch_size"].source == "set in the configuration"
    assert got["max_loras"].value == 8 and got["max_loras"].source == "default (cpu)"
    assert got["kv_num_blocks"].value == cfg.kv_pool_blocks


def test_an_h200_gets_a_large_batch_a_kv_pool_of_its_memory_and_room_for_thousands_of_adapters():
    model = model_config("llama-1b")
    weights = 2_500_000_000
    memory = DeviceMemory(total=H200, free=H200 - weights - 600_000_000, weights_loaded=True)
    sized, lines = derive(EngineConfig(), model, CUDA, torch.bfloat16, memory, cpu_count=16)
    usable = int(H200 * 0.9) - (H200 - memory.free)
    graph_tokens = min(sized.cuda_graph_prompt_tokens, sized.max_num_batched_tokens)  # the prompt steps' graphs' pool
    left = usable - activation_reserve_bytes(model, sized.max_num_batched_tokens, AUTO_MAX_BATCH, 2, graph_tokens)
    assert sized.adapter_gpu_bytes == int(left * 0.10)
    block = 2 * model.num_layers * model.num_kv_heads * model.head_dim * sized.kv_block_size * 2
    assert sized.kv_num_blocks == (left - sized.adapter_gpu_bytes) // block
    eager, _ = derive(EngineConfig(cuda_graph_prompt_tokens=0), model, CUDA, torch.bfloat16, memory, cpu_count=16)
    assert eager.kv_num_blocks > sized.kv_num_blocks, "without prompt graphs their pool's bytes go to the KV pool"
    assert sized.kv_num_blocks * block + sized.adapter_gpu_bytes <= usable  # never more than the fraction allows
    assert sized.max_batch_size == AUTO_MAX_BATCH  # the KV pool holds thousands of full-length sequences
    assert 1000 < sized.max_loras <= AUTO_MAX_LORAS
    assert (sized.adapter_read_processes, sized.adapter_read_threads) == (8, 8)
    assert sized.adapter_loads_per_s == 400.0 and sized.adapter_load_burst == 2 * AUTO_MAX_BATCH
    got = _by_field(lines)
    assert "0.90 of 133.2 GiB" in got["adapter_gpu_bytes"].source and "KV pool holds" in got["max_batch_size"].source
    assert all(d.source != "set in the configuration" for d in lines)


def test_fields_the_configuration_sets_keep_their_values_and_the_rest_fit_around_them():
    model = model_config("llama-8b")
    memory = DeviceMemory(total=H200, free=H200 - 17 * GB, weights_loaded=True)
    cfg = EngineConfig(max_batch_size=64, adapter_gpu_bytes=10 * GB, adapter_read_processes=2)
    sized, lines = derive(cfg, model, CUDA, torch.bfloat16, memory, cpu_count=16)
    assert (sized.max_batch_size, sized.adapter_gpu_bytes, sized.adapter_read_processes) == (64, 10 * GB, 2)
    got = _by_field(lines)
    assert {got[f].source for f in ("max_batch_size", "adapter_gpu_bytes", "adapter_read_processes")} == {"set in the configuration"}
    block = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 16 * 2
    usable = int(H200 * 0.9) - 17 * GB
    assert sized.kv_num_blocks * block <= usable - 10 * GB
    # rank-16 q,v adapters of llama-8b are 13.6 MB: a 10 GB pool holds about 700 of them, each with a table row
    assert 650 < sized.max_loras < 800
    # the threads and the bucket follow the readers and the batch it has
    assert (sized.adapter_read_threads, sized.adapter_loads_per_s, sized.adapter_load_burst) == (2, 100.0, 128)


def test_none_set_explicitly_keeps_the_cpu_rule_for_that_field():
    """kv_num_blocks = None and adapter_gpu_bytes = None written in the configuration mean what they mean on the CPU
    (a pool for max_batch_size sequences; max_loras max-rank adapters on every projection), not a derived size."""
    memory = DeviceMemory(total=H200, free=H200 - 3 * GB, weights_loaded=True)
    cfg = EngineConfig(max_batch_size=32, kv_num_blocks=None, adapter_gpu_bytes=None)
    sized, lines = derive(cfg, model_config("llama-1b"), CUDA, torch.bfloat16, memory, cpu_count=2)
    assert sized.kv_pool_blocks == cfg.kv_pool_blocks and sized.adapter_gpu_bytes is None
    assert _by_field(lines)["kv_num_blocks"].value == cfg.kv_pool_blocks


def test_weights_not_yet_loaded_count_against_the_memory():
    model = model_config("llama-8b")
    before = DeviceMemory(total=H200, free=H200, weights_loaded=False)
    after = DeviceMemory(total=H200, free=H200 - 16 * GB, weights_loaded=True)
    a, _ = derive(EngineConfig(), model, CUDA, torch.bfloat16, before, weight_bytes=16 * GB, cpu_count=4)
    b, _ = derive(EngineConfig(), model, CUDA, torch.bfloat16, after, cpu_count=4)
    assert a == b


def test_a_gpu_too_small_for_the_weights_or_one_sequence_is_an_error_that_says_what_to_change():
    model = model_config("llama-8b")
    small = DeviceMemory(total=16 * GB, free=16 * GB, weights_loaded=False)
    with pytest.raises(EngineError, match="gpu_memory_fraction"):
        derive(EngineConfig(), model, CUDA, torch.bfloat16, small, weight_bytes=16 * GB)
    tight = DeviceMemory(total=24 * GB, free=24 * GB - 16 * GB, weights_loaded=True)
    with pytest.raises(EngineError, match="max_prompt_tokens"):
        derive(EngineConfig(max_prompt_tokens=100_000, max_num_batched_tokens=512), model, CUDA, torch.bfloat16, tight)


def test_the_worker_checks_its_batches_against_the_sized_engine():
    """A worker batch larger than the engine's: refused at load when the engine's size is set in the file, and when the
    worker starts against the sized engine when it is derived (a file may rely on a GPU's larger batch)."""
    with pytest.raises(ConfigError, match="worker.max_batch_size=64 exceeds engine.max_batch_size=16"):
        load_settings(None, {"worker": {"max_batch_size": 64}, "engine": {"max_batch_size": 16}})
    settings = load_settings(None, {"worker": {"max_batch_size": 64}})  # engine.max_batch_size unset: derived on a GPU
    assert settings.worker.max_batch_size == 64
    with pytest.raises(ValueError, match="lower the first or raise the second"):
        check_worker_fits(WorkerConfig(max_batch_size=64), EngineConfig())  # the CPU's 32


def test_checkpoint_bytes_are_the_tensors_bytes_of_the_safetensors_files(demo_set):
    from safetensors import safe_open

    model_dir = demo_set["model"]
    want = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                want += t.numel() * t.element_size()
    assert checkpoint_bytes(model_dir) == want > 0


def test_config_show_prints_the_sizes_as_comments_of_a_valid_file(tmp_path, demo_set):
    import tomllib

    from typer.testing import CliRunner

    from consumer.cli import build_app

    path = tmp_path / "c.toml"
    path.write_text(f'[worker]\nmax_batch_size = 4\n[engine]\nmodel_dir = "{demo_set["model"]}"\nmax_batch_size = 4\n')
    out = CliRunner().invoke(build_app(), ["config", "show", "--config", str(path)])
    assert out.exit_code == 0, out.output
    assert tomllib.loads(out.stdout)["engine"]["max_batch_size"] == 4
    assert "# engine sizes on cpu" in out.stdout
    assert "max_batch_size = 4" in out.stdout and "<- set in the configuration" in out.stdout
    assert "max_loras = 8" in out.stdout and "<- default (cpu)" in out.stdout
