"""The engine's sizes derived from its device at start (issue 20), as vLLM's memory fraction does.

EngineConfig's defaults are the CPU demo's: a batch of 32, a KV pool for that batch, 8 adapter rows, 4 store reads a
second, reads on the engine thread. On a GPU those leave most of it idle, so on CUDA every one of the fields below that
the configuration does not set is derived from the device, the model and the other fields (a field set in the file
keeps its value; the CPU keeps the defaults):

- memory: `gpu_memory_fraction` of the device's memory, less what is in use already (the weights, once loaded, and
  anything else on the device), less a reserve for a step's activations and logits (`activation_reserve_bytes`), is
  split between the adapter pool (`adapter_gpu_bytes`: ADAPTER_SHARE of it) and the KV pool (`kv_num_blocks`: the
  rest, in blocks);
- `max_batch_size`: the sequences of max_prompt_tokens + max_new_tokens the KV pool holds at once, at most
  AUTO_MAX_BATCH (CUDA graphs are captured up to it, engine.cuda_graph_max_batch);
- `max_loras` (page-table rows: adapters resident at once): as many rank-16 q,v adapters as the adapter pool holds,
  at most AUTO_MAX_LORAS, so that the pool's bytes, not its rows, bound residency;
- store reads: `adapter_read_processes` and `adapter_read_threads` from the host's cores (half of them, at most
  AUTO_READERS), and the admission bucket (`adapter_loads_per_s`, `adapter_load_burst`) from what those readers do
  (about READS_PER_PROCESS_S each) and a batch of distinct adapters.

`derive` returns the sized configuration and one `Derived` line per field, with what it came from;
`lorabatch config show` prints them, and the engine logs them at start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.api import EngineError
from engine.config import DEVICE_SIZED, EngineConfig
from engine.model import ModelConfig

AUTO_MAX_BATCH = 256  # the largest batch a derived max_batch_size gives
AUTO_MAX_LORAS = 4096  # page-table rows at most (7 x max_lora_rank int64 each: 3.6 KB at rank 64)
AUTO_READERS = 8  # reader processes (and threads) at most
ADAPTER_SHARE = 0.10  # of the memory left after weights and the activation reserve, for the adapter pool
READS_PER_PROCESS_S = 50  # store reads a reader process does a second (a 3-25 MB adapter: 12-20 ms of one core)
GRAPH_RESERVE = 1 << 30  # CUDA graphs' pools, cuBLAS workspaces, the allocator's fragmentation


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # bytes of the device
    free: int  # bytes free now
    weights_loaded: bool  # whether the model's weights are among what is in use (else `weight_bytes` is still to come)


@dataclass(frozen=True)
class Derived:
    field: str
    value: object
    source: str  # "set" (the configuration's), "default" (the CPU's), or how it was derived


def auto_readers(cores: int | None = None) -> int:
    """Store-reader processes (and read-ahead threads) for a host of `cores` cores (default: this one's): half of them, at
    least 1, at most AUTO_READERS; what `engine.adapter_read_processes` derives to. A reader hashes on a second thread for
    part of each read (engine.adapter_records), so at their busiest the readers can take most of the cores."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return max(1, min(AUTO_READERS, cores // 2))


def derive(config: EngineConfig, model: ModelConfig, device: torch.device, dtype: torch.dtype, memory: DeviceMemory | None,
           weight_bytes: int = 0, cpu_count: int | None = None) -> tuple[EngineConfig, list[Derived]]:  # fmt: skip
    """(the configuration sized for `device`, what each sized field is and where it came from) (module docstring)."""
    explicit = config.model_fields_set
    lines: list[Derived] = []
    update: dict[str, object] = {}

    def put(field: str, value: object, how: str) -> None:
        if field in explicit:
            lines.append(Derived(field, config.kv_pool_blocks if field == "kv_num_blocks" else getattr(config, field), "set in the configuration"))
        else:
            update[field] = value
            lines.append(Derived(field, value, how))

    if device.type != "cuda" or memory is None:
        for field in DEVICE_SIZED:
            value = config.kv_pool_blocks if field == "kv_num_blocks" else getattr(config, field)
            lines.append(Derived(field, value, "set in the configuration" if field in explicit else f"default ({device.type})"))
        return config, lines

    elem = torch.empty(0, dtype=dtype).element_size()
    usable = int(memory.total * config.gpu_memory_fraction) - (memory.total - memory.free)
    if not memory.weights_loaded:
        usable -= weight_bytes
    batch_cap = config.max_batch_size if "max_batch_size" in explicit else AUTO_MAX_BATCH
    graph_tokens = min(config.cuda_graph_prompt_tokens, config.max_num_batched_tokens) if config.cuda_graph_max_batch else 0
    reserve = activation_reserve_bytes(model, config.max_num_batched_tokens, batch_cap, elem, graph_tokens)
    left = usable - reserve
    where = (f"{config.gpu_memory_fraction:.2f} of {_gib(memory.total)} GiB, less {_gib(memory.total - memory.free)} GiB in use"
             + ("" if memory.weights_loaded else f" and {_gib(weight_bytes)} GiB of weights")
             + f", less a {_gib(reserve)} GiB activation reserve: {_gib(left)} GiB")  # fmt: skip
    if left <= 0:
        raise EngineError(f"the device has no memory left for the KV cache and adapters ({where}); raise "
                          "engine.gpu_memory_fraction, lower max_num_batched_tokens, or use a larger GPU", code="config_invalid")  # fmt: skip
    adapter_bytes = config.adapter_gpu_bytes if "adapter_gpu_bytes" in explicit else int(left * ADAPTER_SHARE)
    put("adapter_gpu_bytes", adapter_bytes, f"{ADAPTER_SHARE:.0%} of {where}")
    block_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * config.kv_block_size * elem
    kv_blocks = config.kv_pool_blocks if "kv_num_blocks" in explicit else (left - (adapter_bytes or 0)) // block_bytes
    put("kv_num_blocks", kv_blocks, f"the rest of {_gib(left)} GiB after the adapter pool, in blocks of {block_bytes // 1024} KiB")
    per_seq = config.blocks_per_sequence
    if kv_blocks < per_seq:
        raise EngineError(f"the KV pool of {kv_blocks} blocks ({where}) cannot hold one sequence of max_prompt_tokens + "
                          f"max_new_tokens ({per_seq} blocks); lower those or free device memory", code="config_invalid")  # fmt: skip
    put("max_batch_size", min(AUTO_MAX_BATCH, kv_blocks // per_seq), f"sequences of {config.max_prompt_tokens} + {config.max_new_tokens} tokens the KV pool holds "
        f"({kv_blocks // per_seq}), at most {AUTO_MAX_BATCH}")  # fmt: skip
    typical = 16 * sum(model.projection_shapes()[m][0] + model.projection_shapes()[m][1] for m in ("q_proj", "v_proj"))
    typical *= model.num_layers * elem
    rows = max(config.max_loras, min(AUTO_MAX_LORAS, (adapter_bytes or 0) // typical))
    put("max_loras", rows, f"rank-16 q,v adapters ({typical / 2**20:.1f} MiB each) the adapter pool holds, at most {AUTO_MAX_LORAS}")
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    readers = auto_readers(cores)
    put("adapter_read_processes", readers, f"half of the host's {cores} cores, at most {AUTO_READERS}")
    procs = update.get("adapter_read_processes", config.adapter_read_processes)
    put("adapter_read_threads", max(1, procs), "one per reader process")
    put("adapter_loads_per_s", float(READS_PER_PROCESS_S * max(1, procs)), f"{READS_PER_PROCESS_S} store reads a second per reader process")
    put("adapter_load_burst", 2 * update.get("max_batch_size", config.max_batch_size), "two batches of distinct adapters")
    sized = config.model_copy(update=update)
    return sized, lines


def activation_reserve_bytes(model: ModelConfig, tokens: int, rows: int, elem: int, graph_tokens: int = 0) -> int:
    """Device memory a step needs beyond weights, KV and adapters, with room to spare: a prefill of `tokens` tokens
    (the hidden state, q/k/v, the MLP's gate and up, their LoRA deltas, twice over for the allocator's blocks) and the
    fp32 logits of `rows` sampled rows (with their softmax), GRAPH_RESERVE, and the pool of the prompt steps' graphs
    (engine.mixed_graphs): one forward of `graph_tokens` tokens, held apart from the eager steps' memory, and its logits."""
    per_token = model.hidden_size * 6 + model.num_heads * model.head_dim * 2 + model.intermediate_size * 4
    graphs = graph_tokens * per_token * elem + rows * model.vocab_size * 4 if graph_tokens else 0
    return 2 * tokens * per_token * elem + 3 * rows * model.vocab_size * 4 + GRAPH_RESERVE + graphs


def device_memory(device: torch.device, *, weights_loaded: bool) -> DeviceMemory | None:
    """The device's memory now (CUDA), or None."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, free=free, weights_loaded=weights_loaded)


def checkpoint_bytes(model_dir: Path) -> int:
    """Bytes of a model folder's weights as they will sit on the device (the safetensors files' tensors; the dtype's
    size is the checkpoint's, which is the engine's for bf16 checkpoints on CUDA)."""
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def plan(config: EngineConfig) -> tuple[str, list[Derived]]:
    """(the device, what `derive` would give) for `config` before any weights are loaded: from the model folder's
    config.json and checkpoint size and the device's free memory now (`lorabatch config show`)."""
    from engine.checkpoint import read_model_config
    from engine.device import pick_device, pick_dtype

    device = pick_device(config.device)
    model = read_model_config(Path(config.model_dir))
    memory = device_memory(device, weights_loaded=False)
    _, lines = derive(config, model, device, pick_dtype(config.dtype, device), memory, checkpoint_bytes(Path(config.model_dir)))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{device} ({name})", lines


@contextlib.contextmanager
def sized_by(config: EngineConfig, *fields: str) -> Iterator[None]:
    """Allocations that `fields` of `config` size: a size the device or host cannot hold (engine.kv_num_blocks = 10^11,
    host_cache_bytes = 10^15) ends the engine with an EngineError naming the fields and their values, where torch's
    allocator error ("DefaultCPUAllocator: can't allocate memory", CUDA out of memory) ended it in a traceback."""
    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError is one; so is the CPU allocator's failure
        text = str(e)
        if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in text:
            raise
        asked = re.search(r"allocate ([0-9.]+ ?[KMGT]?i?B|[0-9]+ bytes)", text)
        shown = ", ".join(f"engine.{f}={config.kv_pool_blocks if f == 'kv_num_blocks' else getattr(config, f)}" for f in fields)
        one = len(fields) == 1
        raise EngineError(f"the engine cannot allocate the memory that {shown} {'asks' if one else 'ask'} for"
                          f"{f' ({asked.group(1)})' if asked else ''}: lower {'it' if one else 'them'} to what this "
                          f"machine holds"
                          f"{' (on a GPU, leave them unset: they are derived from its memory)' if 'host_cache_bytes' not in fields else ''}",
                          code="config_invalid") from e
