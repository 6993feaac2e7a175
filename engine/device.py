"""How the engine runs on its device, chosen once at start: the device, the dtype, the compute backend, the graphs.

`auto` picks the current CUDA GPU when one is visible, else the CPU; and bf16 on CUDA, fp32 on the CPU
(DESIGN.md "Engine"). Asking for CUDA where there is none is an error naming the fix, never a silent CPU run
(STYLE item 10). The compute backend (engine.backend): Triton kernels on CUDA, with decode steps replayed as
CUDA graphs (engine.cuda_graphs); the torch reference ops on the CPU. `build_runner` logs the choice.
"""

from __future__ import annotations

import logging

import torch

from engine.api import EngineError
from engine.backend import graph_batch_sizes, pick_backend
from engine.config import EngineConfig
from engine.model import LlamaForCausalLM
from engine.runner import ModelRunner

log = logging.getLogger("lorabatch.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise EngineError("engine.device='cuda' but no CUDA GPU is visible; set engine.device to 'cpu' or 'auto'", code="no_gpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[choice]


def build_runner(model: LlamaForCausalLM, config: EngineConfig, tenant_quota_blocks: int) -> ModelRunner:
    """The runner of `model` on its weights' device: the compute backend (engine.backend) and the decode CUDA graph
    buckets chosen once for that device, and said in the log."""
    device = model.lm_head.weight.device
    backend = pick_backend(config.kernel_backend, device)
    graph_cap = min(config.cuda_graph_max_batch, config.max_batch_size)
    graphs = graph_batch_sizes(graph_cap) if backend.triton and device.type == "cuda" else ()
    runner = ModelRunner(
        model,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        adapter_gpu_bytes=config.adapter_gpu_bytes,
        kv_num_blocks=config.kv_pool_blocks,
        kv_block_size=config.kv_block_size,
        prefix_caching=config.enable_prefix_caching,
        tenant_quota_blocks=tenant_quota_blocks,
        backend=backend,
        graph_sizes=graphs,
        prompt_graph_tokens=min(config.cuda_graph_prompt_tokens, config.max_num_batched_tokens) if graphs else 0,
        max_blocks_per_seq=config.blocks_per_sequence,
        max_chain=config.decode_steps,
        decode_lora_in_ops=tuple(config.decode_lora_in_ops),
        decode_lora_overlap=config.decode_lora_overlap,
    )
    if backend.triton:
        what = "Triton kernels (multi-LoRA shrink/expand, paged attention)" + (" in the interpreter" if backend.interpreted else "")
    else:
        what = "torch reference ops (gathered multi-LoRA, per-sequence SDPA)"
    if graphs:
        how = f"decode steps of up to {graphs[-1]} requests replay CUDA graphs (buckets {', '.join(map(str, graphs))})"
        if runner.mixed is not None:
            how += f", and so do steps with prompt tokens of up to {runner.mixed.tokens[-1]} tokens"
    elif backend.triton and device.type == "cuda":
        how = "CUDA graphs off (engine.cuda_graph_max_batch=0): every step eager"
    else:
        how = "no CUDA graphs (they need the triton backend on cuda): every step eager"
    log.info("engine backend: %s on %s, %s (engine.kernel_backend=%r); %s", backend.name, device, what, config.kernel_backend, how)
    return runner
