"""`lorabatch bench engine`: decode and prefill speed of the engine, base-only and with many adapters.

One run builds a random-weight model of the chosen shape directly on the device (no checkpoint is read:
an 8B model would take minutes to write and read), writes N random PEFT adapters of rank R on all seven
projections (the engine loads them through its real path: files, validation, L2, slots), and measures:

- ours, base: B requests without adapters, prompt P, T new tokens (EOS ignored); the first step is the
  prefill of all B prompts, the others are decode steps of B rows.
- ours, mixed: the same with the B rows spread over N distinct adapters (row i uses adapter i mod N).
- with `mixed_ranks` (e.g. 8,16,32,64, cycled over the N adapters, used by the mixed run): also a batch over
  N more adapters all at the mean rank of the batch's adapters (30 for 8/16/32/64: the same bytes), and
  the ratio of the two steps (S-LoRA's heterogeneity cost; issue 4's target is at most 1.1x).
- the peer (HF transformers + peft `generate` with `adapter_names=`, when importable), on the very same
  weights and batch; its decode time is generate(T) - generate(1).
- the memory roofline of a decode step: the bytes it must read (base weights, the distinct adapters of
  the batch at their own rank, the KV of every row at its mean context P + T/2) over the copy bandwidth
  measured on the device (a device-to-device copy on CUDA, a large memcpy on CPU); and the matmul rate
  (an 8192^3 product in the model's dtype on random data) that the prefill's FLOP rate is set against.

Step times: `step_ms` is the decode phase's wall time (scheduling, forward, sampling, bookkeeping) over its
steps, engine.step() called back to back as a serving loop does; a call runs up to engine.config
decode_steps steps back to back (engine.cuda_graphs "Chains") and launches the next round before it
reads the last (engine.engine); `decode_rounds` counts the calls, and `*_one_per_round` are the same
batches with decode_steps 1; tokens/s is B x decode steps / their wall time;
`device_step_ms` is the engine's own measurement of the same steps (CUDA events around the
forward and sampling, engine.timing), so the gap between the two is host time the GPU waits for;
`decode_first_call_ms` (the host's time before the first round is launched, the GPU idle) and
`decode_last_call_ms` (the wait for the last round and its bookkeeping) say where.
prefill_tflops counts the matmul and attention FLOPs of the base prefill step over its wall time;
prefill_lora_overhead_pct is the mixed prefill step's extra time over the base one; both from the medians of
PREFILL_SAMPLES prefills each (base and mixed interleaved), `prefill_lora_overhead_pct_range` the share of each
pair. It prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.checkpoint import build_model, hf_param_shapes, unfuse_state
from engine.device import pick_device, pick_dtype
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


PREFILL_SAMPLES = 11  # prefill steps timed per run (base and mixed each); the figures are their medians


def bench_engine(
    shape: str = "tiny",
    adapters: int = 8,
    rank: int = 16,
    batch: int = 8,
    prompt: int = 32,
    new: int = 16,
    mixed_ranks: str | None = None,
    peer: bool = False,
    device: str = "auto",
    json_only: bool = False,
    peer_new: int | None = None,
    kernel_backend: str = "auto",
) -> dict:
    """Run the bench of the module docstring; print a table (unless json_only), then one JSON line; return the figures.
    `peer_new`: new tokens of the peer's runs (default `new`); `kernel_backend`: the engine's (engine.backend)."""
    assert shape in SHAPES, f"shape {shape!r}: use one of {sorted(SHAPES)}"
    assert adapters >= 1 and batch >= 1 and prompt >= 1 and new >= 2, (adapters, batch, prompt, new)
    dev = pick_device(device)
    dtype = pick_dtype("auto", dev)
    cfg = model_config(shape)
    ranks = [int(r) for r in mixed_ranks.split(",")] if mixed_ranks else [rank]
    adapter_ranks = [ranks[i % len(ranks)] for i in range(adapters)]
    # mixed ranks: the same batch over as many adapters all of their mean rank, for the heterogeneity ratio
    uniform_rank = round(statistics.mean(adapter_ranks[: min(adapters, batch)])) if mixed_ranks else None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, cfg.vocab_size, (prompt,), generator=gen).tolist() for _ in range(batch)]
    out: dict = {"shape": shape, "device": str(dev), "dtype": str(dtype).removeprefix("torch."), "adapters": adapters,
                 "ranks": sorted(set(adapter_ranks)), "batch": batch, "prompt": prompt, "new": new}  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        engine, paths = build_bench_engine(cfg, shape, adapter_ranks, uniform_rank, batch, prompt, new, dev, dtype, Path(tmp), kernel_backend)
        runs = {"base": [None] * batch, "mixed": [f"a{i % adapters}" for i in range(batch)]}
        if uniform_rank is not None:
            runs["uniform"] = [f"u{i % adapters}" for i in range(batch)]
        for keys in runs.values():  # first-call costs (kernels, graph captures, allocator) at the measured shapes
            _run(engine, prompts, keys, min(3, new), "warm")
        got = {name: _run(engine, prompts, keys, new, name) for name, keys in runs.items()}
        base, mixed = got["base"], got["mixed"]
        chained = engine.config.decode_steps
        engine.config = engine.config.model_copy(update={"decode_steps": 1})  # the same batches, one step per round
        single = {name: _run(engine, prompts, runs[name], new, f"{name}-single") for name in ("base", "mixed")}
        engine.config = engine.config.model_copy(update={"decode_steps": chained})
        # The prefill is one ~0.02-0.4 s step, and one sample of it varied by several % between runs (8b LoRA share
        # +9.7% in one, +13.4% in another; pairs of one run from +5.8% to +13.9%): its figures are medians of
        # PREFILL_SAMPLES samples, base and mixed interleaved.
        samples: dict[str, list[dict]] = {"base": [base, single["base"]], "mixed": [mixed, single["mixed"]]}
        for i in range(PREFILL_SAMPLES - 2):
            for name in ("base", "mixed"):
                samples[name].append(_run(engine, prompts, runs[name], 2, f"{name}-prefill{i}"))
        prefill = {name: {key: statistics.median(r[key] for r in rs) for key in ("prefill_ms", "prefill_device_ms")}
                   for name, rs in samples.items()}  # fmt: skip
        bandwidth = measure_bandwidth(dev)
        matmul = measure_matmul(dev, dtype)
        flops = prefill_flops(cfg, batch, prompt)
        out.update(
            backend=engine.runner.backend.name, cuda_graphs=engine.runner.graphs is not None,
            ours_base_tok_s=base["tok_s"], ours_mixed_tok_s=mixed["tok_s"],
            base_step_ms=base["step_ms"], mixed_step_ms=mixed["step_ms"], decode_rounds=base["decode_rounds"],
            decode_first_call_ms=base["first_call_ms"], decode_last_call_ms=base["last_call_ms"],
            decode_steps=chained, base_step_ms_one_per_round=single["base"]["step_ms"],
            mixed_step_ms_one_per_round=single["mixed"]["step_ms"],
            base_device_step_ms=base["device_step_ms"], mixed_device_step_ms=mixed["device_step_ms"],
            prefill_ms=prefill["base"]["prefill_ms"], mixed_prefill_ms=prefill["mixed"]["prefill_ms"],
            prefill_device_ms=prefill["base"]["prefill_device_ms"], mixed_prefill_device_ms=prefill["mixed"]["prefill_device_ms"],
            prefill_samples=PREFILL_SAMPLES,
            prefill_lora_overhead_pct_range=[round(100 * (m["prefill_ms"] / b["prefill_ms"] - 1), 2)
                                             for b, m in zip(samples["base"], samples["mixed"])],
            prefill_tflops=flops / (prefill["base"]["prefill_ms"] / 1e3) / 1e12,
            mixed_prefill_tflops=flops / (prefill["mixed"]["prefill_ms"] / 1e3) / 1e12,
            prefill_lora_overhead_pct=100 * (prefill["mixed"]["prefill_ms"] / prefill["base"]["prefill_ms"] - 1),
            matmul_tflops=matmul / 1e12, prefill_matmul_pct=100 * flops / (prefill["base"]["prefill_ms"] / 1e3) / matmul,
            copy_bandwidth_gb_s=bandwidth / 1e9,
        )  # fmt: skip
        context = prompt + new / 2
        elem = torch.tensor([], dtype=dtype).element_size()
        distinct = adapter_ranks[: min(adapters, batch)]
        base_bytes = weight_bytes(engine.runner.model) + kv_bytes(cfg, batch, context, elem)
        mixed_bytes = base_bytes + sum(adapter_bytes(cfg, r, elem) for r in distinct)
        out.update(base_roofline_ms=base_bytes / bandwidth * 1e3, mixed_roofline_ms=mixed_bytes / bandwidth * 1e3)
        out.update(base_x_roofline=out["base_step_ms"] / out["base_roofline_ms"],
                   mixed_x_roofline=out["mixed_step_ms"] / out["mixed_roofline_ms"])  # fmt: skip
        if uniform_rank is not None:
            uniform = got["uniform"]
            out.update(
                uniform_rank=uniform_rank, uniform_step_ms=uniform["step_ms"], uniform_device_step_ms=uniform["device_step_ms"],
                mixed_ranks_ratio=mixed["step_ms"] / uniform["step_ms"],
                # the LoRA part alone: what each batch adds to the base-only step
                mixed_ranks_lora_ratio=_ratio(mixed["device_step_ms"] - base["device_step_ms"], uniform["device_step_ms"] - base["device_step_ms"]),
            )  # fmt: skip
        out["peer_base_tok_s"] = out["peer_mixed_tok_s"] = None
        if peer:
            out["peer_new"] = peer_new or new
            out.update(run_peer(engine.runner.model, cfg, paths[:adapters], adapter_ranks, prompts, peer_new or new, dev, dtype))
            if out["peer_mixed_tok_s"]:
                out["mixed_vs_peer"] = out["ours_mixed_tok_s"] / out["peer_mixed_tok_s"]
    out = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
    if not json_only:
        _print_table(out)
    print(json.dumps(out), flush=True)
    return out


def build_bench_engine(cfg: ModelConfig, shape: str, adapter_ranks: list[int], uniform_rank: int | None, batch: int, prompt: int,
                       new: int, dev: torch.device, dtype: torch.dtype, tmp: Path, kernel_backend: str = "auto") -> tuple[Engine, list[Path]]:  # fmt: skip
    """The bench's engine on a random model of `cfg` with adapters a0.. of `adapter_ranks` (and u0.. of `uniform_rank`)
    loaded, sized for `batch` requests of `prompt` + `new` tokens; returns it and the adapter folders."""
    model = random_model(cfg, dev, dtype, seed=0)
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


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    """Random weights drawn on the device, std 1/sqrt(fan_in) so activations stay O(1) through the layers."""
    shapes = hf_param_shapes(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for key, shp in shapes.items():
        if key.endswith("norm.weight"):
            state[key] = torch.ones(shp, dtype=dtype, device=device)
        else:
            state[key] = torch.randn(shp, generator=gen, dtype=dtype, device=device) * (shp[-1] ** -0.5)
    return build_model(cfg, state, device, dtype)


def prefill_flops(cfg: ModelConfig, batch: int, prompt: int) -> float:
    """Matmul FLOPs of a prefill of batch x prompt tokens (logits for the last token of each), plus causal attention."""
    per_token = 2 * sum(i * o for i, o in cfg.projection_shapes().values()) * cfg.num_layers
    attention = 2 * cfg.num_layers * batch * cfg.num_heads * cfg.head_dim * prompt * prompt  # QK^T and AV, causal halves
    return per_token * batch * prompt + 2 * cfg.hidden_size * cfg.vocab_size * batch + attention


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes a decode step reads of the base: every weight but the embedding table (B rows of it only)."""
    skip = model.model.embed_tokens.weight.data_ptr()
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or ("a_stack" in name or "b_stack" in name):
            continue
        seen.add(p.data_ptr())
        if p.data_ptr() != skip or model.config.tie_word_embeddings:
            total += p.numel() * p.element_size()
    return total


def kv_bytes(cfg: ModelConfig, batch: int, context: float, elem: int) -> float:
    return batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem


def adapter_bytes(cfg: ModelConfig, rank: int, elem: int) -> int:
    return cfg.num_layers * rank * sum(i + o for i, o in cfg.projection_shapes().values()) * elem


def measure_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large copy (read + write counted) on the device."""
    n = (1 << 28) if device.type == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of fp32
    src = torch.rand(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    reps = 10 if device.type == "cuda" else 3
    dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * n * 4 * reps / (time.perf_counter() - t0)


def measure_matmul(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in the model's dtype on random data (8192^3 on CUDA, 1024^3 on CPU)."""
    n, reps = (8192, 10) if device.type == "cuda" else (1024, 3)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


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
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=adapter_names,
                        max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
        _sync(device)
        return time.perf_counter() - t0

    base_names = ["__base__"] * batch
    mixed_names = [names[i % len(names)] for i in range(batch)]
    gen(mixed_names, 2)  # warm
    out = {}
    for label, adapter_names in (("base", base_names), ("mixed", mixed_names)):
        decode_s = gen(adapter_names, new) - gen(adapter_names, 1)
        out[f"peer_{label}_tok_s"] = batch * (new - 1) / decode_s if decode_s > 0 else None
    return out


def _run(engine: Engine, prompts: list[list[int]], adapters: list[str | None], new: int, tag: str) -> dict:
    """Prefill of every prompt in one step (wall time, the device synchronised around it), then new - 1 decode
    steps: their wall time from the end of the prefill to the device's end of the last one, as a serving loop
    runs them (engine.step() calls back to back; a call may run several steps, engine.config decode_steps,
    and launch the next round before reading the last, engine.engine), over the steps; and the engine's own
    device time per step (CUDA events, its step records)."""
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
        engine.add_request(GenerationRequest(request_id=f"{tag}-{i}-{a}", input_ids=tuple(p), adapter=a, sampling=sp))
    engine.pop_step_records()
    _sync(engine.device)
    t0 = time.perf_counter()
    results = engine.step()
    _sync(engine.device)
    t1 = time.perf_counter()
    calls, first_call_s, last_call_s = 0, 0.0, 0.0
    while engine.has_unfinished():
        c0 = time.perf_counter()
        results += engine.step()
        last_call_s = time.perf_counter() - c0
        first_call_s = first_call_s or last_call_s
        calls += 1
    _sync(engine.device)
    t2 = time.perf_counter()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    records = engine.pop_step_records()
    engine.pop_load_events()
    assert records[0].tokens == sum(map(len, prompts)), "the prefill must be one step"
    decode_steps = len(records) - 1
    assert decode_steps == new - 1, (decode_steps, new)
    return {
        "prefill_ms": (t1 - t0) * 1e3,
        "prefill_device_ms": records[0].total_us / 1e3,
        "step_ms": (t2 - t1) / decode_steps * 1e3,
        "device_step_ms": statistics.median(r.total_us for r in records[1:]) / 1e3,
        "tok_s": len(prompts) * decode_steps / (t2 - t1),
        "decode_rounds": calls,
        "first_call_ms": first_call_s * 1e3,  # host time before the first decode round is launched: the GPU idles
        "last_call_ms": last_call_s * 1e3,  # the wait for the last round and its bookkeeping
    }


def _kv_blocks(batch: int, tokens: int, block_size: int = EngineConfig.model_fields["kv_block_size"].default) -> int:
    """KV blocks for `batch` sequences of `tokens`, plus the scheduler's admission watermark (1% of the pool), so
    that every prompt is admitted in the first step."""
    need = batch * -(-tokens // block_size)
    return need + need // 50 + 2


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _print_table(out: dict) -> None:
    def f(v: object) -> str:
        return "-" if v is None else f"{v:,.2f}" if isinstance(v, float) else str(v)

    print(f"engine bench: {out['shape']} on {out['device']} ({out['dtype']}, {out['backend']}, graphs {out['cuda_graphs']}), "
          f"batch {out['batch']}, prompt {out['prompt']}, new {out['new']}, {out['adapters']} adapters of rank {out['ranks']}")  # fmt: skip
    print(f"{'':<14}{'tok/s':>12}{'step ms':>10}{'device ms':>11}{'roofline ms':>13}{'x roof':>8}{'prefill ms':>12}")
    for name in ("base", "mixed"):
        print(f"{'ours ' + name:<14}{f(out[f'ours_{name}_tok_s']):>12}{f(out[f'{name}_step_ms']):>10}{f(out[f'{name}_device_step_ms']):>11}"
              f"{f(out[f'{name}_roofline_ms']):>13}{f(out[f'{name}_x_roofline']):>8}{f(out['prefill_ms' if name == 'base' else 'mixed_prefill_ms']):>12}")  # fmt: skip
    if "uniform_rank" in out:
        print(f"{'uniform r' + str(out['uniform_rank']):<14}{'':>12}{f(out['uniform_step_ms']):>10}{f(out['uniform_device_step_ms']):>11}"
              f"   mixed / uniform: step {f(out['mixed_ranks_ratio'])}, LoRA part {f(out['mixed_ranks_lora_ratio'])}")  # fmt: skip
    print(f"{'one step/round':<14}{'':>12}{f(out['base_step_ms_one_per_round']):>10}  base, {f(out['mixed_step_ms_one_per_round'])} mixed "
          f"(decode_steps 1; above: {out['decode_steps']}, {out['decode_rounds']} rounds)")  # fmt: skip
    print(f"{'peer base':<14}{f(out['peer_base_tok_s']):>12}")
    print(f"{'peer mixed':<14}{f(out['peer_mixed_tok_s']):>12}" + (f"   ours mixed / peer mixed: {out['mixed_vs_peer']:,.1f}x" if out.get("mixed_vs_peer") else ""))
    print(f"prefill {out['prefill_tflops']:.2f} TFLOP/s ({out['prefill_matmul_pct']:.1f}% of the {out['matmul_tflops']:.1f} TFLOP/s matmul), "
          f"LoRA +{out['prefill_lora_overhead_pct']:.1f}% (median of {out['prefill_samples']}; each pair: "
          f"{', '.join(f'{v:+.1f}%' for v in out['prefill_lora_overhead_pct_range'])}); copy bandwidth {out['copy_bandwidth_gb_s']:.1f} GB/s")  # fmt: skip


def ab_prefill_consumers(shape: str = "llama-1b", adapters: int = 32, rank: int = 16, batch: int = 32, prompt: int = 128,
                         pairs: int = PREFILL_SAMPLES) -> dict:  # fmt: skip
    """A/B of gate_up's delta in SiLU x up (engine.lora "Prefill") against the delta-first order, in one process on one
    engine: base, mixed with it and mixed without it, interleaved `pairs` times; medians of the prefill's wall and
    device ms and each form's LoRA share (python -c "from engine.bench.serving import ab_prefill_consumers as f; f('llama-1b')";
    prompt 512 for llama-8b, as the issue's prefill)."""
    dev = pick_device("auto")
    cfg = model_config(shape)
    prompts = [torch.randint(4, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).tolist() for _ in range(batch)]
    keys = {"base": [None] * batch, "mixed": [f"a{i % adapters}" for i in range(batch)]}
    with tempfile.TemporaryDirectory() as tmp:
        engine, _ = build_bench_engine(cfg, shape, [rank] * adapters, None, batch, prompt, 2, dev, pick_dtype("auto", dev), Path(tmp))
        state = engine.runner.lora
        consumers = state.consumers
        runs: dict[str, list[dict]] = {"base": [], "in the op": [], "delta first": []}
        for i in range(pairs + 1):  # the first round warms up
            for name in runs:
                state.consumers = consumers if name == "in the op" else frozenset()
                got = _run(engine, prompts, keys["base" if name == "base" else "mixed"], 2, f"ab{i}-{name}")
                if i:
                    runs[name].append(got)
        state.consumers = consumers
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("prefill_ms", "prefill_device_ms")} for name, rs in runs.items()}
    out = {"shape": shape, "pairs": pairs, **{f"{name} {k}": round(v, 3) for name, m in med.items() for k, v in m.items()}}
    for name in ("in the op", "delta first"):
        out[f"{name} lora_pct"] = round(100 * (med[name]["prefill_ms"] / med["base"]["prefill_ms"] - 1), 2)
        out[f"{name} lora_pct_device"] = round(100 * (med[name]["prefill_device_ms"] / med["base"]["prefill_device_ms"] - 1), 2)
    print(json.dumps(out), flush=True)
    return out
