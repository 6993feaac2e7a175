"""The engine bench's peer: HF transformers + peft `generate` with `adapter_names=`, on the very same weights
(shared tensors, no second copy), adapters and batch as the engine (engine.bench.serving)."""

from __future__ import annotations

import time

import torch

from engine.bench.build import sync
from engine.checkpoint import unfuse_state
from engine.model import LORA_TARGETS, PROJECTION_PARENT


def run_peer(model, cfg, paths, ranks, prompts, new, device, dtype) -> dict:
    """HF transformers + peft on the same weights and batch; {} when they are not importable."""
    try:
        from peft import LoraConfig, get_peft_model
        from safetensors.torch import load_file
        from transformers import LlamaConfig
        from transformers import LlamaForCausalLM as HFLlama
    except ImportError:
        return {}
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope.theta,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False, eos_token_id=None,
    )  # fmt: skip
    with torch.device("meta"):
        hf = HFLlama(hf_cfg)
    state = unfuse_state(cfg, {k.replace(".base.", "."): v for k, v in model.state_dict().items()})  # HF names, views
    hf.load_state_dict(state, assign=True, strict=True)  # shares our tensors: no second copy of the weights
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_cfg).to(device)  # its buffers were left on meta
    hf.eval()
    names = [f"a{i}" for i in range(len(paths))]
    pm = None
    for name, r, path in zip(names, ranks, paths):
        lcfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
        if pm is None:
            pm = get_peft_model(hf, lcfg, adapter_name=name)
        else:
            pm.add_adapter(name, lcfg)
        weights = load_file(str(path / "adapter_model.safetensors"))
        for layer in range(cfg.num_layers):
            for module in LORA_TARGETS:
                proj = getattr(getattr(pm.base_model.model.model.layers[layer], PROJECTION_PARENT[module]), module)
                prefix = f"base_model.model.model.layers.{layer}.{PROJECTION_PARENT[module]}.{module}"
                proj.lora_A[name].weight.data.copy_(weights[f"{prefix}.lora_A.weight"])
                proj.lora_B[name].weight.data.copy_(weights[f"{prefix}.lora_B.weight"])
    pm.eval()
    ids = torch.tensor(prompts, device=device)
    batch = len(prompts)

    def gen(adapter_names: list[str], n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=adapter_names,
                        max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
        sync(device)
        return time.perf_counter() - t0

    base_names = ["__base__"] * batch
    mixed_names = [names[i % len(names)] for i in range(batch)]
    gen(mixed_names, 2)  # warm
    out = {}
    for label, adapter_names in (("base", base_names), ("mixed", mixed_names)):
        # The decode time is a difference of two runs; on a busy CPU the shorter run can take longer (tiny shapes in the
        # tests), so a non-positive difference is measured again, at most three times in all.
        for _ in range(3):
            decode_s = gen(adapter_names, new) - gen(adapter_names, 1)
            if decode_s > 0:
                break
        out[f"peer_{label}_tok_s"] = batch * (new - 1) / decode_s if decode_s > 0 else None
    return out
