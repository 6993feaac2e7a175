"""FP8 base weights (engine.quant): quantization per output channel, the FP8 projection module, FP8 folders in the
FBGEMM FP8 layout, and the engine on them, with adapters, against the same engine on the dequantized weights (to fp32
rounding) and on the original ones (close, same top-1 almost everywhere)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.api import EngineError
from engine.config import EngineConfig
from engine.engine import Engine
from engine.quant import FP8, FP8_MAX, Fp8Linear, dequantize_fp8, quantize_fp8, write_fp8_folder
from engine.runner import BatchItem

PROMPTS = [((5, 6, 7, 8, 9, 10), "qv-r4"), ((11, 12, 13), "all-r16"), ((40, 41, 42, 43), None), ((7, 7, 7, 7, 7), "mlp-r64")]


def test_quantize_per_output_channel_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 64)[:, None]  # rows five decades apart
    w[3] = 0.0
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale.shape == (64,) and scale.dtype == torch.float32
    assert scale[3] == 1.0 and (q[3].float() == 0).all(), "a zero row: scale 1, all zeros"
    back = dequantize_fp8(q, scale, torch.float32)
    assert (q.float().abs().amax(dim=1)[torch.arange(64) != 3] == FP8_MAX).all(), "each row's largest maps to 448"
    # e4m3 keeps 3 mantissa bits: within half a step (2^-4 relative) of each value, or of the smallest normal step
    err = (back - w).abs()
    bound = torch.maximum(w.abs() * 2**-4, scale[:, None] * 2**-9)
    assert (err <= bound * 1.0001).all()
    exact = torch.tensor([[448.0, -224.0, 1.0, 0.5]])
    assert torch.equal(dequantize_fp8(*quantize_fp8(exact), torch.float32), exact)


def test_quantize_refuses_a_weight_with_nan_or_inf():
    for bad in (float("nan"), float("inf")):
        w = torch.ones(2, 4)
        w[1, 2] = bad
        with pytest.raises(ValueError, match="NaN or an infinity"):
            quantize_fp8(w)


def test_fp8_linear_is_the_linear_of_its_dequantized_weight():
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(48, 32, generator=g), torch.randn(48, generator=g), torch.randn(5, 32, generator=g)
    lin = Fp8Linear.quantize(w, b, torch.float32)
    assert (lin.in_features, lin.out_features) == (32, 48) and lin.qweight.dtype == FP8
    assert torch.equal(lin(x), torch.nn.functional.linear(x, dequantize_fp8(lin.qweight, lin.weight_scale, torch.float32), b))


def _engine(model_dir, **kw) -> Engine:
    return Engine(EngineConfig(model_dir=str(model_dir), device="cpu", max_prompt_tokens=32, max_new_tokens=8, **kw))


def _logits(engine: Engine, demo_set) -> torch.Tensor:
    """Every prompt token's logits in one forward, each row on its adapter (or the base)."""
    for name in {a for _, a in PROMPTS if a is not None}:
        engine.load_adapter(name, demo_set["adapters"][name])
    slots = [-1 if a is None else engine.adapters.acquire(a)[0] for _, a in PROMPTS]
    items = [BatchItem(("fp8", i), p, 0, s) for i, ((p, _), s) in enumerate(zip(PROMPTS, slots))]
    try:
        return engine.runner.forward(items, all_logits=True)
    finally:
        for it, (_, a) in zip(items, PROMPTS):
            engine.runner.free(it.seq_id)
            if a is not None:
                engine.adapters.release(engine.adapters.sha_of(a))


@pytest.fixture(scope="module")
def dequantized_dir(demo_set, tmp_path_factory):
    """The demo model with each projection weight replaced by its FP8 round trip: the reference an FP8 engine must
    equal, up to fp32 rounding."""
    src, dst = demo_set["model"], tmp_path_factory.mktemp("dequantized")
    for path in src.iterdir():
        if path.suffix == ".safetensors":
            state = load_file(str(path))
            for key, t in state.items():
                if key.endswith("_proj.weight"):
                    state[key] = dequantize_fp8(*quantize_fp8(t), t.dtype)
            save_file(state, str(dst / path.name))
        else:
            (dst / path.name).write_bytes(path.read_bytes())
    return dst


def test_engine_quantizing_at_load_equals_its_dequantized_reference_and_stays_near_the_original(demo_set, dequantized_dir):
    fp8 = _engine(demo_set["model"], weight_dtype="fp8")
    layer = fp8.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.base, Fp8Linear) and isinstance(layer.mlp.down_proj.base, Fp8Linear)
    assert fp8.runner.model.lm_head.weight.dtype == torch.float32, "the LM head keeps the engine's dtype"
    ours = _logits(fp8, demo_set)
    ref = _logits(_engine(dequantized_dir), demo_set)
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.abs().max().item(), "FP8 engine = dequantized reference"
    full = _logits(_engine(demo_set["model"]), demo_set)
    rel = ((ours - full).abs().max() / full.abs().max()).item()
    top1 = (ours.argmax(-1) == full.argmax(-1)).float().mean().item()
    assert rel < 0.1 and top1 >= 0.8, (rel, top1)  # e4m3 rounding of every projection of a random-weight model
    assert rel > 0, "the comparison has teeth: FP8 changes the logits"


def test_an_fp8_folder_loads_as_fp8_and_equals_quantizing_at_load(demo_set, tmp_path):
    folder = write_fp8_folder(demo_set["model"], tmp_path / "fp8")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fbgemm_fp8"
    state = load_file(str(folder / "model.safetensors"))
    assert state["model.layers.0.self_attn.q_proj.weight"].dtype == FP8
    assert state["model.layers.0.self_attn.q_proj.weight_scale"].shape[1] == 1
    assert state["lm_head.weight"].dtype == torch.float32 and state["model.embed_tokens.weight"].dtype == torch.float32
    loaded = _engine(folder)  # weight_dtype auto: the folder says FP8
    assert isinstance(loaded.runner.model.model.layers[1].mlp.gate_up_proj.base, Fp8Linear)
    assert torch.equal(_logits(loaded, demo_set), _logits(_engine(demo_set["model"], weight_dtype="fp8"), demo_set))
    with pytest.raises(ValueError, match="quantized already"):
        write_fp8_folder(folder, tmp_path / "again")


def test_fp8_engine_generates_with_adapters(demo_set):
    from engine.api import GenerationRequest, SamplingParams

    eng = _engine(demo_set["model"], weight_dtype="fp8")
    for name in ("qv-r4", "mlp-r64"):
        eng.load_adapter(name, demo_set["adapters"][name])
    reqs = [GenerationRequest(request_id=f"g{i}", input_ids=p, adapter_key=a, sampling=SamplingParams(max_new_tokens=6, ignore_eos=True))
            for i, (p, a) in enumerate(PROMPTS) if a in (None, "qv-r4", "mlp-r64")]  # fmt: skip
    out = eng.generate(reqs)
    assert all(r.ok and len(r.output_ids) == 6 and r.timings.base_us > 0 for r in out), [r.error for r in out]


def test_a_quantization_the_engine_does_not_read_is_refused_by_name(demo_set, tmp_path):
    folder = tmp_path / "awq"
    folder.mkdir()
    for path in demo_set["model"].iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match="quant_method='awq' is not supported"):
        _engine(folder)


def test_an_fp8_folder_with_a_projection_not_in_fp8_is_refused(demo_set, tmp_path):
    folder = write_fp8_folder(demo_set["model"], tmp_path / "fp8")
    state = load_file(str(folder / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    state[key] = dequantize_fp8(state[key], state[key + "_scale"].reshape(-1), torch.float32)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(EngineError, match="down_proj.weight is torch.float32, not float8_e4m3fn"):
        _engine(folder)
    del state[key + "_scale"]
    state[key] = quantize_fp8(state[key])[0]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(EngineError, match="missing"):
        _engine(folder)


@pytest.mark.parametrize("rows", [1, 70])
def test_scaled_linear_on_fp8_operands_equals_its_reference(rows):
    """Prefill's FP8 tensor-core GEMM (torch._scaled_mm; it runs on the CPU too): activations quantized per row, both
    scales applied, equal to both operands dequantized and multiplied in fp32, to bf16 rounding."""
    from engine.quant import quantize_rows_fp8, scaled_linear, scaled_linear_ref

    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 64, generator=g) * torch.logspace(-2, 2, rows)[:, None]).to(torch.bfloat16)
    q, scale = quantize_fp8(torch.randn(48, 64, generator=g))
    bias = torch.randn(48, generator=g).to(torch.bfloat16)
    got, want = scaled_linear(x, q, scale, bias), scaled_linear_ref(x, q, scale, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-2).all()
    xq, xs = quantize_rows_fp8(x)
    assert xq.dtype == FP8 and xs.shape == (rows, 1) and (xq.float().abs().amax(dim=1) == FP8_MAX).all()
    exact = x.float() @ dequantize_fp8(q, scale, torch.float32).t() + bias.float()
    assert ((got.float() - exact).abs().max() / exact.abs().max()).item() < 0.1, "activation rounding: a few percent"


def test_an_fp8_model_with_projection_biases_loads_and_matches_its_reference(tmp_path):
    """Qwen2's q, k and v carry biases: they stay in the compute dtype beside the FP8 weights."""
    from engine.demo_model import write_demo_set

    demo = {"model": tmp_path / "model", "adapters": write_demo_set(tmp_path, arch="qwen2")}
    eng = _engine(demo["model"], weight_dtype="fp8")
    qkv = eng.runner.model.model.layers[0].self_attn.qkv_proj.base
    assert isinstance(qkv, Fp8Linear) and qkv.bias is not None and qkv.bias.dtype == torch.float32
    ours = _logits(eng, demo)
    folder = write_fp8_folder(demo["model"], tmp_path / "fp8")
    assert torch.equal(_logits(_engine(folder), demo), ours)
    full = _logits(_engine(demo["model"]), demo)
    assert ((ours - full).abs().max() / full.abs().max()).item() < 0.1
