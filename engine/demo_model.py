"""Tiny random-weight decoders and PEFT LoRA adapters, written locally in Hugging Face format.

The embedded default model of DESIGN.md: the demo, the tests and CI run the whole service on it with
no network. Everything written here loads unchanged in `transformers` (AutoModelForCausalLM,
AutoTokenizer) and `peft` (PeftModel.from_pretrained, load_adapter), so tests can hold the engine to
those libraries' numbers.

Architectures (`arch`), all of the same sizes:
- "llama": LlamaForCausalLM, plain RoPE, untied embeddings (the default demo model).
- "llama3": LlamaForCausalLM with Llama 3.1's rope_scaling (rope_type llama3, factor 8), its original
  context shrunk to 64 tokens so that the scaling changes most frequencies even in short tests.
- "mistral": MistralForCausalLM with sliding_window 4096, longer than any sequence the engine accepts
  for it (the engine refuses windows shorter than its longest sequence; see engine.model).
- "qwen2": Qwen2ForCausalLM: biases on q, k and v, tied embeddings (no lm_head.weight in the file).

Adapters record the base fingerprint (engine.model) in their safetensors metadata, where PEFT ignores it.

Deterministic by seed: same seed, same bytes. Weights come from a seeded torch.Generator; the
tokenizer is a byte-level BPE trained on the corpus below (the `tokenizers` trainer breaks ties by
pair order, so its merges do not depend on hash seeds).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.adapters import FINGERPRINT_KEY
from engine.checkpoint import base_fingerprint
from engine.model import LORA_TARGETS, PROJECTION_PARENT, ModelConfig

# Sizes of the demo Llama. head_dim 32 = 128 / 4 heads; 2 KV heads make it GQA (2 query heads share
# one KV head), so the engine's head grouping is exercised.
_HIDDEN = 128
_LAYERS = 4
_HEADS = 4
_KV_HEADS = 2
_INTERMEDIATE = 352
_BPE_VOCAB = 640  # target; the trainer stops earlier when the corpus has no more pairs seen twice

_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, Llama's order for the first three

# Renders like HF's templates do (trim_blocks / lstrip_blocks); it starts with the BOS token itself,
# so chat prompts are encoded without adding special tokens, as HF's apply_chat_template does.
_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# What each architecture changes in the Llama config.json written by write_demo_model.
_ARCH_CONFIG: dict[str, dict] = {
    "llama": {},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096},
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": _LAYERS,
    },
}

_CORPUS = """
The lighthouse keeper climbed the stairs every evening before the sun went down. He carried a small
lamp, a notebook and a flask of tea. From the top of the tower he could see the harbour, the fishing
boats coming home and the long grey line of the sea. He wrote the weather in his notebook: the wind,
the clouds, the height of the waves and the colour of the sky. On clear nights he counted the ships
that passed and the stars that came out one by one.

In the morning the market opened early. Farmers brought apples, pears, cabbages and bread. The baker
sold warm rolls and the fisherman sold fresh fish from the night before. Children ran between the
stalls and the old women talked about the price of butter. A teacher bought a newspaper and read it
on the bench by the fountain, where the pigeons waited for crumbs.

A good recipe for soup needs patience. Cut the onions and the carrots, warm the oil in a heavy pot and
let the vegetables soften slowly. Add the stock, a little salt, a bay leaf and some pepper. Let it
simmer for an hour. Taste it, and add what is missing. Serve the soup hot with bread and cheese, and
keep the rest for the next day, when it will taste even better.

The river runs through the middle of the town. In spring the water is high and fast, and in summer it
is slow and warm. People walk along the river in the evening, and students sit on the grass with
their books. There are three bridges: the old stone bridge, the iron bridge for the train and the new
bridge for bicycles. Boats carry visitors up the river to the castle on the hill.

A computer program is a list of instructions. The computer reads each instruction and does what it
says: it adds numbers, compares them, stores them in memory and writes them to the screen. A good
program is easy to read, easy to test and easy to change. When a program has a bug, the programmer
reads the code again, writes a small test that fails, and then fixes the code until the test passes.

The user asked the assistant a question about the weather. The assistant answered that the morning
would be cold and cloudy, that rain would come in the afternoon and that the evening would be clear.
The user thanked the assistant and asked another question about the train to the city. The assistant
said that the first train leaves at seven and the last train comes back at eleven.

Winter in the mountains is long and quiet. Snow covers the roads and the roofs, and the villages are
small and far apart. The people who live there keep wood for the fire, food for the animals and warm
clothes for the children. When the snow melts, the streams fill with water, the meadows turn green
and the cows go up to the high pastures for the summer.

Numbers are everywhere: one, two, three, four, five, six, seven, eight, nine and ten. We count the
days of the week, the months of the year and the hours of the day. We measure the length of a table,
the weight of a bag of flour and the time it takes to walk to the station. A clock on the wall shows
the time, and a calendar shows the date.

The library was open from nine in the morning until six in the evening. Inside it was quiet and warm.
There were books about history, science, music, art and travel, and a room for children with small
chairs and picture books. The librarian knew every reader by name and always had a book to suggest.
"""


ARCHS = ("llama", "llama3", "mistral", "qwen2")


def write_demo_model(out_dir: Path, *, seed: int = 0, arch: str = "llama", vocab_multiple: int = 1, num_layers: int = _LAYERS) -> None:
    """Write a small random-weight model of `arch` (module docstring) with its tokenizer into `out_dir` (HF format).
    `vocab_multiple`: the model's vocabulary is the tokenizer's rounded up to a multiple of it, as real checkpoints
    pad it (e.g. to 64): the ids past the tokenizer's have embeddings and logits but no text. `num_layers`: fewer
    layers for tests that run every kernel in Triton's interpreter, where each layer costs seconds a step."""
    assert isinstance(vocab_multiple, int) and vocab_multiple >= 1, vocab_multiple
    assert isinstance(num_layers, int) and num_layers >= 1, num_layers
    if arch not in ARCHS:
        raise ValueError(f"write_demo_model: arch={arch!r} is not supported; use one of {ARCHS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer()
    vocab = -(-tokenizer.get_vocab_size(with_added_tokens=True) // vocab_multiple) * vocab_multiple
    unk, bos, eos, pad = (tokenizer.token_to_id(t) for t in _SPECIAL_TOKENS)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    head_dim = _HIDDEN // _HEADS
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": _HIDDEN,
        "intermediate_size": _INTERMEDIATE,
        "num_hidden_layers": num_layers,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    config.update(_ARCH_CONFIG[arch])
    if "max_window_layers" in config:
        config["max_window_layers"] = num_layers
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False},
    )
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "model_max_length": 2048,
            "clean_up_tokenization_spaces": False,
            "chat_template": _CHAT_TEMPLATE,
        },
    )
    weights = _model_weights(vocab, seed, num_layers, qkv_bias=arch == "qwen2")
    if config["tie_word_embeddings"]:
        del weights["lm_head.weight"]
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def write_demo_adapter(
    out_dir: Path,
    base_dir: Path,
    *,
    rank: int,
    target_modules: tuple[str, ...] | list[str],
    alpha: float,
    use_rslora: bool = False,
    seed: int = 0,
    fingerprint: bool = True,
) -> None:
    """Write a PEFT LoRA adapter for the demo model in `base_dir`, with non-zero random A and B (and the
    base fingerprint in the safetensors metadata unless `fingerprint` is False).

    PEFT initialises B to zero, which makes a fresh adapter a no-op and would hide any bug in the LoRA
    path; here both are random, with B scaled so that every adapter moves its projections' outputs by
    about 20% of their input's size whatever its rank and scaling.
    """
    assert rank >= 1, rank
    targets = tuple(target_modules)
    assert targets and set(targets) <= set(LORA_TARGETS), targets
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_config = json.loads((Path(base_dir) / "config.json").read_text())
    shapes = ModelConfig.from_hf(base_config).projection_shapes()
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank

    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for layer in range(base_config["num_hidden_layers"]):
        for module in LORA_TARGETS:  # fixed order, so the generator's draws do not depend on the caller's
            if module not in targets:
                continue
            in_f, out_f = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTION_PARENT[module]}.{module}"
            # x A^T has entries of about |x|; B std 0.2 / (scaling * sqrt(r)) makes s * (x A^T) B^T
            # about 0.2 |x| per output entry for every rank and alpha.
            weights[f"{prefix}.lora_A.weight"] = _randn((rank, in_f), 1.0 / math.sqrt(in_f), gen)  # [r, in]
            weights[f"{prefix}.lora_B.weight"] = _randn((out_f, rank), 0.2 / (scaling * math.sqrt(rank)), gen)  # [out, r]

    _write_json(
        out_dir / "adapter_config.json",
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(base_dir),
            "r": rank,
            "lora_alpha": alpha,
            "use_rslora": use_rslora,
            "target_modules": list(targets),
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "init_lora_weights": True,
            "modules_to_save": None,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "use_dora": False,
            "revision": None,
        },
    )
    # One metadata key only: safetensors writes its metadata map in hash order, which varies between
    # processes, so two keys would make the bytes (and the adapter's sha256) differ run to run. PEFT reads
    # adapters without looking at "format".
    metadata = {FINGERPRINT_KEY: base_fingerprint(Path(base_dir))} if fingerprint else {"format": "pt"}
    save_file(weights, str(out_dir / "adapter_model.safetensors"), metadata=metadata)


# name -> (rank, targets, alpha, use_rslora): ranks 4..64, four kinds of target set, two rsLoRA.
DEMO_ADAPTERS: dict[str, tuple[int, tuple[str, ...], float, bool]] = {
    "qv-r4": (4, ("q_proj", "v_proj"), 8.0, False),
    "qkvo-r8": (8, ("q_proj", "k_proj", "v_proj", "o_proj"), 16.0, False),
    "all-r16": (16, LORA_TARGETS, 32.0, False),
    "mlp-r64": (64, ("gate_proj", "up_proj", "down_proj"), 64.0, False),
    "all-r8-rslora": (8, LORA_TARGETS, 16.0, True),
    "qkvo-r64-rslora": (64, ("q_proj", "k_proj", "v_proj", "o_proj"), 16.0, True),
    "qv-r16": (16, ("q_proj", "v_proj"), 16.0, False),
    "mlp-r4": (4, ("gate_proj", "up_proj", "down_proj"), 8.0, False),
}


def write_demo_set(root: Path, *, seed: int = 0, arch: str = "llama", num_layers: int = _LAYERS) -> dict[str, Path]:
    """Write the demo model to root/"model" and 8 adapters to root/"adapters"/NAME; return name -> folder."""
    root = Path(root)
    model_dir = root / "model"
    write_demo_model(model_dir, seed=seed, arch=arch, num_layers=num_layers)
    paths: dict[str, Path] = {}
    for i, (name, (rank, targets, alpha, rslora)) in enumerate(DEMO_ADAPTERS.items()):
        path = root / "adapters" / name
        write_demo_adapter(
            path, model_dir, rank=rank, target_modules=targets, alpha=alpha, use_rslora=rslora, seed=seed * 1000 + i + 1
        )
        paths[name] = path
    return paths


def _train_tokenizer():
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB,
        min_frequency=2,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in _CORPUS.splitlines() if line.strip()], trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Encoding adds BOS as Llama tokenizers do; HF's PreTrainedTokenizerFast runs this post-processor.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def _model_weights(vocab: int, seed: int, num_layers: int, *, qkv_bias: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    head_dim = _HIDDEN // _HEADS
    h, q_out, kv_out, inter = _HIDDEN, _HEADS * head_dim, _KV_HEADS * head_dim, _INTERMEDIATE
    # Std 1/sqrt(in) keeps each projection's output about as large as its (RMS-normed) input; the
    # residual writers (o, down) get half that so 4 layers do not swamp the embeddings. lm_head std
    # 0.15 over a unit-RMS hidden of 128 gives logits of std ~1.7, so the top two logits of a row are
    # typically ~0.5 apart: greedy choices are far from ties at fp32 error (~1e-5).
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _randn((vocab, h), 1.0, gen)}  # [V, hidden]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = 1.0 + _randn((h,), 0.1, gen)
        w[f"{p}.self_attn.q_proj.weight"] = _randn((q_out, h), h**-0.5, gen)  # [heads*head_dim, hidden]
        w[f"{p}.self_attn.k_proj.weight"] = _randn((kv_out, h), h**-0.5, gen)  # [kv_heads*head_dim, hidden]
        w[f"{p}.self_attn.v_proj.weight"] = _randn((kv_out, h), h**-0.5, gen)
        w[f"{p}.self_attn.o_proj.weight"] = _randn((h, q_out), 0.5 * q_out**-0.5, gen)  # [hidden, heads*head_dim]
        w[f"{p}.post_attention_layernorm.weight"] = 1.0 + _randn((h,), 0.1, gen)
        w[f"{p}.mlp.gate_proj.weight"] = _randn((inter, h), h**-0.5, gen)  # [intermediate, hidden]
        w[f"{p}.mlp.up_proj.weight"] = _randn((inter, h), h**-0.5, gen)
        w[f"{p}.mlp.down_proj.weight"] = _randn((h, inter), 0.5 * inter**-0.5, gen)  # [hidden, intermediate]
    w["model.norm.weight"] = 1.0 + _randn((h,), 0.1, gen)
    w["lm_head.weight"] = _randn((vocab, h), 0.15, gen)  # [V, hidden]
    if qkv_bias:  # drawn last, so the other weights are the same bytes as the Llama's of this seed
        for i in range(num_layers):
            p = f"model.layers.{i}.self_attn"
            w[f"{p}.q_proj.bias"] = _randn((q_out,), 0.1, gen)
            w[f"{p}.k_proj.bias"] = _randn((kv_out,), 0.1, gen)
            w[f"{p}.v_proj.bias"] = _randn((kv_out,), 0.1, gen)
    return w


def _randn(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).contiguous()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
