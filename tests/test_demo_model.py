"""The demo model and adapters are real HF / PEFT artefacts, deterministic by seed, and our tokenizer agrees with HF's."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.tokenizer import Tokenizer

TEXTS = [
    "The lighthouse keeper climbed the stairs.",
    "  leading spaces and\ttabs\nand newlines ",
    "café, naïve, 日本語, emoji ☕🚀",
    "</s> looks special but is typed text <s>",
    "a",
]


def _digest_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_hf_transformers_loads_the_model_unchanged(demo_set):
    """AutoModelForCausalLM reads the folder as a Llama with the written sizes, strictly (no missing or new weights)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(demo_set["model"], dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 4, 4, 2)
    assert cfg.vocab_size == Tokenizer(demo_set["model"]).vocab_size
    ids = torch.tensor([Tokenizer(demo_set["model"]).encode(TEXTS[0])])
    with torch.no_grad():
        logits = model(ids).logits[0]  # [T, V]
    top2 = logits.topk(2, dim=-1).values
    assert logits.std(dim=-1).min() > 0.5, "logits too flat: greedy choices would be near ties"
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, "near-tie in greedy choice"


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_hf(demo_set, text):
    """encode adds BOS exactly as HF's AutoTokenizer does, decode skips specials as HF does, and token bytes rebuild the text."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(demo_set["model"])
    ours = Tokenizer(demo_set["model"])
    ids = ours.encode(text)
    assert ids == hf(text).input_ids
    assert ids[0] == ours.bos_token_id == hf.bos_token_id
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert b"".join(ours.token_bytes(t) for t in ours.encode(text, add_special_tokens=False)) == text.encode()


def test_chat_template_matches_hf(demo_set):
    """The jinja2 chat template renders and encodes exactly as HF's apply_chat_template(add_generation_prompt=True)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(demo_set["model"])
    ours = Tokenizer(demo_set["model"])
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": "Cold."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    text = ours.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|assistant|>\n")
    hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ours.encode_chat(messages) == list(hf_ids)


def test_peft_loads_every_adapter_with_nonzero_b(demo_set):
    """PeftModel / load_adapter read all 8 adapters; B is non-zero and PEFT's scaling is alpha/r or alpha/sqrt(r)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    names = list(demo_set["adapters"])
    assert len(names) == 8
    base = AutoModelForCausalLM.from_pretrained(demo_set["model"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, demo_set["adapters"][names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(demo_set["adapters"][name], adapter_name=name)
    ranks, targets, rslora = set(), set(), 0
    for name in names:
        cfg = json.loads((demo_set["adapters"][name] / "adapter_config.json").read_text())
        ranks.add(cfg["r"])
        targets.add(tuple(sorted(cfg["target_modules"])))
        rslora += cfg["use_rslora"]
        want = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg["use_rslora"] else cfg["r"])
        layers = model.base_model.model.model.layers
        proj = getattr(layers[0].self_attn, cfg["target_modules"][0], None) or getattr(layers[0].mlp, cfg["target_modules"][0])
        assert proj.scaling[name] == pytest.approx(want)
        assert proj.lora_B[name].weight.abs().min() > 0, f"{name}: B has zeros, LoRA bugs could hide"
        assert tuple(proj.lora_A[name].weight.shape) == (cfg["r"], proj.in_features)
    assert {4, 8, 16, 64} <= ranks
    assert len(targets) >= 4 and rslora >= 1


def test_same_seed_same_bytes_across_processes(tmp_path):
    """write_demo_set is a pure function of its seed: a second write, in a fresh process, gives identical bytes."""
    from engine.demo_model import write_demo_set

    root = tmp_path / "set"
    write_demo_set(root, seed=3)
    first = _digest_tree(root)
    for p in sorted(root.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    code = f"from pathlib import Path; from engine.demo_model import write_demo_set; write_demo_set(Path({str(root)!r}), seed=3)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
    assert _digest_tree(root) == first
    assert len(first) == 5 + 2 * 8

    write_demo_set(tmp_path / "other", seed=4)
    assert _digest_tree(tmp_path / "other")["model/model.safetensors"] != first["model/model.safetensors"]


@pytest.mark.parametrize(
    ("arch", "cls", "check"),
    [
        ("llama3", "LlamaForCausalLM", lambda m: m.config.rope_parameters["rope_type"] == "llama3"),
        ("mistral", "MistralForCausalLM", lambda m: m.config.sliding_window == 4096),
        ("qwen2", "Qwen2ForCausalLM",
         lambda m: m.model.layers[0].self_attn.q_proj.bias is not None and m.model.layers[0].self_attn.o_proj.bias is None
         and m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()),
    ],
)
def test_hf_transformers_loads_every_demo_architecture(tmp_path, arch, cls, check):
    """Each architecture loads strictly (no missing or unexpected weights) as its HF class, with its distinguishing
    feature (llama3 rope scaling, Mistral's window, Qwen2's q/k/v biases and tied embeddings), and the same
    seed gives the Llama's weights wherever the architectures share them."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from engine.demo_model import write_demo_model

    write_demo_model(tmp_path / arch, seed=5, arch=arch)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / arch, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == cls
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert check(model)
    write_demo_model(tmp_path / "llama", seed=5)
    ours, llama = load_file(str(tmp_path / arch / "model.safetensors")), load_file(str(tmp_path / "llama" / "model.safetensors"))
    shared = set(ours) & set(llama)
    assert len(shared) >= len(llama) - 1 and all(torch.equal(ours[k], llama[k]) for k in shared)
