"""An FP8 engine (engine.weight_dtype = "fp8") on the Triton kernels computes what it computes on the torch reference
ops: decode rows of each FP8 projection go through kernels/fp8_linear.py (reading the FP8 bytes), longer ones through
the dequantized weight. fp32, the 2-layer demo model; without CUDA in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.demo_model import write_demo_set
from engine.engine import Engine
from engine.quant import Fp8Linear
from engine.runner import BatchItem
from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

TOL = 1e-4
ROWS = [((5, 6, 7, 8), "qv-r4"), ((40, 41), None), ((90, 91, 92), "mlp-r64")]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("demo")
    return {"model": root / "model", "adapters": write_demo_set(root, seed=0, num_layers=2)}


def _engine(demo, backend: str) -> Engine:
    eng = Engine(EngineConfig(model_dir=str(demo["model"]), device=DEVICE.type, dtype="float32", max_prompt_tokens=16,
                              max_new_tokens=4, kv_block_size=4, max_batch_size=4, kernel_backend=backend, weight_dtype="fp8",
                              cuda_graph_max_batch=0, kv_num_blocks=None, adapter_gpu_bytes=None, adapter_read_processes=0,
                              adapter_read_threads=0))  # fmt: skip
    for _, name in ROWS:
        if name is not None:
            eng.load_adapter(name, demo["adapters"][name])
    return eng


def _forward(eng: Engine, items_of) -> torch.Tensor:
    slots = [-1 if a is None else eng.adapters.acquire(a)[0] for _, a in ROWS]
    items = items_of(slots)
    try:
        return eng.runner.forward(items, all_logits=True).cpu()
    finally:
        for it, (_, a) in zip(items, ROWS):
            eng.runner.free(it.seq_id)
            if a is not None:
                eng.adapters.release(eng.adapters.sha_of(a))


def test_fp8_projections_on_the_triton_kernels_match_the_torch_ops(demo, monkeypatch):
    torch_engine, triton_engine = _engine(demo, "torch"), _engine(demo, "triton")
    fp8 = [m for m in triton_engine.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 4 * 2 and all(m.decode is not None for m in fp8)
    assert all(m.decode is None for m in torch_engine.runner.model.modules() if isinstance(m, Fp8Linear))
    calls = []
    for m in fp8:
        monkeypatch.setattr(m, "decode", lambda *a, run=m.decode: calls.append(a[0].shape[0]) or run(*a))

    def prefill(slots):  # 9 rows: within the kernel's 64
        return [BatchItem(("p", i), p, 0, s) for i, ((p, _), s) in enumerate(zip(ROWS, slots))]

    want, got = _forward(torch_engine, prefill), _forward(triton_engine, prefill)
    assert calls and set(calls) == {sum(len(p) for p, _ in ROWS)}, "every FP8 projection ran on the kernel"
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= TOL, err


def test_a_bf16_prefill_runs_its_fp8_projections_on_scaled_mm(demo, monkeypatch):
    """A bf16 step of more than 64 rows takes the FP8 tensor-core path (engine.quant `scaled_linear`, activations
    quantized per token) and stays near the dequantized weights' result on the torch ops."""

    def engine(backend):
        eng = Engine(EngineConfig(model_dir=str(demo["model"]), device=DEVICE.type, dtype="bfloat16", max_prompt_tokens=80,
                                  max_new_tokens=4, kv_block_size=8, max_batch_size=4, kernel_backend=backend,
                                  weight_dtype="fp8", cuda_graph_max_batch=0, kv_num_blocks=None, adapter_gpu_bytes=None,
                                  adapter_read_processes=0, adapter_read_threads=0))  # fmt: skip
        eng.load_adapter("qv-r4", demo["adapters"]["qv-r4"])
        return eng

    ref, fast = engine("torch"), engine("triton")
    calls = []
    for m in fast.runner.model.modules():
        if isinstance(m, Fp8Linear):
            monkeypatch.setattr(m, "prefill", lambda *a, run=m.prefill: calls.append(a[0].shape[0]) or run(*a))
    prompts = [(tuple(range(3, 43)), "qv-r4"), (tuple(range(100, 135)), None)]  # 75 rows

    def run(eng):
        slots = [-1 if a is None else eng.adapters.acquire(a)[0] for _, a in prompts]
        items = [BatchItem(("s", i), p, 0, s) for i, ((p, _), s) in enumerate(zip(prompts, slots))]
        try:
            return eng.runner.forward(items, all_logits=True).float().cpu()
        finally:
            for it, (_, a) in zip(items, prompts):
                eng.runner.free(it.seq_id)
                if a is not None:
                    eng.adapters.release(eng.adapters.sha_of(a))

    want, got = run(ref), run(fast)
    assert calls and set(calls) == {75}, calls
    rel = ((got - want).abs().max() / want.abs().max()).item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert rel < 0.1 and top1 >= 0.8, (rel, top1)
