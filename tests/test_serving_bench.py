"""`lorabatch bench engine` runs end to end on the CPU at tiny sizes and reports its figures (no timing is judged)."""

from __future__ import annotations

import json

import torch

from engine.bench.build import SHAPES, model_config
from engine.bench.roofline import adapter_bytes, prefill_flops
from engine.bench.serving import PREFILL_SAMPLES, bench_engine

KEYS = {"ours_base_tok_s", "ours_mixed_tok_s", "peer_mixed_tok_s", "base_step_ms", "mixed_step_ms", "base_roofline_ms",
        "mixed_roofline_ms", "prefill_tflops"}  # fmt: skip


def test_bench_runs_on_cpu_with_the_peer_and_prints_one_json_line(capsys):
    """Tiny shape, mixed ranks, HF+peft peer: the returned dict and the printed JSON line carry every figure."""
    out = bench_engine(shape="tiny", adapters=4, rank=8, batch=4, prompt=8, new=4, mixed_ranks="4,8,16,64", peer=True,
                       device="cpu", json_only=True)  # fmt: skip
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and json.loads(printed[0]) == out
    assert KEYS <= set(out)
    for key in KEYS:
        assert isinstance(out[key], float) and out[key] > 0, (key, out[key])
    assert out["ranks"] == [4, 8, 16, 64] and out["device"] == "cpu"
    assert out["mixed_roofline_ms"] > out["base_roofline_ms"]  # the adapters' bytes are counted
    assert out["prefill_samples"] == PREFILL_SAMPLES == len(out["prefill_lora_overhead_pct_range"])  # one share per pair


def test_bench_table_and_no_peer(capsys):
    out = bench_engine(shape="tiny", adapters=2, rank=4, batch=2, prompt=4, new=2, device="cpu")
    text = capsys.readouterr().out
    assert "ours mixed" in text and text.strip().splitlines()[-1].startswith("{")
    assert out["peer_mixed_tok_s"] is None
    assert out["decode_lora_in_ops"] == []


def test_the_bench_passes_decode_lora_in_ops_to_its_engine(monkeypatch):
    """bench_engine's `decode_lora_in_ops` (the A/B of engine.decode_lora_in_ops) reaches the engine's config, and the row
    says which it ran."""
    import engine.bench.build as build

    seen, real = [], build.Engine.from_model

    def spy(config, *args, **kw):
        seen.append(config.decode_lora_in_ops)
        return real(config, *args, **kw)

    monkeypatch.setattr(build.Engine, "from_model", spy)
    out = bench_engine(shape="tiny", adapters=2, rank=4, batch=2, prompt=4, new=2, device="cpu", json_only=True,
                       decode_lora_in_ops=("qkv_proj", "gate_up_proj"))  # fmt: skip
    assert seen and all(s == ["qkv_proj", "gate_up_proj"] for s in seen), seen
    assert out["decode_lora_in_ops"] == ["qkv_proj", "gate_up_proj"]


def test_the_bench_runs_an_fp8_base_and_counts_its_bytes_in_the_roofline():
    """weight_dtype "fp8" (issue 22's suite runs): the projections' FP8 bytes and scales, not bf16's, are what the
    roofline says a decode step reads."""
    from engine.bench.build import random_model
    from engine.bench.roofline import weight_bytes

    cfg = model_config("tiny")
    full, fp8 = (weight_bytes(random_model(cfg, torch.device("cpu"), torch.bfloat16, seed=0, fp8=q)) for q in (False, True))
    layer = sum(i * o for i, o in cfg.projection_shapes().values())  # weights of the seven projections, one layer
    outs = sum(o for _, o in cfg.projection_shapes().values())
    assert full - fp8 == cfg.num_layers * (2 * layer - (layer + 4 * outs))  # bf16 -> FP8 bytes + an fp32 scale a row
    out = bench_engine(shape="tiny", adapters=2, rank=4, batch=2, prompt=4, new=2, device="cpu", weight_dtype="fp8", json_only=True)
    assert out["weight_dtype"] == "fp8" and out["base_roofline_ms"] > 0


def test_roofline_and_flop_counts_of_the_published_shapes():
    """The byte and FLOP counts the bench divides by, checked against hand arithmetic for Llama-3.2-1B's shape."""
    cfg = model_config("llama-1b")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == SHAPES["llama-1b"][:5]
    # per layer: q 2048x2048, k and v 2048x512, o 2048x2048, gate/up/down 3 x 2048x8192
    layer = 2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192
    assert prefill_flops(cfg, 1, 1) == 2 * layer * 16 + 2 * 2048 * 128256 + 2 * 16 * 32 * 64
    # rank 16 on all seven: r * (in + out) summed over the projections, per layer, bf16
    per_layer = 16 * ((2048 + 2048) * 2 + (2048 + 512) * 2 + 3 * (2048 + 8192))
    assert adapter_bytes(cfg, 16, torch.bfloat16.itemsize) == per_layer * 16 * 2
