"""The engine benches' workload: a random-weight model of a named shape built on the device, random PEFT
adapters, and an engine sized for one batch (engine.bench.serving, engine.bench.profile_steps).

No checkpoint is read: an 8B model would take minutes to write and read. The adapters go through the
engine's real load path (files, validation, L2, slots).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.checkpoint import build_model, hf_param_shapes
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model import LORA_TARGETS, PROJECTION_PARENT, LlamaForCausalLM, ModelConfig
from engine.rope import RopeConfig
from engine.tokenizer import Tokenizer

# hidden, layers, heads, kv heads, intermediate, vocab
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (128, 4, 4, 2, 352, 640),  # the demo model's sizes (engine.demo_model)
    "llama-1b": (2048, 16, 32, 8, 8192, 128256),  # Llama-3.2-1B
    "llama-8b": (4096, 32, 32, 8, 14336, 128256),  # Llama-3.1-8B
}


def build_bench_engine(cfg: ModelConfig, shape: str, adapter_ranks: list[int], uniform_rank: int | None, batch: int, prompt: int,
                       new: int, dev: torch.device, dtype: torch.dtype, tmp: Path, kernel_backend: str = "auto",
                       weight_dtype: str = "auto", decode_lora_in_ops: tuple[str, ...] = (),
                       decode_lora_overlap: bool = True) -> tuple[Engine, list[Path]]:  # fmt: skip
    """The bench's engine on a random model of `cfg` (its projections FP8 with weight_dtype "fp8", engine.quant) with
    adapters a0.. of `adapter_ranks` (and u0.. of `uniform_rank`) loaded, sized for `batch` requests of `prompt` + `new`
    tokens, and engine.decode_lora_in_ops and decode_lora_overlap; returns it and the adapter folders."""
    model = random_model(cfg, dev, dtype, seed=0, fp8=weight_dtype == "fp8")
    paths = [_write_adapter(tmp / f"a{i}", cfg, r, seed=i + 1, device=dev) for i, r in enumerate(adapter_ranks)]
    if uniform_rank is not None:
        paths += [_write_adapter(tmp / f"u{i}", cfg, uniform_rank, seed=1000 + i, device=dev) for i in range(len(adapter_ranks))]
    slots = len(paths)
    host_bytes = 2 * sum(p.joinpath("adapter_model.safetensors").stat().st_size for p in paths) + (64 << 20)  # fp32 on CPU
    config = EngineConfig(
        model_dir=str(tmp), device=dev.type, max_batch_size=batch, max_prompt_tokens=prompt, max_new_tokens=new,
        max_num_batched_tokens=batch * prompt, kv_num_blocks=_kv_blocks(batch, prompt + new), max_loras=slots,
        max_lora_rank=max(adapter_ranks + [uniform_rank or 1]),
        enable_prefix_caching=False,  # the base and mixed runs share prompts: neither may skip its prefill
        adapter_load_burst=slots, warm_pool_slots=0, host_cache_bytes=host_bytes, kernel_backend=kernel_backend,
        decode_lora_in_ops=list(decode_lora_in_ops), decode_lora_overlap=decode_lora_overlap,
        # as the issue-4 suite measured them: none of these derived from the device (engine.sizing)
        adapter_gpu_bytes=None, adapter_read_processes=0, adapter_read_threads=0, adapter_loads_per_s=4.0,
    )  # fmt: skip
    engine = Engine.from_model(config, model, _word_tokenizer(cfg.vocab_size), fingerprint=f"bench-{shape}")
    for path in paths:
        engine.load_adapter(path.name, path)
    return engine, paths


def model_config(shape: str) -> ModelConfig:
    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[shape]
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=hidden // heads, rope=RopeConfig(theta=500000.0), rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False,
    )  # fmt: skip


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int, fp8: bool = False) -> LlamaForCausalLM:
    """Random weights drawn on the device, std 1/sqrt(fan_in) so activations stay O(1) through the layers; with `fp8`,
    the projections quantized from them (engine.quant)."""
    shapes = hf_param_shapes(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for key, shp in shapes.items():
        if key.endswith("norm.weight"):
            state[key] = torch.ones(shp, dtype=dtype, device=device)
        else:
            state[key] = torch.randn(shp, generator=gen, dtype=dtype, device=device) * (shp[-1] ** -0.5)
    return build_model(cfg, state, device, dtype, fp8=fp8)


def _kv_blocks(batch: int, tokens: int, block_size: int = EngineConfig.model_fields["kv_block_size"].default) -> int:
    """KV blocks for `batch` sequences of `tokens`, plus the planner's admission watermark (1% of the pool), so
    that every prompt is admitted in the first step."""
    need = batch * -(-tokens // block_size)
    return need + need // 50 + 2


def _write_adapter(path: Path, cfg: ModelConfig, rank: int, seed: int, device: torch.device | None = None) -> Path:
    """A PEFT adapter of `rank` on all seven projections, alpha = 2 * rank, B scaled to move outputs ~10%.
    The numbers are drawn on `device` (an 8b adapter is 42M of them), from a seeded generator."""
    path.mkdir(parents=True)
    device = device or torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for module, (in_f, out_f) in cfg.projection_shapes().items():
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTION_PARENT[module]}.{module}"
            a = torch.randn(rank, in_f, generator=gen, device=device) * in_f**-0.5
            b = torch.randn(out_f, rank, generator=gen, device=device) * (0.05 / math.sqrt(rank))
            weights[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
            weights[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_TARGETS),
        "lora_dropout": 0.0, "bias": "none",
    }))  # fmt: skip
    return path


def _word_tokenizer(vocab_size: int) -> Tokenizer:
    """A tokenizer of vocab_size made-up words: the bench feeds token ids and never reads the text."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    tok = HFTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer.from_tokenizer(tok)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall clock read next measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
