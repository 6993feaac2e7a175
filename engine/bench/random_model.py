"""Random-weight models of real shapes, written as Hugging Face folders, and PEFT adapters for them.

For runs that need a model *folder* at a real size (workers load one from disk), where the tiny demo
model is too small to mean anything: `write_random_model(dir, shape="llama-1b")`. The tokenizer is a
word-level vocabulary of made-up words: such runs feed token ids and never read the text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.bench.build import SHAPES
from engine.model import LORA_TARGETS as TARGETS
from engine.model import PROJECTION_PARENT as _PARENT


def projection_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """module -> (in_features, out_features)."""
    hidden, _, heads, kv_heads, inter, _ = SHAPES[shape]
    head_dim = hidden // heads
    return {"q_proj": (hidden, hidden), "k_proj": (hidden, kv_heads * head_dim), "v_proj": (hidden, kv_heads * head_dim),
            "o_proj": (hidden, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_random_model(out_dir: Path, *, shape: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """An HF Llama folder of `shape` with random weights (std 1/sqrt(fan_in), so activations stay O(1))."""
    assert shape in SHAPES, f"shape {shape!r}: use one of {sorted(SHAPES)}"
    from tokenizers import Tokenizer, models, pre_tokenizers

    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[shape]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def randn(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * dims[-1] ** -0.5).to(dtype)

    weights = {"model.embed_tokens.weight": randn(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=dtype),
               "lm_head.weight": randn(vocab, hidden)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for module, (in_f, out_f) in projection_shapes(shape).items():
            weights[f"{prefix}.{_PARENT[module]}.{module}.weight"] = randn(out_f, in_f)
        weights[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        weights[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
    save_file(weights, str(out_dir / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "w1", "eos_token": "w2"}))
    return out_dir


def write_random_adapters(out_dir: Path, *, shape: str, count: int, rank: int, seed: int = 0) -> list[Path]:
    """`count` PEFT adapters of `rank` on all seven projections; B scaled to move outputs by about 10%."""
    out_dir = Path(out_dir)
    paths = []
    for i in range(count):
        path = out_dir / f"a{i:03d}"
        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        weights = {}
        for layer in range(SHAPES[shape][1]):
            for module, (in_f, out_f) in projection_shapes(shape).items():
                prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
                weights[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen) * in_f**-0.5).to(torch.bfloat16)
                weights[f"{prefix}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * (0.05 / math.sqrt(rank))).to(torch.bfloat16)
        save_file(weights, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False}))
        paths.append(path)
    return paths
